"""Receipts: append-only JSON lines, durable before a subgoal is applied, and their one reader.

Each line is one `Receipt`. A write is a single `os.write` on an `O_APPEND`
descriptor (under an exclusive `flock`, so line numbers stay right even if
another process appends) followed by `fsync`; a crash can only lose (or cut)
the line being written. A write returns a `ReceiptRef`: the file's name as the
log was given it, the 1-based line number and the sha256 of the exact bytes.

The one rule for reading (every reader goes through `outcomes_by_call`): a
call's FIRST outcome line is its outcome. It is the one that was fsynced
before its answer was returned, hence before anything was applied; any later
outcome line of the same call is an anomaly that `verify` reports.

This module is read-side safe: it imports neither the SDKs nor the simulator.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import structlog
from pydantic import BaseModel

from rescue.core.records import Receipt, ReceiptRef
from rescue.study.files import fsync_dir

log = structlog.get_logger(__name__)

__all__ = [
    "ReceiptLog",
    "ReceiptLine",
    "ReceiptRef",
    "ReceiptScan",
    "artifact_path",
    "check_artifacts",
    "check_attempt_refs",
    "check_ref",
    "extra_outcomes",
    "first_outcomes",
    "outcomes_by_call",
    "read_receipt_file",
    "read_receipts",
    "scan_receipts",
    "unfinished_calls",
]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- writing ------------------------------------------------------------------------


class ReceiptLog:
    """An append-only receipt file; `write` returns only once the line is on disk."""

    def __init__(self, path: Path | str, name: str | None = None) -> None:
        """`name` is what references carry as the file's path (the study-relative one); default `str(path)`."""
        self.path = Path(path)
        self.name = name if name is not None else str(path)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._end = 0  # file size after our last look
        self._lines = 0  # newlines in the file up to _end

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            existed = self.path.exists()
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            self._end = self._lines = 0
            if not existed:
                fsync_dir(self.path.parent)  # a new file's directory entry must survive a crash too
        return self._fd

    def _catch_up(self, fd: int) -> None:
        """Count the lines others appended since we last looked; end a cut-off last line."""
        size = os.fstat(fd).st_size
        while self._end < size:
            chunk = os.pread(fd, min(1 << 20, size - self._end), self._end)
            self._lines += chunk.count(b"\n")
            self._end += len(chunk)
        if size and os.pread(fd, 1, size - 1) != b"\n":
            # A crash cut the last line; our line must not be glued onto it.
            os.write(fd, b"\n")
            self._lines += 1
            self._end += 1

    def write(self, receipt: Receipt) -> ReceiptRef:
        """Append one receipt, fsync it, and return its reference."""
        data = receipt.model_dump_json().encode("utf-8")
        with self._lock:
            fd = self._open()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                self._catch_up(fd)
                line = data + b"\n"
                written = 0
                try:
                    while written < len(line):
                        written += os.write(fd, line[written:])
                    os.fsync(fd)
                except OSError:
                    # A full disk may take part of a line: undo it, so the file holds whole lines only
                    # and parses to its last byte (verify holds it to that).
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, self._end)
                    raise
                self._lines += 1
                self._end += len(line)
                lineno = self._lines
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        return ReceiptRef(path=self.name, lineno=lineno, sha256=_sha(data))

    def close(self) -> None:
        """Close the file descriptor (writing again reopens it)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# ---- reading: the one reader --------------------------------------------------------


class ReceiptLine(BaseModel):
    """One non-blank line of a receipts file: where it is, its bytes' sha256, and what it says."""

    lineno: int
    """1-based line number."""
    sha256: str
    """sha256 of the line's bytes without the newline."""
    receipt: Receipt | None = None
    """The parsed receipt; None when the line does not parse."""
    error: str | None = None
    """Why the line does not parse."""
    complete: bool = True
    """False for a last line with no newline (a write cut by a crash)."""

    def ref(self, name: str) -> ReceiptRef:
        """This line's reference, in the file known as `name`."""
        return ReceiptRef(path=name, lineno=self.lineno, sha256=self.sha256)


