"""The manifest: the list of historical failures a study replays (DESIGN §2).

A manifest is JSONL (one case per line) or a JSON list of cases, in UTF-8.
Loading it is all-or-nothing: every problem in the file is collected and
reported at once, one line each, naming its line (or list index) and field,
and nothing is written. Cases are checked against the benchmark catalog
(suite, task, initial state, instruction, horizon) without a simulator.

Accepted on purpose, because they are harmless: a UTF-8 byte-order mark at
the start, CRLF line ends, blank lines. Refused: a file over
MAX_MANIFEST_BYTES, a line over MAX_LINE_BYTES (before it is parsed), NaN or
Infinity, repeated keys in one object, case ids that could not safely name a
file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from rescue.core.catalog import Catalog, libero_catalog
from rescue.core.inputs import InputFileError, read_input

# One case is a few hundred bytes; a line far beyond that is a mistake, and
# parsing it would cost many times its size in memory.
MAX_LINE_BYTES = 64 * 1024
# About 200,000 cases; the whole file is read into memory to hash and split it.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_CASE_ID_LENGTH = 128
# A horizon is checked against the suite's official one (x this factor) when
# the suite is in the catalog; MAX_HORIZON bounds it everywhere (it is stored
# as an SQLite integer and counted in steps of ~45 per second).
DEFAULT_MAX_HORIZON_FACTOR = 10.0
MAX_HORIZON = 1_000_000
# A file with thousands of bad lines is one mistake; a screenful says so.
MAX_PROBLEMS = 100
_INT32_MAX = 2**31 - 1
_CASE_ID_CHARS = re.compile(r"[A-Za-z0-9._:-]")
_UTF8_BOM = b"\xef\xbb\xbf"
# An initial-state fingerprint is a sha256 in hex.
FINGERPRINT_HEX_DIGITS = 64

CatalogChoice = Catalog | Literal["libero"] | None
"""A catalog to check cases against: a Catalog, "libero" (the shipped one), or None (no benchmark checks)."""


class ManifestError(Exception):
    """A manifest that cannot be used; `problems` lists every reason, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        count = len(self.problems)
        head = f"{count} problem{'s' if count != 1 else ''} in manifest"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in self.problems))


