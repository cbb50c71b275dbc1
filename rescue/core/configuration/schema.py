"""The one strict schema every way of asking for a study goes through, before pydantic builds the configuration.

`rescue run --config`, `rescue submit --config` and the service's `POST /jobs` hand their plain data
to `request_problem` (rescue/core/configuration/config_files.py's `validate_config` calls it), so a setting has
one verdict whichever way it comes:

- no key is given twice: a dotted key (`"vlm.model"`) beside the table it names (`vlm`) is refused;
- strict types: a whole number is an `int` (never a string or a bool), a number is an `int` or a
  `float` (never a string or a bool), a flag is a bool, a text is a string;
- every float is finite (no `nan`, no `inf`), wherever it is;
- every number of `RANGES` lies in its documented range (docs/reference.md lists them).

The work a study may ask for (arms per case, arm-steps) is bounded in `rescue.core.configuration.work_limit`.
Each check answers one line naming the key; `ConfigError` carries it. Stored studies are read
without these checks (an older study stays readable): they bound what may be asked for now.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, SecretStr

def number(value: float) -> str:
    """A bound as the docs and refusals write it: a whole number with thousands separators, else `%g`."""
    return f"{int(value):,}" if float(value).is_integer() and abs(value) < 1e19 else f"{value:g}"


@dataclass(frozen=True)
class Range:
    """A number's documented range: above (or at) `low`, below (or at) `high`."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        return ((value > self.low if self.low_open else value >= self.low)
                and (value < self.high if self.high_open else value <= self.high))

    def text(self) -> str:
        low = f"above {number(self.low)}" if self.low_open else f"at least {number(self.low)}"
        high = f"below {number(self.high)}" if self.high_open else f"at most {number(self.high)}"
        return f"{low} and {high}"


# The VLM keys' ranges, for `[vlm]` and for each `[[advisor]]` table.
_VLM_RANGES: dict[str, Range] = {
    "deadline_s": Range(0, 7 * 86400, low_open=True),
    "request_timeout_s": Range(0, 86400, low_open=True),
    "max_attempts": Range(1, 100),
    "backoff_initial_s": Range(0, 3600),
    "backoff_max_s": Range(0, 86400),
    "backoff_jitter_s": Range(0, 3600),
    "max_subgoal_chars": Range(1, 1_000_000),
    "max_concurrent_calls": Range(1, 100_000),
    "requests_per_minute": Range(0, 1_000_000, low_open=True),
    "batch_size": Range(1, 256),
    "batch_window_s": Range(0, 86400),
    "max_output_tokens": Range(1, 10_000_000),
    "temperature": Range(0, 2),
    "seed": Range(-(2**63), 2**63 - 1),
    "lab_budget": Range(0, 1e15, low_open=True),
    "price.input": Range(0, 1e9),
    "price.output": Range(0, 1e9),
    "price.cached_input": Range(0, 1e9),
}
# Every bounded number by its dotted key (`advisors.*`: each advisor's; `query_points.*`, `triggers.*`: each query
# point's, each trigger's).
RANGES: dict[str, Range] = {
    "cases_in_flight": Range(1, 100_000),
    "continuations": Range(1, 100),
    "keepalive_s": Range(0.1, 3600),
    "fail_fast_arms": Range(0, 1_000_000),
    "env.simulators": Range(1, 4096),
    "env.image_size": Range(1, 4096),
    "env.max_simulator_rss_gb": Range(0, 4096, low_open=True),
    "policy.replan_interval": Range(1, 100_000),
    "policy.processes": Range(0, 4096),
    "policy.connect_timeout_s": Range(0, 86_400, low_open=True),
    "query_points.fraction": Range(0, 1, low_open=True, high_open=True),
    "triggers.window": Range(1, 100_000),
    "triggers.distance": Range(0, 100, low_open=True),
    "triggers.cycles": Range(0, 100_000),
    "triggers.samples": Range(2, 64),
    "triggers.threshold": Range(0, 1e6),
    "triggers.rate": Range(0, 1),
    "triggers.seed": Range(-(2**63), 2**63 - 1),
    "asking.max_calls": Range(1, 100),
    "asking.every_queries": Range(1, 100_000),
    **{f"vlm.{k}": r for k, r in _VLM_RANGES.items()},
    **{f"advisors.{k}": r for k, r in _VLM_RANGES.items() if k != "lab_budget"},
}
# TOML's table names beside the configuration's keys.
_TABLES = {"advisor": "advisors", "query_point": "query_points", "trigger": "triggers"}


