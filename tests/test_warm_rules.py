"""Which warm simulators a run may lease (rescue.env.warm), without starting one: the folder a run names, and the
refusals that keep a simulator that is not the run's own from serving it."""

from __future__ import annotations

import pytest

from rescue.env import warm

pytestmark = pytest.mark.fast


def test_the_flag_wins_over_the_variable_and_off_means_none(monkeypatch):
    monkeypatch.setenv(warm.WARM_ENV, "/tmp/pool")
    assert warm.warm_folder(None) == "/tmp/pool"
    assert warm.warm_folder("/elsewhere") == "/elsewhere"
    assert warm.warm_folder("off") is None
    monkeypatch.setenv(warm.WARM_ENV, "off")
    assert warm.warm_folder(None) is None
    monkeypatch.delenv(warm.WARM_ENV)
    assert warm.warm_folder(None) is None


def test_a_run_that_differs_in_anything_the_simulator_depends_on_is_refused_naming_it(monkeypatch):
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    monkeypatch.delenv("PYOPENGL_PLATFORM", raising=False)
    monkeypatch.setenv("RESCUE_MODEL_CACHE", "/tmp/models")
    facts = warm._facts("0")
    # The renderer as the adapter takes it: egl when unset, PyOpenGL's platform following it.
    assert facts["MUJOCO_GL"] == facts["PYOPENGL_PLATFORM"] == "egl"
    spec = warm.DEFAULT_ADAPTER
    same = {"spec": spec, "facts": dict(facts)}
    assert warm._refusal("lease", same, spec, facts) is None
    for name, value in (("hash_seed", "1"), ("MUJOCO_GL", "osmesa"), ("RESCUE_MODEL_CACHE", None),
                        ("python", "/usr/bin/python3"), ("package", "/elsewhere/rescue")):
        said = warm._refusal("lease", {"spec": spec, "facts": {**facts, name: value}}, spec, facts)
        assert said is not None and name in said, (name, said)
    assert "serves" in warm._refusal("lease", {**same, "spec": "tests.slow_adapter:SlowAdapter"}, spec, facts)
    assert warm._refusal("hello", same, spec, facts) is not None


def test_a_folder_a_pool_serves_or_is_starting_to_serve_is_refused_and_left_as_it_is():
    import shutil
    import socket
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="warm-", dir="/tmp"))  # a socket path must stay short
    try:
        (root / warm.KEY).write_bytes(b"the serving pool's key")
        with socket.socket(socket.AF_UNIX) as listening:  # the other pool's first simulator
            listening.bind(str(root / "sim-0.sock"))
            listening.listen()
            # Starting: its simulators listen before it writes `ready`.
            with pytest.raises(warm.SimulatorError, match=r"a warm pool serves it already$"):
                warm.serve(str(root), 2)
            (root / warm.READY).write_text("4242 2 rescue.env.libero:LiberoAdapter\n")
            with pytest.raises(warm.SimulatorError, match=r"a warm pool \(pid 4242\) serves it already$"):
                warm.serve(str(root), 2)
        assert (root / warm.KEY).read_bytes() == b"the serving pool's key"
        assert (root / warm.READY).read_text().startswith("4242 ")
    finally:
        shutil.rmtree(root, ignore_errors=True)
