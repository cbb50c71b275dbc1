"""The files a user names (manifests, configurations, prompt templates, another evaluation's results), read
with one guard: a regular file of bounded size, or one line saying why not.

Opened without blocking and checked before a byte is read: a FIFO would hang the reader, `/dev/zero`
would never end, a file far past its kind's bound would cost memory for nothing.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# A configuration (study or service) and a prompt template are a few kilobytes; far past that is a mistake.
MAX_CONFIG_BYTES = 1024 * 1024
MAX_PROMPT_BYTES = 1024 * 1024

_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


class InputFileError(ValueError):
    """A named file that cannot be used as input, in one line that names it (its caller's error type wraps it)."""


def read_input(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The bytes of the regular file `path`, at most `limit`; InputFileError otherwise.

    `what` names the file's role in the messages ("manifest", "configuration file")."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InputFileError(f"{path}: cannot read: no such {what}") from None
    except OSError as exc:
        raise InputFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "not a regular file")
            raise InputFileError(f"{path}: is {kind}, not a file; give the {what} as a regular file")
        if info.st_size > limit:  # refused before reading any of it
            raise InputFileError(f"{path}: the file is {info.st_size} bytes long, at most {limit}")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            # Read what stat promises plus one byte: a buffer of the file's size, not of the
            # limit. One byte over the limit is enough to refuse a file that keeps growing.
            want = min(info.st_size + 1, limit + 1)
            data = f.read(want)
            if len(data) == want:
                data += f.read(limit + 1 - len(data))
    except OSError as exc:
        raise InputFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise InputFileError(f"{path}: the file grew past {limit} bytes while it was read")
    return data
