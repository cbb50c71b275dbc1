"""Reading a study's configuration: TOML files and flag overrides, validated into a StudyConfig.

Every error is one line naming the key and the file it came from (ConfigError), and so is a study that
asks for more work than it may (rescue.core.configuration.work_limit).
"""

from __future__ import annotations

import difflib
import os
import tomllib
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from rescue.core.configuration.config import StudyConfig
from rescue.core.inputs import MAX_CONFIG_BYTES, InputFileError, read_input
from rescue.core.configuration.schema import request_problem
from rescue.core.configuration.work_limit import MAX_ARMS_PER_CASE, config_arms_problem


class ConfigError(ValueError):
    """A configuration file or flag that cannot be used, named in one line."""


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> StudyConfig:
    """Read a TOML file (if any), apply dotted-key overrides, validate; ConfigError names what is wrong."""
    where = str(path) if path is not None else "the command line"
    return validate_config(config_data(path, overrides), where)


def config_data(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A TOML file's tables (if any) with dotted-key overrides applied (None values skipped), not yet validated."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_toml(path, "configuration file")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return data


def read_toml(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """A TOML file's tables, read with the input guard (rescue/core/inputs.py); ConfigError names what is wrong."""
    try:
        return tomllib.loads(read_input(path, MAX_CONFIG_BYTES, what).decode("utf-8"))
    except InputFileError as exc:
        raise ConfigError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None


def _unknown_key(loc: tuple) -> str:
    """"unknown key", with the keys of its table it may mean (`contnuations`: did you mean continuations?)."""
    model: Any = StudyConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an entry of a list of tables ([[advisor]], [[query_point]])
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return "unknown key"
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        kinds += [inner for kind in kinds for inner in typing.get_args(kind)]
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if model is None:
            return "unknown key"
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=2, cutoff=0.75)
    return f"unknown key; did you mean {' or '.join(close)}?" if close else "unknown key"


def _unknown_keys(data: dict[str, Any]) -> list[str]:
    """The unknown keys of data the strict schema refused, so that one line names every key that is wrong."""
    try:
        StudyConfig.model_validate(data)
    except ValidationError as exc:
        return [f"{'.'.join(str(part) for part in err['loc'])}: {_unknown_key(err['loc'])}"
                for err in exc.errors() if err["type"] == "extra_forbidden"]
    except Exception:  # data the schema refused may break a validator in other ways: its verdict stands alone
        return []
    return []


def validate_config(data: dict[str, Any], where: str, max_arms_per_case: int = MAX_ARMS_PER_CASE) -> StudyConfig:
    """A StudyConfig from plain data, through the one strict schema (rescue/core/configuration/schema.py: types, finite numbers
    in their ranges, each key once, the arms of a case bounded by `max_arms_per_case`), or ConfigError naming
    every problem in one line (`where` first)."""
    problem = request_problem(data, StudyConfig)
    if problem is not None:
        raise ConfigError(f"{where}: " + "; ".join([problem, *_unknown_keys(data)]))
    try:
        config = StudyConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"]) or "(top level)"
            what = (_unknown_key(err["loc"]) if err["type"] == "extra_forbidden"
                    else err["msg"].removeprefix("Value error, "))
            problems.append(f"{key}: {what}")
        raise ConfigError(f"{where}: " + "; ".join(problems)) from None
    problem = config_arms_problem(config, max_arms_per_case)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    return config
