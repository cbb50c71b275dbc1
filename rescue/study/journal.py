"""The journal: a study's one source of truth (DESIGN §4, §5).

One SQLite file in WAL mode in the study folder holds the cases, their
claims, arm results (each with the sha256 of its canonical JSON), verdicts
and the receipts index (each entry with the sha256 of its receipt line), so
that `rescue verify` can tell a record changed after it was written. The
rules of §4 live here as constraints rather than conventions:

- a claim is a compare-and-set from `pending`, committed before the caller
  touches the simulator, and a case once claimed is never pending again;
- a crashed claim becomes `interrupted`, a final state;
- an arm result or verdict is written once; a second write raises.

Every write is its own `BEGIN IMMEDIATE` transaction, so several processes
(workers, `rescue drain`, `rescue status`) can share the file safely.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from rescue.core.digest import digest_json
from rescue.core.manifest import Case
from rescue.core.records import ArmResult
from rescue.core.verdicts import Verdict
from rescue.study.layout import StudyLayout
from rescue.study.transaction import write_transaction

# 2: arms.digest and receipts.line_sha256.
SCHEMA_VERSION = 2
BUSY_TIMEOUT_S = 60.0

CaseState = Literal["pending", "claimed", "finished", "interrupted"]
STATES: tuple[CaseState, ...] = ("pending", "claimed", "finished", "interrupted")
EVER_CLAIMED: tuple[CaseState, ...] = ("claimed", "finished", "interrupted")

# Keys the journal writes itself; `drain` is shared with other processes.
_SCHEMA_KEY = "schema_version"
_CREATED_KEY = "created_at"
_DRAIN_KEY = "drain"
# The study's summary as last stored; `rescue verify` recomputes and compares it.
SUMMARY_KEY = "summary"
# Why a run stopped claiming before its queue was empty (one line for the person who runs it), and
# the cases a second signal stopped in flight; a resume clears both.
STOP_REASON_KEY = "stop_reason"
STOPPED_NOW_KEY = "stopped_now"

_SCHEMA = """
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE cases (
    case_id TEXT PRIMARY KEY,
    ord INTEGER NOT NULL UNIQUE,
    data TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'claimed', 'finished', 'interrupted')),
    worker TEXT,
    claimed_at REAL,
    finished_at REAL,
    reason TEXT
);
CREATE INDEX cases_by_state ON cases(state, ord);
CREATE TABLE arms (
    case_id TEXT NOT NULL REFERENCES cases(case_id),
    arm TEXT NOT NULL,
    data TEXT NOT NULL,
    digest TEXT NOT NULL,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (case_id, arm)
);
CREATE TABLE verdicts (
    case_id TEXT PRIMARY KEY REFERENCES cases(case_id),
    data TEXT NOT NULL
);
CREATE TABLE receipts (
    call_id TEXT NOT NULL,
    case_id TEXT NOT NULL REFERENCES cases(case_id),
    path TEXT NOT NULL,
    line_sha256 TEXT,
    PRIMARY KEY (call_id, case_id)
);
-- The only moves are pending -> claimed -> finished | interrupted, whoever
-- writes the file: a claimed case never returns to pending.
CREATE TRIGGER cases_state_moves
BEFORE UPDATE OF state ON cases
WHEN NOT (
    NEW.state = OLD.state
    OR (OLD.state = 'pending' AND NEW.state = 'claimed')
    OR (OLD.state = 'claimed' AND NEW.state IN ('finished', 'interrupted'))
)
BEGIN
    SELECT RAISE(ABORT, 'illegal case state change');
END;
"""


class JournalError(Exception):
    """A journal operation that would break a study rule or found no journal."""


class DuplicateRecord(JournalError):
    """A second arm result or verdict for the same case (and arm)."""


class CaseRow(BaseModel):
    """A case's queue state as the journal holds it (without the case itself)."""

    case_id: str
    ord: int
    state: CaseState
    worker: str | None = None
    claimed_at: float | None = None
    finished_at: float | None = None
    reason: str | None = None


