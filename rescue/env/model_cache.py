"""Compiled MuJoCo models kept on disk, by the digest of the XML they were compiled from (opt-in).

Building a LIBERO env compiles its MJCF with MuJoCo: about half of the CPU a build costs, mostly
decoding textures and processing meshes. MuJoCo's binary form (MJB) holds the whole compiled
`mjModel`, so a model loaded from it is the compiled model byte for byte (`mj_saveModel` of either
gives the same bytes), and with it the physics, the renders and the reset's fingerprint (which
digests that binary form).

`RESCUE_MODEL_CACHE=DIR` turns the cache on: DIR keeps `<key>-<sha256 of the file>.mjb`, where key
is the sha256 of MuJoCo's version and the XML. A file is loaded only when its bytes match the digest
in its name; one that does not (a bad disk, an edit) is compiled again. Unset or `off`: every model is
compiled. A LIBERO scene's binary form is large (about 240 MB, its textures decoded), so the cache
is for machines that build the same envs again and again, such as a test suite's.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

# The environment variable that names the cache's folder (unset or `off`: compile every model).
CACHE_ENV = "RESCUE_MODEL_CACHE"
OFF = "off"
_warned: set[str] = set()


def cache_dir() -> Path | None:
    """Where compiled models are kept; None when the cache is off (`RESCUE_MODEL_CACHE` unset or `off`)."""
    named = os.environ.get(CACHE_ENV, "").strip()
    if not named or named.lower() == OFF:
        return None
    return Path(named).expanduser()


def model_key(xml: str) -> str:
    """The cache key of an MJCF text: MuJoCo's version and the text (another version may compile it otherwise)."""
    import mujoco

    return hashlib.sha256(f"mujoco {mujoco.__version__}\0{xml}".encode()).hexdigest()


def compiled_model(xml: str):
    """The `mujoco.MjModel` of an MJCF text: loaded from the cache when a sound copy is there, else compiled
    (and kept for the next process). A cache that cannot be read or written costs only the compile."""
    import mujoco

    folder = cache_dir()
    if folder is None:
        return mujoco.MjModel.from_xml_string(xml)
    key = model_key(xml)
    path = _sound_copy(folder, key)
    if path is not None:
        return mujoco.MjModel.from_binary_path(str(path))
    model = mujoco.MjModel.from_xml_string(xml)
    _keep(model, folder, key)
    return model


def _sound_copy(folder: Path, key: str) -> Path | None:
    """The cached binary form of `key` whose bytes match the digest its name carries, if there is one."""
    try:
        candidates = sorted(folder.glob(f"{key}-*.mjb"))
    except OSError:
        candidates = []
    for path in candidates:
        named = path.stem.rpartition("-")[2]
        try:
            with path.open("rb") as f:
                actual = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as exc:
            _warn(path, f"could not read it ({exc.strerror or exc}); compiling")
            continue
        if actual == named:
            return path
        _warn(path, "its bytes do not match the digest in its name; compiling the model again")
    return None


def _keep(model, folder: Path, key: str) -> None:
    """Write the model's binary form under its key and digest, atomically: a reader sees the whole file or none."""
    import mujoco
    import numpy as np

    buffer = np.zeros(mujoco.mj_sizeModel(model), dtype=np.uint8)
    mujoco.mj_saveModel(model, None, buffer)
    digest = hashlib.sha256(buffer).hexdigest()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(memoryview(buffer))
            os.replace(tmp, folder / f"{key}-{digest}.mjb")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        _warn(folder, f"could not keep a compiled model there ({exc.strerror or exc})")


def _warn(where: Path, what: str) -> None:
    """One line per place and problem on the simulator's log, not one per build."""
    line = f"rescue: model cache {where}: {what}"
    if line not in _warned:
        _warned.add(line)
        print(line, file=sys.stderr, flush=True)
