"""The lab's ledger: what the VLM calls of every budgeted study cost together, and the cap they share.

One SQLite file (`receipts/ledger.sqlite` by default, created on first use) in WAL mode with
`synchronous = FULL`, written only in `BEGIN IMMEDIATE` transactions, as the journal is: several
studies run by several processes share it safely. It holds two things:

- **calls**: one row per VLM call of a budgeted study (by its call id, so a call is never counted
  twice), with its token counts and its cost under the study's declared price. The study's receipts
  stay the evidence; the ledger is what the cap is kept against.
- **holds**: before a study claims a case it holds, for every call the case can make, the estimated
  cost of one call (the dearest call per case this model and endpoint have made, its output bounded
  by `max_output_tokens` when set). A case calls up to `[asking] max_calls` times per arm that asks at
  its own q: each advisor's arm and each declared query point's and trigger's arm (`case_calls`); the
  K continuations of an arm share its call. The check (spent + held + this case's estimates <= cap) and the holds are one transaction:
  two studies cannot both pass a check only one of them fits. Each call's row replaces one of its
  case's holds in one transaction (per call, not per case), and a case's leftover holds (an arm that
  never asked) go when the case ends.

Before the first call of a model at an endpoint its cost is unknown: one case at a time holds an
unknown amount, the others wait for its call; once that call is counted, the case's other unknown
holds count at the estimate it gives.

The bound: an admission never lets spent + held pass the cap, so the ledger's total passes it only
by what the calls in flight at the moment of the refusal cost beyond their holds (a call dearer than
any before it, or the calls of the one case admitted while the model's cost was unknown): at most
the cost of those calls. A process that died leaves holds: they are dropped
once its study's receipts are counted into the ledger (a call written to the receipts but not yet
to the ledger is found there), by the next admission on the same machine.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.vlm_config import TokenPrice, VLMConfig, endpoint_host
from rescue.core.arms import advisor_arm, base_arm, is_assisted
from rescue.core.records import Receipt
from rescue.study.files import fsync_dir
from rescue.study.folder import StudyError
from rescue.study.layout import LAB_LEDGER, LAB_RECEIPTS
from rescue.study.owner import alive as _alive
from rescue.study.transaction import write_transaction
from rescue.study.usage import CallCost, call_cost, study_calls

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 60.0
# How often a case waiting for the first call of a model (its cost still unknown) looks again.
WAIT_S = 0.5

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE calls (
    call_id TEXT PRIMARY KEY,
    study TEXT NOT NULL,
    advisor TEXT,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    cases INTEGER NOT NULL,
    input_tokens INTEGER,
    cached_input_tokens INTEGER,
    output_tokens INTEGER,
    cost REAL,
    started_at REAL NOT NULL,
    recorded_at REAL NOT NULL
);
CREATE TABLE holds (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    study TEXT NOT NULL,
    case_id TEXT,
    arm TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    amount REAL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX holds_by_case ON holds(study, case_id, arm);
"""


class LedgerTotals(BaseModel):
    """What a lab's ledger holds now."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    path: str
    """The ledger file."""
    calls: int
    """Calls counted (of studies with a lab budget)."""
    cost: float
    """Their declared cost, summed (calls whose cost is unknown count nothing)."""
    calls_without_cost: int
    """Calls whose cost is unknown (their endpoint reported no token counts)."""
    held: float
    """The estimated cost of the calls of cases in flight, held against the cap."""
    holds: int
    """Holds open now (one per call still to come of a case in flight)."""


class LedgerError(StudyError):
    """The lab's ledger cannot be used: one line naming its file (bad input, exit 2)."""


class BudgetReached(StudyError):
    """The lab budget leaves no room for the next case's calls (or cannot be kept): the study stops claiming."""


def ledger_path(folder: str | os.PathLike[str] | None = None) -> Path:
    """The ledger file in a lab receipts folder (None: `receipts/` under the working directory)."""
    return Path(folder if folder is not None else LAB_RECEIPTS) / LAB_LEDGER


@dataclass(frozen=True)
class ArmCost:
    """What one VLM arm of a case costs per call, as an admission estimates it."""

    arm: str
    model: str
    endpoint: str
    price: TokenPrice
    max_output_tokens: int | None


def _study_calls(study: str) -> list[CallCost]:
    """A study's calls from its receipts, as the ledger counts them."""
    _, config, receipts = study_calls(study)
    return [ledger_cost(call_cost(config, r, study), r) for r in receipts]