def derive_policy_seed(env_seed: int) -> int:
    """The default policy seed of a case: a fixed 31-bit digest of its env seed."""
    # A digest rather than env_seed itself, so the policy's RNG stream never
    # starts where the environment's does, yet replays stay reproducible.
    digest = hashlib.sha256(f"policy_seed:{env_seed}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _show(value: Any, limit: int = 60) -> str:
    """A value for a one-line message: repr (escapes newlines, NUL, bidi controls), shortened."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def case_id_problem(value: str) -> str | None:
    """Why `value` cannot be a case id, or None if it can.

    Case ids name files in the study folder (keyframes, receipts), so they are
    a safe file-name component on every system: ASCII letters, digits and
    `. _ : -`, starting with a letter or digit, no `..`, at most 128 long.
    """
    if not value:
        return "case id is empty"
    if len(value) > MAX_CASE_ID_LENGTH:
        return f"case id is {len(value)} characters long, at most {MAX_CASE_ID_LENGTH}"
    bad = next((ch for ch in value if not _CASE_ID_CHARS.fullmatch(ch)), None)
    if bad is not None:
        return f"case id {_show(value)} has the character {bad!r}; use letters, digits and . _ : -"
    if not value[0].isalnum():
        return f"case id {_show(value)} must start with a letter or digit"
    if ".." in value:
        return f"case id {_show(value)} must not contain '..'"
    return None


def _tag_value(value: Any) -> str | int | float | bool:
    # One plain check instead of a union type: a union reports one error per
    # member, which buries the single thing the user got wrong.
    if isinstance(value, (str, int, float, bool)):
        return value
    raise ValueError("tag values must be a string, number or boolean")


TagValue = Annotated[str | int | float | bool, PlainValidator(_tag_value)]


class Case(BaseModel):
    """One historical episode to replay: a failure (or, with `outcome: success`, a success, DESIGN §17). Adapters with extra fields subclass it."""

    # Strict: a manifest saying "task_id": "3" is a mistake to report, not coerce.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)

    case_id: str = Field(min_length=1)
    """Stable, unique id of the case; a safe file-name component (ASCII letters, digits, `. _ : -`)."""
    suite: str = Field(min_length=1)
    """The benchmark suite (e.g. `libero_spatial`)."""
    task_id: int = Field(ge=0, le=_INT32_MAX)
    """The task's index in its suite."""
    init_state_index: int = Field(ge=0, le=_INT32_MAX)
    """Which of the task's recorded initial states the episode starts from."""
    # Simulators and policies seed numpy-style generators: 32-bit, non-negative.
    env_seed: int = Field(ge=0, lt=2**32)
    """The environment's seed for the episode."""
    horizon: int = Field(gt=0, le=MAX_HORIZON)
    """H: the most env steps an arm may run."""
    group: str = Field(min_length=1)
    """The group the case is reported under (e.g. Atomic-Seen); absent from the manifest: the suite."""
    instruction: str | None = Field(default=None, min_length=1)
    """The task's instruction, one of its own wordings (the catalog's `instruction`, or its `task_language`), and
    the arm's must equal it; None: not given (the one the episode protocol tells is used)."""
    fingerprint: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]+$")
    """The historical initial-state fingerprint (hex, stored lowercase); None: not given (the arms are then
    compared with each other)."""
    pilot: bool = False
    """Whether the case is a declared pilot (reported apart, never counted in N)."""
    outcome: Literal["failure", "success"] | None = None
    """How the episode ended in the evaluation: `success` for a historical success replayed to measure harm
    (DESIGN §17), `failure`; None (absent): a failure, as every manifest before successes were cases."""
    tags: dict[str, TagValue] = Field(default_factory=dict)
    """Free labels carried with the case (string, number or boolean values)."""
    policy_seed: int = Field(ge=0, lt=2**32)
    """Seed of the policy's sampling RNG for the case; absent from the manifest: derived from env_seed."""

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_other_fields(cls, data: Any) -> Any:
        # `group` defaults to the suite and `policy_seed` to one derived from
        # env_seed; both are filled in here so the stored case is explicit.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("group") is None and isinstance(data.get("suite"), str):
            data["group"] = data["suite"]
        env_seed = data.get("env_seed")
        if data.get("policy_seed") is None and type(env_seed) is int and 0 <= env_seed < 2**32:
            data["policy_seed"] = derive_policy_seed(env_seed)
        return data

    @field_validator("case_id")
    @classmethod
    def _safe_case_id(cls, value: str) -> str:
        problem = case_id_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("fingerprint")
    @classmethod
    def _lowercase_fingerprint(cls, value: str | None) -> str | None:
        if value is not None and len(value) != FINGERPRINT_HEX_DIGITS:
            raise ValueError(f"a fingerprint is a sha256: {FINGERPRINT_HEX_DIGITS} hex digits, not {len(value)}")
        # Fingerprints are compared as strings; one spelling avoids false deviations.
        return value.lower() if value is not None else None

    @property
    def task(self) -> str:
        """The benchmark task this case belongs to, as `suite/task_id`."""
        return f"{self.suite}/{self.task_id}"

    @property
    def historical_outcome(self) -> Literal["failure", "success"]:
        """How the episode ended in the evaluation (`failure` when the manifest does not say)."""
        return self.outcome or "failure"


class Manifest(BaseModel):
    """The cases of one manifest file, with the file's path and sha256."""

    model_config = ConfigDict(frozen=True)

    cases: list[Case]
    source: str
    sha256: str
    data: bytes | None = Field(default=None, exclude=True, repr=False)
    """The file's bytes as read (the study keeps them verbatim, so that `rescue verify` re-derives `sha256`)."""

    @model_validator(mode="after")
    def _unique_ids(self) -> Manifest:
        seen: set[str] = set()
        for case in self.cases:
            if case.case_id in seen:
                raise ValueError(f"duplicate case id {case.case_id!r}")
            seen.add(case.case_id)
        return self

    @property
    def main_cases(self) -> list[Case]:
        """The main cohort: every non-pilot case, in manifest order (N of DESIGN §3)."""
        return [c for c in self.cases if not c.pilot]

    @property
    def pilot_cases(self) -> list[Case]:
        """The declared pilot cases, in manifest order; never counted in the main study."""
        return [c for c in self.cases if c.pilot]

    @property
    def case_ids(self) -> list[str]:
        """All case ids, in manifest order."""
        return [c.case_id for c in self.cases]

    def require_main_cohort(self) -> None:
        """Refuse a manifest whose every case is a pilot (N = 0), unless it is run as a pilot on purpose."""
        if not self.main_cases:
            raise ManifestError([
                f"{self.source}: every one of its {len(self.cases)} cases is a pilot, so the main cohort is empty "
                "(N = 0); mark the main cases `\"pilot\": false`, or give --pilot-run to run the pilot alone"
            ])


# --- reading JSON ------------------------------------------------------------


