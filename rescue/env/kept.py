"""Files kept on disk under a key and the sha256 of their bytes: the store of the opt-in caches.

A cache is named by an environment variable (unset or `off`: no cache) and keeps `<key>-<sha256 of
the bytes><suffix>` in that folder. A copy is used only when its bytes match the digest its name
carries; one that does not (a bad disk, an edit) is made again. A file is written whole or not at all
(a temporary file, then a rename), so processes may share a folder. A folder that cannot be read or
written costs only the work the cache would have saved, with one warning line per place and problem.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

OFF = "off"
_warned: set[str] = set()


@dataclass(frozen=True)
class Kept:
    """One cache: its environment variable, its files' suffix, and its name in warnings."""

    variable: str
    suffix: str
    label: str

    def folder(self) -> Path | None:
        """The folder the variable names; None when it is unset, empty or `off`."""
        named = os.environ.get(self.variable, "").strip()
        if not named or named.lower() == OFF:
            return None
        return Path(named).expanduser()

    def sound_copy(self, folder: Path, key: str, instead: str) -> Path | None:
        """The kept file of `key` whose bytes match the digest its name carries, if there is one. `instead`
        says what happens in its place, for the warning about a copy that is unreadable or does not match."""
        try:
            candidates = sorted(folder.glob(f"{key}-*{self.suffix}"))
        except OSError:
            candidates = []
        for path in candidates:
            named = path.name[: -len(self.suffix)].rpartition("-")[2]
            try:
                with path.open("rb") as f:
                    actual = hashlib.file_digest(f, "sha256").hexdigest()
            except OSError as exc:
                self.warn(path, f"could not read it ({exc.strerror or exc}); {instead}")
                continue
            if actual == named:
                return path
            self.warn(path, f"its bytes do not match the digest in its name; {instead}")
        return None

    def keep(self, folder: Path, key: str, data, what: str) -> None:
        """Write `data` (bytes or a buffer) under its key and digest, atomically: a reader sees the whole file or none."""
        digest = hashlib.sha256(data).hexdigest()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(memoryview(data))
                os.replace(tmp, folder / f"{key}-{digest}{self.suffix}")
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            self.warn(folder, f"could not keep {what} there ({exc.strerror or exc})")

    def warn(self, where: Path, what: str) -> None:
        """One line per place and problem on the process's log, not one per use."""
        line = f"rescue: {self.label} {where}: {what}"
        if line not in _warned:
            _warned.add(line)
            print(line, file=sys.stderr, flush=True)