class ArmRow(BaseModel):
    """An arm result as stored: its raw JSON and the digest taken when it was recorded."""

    case_id: str
    arm: str
    data: str
    digest: str
    recorded_at: float


class ReceiptIndexRow(BaseModel):
    """One receipts-index entry: which file holds a call naming a case, and its line's sha256."""

    call_id: str
    case_id: str
    path: str
    line_sha256: str | None = None


def arm_digest(result: ArmResult) -> str:
    """The sha256 of an arm result's canonical JSON (what the journal stores beside it)."""
    return digest_json(result.model_dump(mode="json"))


def stored_arm_digest(data: str) -> str:
    """The same digest of an arm record as stored (its JSON text): independent of the fields the record
    type has today, so a record written before a field was added still hashes to its stored digest."""
    return digest_json(json.loads(data))


def journal_path(study_dir: str | os.PathLike[str]) -> Path:
    """Where a study's journal lives."""
    return StudyLayout.of(study_dir).journal


def _connect(path: Path, *, readonly: bool, must_exist: bool) -> sqlite3.Connection:
    # URI modes so that opening never creates an empty database by accident.
    mode = "ro" if readonly else ("rw" if must_exist else "rwc")
    uri = f"{path.resolve().as_uri()}?mode={mode}"
    conn = sqlite3.connect(
        uri,
        uri=True,
        timeout=BUSY_TIMEOUT_S,
        isolation_level=None,  # we issue BEGIN IMMEDIATE / COMMIT ourselves
        check_same_thread=False,  # guarded by Journal._lock instead
    )
    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    conn.execute("PRAGMA foreign_keys = ON")
    if not readonly:
        conn.execute("PRAGMA synchronous = FULL")
    return conn