def mixed_keys_problem(data: Any, prefix: str = "") -> str | None:
    """A dotted key given beside the table it names (`{"vlm.model": "x", "vlm": {"model": "y"}}`), at any
    depth, in one line; None: every key is given once."""
    if not isinstance(data, Mapping):
        return None
    keys = [k for k in data if isinstance(k, str)]
    for key in keys:
        if "." in key:
            parts = key.split(".")
            for i in range(1, len(parts)):
                if ".".join(parts[:i]) in data:
                    head = ".".join(parts[:i])
                    return (f"{prefix}{key}: given both as a dotted key and in the table {prefix}{head}; "
                            "give each key once")
    for key in keys:
        value = data[key]
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            where = f"{prefix}{key}[{i}]." if isinstance(value, list) else f"{prefix}{key}."
            found = mixed_keys_problem(item, where)
            if found:
                return found
    return None


def _kinds(annotation: Any) -> list[Any]:
    """The alternatives of an annotation (Optional and unions unfolded, Annotated unwrapped)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _kinds(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [k for arg in typing.get_args(annotation) for k in _kinds(arg)]
    return [annotation]


def _scalar(kinds: list[Any]) -> str | None:
    plain = [k for k in kinds if k is not type(None)]
    if not plain:
        return None
    if all(k is bool for k in plain):
        return "bool"
    if all(k is int for k in plain):
        return "int"
    if all(k in (int, float) for k in plain):
        return "float"
    if all(k in (str, SecretStr) for k in plain):
        return "str"
    return None


_WANT = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a text"}


def _type_problem(kind: str, value: Any) -> bool:
    if value is None:
        return False
    if kind == "bool":
        return not isinstance(value, bool)
    if kind == "int":
        return isinstance(value, bool) or not isinstance(value, int)
    if kind == "float":
        return isinstance(value, bool) or not isinstance(value, (int, float))
    return not isinstance(value, (str, SecretStr))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_model(model: type[BaseModel], data: Mapping[str, Any], where: str, ranged: str) -> str | None:
    """Strict types and ranges of one table against its model; `ranged`: its prefix in RANGES."""
    for key, value in data.items():
        if not isinstance(key, str):
            return f"{where}{key!r}: a key is a text"
        name = _TABLES.get(key, key) if not where else key
        field = model.model_fields.get(name)
        if field is None:
            continue  # pydantic names an unknown key (with the keys it may mean)
        kinds = _kinds(field.annotation)
        dotted = f"{where}{key}"
        scalar = _scalar(kinds)
        if scalar is not None:
            if _type_problem(scalar, value):
                return f"{dotted}: {_WANT[scalar]}, not {type(value).__name__} {_shown(value)}"
            limits = RANGES.get(f"{ranged}{name}")
            if limits is not None and value is not None and not limits.holds(value):
                return f"{dotted}: {_shown(value)} is out of range ({limits.text()})"
            continue
        sub = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if sub is not None and isinstance(value, Mapping):
            found = _check_model(sub, value, f"{dotted}.", f"{ranged}{name}.")
            if found:
                return found
            continue
        items = next((typing.get_args(k)[0] for k in kinds if typing.get_origin(k) is list
                      and typing.get_args(k) and isinstance(typing.get_args(k)[0], type)
                      and issubclass(typing.get_args(k)[0], BaseModel)), None)
        if items is not None and isinstance(value, list):
            for i, entry in enumerate(value):
                if isinstance(entry, Mapping):
                    found = _check_model(items, entry, f"{where}{name}.{i}.", f"{name}.")
                    if found:
                        return found
            continue
        if typing.get_origin(kinds[0]) is tuple and isinstance(value, (list, tuple)):
            bad = next((v for v in value if not isinstance(v, str)), None)
            if bad is not None:
                return f"{dotted}: a list of texts, not one holding {type(bad).__name__} {_shown(bad)}"
    return None


def _not_finite(data: Any, where: str) -> str | None:
    if isinstance(data, float) and not math.isfinite(data):
        return f"{where or '(top level)'}: {data!r} is not a finite number"
    if isinstance(data, Mapping):
        for key, value in data.items():
            found = _not_finite(value, f"{where}.{key}" if where else str(key))
            if found:
                return found
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            found = _not_finite(value, f"{where}[{i}]")
            if found:
                return found
    return None


def request_problem(data: Any, model: type[BaseModel]) -> str | None:
    """Why plain data may not be asked for as a study configuration of `model`, in one line; None: it may
    (pydantic then builds it, and names what is left: an unknown key, a name that is not built in...)."""
    if not isinstance(data, Mapping):
        return "(top level): a table of settings"
    return mixed_keys_problem(data) or _not_finite(data, "") or _check_model(model, data, "", "")