class Ledger:
    """A handle on the lab's ledger; one SQLite connection, safe to share across threads."""

    def __init__(self, path: Path, readonly: bool = False):
        """Open (and, writable, create) the ledger; LedgerError naming the file when it cannot be used (not a
        regular file, not SQLite, another schema, read-only, its folder not a folder)."""
        self.path = Path(path)
        self._lock = threading.RLock()
        if self.path.exists() and not self.path.is_file():
            # A FIFO would block the open; a folder is no ledger either.
            raise LedgerError(f"{self.path}: the lab's ledger is not a regular file")
        try:
            self._open(readonly)
        except (sqlite3.Error, OSError, LedgerError) as exc:
            conn = getattr(self, "_conn", None)
            if conn is not None:
                conn.close()
            if isinstance(exc, LedgerError):
                raise
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise LedgerError(f"{self.path}: the lab's ledger cannot be used ({why})") from None

    def _open(self, readonly: bool) -> None:
        if readonly:
            self._conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S,
                                         isolation_level=None, check_same_thread=False)
            self._check_version()
            return
        new_dir = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self._conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = FULL")
        with self._write() as conn:
            # Two processes may create it at once: the first one's schema wins, the second sees it.
            if conn.execute("SELECT name FROM sqlite_master WHERE name = 'meta'").fetchone() is None:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)  # not executescript: it would commit the transaction first
                conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        if new_dir:
            fsync_dir(self.path.parent.parent)  # the new folder's entry, beside the studies
        self._check_version()

    def _check_version(self) -> None:
        version = self._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if version is None or str(version[0]) != str(SCHEMA_VERSION):
            raise LedgerError(f"{self.path}: ledger schema {version and version[0]!r}, expected {SCHEMA_VERSION}")

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._conn.close()

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:
        return write_transaction(self._conn, self._lock)

    # --- calls ------------------------------------------------------------

    @staticmethod
    def _insert(conn: sqlite3.Connection, call: CallCost) -> None:
        t = call.tokens
        conn.execute(
            "INSERT OR IGNORE INTO calls VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (call.call_id, call.study, call.advisor, call.model, call.endpoint, call.cases, t["input"],
             t["cached_input"], t["output"], call.cost, call.started_at, time.time()),
        )

    def record(self, call: CallCost, case_ids: list[str], arm: str) -> None:
        """Count one call (once, whoever records it again) and drop the one hold it used of each of its cases
        (a case holds one per call it can make: its other calls stay held)."""
        with self._write() as conn:
            before = conn.total_changes
            self._insert(conn, call)
            if conn.total_changes == before:
                return  # counted already: its holds went then
            conn.executemany("DELETE FROM holds WHERE id = (SELECT MIN(id) FROM holds WHERE study = ? AND case_id = ? "
                             "AND arm = ?)", [(call.study, c, arm) for c in case_ids])

    def reconcile(self, study: str) -> int:
        """Count every call of a study's receipts the ledger lacks (a process that died between its receipt and
        its ledger row); how many were added."""
        with self._write() as conn:
            return self._reconcile(conn, _study_calls(study))

    @staticmethod
    def _reconcile(conn: sqlite3.Connection, calls: list[CallCost]) -> int:
        before = conn.total_changes
        for call in calls:
            Ledger._insert(conn, call)
        return conn.total_changes - before

    # --- holds ------------------------------------------------------------

    def _purge_dead(self, conn: sqlite3.Connection) -> None:
        host = socket.gethostname()
        dead = [(i, study) for i, study, pid in conn.execute("SELECT id, study, pid FROM holds WHERE host = ?", (host,))
                if not _alive(pid)]
        for study in sorted({s for _, s in dead}):
            try:
                calls = _study_calls(study)
            except (StudyError, OSError, ValueError):
                calls = []  # a study folder gone or unreadable: its holds go, its calls cannot be found
            self._reconcile(conn, calls)
        conn.executemany("DELETE FROM holds WHERE id = ?", [(i,) for i, _ in dead])

    @staticmethod
    def _estimate(conn: sqlite3.Connection, arm: ArmCost) -> float | None:
        """One request's cost for this arm: the dearest per case under this price; None before any call."""
        rows = conn.execute(
            "SELECT input_tokens, cached_input_tokens, output_tokens, cases FROM calls "
            "WHERE model = ? AND endpoint = ? AND cost IS NOT NULL", (arm.model, arm.endpoint)).fetchall()
        best = None
        for input_tokens, cached, output, cases in rows:
            if arm.max_output_tokens is not None:
                output = arm.max_output_tokens  # a call answers at most this much, however many cases it carries
            cost = arm.price.cost(input_tokens, cached, output)
            if cost is not None:
                best = max(best or 0.0, cost / max(1, cases))
        return best

    @staticmethod
    def _held(conn: sqlite3.Connection) -> float:
        """What the holds keep: their amounts, and a hold made while its model's cost was unknown at the dearest
        call per case of that model and endpoint counted since (0 while there is none)."""
        held = conn.execute("SELECT COALESCE(SUM(amount), 0) FROM holds").fetchone()[0]
        unknown = conn.execute(
            "SELECT COALESCE(SUM((SELECT MAX(c.cost / MAX(1, c.cases)) FROM calls c WHERE c.model = h.model "
            "AND c.endpoint = h.endpoint AND c.cost IS NOT NULL)), 0) FROM holds h WHERE h.amount IS NULL").fetchone()[0]
        return held + unknown

    def try_hold(self, study: str, arms: list[ArmCost], cap: float) -> list[int] | None:
        """Hold one case's calls if they fit under the cap: the hold ids; None: wait (the first call of a model
        here is in flight, its cost still unknown). BudgetReached when they do not fit or cannot be kept."""
        with self._write() as conn:
            self._purge_dead(conn)
            for arm in arms:
                row = conn.execute("SELECT call_id, study FROM calls WHERE model = ? AND endpoint = ? AND cost IS NULL "
                                   "LIMIT 1", (arm.model, arm.endpoint)).fetchone()
                if row is not None:
                    raise BudgetReached(
                        f"the lab budget cannot be kept: call {row[0]} of {row[1]} to {arm.model} at {arm.endpoint} "
                        f"reported no token counts, so its cost is unknown ({self.path})")
            spent = conn.execute("SELECT COALESCE(SUM(cost), 0) FROM calls").fetchone()[0]
            held = self._held(conn)
            estimates = [self._estimate(conn, arm) for arm in arms]
            unknown = [a for a, e in zip(arms, estimates) if e is None]
            for arm in unknown:
                if conn.execute("SELECT 1 FROM holds WHERE model = ? AND endpoint = ? AND amount IS NULL",
                                (arm.model, arm.endpoint)).fetchone():
                    return None
            need = sum(e for e in estimates if e is not None)
            if spent + held + need > cap or (unknown and spent + held >= cap):
                raise BudgetReached(
                    f"the lab budget of {cap:g} leaves no room for the next case: {spent:.4f} spent and {held:.4f} held "
                    f"by cases in flight ({self.path}), its calls estimated at {need:.4f}; raise it "
                    "(rescue resume STUDY --lab-budget X) to run the cases never started")
            host, pid, now = socket.gethostname(), os.getpid(), time.time()
            ids = []
            for arm, estimate in zip(arms, estimates):
                cur = conn.execute(
                    "INSERT INTO holds (study, case_id, arm, model, endpoint, amount, host, pid, created_at) "
                    "VALUES (?, NULL, ?, ?, ?, ?, ?, ?, ?)", (study, arm.arm, arm.model, arm.endpoint, estimate, host, pid, now))
                ids.append(int(cur.lastrowid))
            return ids

    def bind(self, ids: list[int], case_id: str) -> None:
        """Name the case a hold is for, once it is claimed (its calls then replace it)."""
        with self._write() as conn:
            conn.executemany("UPDATE holds SET case_id = ? WHERE id = ?", [(case_id, i) for i in ids])

    def release(self, ids: list[int]) -> None:
        """Drop what is left of a case's holds (its arms ended; a call already replaced its own)."""
        with self._write() as conn:
            conn.executemany("DELETE FROM holds WHERE id = ?", [(i,) for i in ids])

    def totals(self) -> LedgerTotals:
        """Calls counted, their cost, calls whose cost is unknown, and what is held now."""
        with self._lock:
            calls, cost, unknown = self._conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(cost), 0), COUNT(*) - COUNT(cost) FROM calls").fetchone()
            holds = self._conn.execute("SELECT COUNT(*) FROM holds").fetchone()[0]
            held = self._held(self._conn)
        return LedgerTotals(path=str(self.path), calls=calls, cost=cost, calls_without_cost=unknown, held=held,
                            holds=holds)


