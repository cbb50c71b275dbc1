"""Receipts: append-only JSON lines, durable before a subgoal is applied.

Each line is one `Receipt`. A write is a single `os.write` on an `O_APPEND`
descriptor followed by `fsync`, so concurrent writers never interleave lines
and a crash can only lose (or cut) the line being written.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import structlog
from pydantic import BaseModel

from rescue.records import Receipt

log = structlog.get_logger(__name__)


class ReceiptLog:
    """An append-only receipt file; `write` returns only once the line is on disk."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            existed = self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if not existed:
                # A new file's directory entry must survive a crash too.
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        return self._fd

    def write(self, receipt: Receipt) -> None:
        """Append one receipt and fsync it."""
        line = (receipt.model_dump_json() + "\n").encode("utf-8")
        with self._lock:
            fd = self._open()
            written = 0
            while written < len(line):
                written += os.write(fd, line[written:])
            os.fsync(fd)

    def close(self) -> None:
        """Close the file descriptor (writing again reopens it)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class ReceiptScan(BaseModel):
    """What a receipt file holds, and the cut-off last line if a crash left one."""

    receipts: list[Receipt]
    truncated_tail: str | None = None


def scan_receipts(path: Path | str) -> ReceiptScan:
    """Parse every line; an unparsable last line is set aside, any other bad line raises."""
    data = Path(path).read_bytes() if Path(path).exists() else b""
    lines = data.split(b"\n")
    # A complete file ends with a newline, leaving an empty last element.
    tail = lines.pop() if lines else b""
    receipts: list[Receipt] = []
    truncated: str | None = None
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            receipts.append(Receipt.model_validate_json(raw))
        except ValueError:
            if i == len(lines) - 1 and not tail:
                truncated = raw.decode("utf-8", "replace")
            else:
                raise
    if tail.strip():
        try:
            receipts.append(Receipt.model_validate_json(tail))
        except ValueError:
            truncated = tail.decode("utf-8", "replace")
    return ReceiptScan(receipts=receipts, truncated_tail=truncated)


def read_receipts(path: Path | str) -> list[Receipt]:
    """All complete receipts in the file; a truncated last line is ignored and logged."""
    scan = scan_receipts(path)
    if scan.truncated_tail is not None:
        log.warning(
            "receipts.truncated_tail",
            path=str(path),
            chars=len(scan.truncated_tail),
        )
    return scan.receipts
