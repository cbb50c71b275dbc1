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
from pathlib import Path

from rescue.env.kept import OFF, Kept

# The environment variable that names the cache's folder (unset or `off`: compile every model).
CACHE_ENV = "RESCUE_MODEL_CACHE"
_STORE = Kept(CACHE_ENV, ".mjb", "model cache")
__all__ = ["CACHE_ENV", "OFF", "cache_dir", "compiled_model", "model_key"]


def cache_dir() -> Path | None:
    """Where compiled models are kept; None when the cache is off (`RESCUE_MODEL_CACHE` unset or `off`)."""
    return _STORE.folder()


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
    path = _STORE.sound_copy(folder, key, "compiling the model again")
    if path is not None:
        return mujoco.MjModel.from_binary_path(str(path))
    model = mujoco.MjModel.from_xml_string(xml)
    _keep(model, folder, key)
    return model


def _keep(model, folder: Path, key: str) -> None:
    """Keep the model's binary form (MuJoCo's `mj_saveModel`) under its key."""
    import mujoco
    import numpy as np

    buffer = np.zeros(mujoco.mj_sizeModel(model), dtype=np.uint8)
    mujoco.mj_saveModel(model, None, buffer)
    _STORE.keep(folder, key, buffer, "a compiled model")