class Hold:
    """One case's hold on the lab budget: bound to the case once claimed, released when the case ends."""

    def __init__(self, ledger: Ledger, ids: list[int]):
        self._ledger, self._ids = ledger, ids

    def bind(self, case_id: str) -> None:
        """The case this hold is for."""
        self._ledger.bind(self._ids, case_id)

    def release(self) -> None:
        """Give back what the case's calls did not use."""
        if self._ids:
            self._ledger.release(self._ids)
            self._ids = []


class LabBudget:
    """A study's side of the lab budget: holds before a claim, a ledger row after every call."""

    def __init__(self, config: StudyConfig, study_dir: str | os.PathLike[str], cap: float | None = None):
        """`cap`: the cap for this run (None: the study's `[vlm] lab_budget`)."""
        self.config = config
        self.study = str(Path(study_dir).resolve())
        self.cap = cap if cap is not None else config.vlm.lab_budget
        if self.cap is None:
            raise ValueError("a lab budget needs a cap ([vlm] lab_budget)")
        self.ledger = Ledger(ledger_path(config.vlm.lab_ledger))
        self.arms = [_arm_cost(arm, vlm) for arm, vlm in case_calls(config)]
        # Calls this study made that the ledger lacks (a crash between receipt and ledger row) count first.
        self.ledger.reconcile(self.study)

    async def hold(self, stopping: Callable[[], bool]) -> Hold | None:
        """Hold the next case's calls; None when the run stops claiming while it waits. BudgetReached: no room."""
        while True:
            ids = self.ledger.try_hold(self.study, self.arms, self.cap)
            if ids is not None:
                return Hold(self.ledger, ids)
            if stopping():
                return None
            await asyncio.sleep(WAIT_S)

    def record(self, receipt: Receipt) -> None:
        """Count one call from its outcome receipt (written first: the receipt is the evidence)."""
        arm = advisor_arm(receipt.advisor) if receipt.advisor else "assisted"
        self.ledger.record(ledger_cost(call_cost(self.config, receipt, self.study), receipt), receipt.case_ids, arm)

    def close(self) -> None:
        """Close the ledger."""
        self.ledger.close()


