"""The manifest: the list of historical failures a study replays (DESIGN §2).

A manifest is JSONL (one case per line) or a JSON list of cases. Loading it is
all-or-nothing: every problem in the file is collected and reported at once,
each naming its line (or list index) and field, and nothing is written.
Simulator-specific checks (the task's own instruction) come in through a
lookup the env adapter supplies, so this module imports no simulator.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)


class ManifestError(Exception):
    """A manifest that cannot be used; `problems` lists every reason, one per entry."""

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


def _tag_value(value: Any) -> str | int | float | bool:
    # One plain check instead of a union type: a union reports one error per
    # member, which buries the single thing the user got wrong.
    if isinstance(value, (str, int, float, bool)):
        return value
    raise ValueError("tag values must be a string, number or boolean")


TagValue = Annotated[str | int | float | bool, PlainValidator(_tag_value)]


class Case(BaseModel):
    """One historical failure to replay. Adapters with extra fields subclass it."""

    # Strict: a manifest saying "task_id": "3" is a mistake to report, not coerce.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    case_id: str = Field(min_length=1)
    suite: str = Field(min_length=1)
    task_id: int = Field(ge=0)
    init_state_index: int = Field(ge=0)
    env_seed: int
    horizon: int = Field(gt=0)
    group: str = Field(min_length=1)
    instruction: str | None = Field(default=None, min_length=1)
    fingerprint: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]+$")
    pilot: bool = False
    tags: dict[str, TagValue] = Field(default_factory=dict)
    policy_seed: int

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
        if data.get("policy_seed") is None and type(env_seed) is int:
            data["policy_seed"] = derive_policy_seed(env_seed)
        return data

    @field_validator("case_id")
    @classmethod
    def _no_surrounding_space(cls, value: str) -> str:
        # "a" and "a " would be two different ids that print the same.
        if value != value.strip():
            raise ValueError("case id must not start or end with whitespace")
        return value

    @field_validator("fingerprint")
    @classmethod
    def _lowercase_fingerprint(cls, value: str | None) -> str | None:
        # Fingerprints are compared as strings; one spelling avoids false deviations.
        return value.lower() if value is not None else None

    @property
    def task(self) -> str:
        """The benchmark task this case belongs to, as `suite/task_id`."""
        return f"{self.suite}/{self.task_id}"


class Manifest(BaseModel):
    """The cases of one manifest file, with the file's path and sha256."""

    model_config = ConfigDict(frozen=True)

    cases: list[Case]
    source: str
    sha256: str

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


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys silently; a manifest line
    # with "horizon" twice is ambiguous, so it is refused.
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_reject_duplicate_keys)


def _format_loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) if loc else "(case)"


class _Unreadable:
    """An entry that is not valid JSON; carries its problem so order is kept."""

    def __init__(self, problem: str):
        self.problem = problem


def _entries(text: str, label: str, suffix: str) -> list[tuple[str, str, Any]]:
    """Split the text into (where, where-for-duplicates, parsed object) entries."""
    if text.lstrip().startswith("["):
        try:
            items = _loads(text)
        except json.JSONDecodeError as exc:
            return [(label, "", _Unreadable(f"{label}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}"))]
        except ValueError as exc:
            return [(label, "", _Unreadable(f"{label}: invalid JSON: {exc}"))]
        if not isinstance(items, list):
            return [(label, "", _Unreadable(f"{label}: expected a JSON list of cases"))]
        return [(f"{label}[{i}]", f"index {i}", item) for i, item in enumerate(items)]

    if suffix == ".json" and "\n" in text.strip():
        # A .json file that is not a list may be one pretty-printed object;
        # reading it line by line would only produce confusing errors.
        try:
            whole = _loads(text)
        except ValueError:
            whole = None
        if isinstance(whole, dict):
            return [(label, "", _Unreadable(f"{label}: expected a JSON list of cases or one case per line"))]

    entries: list[tuple[str, str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{label}:{lineno}"
        try:
            obj: Any = _loads(line)
        except json.JSONDecodeError as exc:
            obj = _Unreadable(f"{where}:{exc.colno}: invalid JSON: {exc.msg}")
        except ValueError as exc:
            obj = _Unreadable(f"{where}: invalid JSON: {exc}")
        entries.append((where, f"line {lineno}", obj))
    return entries


def parse_manifest(data: bytes, source: str, case_type: type[Case] = Case) -> Manifest:
    """Validate manifest bytes; raise ManifestError listing every problem found."""
    label = source
    problems: list[str] = []
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ManifestError([f"{label}: not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None

    cases: list[Case] = []
    first_seen: dict[str, str] = {}
    for where, dup_where, obj in _entries(text, label, Path(source).suffix.lower()):
        if isinstance(obj, _Unreadable):
            problems.append(obj.problem)
            continue
        if not isinstance(obj, dict):
            problems.append(f"{where}: expected a JSON object, got {type(obj).__name__}")
            continue
        # Duplicates are checked on the raw id so that a line with another
        # error still gets its duplicate reported too.
        case_id = obj.get("case_id")
        if isinstance(case_id, str) and case_id:
            if case_id in first_seen:
                problems.append(
                    f"{where}: case_id: duplicate case id {case_id!r} "
                    f"(first at {first_seen[case_id]})"
                )
            else:
                first_seen[case_id] = dup_where
        try:
            cases.append(case_type.model_validate(obj))
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                problems.append(f"{where}: {_format_loc(err['loc'])}: {err['msg']}")

    if not problems and not cases:
        problems.append(f"{label}: no cases")
    if problems:
        raise ManifestError(problems)
    return Manifest(cases=cases, source=source, sha256=hashlib.sha256(data).hexdigest())


def load_manifest(path: str | os.PathLike[str], case_type: type[Case] = Case) -> Manifest:
    """Read a JSONL or JSON-list manifest; raise ManifestError listing every problem."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ManifestError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    return parse_manifest(data, str(path), case_type)


def check_instructions(manifest: Manifest, lookup: Callable[[Case], str]) -> list[str]:
    """Problems where a case's given instruction differs from its task's own (DESIGN §2)."""
    problems = []
    for case in manifest.cases:
        if case.instruction is None:
            continue
        try:
            own = lookup(case)
        except LookupError as exc:
            problems.append(f"{case.case_id}: task {case.task} not found: {exc}")
            continue
        # Exact equality: the instruction is part of the initial-state
        # fingerprint, so "almost the same" would replay a different case.
        if case.instruction != own:
            problems.append(
                f"{case.case_id}: instruction {case.instruction!r} differs from "
                f"task {case.task}'s own {own!r}"
            )
    return problems


def write_manifest(cases: Iterable[Case], path: str | os.PathLike[str]) -> None:
    """Write cases as JSONL atomically: the file is either the old one or complete."""
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

    path = Path(path)
    lines = [
        json.dumps(case.model_dump(mode="json", exclude_none=True), ensure_ascii=False, separators=(",", ":"))
        for case in cases
    ]
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