class RepeatedKey(ValueError):
    """A JSON object names a key twice (`unique_keys`)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`'s object_pairs_hook for objects whose keys are each given once: json.loads keeps the last of two
    equal keys silently (a manifest line with "horizon" twice is ambiguous), so RepeatedKey names it."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise RepeatedKey(key)
        obj[key] = value
    return obj


def _reject_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which are not JSON and break digests.
    raise ValueError(f"{name} is not a JSON number")


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=unique_keys, parse_constant=_reject_constant)


class _Unreadable:
    """An entry that is not valid JSON; carries its problem so order is kept."""

    def __init__(self, problem: str):
        self.problem = problem


def _parse(text: str, where: str, one_line: bool) -> Any:
    """The JSON value of `text`, or an _Unreadable naming where it went wrong."""
    try:
        return _loads(text)
    except json.JSONDecodeError as exc:
        if one_line:  # `where` names the line: the column is enough
            return _Unreadable(f"{where}:{exc.colno}: invalid JSON: {exc.msg}")
        return _Unreadable(f"{where}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}")
    except RepeatedKey as exc:
        return _Unreadable(f"{where}: {_format_loc((exc.key,))}: the key appears twice in one object")
    except RecursionError:
        return _Unreadable(f"{where}: invalid JSON: nested too deeply")
    except ValueError as exc:  # NaN, or an integer of thousands of digits
        if "integer string conversion" in str(exc):
            return _Unreadable(f"{where}: invalid JSON: a number with more than 4300 digits")
        return _Unreadable(f"{where}: invalid JSON: {str(exc).splitlines()[0]}")


def _decode(data: bytes, where: str) -> str | _Unreadable:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _Unreadable(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start + 1})")


_NOT_SPACE = re.compile(rb"[^ \t\r\n]")


def _entries(data: bytes, start: int, label: str, suffix: str) -> Iterator[tuple[str, str, Any]]:
    """Split data[start:] into (where, where-for-duplicates, parsed object) entries.

    Nothing here copies the whole file: a 50 MB line is measured and refused,
    never decoded or parsed.
    """
    first = _NOT_SPACE.search(data, start)
    lead = data[first.start() : first.start() + 1] if first else b""
    if lead == b"[":
        text = _decode(data[start:], label)
        if isinstance(text, _Unreadable):
            yield label, "", text
            return
        items = _parse(text, label, one_line=False)
        if isinstance(items, _Unreadable):
            if "Extra data" in items.problem:
                items.problem += " (a JSON list must be the whole file; otherwise write one case per line)"
            yield label, "", items
            return
        if not isinstance(items, list):
            yield label, "", _Unreadable(f"{label}: expected a JSON list of cases")
            return
        for i, item in enumerate(items):
            where = f"{label}[{i}]"
            size = len(json.dumps(item, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            if size > MAX_LINE_BYTES:
                item = _Unreadable(f"{where}: case is {size} bytes long, at most {MAX_LINE_BYTES}")
            yield where, f"index {i}", item
        return

    if suffix == ".json" and lead == b"{" and b"\n" in data[first.start() :].rstrip():
        # A .json file that is not a list may be one pretty-printed object;
        # reading it line by line would only produce confusing errors.
        text = _decode(data[start:], label)
        whole = None if isinstance(text, _Unreadable) else _parse(text, label, one_line=False)
        if isinstance(whole, dict):
            yield label, "", _Unreadable(f"{label}: expected a JSON list of cases or one case per line")
            return

    lineno = 0
    while start < len(data):
        # Lines end at b"\n" only: str.splitlines would also split inside a
        # JSON string at U+2028 or U+0085, and a CRLF's b"\r" is JSON whitespace.
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        lineno += 1
        where = f"{label}:{lineno}"
        size = end - start
        if size > MAX_LINE_BYTES:
            yield where, "", _Unreadable(f"{where}: line is {size} bytes long, at most {MAX_LINE_BYTES}")
        else:
            raw = data[start:end]
            if raw.strip():
                text = _decode(raw, where)
                obj = text if isinstance(text, _Unreadable) else _parse(text, where, one_line=True)
                yield where, f"line {lineno}", obj
        start = end + 1


def _surrogate_at(value: Any, loc: tuple[int | str, ...] = ()) -> tuple[int | str, ...] | None:
    """Where a JSON value holds a lone UTF-16 surrogate (`\\ud800` escapes decode to one), or None.

    Such a string is not text: it cannot be written as UTF-8, so it would fail far from here."""
    if isinstance(value, str):
        return loc if any("\ud800" <= ch <= "\udfff" for ch in value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _surrogate_at(key, loc + (key,)) or _surrogate_at(item, loc + (key,))
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _surrogate_at(item, loc + (i,))
            if found is not None:
                return found
    return None


def _format_loc(loc: tuple[int | str, ...]) -> str:
    parts = []
    for part in loc:
        # Field names come from the file (unknown keys): show odd ones quoted and short.
        text = str(part)
        parts.append(text if re.fullmatch(r"[A-Za-z0-9_-]{1,60}", text) else _show(text))
    return ".".join(parts) if parts else "(case)"


# Fields the case fills in from another one when they are absent.
_DERIVED = {("group",), ("policy_seed",)}


def _is_int(value: Any) -> bool:
    return type(value) is int


def _benchmark_problems(obj: dict[str, Any], catalog: Catalog, max_horizon_factor: float | None) -> list[tuple[str, str]]:
    """(field, problem) pairs of one raw case against the catalog; fields of the wrong type are left to the model."""
    name = obj.get("suite")
    if not isinstance(name, str) or not name:
        return []
    suite = catalog.suite(name)
    if suite is None:
        refused = catalog.refusal(name)  # in the benchmark, but not runnable here: say why
        return [("suite", refused or f"unknown suite {_show(name)}; {catalog.hint(name)}")]
    out = []
    task_id, task = obj.get("task_id"), None
    if _is_int(task_id) and 0 <= task_id <= _INT32_MAX:
        task = catalog.task(name, task_id)
        if task is None:
            out.append(("task_id", f"{name} has no task {task_id} (task ids 0..{len(suite.tasks) - 1})"))
    if task is not None:
        index = obj.get("init_state_index")
        if _is_int(index) and task.init_states <= index <= _INT32_MAX:
            out.append((
                "init_state_index",
                f"{name} task {task_id} has no initial state {index} (indices 0..{task.init_states - 1})",
            ))
        instruction = obj.get("instruction")
        # Exact equality: the instruction is part of the initial-state
        # fingerprint, so "almost the same" would replay a different case.
        # Either of the task's wordings: the suite's own, or LIBERO's task.language where that differs (what
        # openpi's and LeRobot's loops send); the arm refuses the one its episode protocol does not send.
        if isinstance(instruction, str) and instruction and instruction not in (task.instruction, task.task_language):
            also = f" (nor its task.language {task.task_language!r})" if task.task_language else ""
            out.append((
                "instruction",
                f"{_show(instruction)} is not {name} task {task_id}'s own instruction {task.instruction!r}{also}",
            ))
    horizon = obj.get("horizon")
    if max_horizon_factor is not None and _is_int(horizon):
        limit = int(max_horizon_factor * suite.horizon)
        if horizon > limit:
            out.append((
                "horizon",
                f"{_show(horizon, 24)} steps is over {max_horizon_factor:g} x {name}'s official horizon "
                f"{suite.horizon} (at most {limit}; a larger max_horizon_factor allows more)",
            ))
    return out


def _resolve(catalog: CatalogChoice) -> Catalog | None:
    return libero_catalog() if catalog == "libero" else catalog  # type: ignore[return-value]


def parse_manifest(
    data: bytes,
    source: str,
    case_type: type[Case] = Case,
    *,
    catalog: CatalogChoice = "libero",
    max_horizon_factor: float | None = DEFAULT_MAX_HORIZON_FACTOR,
) -> Manifest:
    """Validate manifest bytes against the case model and the catalog; raise ManifestError listing every problem.

    `catalog=None` skips the benchmark checks (another benchmark's cases);
    `max_horizon_factor=None` lifts the bound relative to the suite's official horizon.
    """
    label = source
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError([f"{label}: the file is {len(data)} bytes long, at most {MAX_MANIFEST_BYTES}"])
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ManifestError([f"{label}: not UTF-8 text (a UTF-16 byte-order mark); save it as UTF-8"])
    cat = _resolve(catalog)
    start = len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0

    problems: list[str] = []
    cases: list[Case] = []
    first_seen: dict[str, str] = {}
    folded: dict[str, tuple[str, str]] = {}
    episodes: dict[tuple[str, int, int, int], str] = {}
    for where, dup_where, obj in _entries(data, start, label, Path(source).suffix.lower()):
        if len(problems) >= MAX_PROBLEMS:
            problems.append(f"{label}: stopped after {MAX_PROBLEMS} problems")
            break
        if isinstance(obj, _Unreadable):
            problems.append(obj.problem)
            continue
        if not isinstance(obj, dict):
            problems.append(f"{where}: expected a JSON object, got {type(obj).__name__}")
            continue
        bad_text = _surrogate_at(obj)
        if bad_text is not None:
            where_field = _format_loc(tuple(str(p).encode("utf-8", "backslashreplace").decode() for p in bad_text))
            problems.append(f"{where}: {where_field}: holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                            "without its pair), which is not text")
            continue
        line: list[tuple[str, str]] = []
        # Duplicates are checked on the raw id so that a line with another
        # error still gets its duplicate reported too.
        case_id = obj.get("case_id")
        if isinstance(case_id, str) and case_id:
            if case_id in first_seen:
                line.append(("case_id", f"duplicate case id {_show(case_id)} (first at {first_seen[case_id]})"))
            else:
                first_seen[case_id] = dup_where
                # Ids name files; on a case-insensitive file system "A" and "a" collide.
                other = folded.setdefault(case_id.lower(), (case_id, dup_where))
                if other[0] != case_id:
                    line.append(("case_id", f"case id {_show(case_id)} differs from {_show(other[0])} "
                                            f"({other[1]}) only in letter case"))
        checked = _benchmark_problems(obj, cat, max_horizon_factor) if cat is not None else []
        try:
            case = case_type.model_validate(obj)
            episode = (case.suite, case.task_id, case.init_state_index, case.env_seed)
            if episode in episodes:
                # One episode, one case: twice (or once pilot, once main) it would be counted twice.
                line.append(("(case)", f"the same episode (suite, task, initial state, env seed) as {episodes[episode]}"))
            episodes.setdefault(episode, dup_where)
            cases.append(case)
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                if err["loc"] == ("horizon",) and err["type"] == "less_than_equal" and any(f == "horizon" for f, _ in checked):
                    continue  # the catalog's bound says the same, with the suite's numbers
                if err["type"] == "missing" and err["loc"] in _DERIVED and err["loc"][0] not in obj:
                    continue  # derived from a field whose own problem is reported
                line.append((_format_loc(err["loc"]), err["msg"].removeprefix("Value error, ")))
        line += checked
        problems += [f"{where}: {field}: {message}" for field, message in line]

    if not problems and not cases:
        problems.append(f"{label}: no cases")
    if problems:
        raise ManifestError(problems)
    return Manifest(cases=cases, source=source, sha256=hashlib.sha256(data).hexdigest(), data=data)


def read_manifest_bytes(path: str | os.PathLike[str], what: str = "manifest") -> bytes:
    """A manifest file's bytes, at most MAX_MANIFEST_BYTES; ManifestError for anything but a regular
    file (rescue/core/inputs.py). `what`: the file's role in the message (another evaluation's results)."""
    try:
        return read_input(path, MAX_MANIFEST_BYTES, what)
    except InputFileError as exc:
        raise ManifestError([str(exc)]) from None


def load_manifest(
    path: str | os.PathLike[str],
    case_type: type[Case] = Case,
    *,
    catalog: CatalogChoice = "libero",
    max_horizon_factor: float | None = DEFAULT_MAX_HORIZON_FACTOR,
) -> Manifest:
    """Read a JSONL or JSON-list manifest; raise ManifestError listing every problem (see parse_manifest)."""
    path = Path(path)
    data = read_manifest_bytes(path)
    return parse_manifest(data, str(path), case_type, catalog=catalog, max_horizon_factor=max_horizon_factor)


def case_places(data: bytes, source: str) -> dict[str, str]:
    """Where each case id of a readable manifest stands (`file:line`, or `file[index]` in a JSON list)."""
    out: dict[str, str] = {}
    for where, _, obj in _entries(data, len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0, source,
                                  Path(source).suffix.lower()):
        if isinstance(obj, dict) and isinstance(obj.get("case_id"), str):
            out.setdefault(obj["case_id"], where)
    return out


def manifest_text(cases: Iterable[Case]) -> str:
    """Cases as the JSONL text of a manifest file; ManifestError on a duplicate case id."""
    cases = list(cases)
    seen: dict[str, int] = {}
    problems = []
    for i, case in enumerate(cases):
        if case.case_id in seen:
            problems.append(
                f"[{i}]: case_id: duplicate case id {case.case_id!r} "
                f"(first at index {seen[case.case_id]})"
            )
        seen.setdefault(case.case_id, i)
    if problems:
        raise ManifestError(problems)

    lines = [
        json.dumps(case.model_dump(mode="json", exclude_none=True), ensure_ascii=False, separators=(",", ":"))
        for case in cases
    ]
    return "".join(line + "\n" for line in lines)