class Journal:
    """A handle on one study's journal; one SQLite connection, safe to share across threads."""

    def __init__(self, conn: sqlite3.Connection, path: Path, case_type: type[Case], readonly: bool):
        self._conn = conn
        self._lock = threading.RLock()
        self.path = path
        self.case_type = case_type
        self.readonly = readonly

    # --- lifecycle -------------------------------------------------------

    @classmethod
    def create(
        cls,
        study_dir: str | os.PathLike[str],
        cases: Iterable[Case],
        meta: dict[str, Any] | None = None,
        case_type: type[Case] = Case,
    ) -> Journal:
        """Create the journal of a new study with all its cases pending; fail if one exists."""
        final = journal_path(study_dir)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            raise JournalError(f"a journal already exists at {final}")

        # Build the whole database under a private name and link it into
        # place only when complete: a crash leaves no half-made journal, and
        # os.link refuses to replace one created meanwhile by someone else.
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        rows = [
            (case.case_id, i, case.model_dump_json()) for i, case in enumerate(cases)
        ]
        try:
            conn = _connect(tmp, readonly=False, must_exist=False)
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                # BEGIN inside the script: executescript commits any open
                # transaction first, and schema plus cases should be one.
                conn.executescript("BEGIN IMMEDIATE;\n" + _SCHEMA)
                conn.executemany("INSERT INTO cases (case_id, ord, data) VALUES (?, ?, ?)", rows)
                entries = dict(meta or {})
                entries[_SCHEMA_KEY] = SCHEMA_VERSION
                entries[_CREATED_KEY] = time.time()
                conn.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [(k, json.dumps(v)) for k, v in entries.items()],
                )
                conn.execute("COMMIT")
            except sqlite3.IntegrityError as exc:
                raise JournalError(f"cannot create journal: {exc}") from None
            finally:
                conn.close()  # checkpoints the WAL into the file before it moves
            try:
                os.link(tmp, final)
            except FileExistsError:
                raise JournalError(f"a journal already exists at {final}") from None
        finally:
            for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
                try:
                    leftover.unlink()
                except FileNotFoundError:
                    pass
        return cls.open(study_dir, case_type=case_type)

    @classmethod
    def open(
        cls,
        study_dir: str | os.PathLike[str],
        *,
        readonly: bool = False,
        case_type: type[Case] = Case,
    ) -> Journal:
        """Open an existing study's journal (read-only for status views)."""
        path = journal_path(study_dir)
        if not path.exists():
            raise JournalError(f"no journal at {path}")
        conn = _connect(path, readonly=readonly, must_exist=True)
        if not readonly:
            conn.execute("PRAGMA journal_mode = WAL")
        journal = cls(conn, path, case_type, readonly)
        version = journal.meta().get(_SCHEMA_KEY)
        if version != SCHEMA_VERSION:
            conn.close()
            raise JournalError(f"{path}: schema version {version!r}, expected {SCHEMA_VERSION}")
        return journal

    def close(self) -> None:
        """Close the connection; the handle is unusable afterwards."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:
        return write_transaction(self._conn, self._lock)

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def _require_case(self, conn: sqlite3.Connection, case_id: str) -> str:
        row = conn.execute("SELECT state FROM cases WHERE case_id = ?", (case_id,)).fetchone()
        if row is None:
            raise KeyError(case_id)
        return row[0]

    # --- claims ----------------------------------------------------------

    def claim(self, case_id: str, worker: str) -> bool:
        """Mark a pending case started by `worker`; True only for the one caller that won."""
        with self._write() as conn:
            won = conn.execute(
                "UPDATE cases SET state = 'claimed', worker = ?, claimed_at = ? "
                "WHERE case_id = ? AND state = 'pending' RETURNING case_id",
                (worker, time.time(), case_id),
            ).fetchall()
            if not won:
                self._require_case(conn, case_id)
        return bool(won)

    def claim_next(self, worker: str, prefer: Sequence[tuple[str, int]] = ()) -> Case | None:
        """Claim the first pending case in manifest order of the first task in `prefer` ((suite, task_id)s: the
        tasks whose envs the claiming simulator holds, most recent first) that has one, else the first
        pending case; None when none is left or draining."""
        with self._write() as conn:
            # The drain flag is read inside the same transaction as the claim,
            # so no case is handed out after a drain request commits.
            if conn.execute("SELECT 1 FROM meta WHERE key = ?", (_DRAIN_KEY,)).fetchone():
                return None
            row = None
            for suite, task_id in prefer:
                row = conn.execute(
                    "SELECT case_id, data FROM cases WHERE state = 'pending' AND json_extract(data, '$.suite') = ? "
                    "AND json_extract(data, '$.task_id') = ? ORDER BY ord LIMIT 1", (suite, task_id)
                ).fetchone()
                if row is not None:
                    break
            if row is None:
                row = conn.execute(
                    "SELECT case_id, data FROM cases WHERE state = 'pending' ORDER BY ord LIMIT 1"
                ).fetchone()
            if row is None:
                return None
            conn.execute(
                "UPDATE cases SET state = 'claimed', worker = ?, claimed_at = ? "
                "WHERE case_id = ? AND state = 'pending'",
                (worker, time.time(), row[0]),
            )
        return self.case_type.model_validate_json(row[1])

    def unsettled_ids(self) -> list[str]:
        """Cases a recovery must settle, in manifest order: claimed but unfinished (the process that
        held them is gone), and interrupted without a verdict (a recovery that stopped half-way)."""
        return [
            r[0]
            for r in self._read(
                "SELECT c.case_id FROM cases c LEFT JOIN verdicts v USING (case_id) "
                "WHERE c.state = 'claimed' OR (c.state = 'interrupted' AND v.case_id IS NULL) ORDER BY c.ord"
            )
        ]

    def interrupt(self, case_id: str, verdict: Verdict, reason: str = "interrupted") -> None:
        """Make a claimed case `interrupted` (final) with its verdict, in one transaction; a case
        interrupted earlier without a verdict gets its verdict (repair). Nothing else is changed."""
        if verdict.case_id != case_id:
            raise JournalError(f"verdict is for {verdict.case_id!r}, not {case_id!r}")
        with self._write() as conn:
            state = self._require_case(conn, case_id)
            if state == "claimed":
                conn.execute(
                    "UPDATE cases SET state = 'interrupted', reason = ?, finished_at = ? WHERE case_id = ?",
                    (reason, time.time(), case_id),
                )
            elif state != "interrupted":
                raise JournalError(f"case {case_id!r} is {state}, not claimed or interrupted")
            self._insert_verdict(conn, verdict)

    # --- results ---------------------------------------------------------

    @staticmethod
    def _insert_arm(conn: sqlite3.Connection, result: ArmResult) -> None:
        try:
            conn.execute(
                "INSERT INTO arms (case_id, arm, data, digest, recorded_at) VALUES (?, ?, ?, ?, ?)",
                (result.case_id, result.arm, result.model_dump_json(), arm_digest(result), time.time()),
            )
        except sqlite3.IntegrityError:
            raise DuplicateRecord(f"arm {result.arm} of case {result.case_id!r} is already recorded") from None

    def record_arm(self, result: ArmResult,
                   receipt: tuple[str, str, str | None] | list[tuple[str, str, str | None]] | None = None) -> None:
        """Record one finished arm of a claimed case as soon as it ends, with the receipt index entries of the calls
        its subgoals came from (one, or one per call: DESIGN §18) (DESIGN §4: work done survives a kill); the case
        stays claimed until `finish_case` gives it its verdict. A second record of the arm raises."""
        with self._write() as conn:
            state = self._require_case(conn, result.case_id)
            if state != "claimed":
                raise JournalError(f"case {result.case_id!r} is {state}, not claimed; cannot record its {result.arm} arm")
            self._insert_arm(conn, result)
            self._index(conn, result.case_id, receipt if isinstance(receipt, list) else [receipt] if receipt else [])

    def finish_case(
        self,
        case_id: str,
        arms: Iterable[ArmResult],
        verdict: Verdict,
        receipt: tuple[str, str, str | None] | list[tuple[str, str, str | None]] | None = None,
    ) -> None:
        """Record a claimed case's arms (those `record_arm` has not recorded already, which must be the same
        records), its receipt index entries (call id, receipts file, line sha256: one, or one per advisor) and its
        verdict, and finish it, in one transaction."""
        if verdict.case_id != case_id:
            raise JournalError(f"verdict is for {verdict.case_id!r}, not {case_id!r}")
        with self._write() as conn:
            state = self._require_case(conn, case_id)
            if state != "claimed":
                raise JournalError(f"case {case_id!r} is {state}, not claimed; cannot finish it")
            recorded = dict(conn.execute("SELECT arm, digest FROM arms WHERE case_id = ?", (case_id,)).fetchall())
            for result in arms:
                if result.case_id != case_id:
                    raise JournalError(f"arm result is for {result.case_id!r}, not {case_id!r}")
                if result.arm in recorded:
                    if recorded[result.arm] != arm_digest(result):
                        raise DuplicateRecord(f"arm {result.arm} of case {case_id!r} is recorded with other contents")
                    continue
                self._insert_arm(conn, result)
            self._index(conn, case_id, [receipt] if isinstance(receipt, tuple) else list(receipt or []))
            conn.execute(
                "UPDATE cases SET state = 'finished', finished_at = ? WHERE case_id = ?",
                (time.time(), case_id),
            )
            self._insert_verdict(conn, verdict)

    @staticmethod
    def _index(conn: sqlite3.Connection, case_id: str, entries: list[tuple[str, str, str | None]]) -> None:
        for call_id, path, line_sha256 in entries:
            conn.execute(
                "INSERT OR IGNORE INTO receipts (call_id, case_id, path, line_sha256) VALUES (?, ?, ?, ?)",
                (call_id, case_id, path, line_sha256),
            )

    @staticmethod
    def _insert_verdict(conn: sqlite3.Connection, verdict: Verdict) -> None:
        try:
            conn.execute(
                "INSERT INTO verdicts (case_id, data) VALUES (?, ?)",
                (verdict.case_id, verdict.model_dump_json()),
            )
        except sqlite3.IntegrityError:
            raise DuplicateRecord(f"case {verdict.case_id!r} already has a verdict") from None

    # --- drain -----------------------------------------------------------

    def request_drain(self) -> None:
        """Ask every worker on this study to stop taking new cases."""
        self.set_meta(_DRAIN_KEY, True)

    def clear_drain(self) -> None:
        """Let workers take new cases again."""
        with self._write() as conn:
            conn.execute("DELETE FROM meta WHERE key = ?", (_DRAIN_KEY,))

    def draining(self) -> bool:
        """Whether a drain has been requested (by any process)."""
        return bool(self._read("SELECT 1 FROM meta WHERE key = ?", (_DRAIN_KEY,)))

    # --- queries ---------------------------------------------------------

    def meta(self) -> dict[str, Any]:
        """All meta entries, decoded from JSON."""
        return {k: json.loads(v) for k, v in self._read("SELECT key, value FROM meta ORDER BY key")}

    def set_meta(self, key: str, value: Any) -> None:
        """Store one meta entry (any JSON-serialisable value), replacing an earlier one."""
        if key == _SCHEMA_KEY:
            raise JournalError(f"{key!r} is managed by the journal")
        with self._write() as conn:
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, json.dumps(value)),
            )

    def delete_meta(self, key: str) -> None:
        """Remove one meta entry (absent: nothing happens)."""
        if key == _SCHEMA_KEY:
            raise JournalError(f"{key!r} is managed by the journal")
        with self._write() as conn:
            conn.execute("DELETE FROM meta WHERE key = ?", (key,))

    def set_summary(self, summary: BaseModel | dict[str, Any]) -> None:
        """Store the study's summary in meta (under `summary`) for later re-checking."""
        value = summary.model_dump(mode="json") if isinstance(summary, BaseModel) else summary
        self.set_meta(SUMMARY_KEY, value)

    def counts(self) -> dict[str, int]:
        """Number of cases in each state (every state present, zero included)."""
        counts = dict.fromkeys(STATES, 0)
        counts.update(self._read("SELECT state, COUNT(*) FROM cases GROUP BY state"))
        return counts

    def label_counts(self) -> dict[tuple[bool, str], int]:
        """Stored verdicts counted by (pilot, label), without parsing a case or a verdict."""
        rows = self._read(
            "SELECT COALESCE(json_extract(c.data, '$.pilot'), 0), json_extract(v.data, '$.label'), COUNT(*) "
            "FROM verdicts v JOIN cases c USING (case_id) GROUP BY 1, 2"
        )
        return {(bool(pilot), label): n for pilot, label, n in rows}

    def arm_label_counts(self) -> dict[str, dict[str, int]]:
        """The verdict labels of every arm judged besides the primary (the sham, further advisors, extra query
        points), by arm, over main-cohort cases, counted by SQLite (empty: a study of two arms). Verdicts stored
        before the record family keep the sham's under `sham` and every advisor's under `advisors`."""
        main = "NOT COALESCE(json_extract(c.data, '$.pilot'), 0)"
        rows = self._read(
            "SELECT a.key, json_extract(a.value, '$.label'), COUNT(*) FROM verdicts v JOIN cases c USING (case_id), "
            f"json_each(v.data, '$.arms') a WHERE {main} GROUP BY 1, 2 "
            "UNION ALL SELECT 'sham', json_extract(v.data, '$.sham.label'), COUNT(*) FROM verdicts v "
            f"JOIN cases c USING (case_id) WHERE json_extract(v.data, '$.sham.label') IS NOT NULL AND {main} GROUP BY 2 "
            "UNION ALL SELECT 'assisted:' || a.key, json_extract(a.value, '$.label'), COUNT(*) FROM verdicts v "
            f"JOIN cases c USING (case_id), json_each(v.data, '$.advisors') a WHERE {main} GROUP BY 1, 2"
        )
        out: dict[str, dict[str, int]] = {}
        for arm, label, n in rows:
            out.setdefault(arm, {})[label] = out.get(arm, {}).get(label, 0) + n
        return out

    def pilot_count(self) -> int:
        """How many cases the manifest declared pilot."""
        return self._read("SELECT COUNT(*) FROM cases WHERE COALESCE(json_extract(data, '$.pilot'), 0)")[0][0]

    def cases(self) -> list[Case]:
        """All cases in manifest order."""
        return [
            self.case_type.model_validate_json(data)
            for (data,) in self._read("SELECT data FROM cases ORDER BY ord")
        ]

    def case(self, case_id: str) -> Case:
        """One case by id; KeyError when the study has no such case."""
        rows = self._read("SELECT data FROM cases WHERE case_id = ?", (case_id,))
        if not rows:
            raise KeyError(case_id)
        return self.case_type.model_validate_json(rows[0][0])

    def state(self, case_id: str) -> CaseState:
        """A case's state; KeyError when the study has no such case."""
        rows = self._read("SELECT state FROM cases WHERE case_id = ?", (case_id,))
        if not rows:
            raise KeyError(case_id)
        return rows[0][0]

    def rows(self) -> list[CaseRow]:
        """Every case's queue state (worker, times, reason) in manifest order."""
        return [
            CaseRow(
                case_id=r[0], ord=r[1], state=r[2], worker=r[3],
                claimed_at=r[4], finished_at=r[5], reason=r[6],
            )
            for r in self._read(
                "SELECT case_id, ord, state, worker, claimed_at, finished_at, reason "
                "FROM cases ORDER BY ord"
            )
        ]

    def arms(self, case_id: str) -> dict[str, ArmResult]:
        """The recorded arm results of one case, keyed by arm name."""
        return {
            arm: ArmResult.model_validate_json(data)
            for arm, data in self._read(
                "SELECT arm, data FROM arms WHERE case_id = ? ORDER BY arm", (case_id,)
            )
        }

    def all_arms(self) -> dict[str, dict[str, ArmResult]]:
        """Every recorded arm result, by case id (manifest order) and arm name."""
        out: dict[str, dict[str, ArmResult]] = {}
        for case_id, arm, data in self._read(
            "SELECT a.case_id, a.arm, a.data FROM arms a JOIN cases c USING (case_id) "
            "ORDER BY c.ord, a.arm"
        ):
            out.setdefault(case_id, {})[arm] = ArmResult.model_validate_json(data)
        return out

    def verdicts(self) -> dict[str, Verdict]:
        """Every stored verdict, by case id in manifest order."""
        return {
            case_id: Verdict.model_validate_json(data)
            for case_id, data in self._read(
                "SELECT v.case_id, v.data FROM verdicts v JOIN cases c USING (case_id) ORDER BY c.ord"
            )
        }

    def raw_verdicts(self) -> dict[str, str]:
        """Every stored verdict as its raw JSON, by case id in manifest order (for re-checking)."""
        return dict(
            self._read(
                "SELECT v.case_id, v.data FROM verdicts v JOIN cases c USING (case_id) ORDER BY c.ord"
            )
        )

    def pending_ids(self) -> list[str]:
        """Ids of cases never claimed, in manifest order."""
        return [r[0] for r in self._read("SELECT case_id FROM cases WHERE state = 'pending' ORDER BY ord")]

    def arm_rows(self) -> list[ArmRow]:
        """Every stored arm result as raw JSON with its recorded digest, in manifest order."""
        return [
            ArmRow(case_id=r[0], arm=r[1], data=r[2], digest=r[3], recorded_at=r[4])
            for r in self._read(
                "SELECT a.case_id, a.arm, a.data, a.digest, a.recorded_at "
                "FROM arms a JOIN cases c USING (case_id) ORDER BY c.ord, a.arm"
            )
        ]

    def receipt_index(self, case_id: str | None = None) -> list[ReceiptIndexRow]:
        """Receipts-index entries with their line sha256, optionally for one case."""
        where, params = ("WHERE case_id = ? ", (case_id,)) if case_id is not None else ("", ())
        return [
            ReceiptIndexRow(call_id=r[0], case_id=r[1], path=r[2], line_sha256=r[3])
            for r in self._read(
                f"SELECT call_id, case_id, path, line_sha256 FROM receipts {where}"
                "ORDER BY call_id, case_id",
                params,
            )
        ]