def read_receipt_file(path: Path | str) -> list[ReceiptLine]:
    """Every non-blank line of a receipts file (missing file: none), parsed where possible."""
    path = Path(path)
    if not path.exists():
        return []
    raws = path.read_bytes().split(b"\n")
    out = []
    for lineno, raw in enumerate(raws, start=1):
        if not raw.strip():
            continue
        line = ReceiptLine(lineno=lineno, sha256=_sha(raw), complete=lineno < len(raws))
        try:
            line.receipt = Receipt.model_validate_json(raw)
        except ValueError as exc:
            line.error = str(exc).splitlines()[0]
        out.append(line)
    return out


class OutcomeIndex:
    """The outcome lines of one receipts file, read incrementally as a running study appends to it.

    It applies the same rule as `outcomes_by_call` (a call's first outcome line
    is its outcome) and numbers lines as `read_receipt_file` does, so the
    engine and a later `rescue verify` agree on every reference.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._offset = 0
        self._lineno = 0
        self._outcomes: dict[str, ReceiptLine] = {}

    def refresh(self) -> None:
        """Read the complete lines appended since the last read."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n")
        if end < 0:
            return  # nothing complete yet; a line being written is read next time
        for raw in data[:end].split(b"\n"):
            self._lineno += 1
            if not raw.strip():
                continue
            try:
                receipt = Receipt.model_validate_json(raw)
            except ValueError:
                continue  # verify reports unparsable lines; they are nobody's outcome
            if receipt.kind == "outcome" and receipt.call_id not in self._outcomes:
                self._outcomes[receipt.call_id] = ReceiptLine(lineno=self._lineno, sha256=_sha(raw), receipt=receipt)
        self._offset += end + 1

    def outcome(self, call_id: str) -> ReceiptLine | None:
        """The outcome line of a call, reading the file again when it is not known yet."""
        if call_id not in self._outcomes:
            self.refresh()
        return self._outcomes.get(call_id)


def first_outcomes(receipts: Iterable[Receipt]) -> dict[str, Receipt]:
    """THE rule: each call's first outcome receipt, by call id (later ones are anomalies)."""
    seen: dict[str, Receipt] = {}
    for r in receipts:
        if r.kind == "outcome" and r.call_id not in seen:
            seen[r.call_id] = r
    return seen


def outcomes_by_call(lines: Iterable[ReceiptLine]) -> dict[str, ReceiptLine]:
    """Each call's outcome line (its first), by call id."""
    lines = [line for line in lines if line.receipt is not None]
    first = first_outcomes(line.receipt for line in lines)  # type: ignore[misc]
    return {line.receipt.call_id: line for line in lines if line.receipt is first.get(line.receipt.call_id)}  # type: ignore[union-attr]


def extra_outcomes(lines: Iterable[ReceiptLine]) -> dict[str, list[ReceiptLine]]:
    """Outcome lines after a call's first one, by call id: anomalies to report, never used."""
    lines = list(lines)
    chosen = {id(line) for line in outcomes_by_call(lines).values()}
    extra: dict[str, list[ReceiptLine]] = {}
    for line in lines:
        r = line.receipt
        if r is not None and r.kind == "outcome" and id(line) not in chosen:
            extra.setdefault(r.call_id, []).append(line)
    return extra


def unfinished_calls(lines: Iterable[ReceiptLine]) -> dict[str, list[ReceiptLine]]:
    """Attempt lines of calls that have no outcome line (in flight at a crash or kill), by call id."""
    lines = list(lines)
    done = set(outcomes_by_call(lines))
    out: dict[str, list[ReceiptLine]] = {}
    for line in lines:
        r = line.receipt
        if r is not None and r.kind != "outcome" and r.call_id not in done:
            out.setdefault(r.call_id, []).append(line)
    return out