def ledger_cost(call: CallCost, receipt: Receipt) -> CallCost:
    """A call as the ledger counts it: one to which no response arrived (no body, no counts) costs nothing that
    its receipts can show, and counts 0; one answered without the counts its price needs stays unknown."""
    if call.cost is None and receipt.response_sha256 is None and all(v is None for v in call.tokens.values()):
        return call.model_copy(update={"cost": 0.0})
    return call


def case_calls(config: StudyConfig) -> list[tuple[str, VLMConfig]]:
    """(advisor arm, its VLM configuration) of every call one case of this study can make: up to `[asking]
    max_calls` per arm that asks at its own q (each advisor's arm, each declared query point's and trigger's arm of
    the primary advisor; DESIGN §18); the continuations of an arm share its call. The advisor arm is what a call's
    receipt names (`LabBudget.record`). A trigger that never fires leaves its holds unused, given back when the case
    ends."""
    vlms = {arm: vlm for _, arm, vlm in config.advisor_configs()}
    asking = dict.fromkeys(base_arm(a) for a in config.case_arms if is_assisted(a))
    return [(base_arm(a, query_point=False), vlms[base_arm(a, query_point=False)]) for a in asking
            for _ in range(config.max_calls)]


def _arm_cost(arm: str, vlm: VLMConfig) -> ArmCost:
    if vlm.price is None:
        raise ValueError(f"arm {arm}: a lab budget needs a declared price")
    return ArmCost(arm=arm, model=vlm.model, endpoint=endpoint_host(vlm.base_url), price=vlm.price,
                   max_output_tokens=vlm.max_output_tokens)


def check_ledger(folder: str | os.PathLike[str] | None) -> None:
    """Open (creating it on first use) and check a lab's ledger before a study that counts into it is created;
    LedgerError naming the file when it cannot be used."""
    Ledger(ledger_path(folder)).close()


def read_ledger(folder: str | os.PathLike[str] | None = None) -> LedgerTotals | None:
    """The totals of a lab's ledger (read-only); None when there is none."""
    path = ledger_path(folder)
    if not path.exists():
        return None
    if not path.is_file():  # a FIFO, a folder, a device: named, as a corrupt ledger is, never left out silently
        raise LedgerError(f"{path}: the lab budget's ledger is not a regular file")
    ledger = Ledger(path, readonly=True)
    try:
        return ledger.totals()
    finally:
        ledger.close()
