"""Durable writes: a reader, or a crash, sees the old file or the new one, never half of one.

The one home of the study's fsync discipline: atomic replacement, appends that reach the
disk, and the directory entries that make a new file survive a crash.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from rescue.core.manifest import Case, manifest_text


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of a directory (a file created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: str | bytes, durable_entry: bool = False) -> None:
    """Write `data` to a private file beside `path`, fsync it, and rename it into place.

    `durable_entry`: also fsync the directory, so the new name survives a crash (the content
    always does once this returns)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable_entry:
        fsync_dir(path.parent)


def write_manifest(cases: Iterable[Case], path: str | os.PathLike[str]) -> None:
    """Write cases as JSONL atomically: the file is either the old one or complete."""
    write_atomic(path, manifest_text(cases))
