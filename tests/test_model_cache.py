"""The compiled-model cache on real MuJoCo and LIBERO: a model loaded from it is the compiled model byte for byte,
an episode on it is the same episode, and a damaged copy is compiled again, never loaded."""

from __future__ import annotations

import numpy as np
import pytest

import rescue.env.libero as libero
from rescue.env import model_cache
from rescue.env.libero import LiberoAdapter

pytestmark = pytest.mark.sim

CASE = {"suite": "libero_object", "task_id": 3, "init_state_index": 1, "env_seed": 1}


def _binary(model) -> bytes:
    import mujoco

    buffer = np.zeros(mujoco.mj_sizeModel(model), dtype=np.uint8)
    mujoco.mj_saveModel(model, None, buffer)
    return buffer.tobytes()


def _episode(monkeypatch, cache: str) -> tuple[str, list[str], str, list[str]]:
    """A fresh adapter's episode of CASE with the cache set to `cache`: its reset fingerprint, the state digest after
    each of three chunks of fixed actions, and the XML texts its build asked a model for."""
    asked: list[str] = []

    def spy(xml: str):
        asked.append(xml)
        return model_cache.compiled_model(xml)

    monkeypatch.setenv(model_cache.CACHE_ENV, cache)
    monkeypatch.setattr(libero, "compiled_model", spy)
    adapter = LiberoAdapter()
    try:
        reset = adapter.reset(CASE)
        rng = np.random.default_rng(7)
        digests = []
        for _ in range(3):
            actions = rng.uniform(-1, 1, (16, 7))
            actions[:, 6] = np.sign(actions[:, 6])
            adapter.run_chunk(actions, 16)
            digests.append(adapter.state_digest())
        return reset.fingerprint, digests, adapter._model_digest(), asked
    finally:
        adapter.close()


@pytest.fixture(scope="module")
def compiled():
    """CASE's episode with the cache off: every model compiled from its XML."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _episode(monkeypatch, model_cache.OFF)


def test_an_episode_on_a_cached_model_is_the_compiled_models_episode(compiled, tmp_path, monkeypatch):
    cache = tmp_path / "models"
    fingerprint, digests, model, asked = compiled
    # The first build with the cache on compiles and keeps the model; the second loads it.
    first = _episode(monkeypatch, str(cache))
    kept = list(cache.glob("*.mjb"))
    assert [p.name.partition("-")[0] for p in kept] == [model_cache.model_key(asked[0])]

    def no_compile(xml):
        raise AssertionError("the model was compiled although the cache holds it")

    import mujoco

    monkeypatch.setattr(mujoco.MjModel, "from_xml_string", no_compile)
    second = _episode(monkeypatch, str(cache))
    monkeypatch.undo()
    assert first == (fingerprint, digests, model, asked)
    assert second == (fingerprint, digests, model, asked)


def test_a_model_loaded_from_the_cache_is_the_compiled_model_byte_for_byte(compiled, tmp_path, monkeypatch):
    import mujoco

    xml = compiled[3][0]
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path))
    made = model_cache.compiled_model(xml)
    loaded = model_cache.compiled_model(xml)
    assert _binary(loaded) == _binary(made) == _binary(mujoco.MjModel.from_xml_string(xml))


def test_a_damaged_copy_is_compiled_again_and_said_once(compiled, tmp_path, monkeypatch, capfd):
    xml = compiled[3][0]
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path))
    reference = _binary(model_cache.compiled_model(xml))
    (kept,) = tmp_path.glob("*.mjb")
    damaged = bytearray(kept.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # one bit of the model's arrays, which MuJoCo itself would load
    kept.write_bytes(bytes(damaged))
    capfd.readouterr()
    assert _binary(model_cache.compiled_model(xml)) == reference
    assert _binary(model_cache.compiled_model(xml)) == reference
    said = [line for line in capfd.readouterr().err.splitlines() if "model cache" in line]
    assert len(said) == 1 and kept.name in said[0] and "do not match" in said[0]
    # The compile wrote the sound copy over the damaged one (the same key, the same digest).
    assert list(tmp_path.glob("*.mjb")) == [kept]
    assert model_cache._STORE.sound_copy(tmp_path, kept.name.partition("-")[0], "compiling") == kept


def test_an_unwritable_cache_costs_only_the_compile(compiled, tmp_path, monkeypatch, capfd):
    xml = compiled[3][0]
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(model_cache.CACHE_ENV, str(blocked / "models"))
    capfd.readouterr()
    assert _binary(model_cache.compiled_model(xml)) == _binary(compiled_model_off(xml))
    said = [line for line in capfd.readouterr().err.splitlines() if "model cache" in line]
    assert len(said) == 1 and "could not keep" in said[0]


def compiled_model_off(xml: str):
    import mujoco

    return mujoco.MjModel.from_xml_string(xml)