def check_ref(ref: ReceiptRef, lines: list[ReceiptLine]) -> str | None:
    """Why `ref` does not point at a line of these bytes (None: it does)."""
    for line in lines:
        if line.lineno == ref.lineno:
            if line.sha256 != ref.sha256:
                return f"{ref.path} line {ref.lineno} changed: sha256 {line.sha256[:12]}…, reference holds {ref.sha256[:12]}…"
            return None
    return f"{ref.path} has no line {ref.lineno}"


def check_attempt_refs(outcome: Receipt, lines: list[ReceiptLine]) -> list[str]:
    """Problems with an outcome's attempt lines: each referenced line unchanged, and every attempt started."""
    problems = [p for ref in outcome.attempt_refs if (p := check_ref(ref, lines)) is not None]
    by_lineno = {line.lineno: line.receipt for line in lines}
    started = {r.attempt for ref in outcome.attempt_refs if (r := by_lineno.get(ref.lineno)) and r.kind == "attempt_started"}
    ended = {r.attempt for ref in outcome.attempt_refs if (r := by_lineno.get(ref.lineno)) and r.kind == "attempt"}
    for n in sorted(ended - started):
        problems.append(f"call {outcome.call_id}: attempt {n} ended without an attempt_started line")
    if outcome.attempt_refs and len(started) != outcome.attempt:
        problems.append(
            f"call {outcome.call_id}: the outcome counts {outcome.attempt} attempt(s), {len(started)} started"
        )
    return problems


class ReceiptScan(BaseModel):
    """What a receipt file holds, and the cut-off last line if a crash left one."""

    receipts: list[Receipt]
    truncated_tail: str | None = None


def scan_receipts(path: Path | str) -> ReceiptScan:
    """Parse every line; an unparsable last line is set aside, any other bad line raises."""
    lines = read_receipt_file(path)
    truncated: str | None = None
    for i, line in enumerate(lines):
        if line.receipt is None:
            if i == len(lines) - 1:
                raw = Path(path).read_bytes().split(b"\n")[line.lineno - 1]
                truncated = raw.decode("utf-8", "replace")
            else:
                raise ValueError(f"{path} line {line.lineno} does not parse: {line.error}")
    return ReceiptScan(receipts=[line.receipt for line in lines if line.receipt is not None], truncated_tail=truncated)


def read_receipts(path: Path | str) -> list[Receipt]:
    """All complete receipts in the file; a truncated last line is ignored and logged."""
    scan = scan_receipts(path)
    if scan.truncated_tail is not None:
        log.warning("receipts.truncated_tail", path=str(path), chars=len(scan.truncated_tail))
    return scan.receipts


# ---- what a call saw ----------------------------------------------------------------


def artifact_path(artifacts_dir: Path | str, sha256: str, suffix: str) -> Path:
    """Where a kept artifact lives: `<dir>/<sha256><suffix>` (".png" images, ".txt" prompts and responses)."""
    return Path(artifacts_dir) / f"{sha256}{suffix}"


def check_artifacts(receipt: Receipt, artifacts_dir: Path | str) -> list[str]:
    """Problems with the files a receipt names: images sent, rendered prompt, raw response (missing or altered)."""
    wanted = [(sha, ".png", "image sent") for sha in receipt.sent_image_sha256]
    wanted.append((receipt.prompt_sha256, ".txt", "rendered prompt"))
    if receipt.response_sha256 is not None:
        wanted.append((receipt.response_sha256, ".txt", "raw response"))
    problems = []
    for sha, suffix, what in wanted:
        path = artifact_path(artifacts_dir, sha, suffix)
        if not path.is_file():
            problems.append(f"call {receipt.call_id}: the {what} {path.name} is missing")
        elif _sha(path.read_bytes()) != sha:
            problems.append(f"call {receipt.call_id}: the {what} {path.name} does not hash to its name")
    return problems
