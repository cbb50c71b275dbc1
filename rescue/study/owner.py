"""One owner per study folder: the process that runs it holds an OS lock for its whole life.

The lock is `flock` on a file in the study folder, so it is released by the
kernel when the owner dies, however it dies (stale-safe), and a second
`run`, `resume` or service on the same folder is refused with the owner's pid
instead of marking the live run's cases interrupted under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from rescue.study.folder import StudyError
from rescue.study.layout import StudyLayout


class StudyBusy(StudyError):
    """Another live process owns the study folder."""


@contextlib.contextmanager
def own_study(study_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the study folder's owner lock for the duration of the block; StudyBusy when another process has it."""
    path = StudyLayout.of(study_dir).lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(path)
            raise StudyBusy(
                f"{study_dir} is in use by process {owner} (a run, resume or service holds it); "
                "wait for it to finish, or stop it with `rescue drain`"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def alive(pid: int) -> bool:
    """Whether a process of this host has this pid (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_owner(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"
