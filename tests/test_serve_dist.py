"""The serving distribution (serve/, package rescue_serve): small, one implementation with `rescue serve-policy`,
one model per process with calls into it serialised, and the openpi adapter's seeded noise."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from conftest import HANG_S, free_port
from rescue_serve import msgpack_numpy, wire
from rescue_serve.openpi import OpenpiServed
from rescue_serve.server import PolicyServer

from rescue.core.configuration.identity import STATELESS_KEY
from rescue.policy.client import WebsocketPolicyClient

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "serve"
CHUNK, DIM = 10, 7


def _obs(prompt: str = "pick up the cup") -> dict:
    return {"state": np.arange(8, dtype=np.float32) / 10, "prompt": prompt}


# --- what the distribution is -------------------------------------------------------------


def test_the_distribution_depends_on_numpy_msgpack_and_websockets_only():
    project = tomllib.loads((SERVE / "pyproject.toml").read_text())["project"]
    names = sorted(dep.split(">")[0].split("<")[0].split("=")[0].strip() for dep in project["dependencies"])
    assert names == ["msgpack", "numpy", "websockets"]
    assert project["requires-python"] == ">=3.10,<3.14"
    numpy_pin = next(d for d in project["dependencies"] if d.startswith("numpy"))
    assert "<3" in numpy_pin and "<2" not in numpy_pin  # numpy 1.x and 2.x both
    assert project["scripts"]["rescue-serve"] == "rescue_serve.cli:main"


def test_one_source_for_both_distributions():
    # The main distribution depends on the serving one instead of shipping its files (no link or copy of the
    # package beside its own, no second `rescue-serve` script); its client takes the codec and the wire names there.
    assert not (ROOT / "rescue_serve").exists()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "rescue-serve" in [dep.split(">")[0].split("=")[0].strip() for dep in project["dependencies"]]
    assert "rescue-serve" not in project["scripts"]
    from rescue.policy import client

    assert client.msgpack_numpy.packb is msgpack_numpy.packb and client.msgpack_numpy.unpackb is msgpack_numpy.unpackb
    assert client.CONTROL_KEY is wire.CONTROL_KEY and client.RNG_EXTENSION is wire.RNG_EXTENSION
    assert wire.STATELESS_KEY == STATELESS_KEY


def test_the_serving_package_loads_none_of_the_projects_stack():
    # Every module, adapters included: torch, lerobot and openpi only when a policy is loaded.
    heavy = ("rescue", "wrappers", "pydantic", "structlog", "aiohttp", "torch", "lerobot", "openpi", "openai", "scipy")
    code = (
        "import json, sys, importlib, pkgutil, rescue_serve\n"
        "for m in pkgutil.iter_modules(rescue_serve.__path__): importlib.import_module('rescue_serve.' + m.name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=SERVE, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# --- one implementation: the two commands on the wire ------------------------------------------------


def _start(cmd: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.Popen([*cmd, "--port", str(port)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


# A session as a client drives it: every kind of frame, ending with an error (the text frame and the close).
SCRIPT = [
    {"__rescue__": "reset_rng", "seed": 5},
    _obs(),
    _obs(),
    {"__rescue__": "rng_state"},
    {"__ctrl__": "episode_start", "__experiment__": "e", "__task__": "t", "__episode_id__": "1"},
    {"__rescue__": "reset"},
    _obs(),
    {"__ctrl__": "episode_end", "__success__": False},
    {"__rescue__": "reset_rng", "seed": 5},
    _obs(),
    {"__rescue__": "no_such_op"},
]
VOLATILE = ("connection_id", "server_instance", "server_timing")


async def _frames(url: str) -> list[tuple[str, object]]:
    """Every frame the server sends for SCRIPT: (kind, content), volatile fields dropped."""
    out: list[tuple[str, object]] = []

    def keep(msg: aiohttp.WSMessage) -> None:
        if msg.type is aiohttp.WSMsgType.BINARY:
            data = msgpack_numpy.unpackb(msg.data)
            if isinstance(data, dict):
                data = {k: v for k, v in data.items() if k not in VOLATILE}
                data = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in data.items()}
            out.append(("binary", data))
        elif msg.type is aiohttp.WSMsgType.TEXT:
            out.append(("text", msg.data))
        else:
            out.append((msg.type.name, msg.data))

    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url) as ws:
            keep(await ws.receive(timeout=HANG_S))
            for request in SCRIPT:
                await ws.send_bytes(msgpack_numpy.packb(request))
                keep(await ws.receive(timeout=HANG_S))
            keep(await ws.receive(timeout=HANG_S))  # the close after the error
    return out


async def _connect_when_up(url: str) -> list[tuple[str, object]]:
    async with await WebsocketPolicyClient.connect(url, connect_timeout_s=HANG_S):
        pass
    return await _frames(url)


def test_rescue_serve_policy_and_rescue_serve_are_wire_identical():
    spec = "test_policy_wire:NoisePolicy"
    commands = {
        "rescue serve-policy": [sys.executable, "-m", "rescue.cli", "serve-policy", "--policy", spec],
        "rescue-serve policy": [sys.executable, "-m", "rescue_serve.cli", "policy", spec],
    }
    frames = {}
    for name, cmd in commands.items():
        port = free_port()
        proc = _start(cmd, port)
        try:
            frames[name] = asyncio.run(_connect_when_up(f"ws://127.0.0.1:{port}/"))
        finally:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 0, err.decode()
        assert out.decode().startswith(f"serving policy at ws://127.0.0.1:{port}/")
    a, b = frames.values()
    assert len(a) == len(SCRIPT) + 2
    assert a == b
    # What the frames hold (so equality is not two empty lists): the metadata, seeded replies, the error.
    assert a[0][1]["policy"] == spec and a[0][1]["rescue_rng"] == 1 and a[0][1]["action_horizon"] == CHUNK
    assert a[2] != a[3] and a[2] == a[10]  # the RNG moves, and the same seed gives the same chunk again
    assert a[-2][0] == "text" and "unknown control message 'no_such_op'" in a[-2][1]
    assert a[-1] == ("CLOSE", 1011)


# --- one model, many connections --------------------------------------------------------------


class SharedModel:
    """A model loaded once; records how many calls were inside it at once."""

    loads = 0

    def __init__(self) -> None:
        SharedModel.loads += 1
        self.inside = 0
        self.most_inside = 0
        self.guard = threading.Lock()

    def __call__(self, state: np.ndarray, noise: np.ndarray) -> np.ndarray:
        with self.guard:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        time.sleep(0.05)  # long enough for a second connection's call to arrive meanwhile
        with self.guard:
            self.inside -= 1
        return state[None, :DIM] + noise


class Session:
    """A connection's own RNG stream over the shared model."""

    def __init__(self, model: SharedModel) -> None:
        self.model = model
        self.action_horizon = CHUNK
        self.reset_rng(0)

    def infer(self, obs: dict) -> dict:
        noise = self.rng.standard_normal((CHUNK, DIM)).astype(np.float32)
        return {"actions": self.model(np.asarray(obs["state"], dtype=np.float32), noise)}

    def reset(self) -> None:
        pass

    def reset_rng(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def rng_state(self) -> str:
        return json.dumps(self.rng.bit_generator.state, sort_keys=True, default=int)


def test_calls_into_the_shared_model_are_serialised_and_each_connection_has_its_stream():
    SharedModel.loads = 0
    model = SharedModel()

    async def main():
        server = PolicyServer(lambda: Session(model), {"action_horizon": CHUNK})
        url = await server.start()
        try:
            clients = [await WebsocketPolicyClient.connect(url) for _ in range(3)]
            for client, seed in zip(clients, (1, 1, 2)):
                await client.reset_rng(seed)
            replies = await asyncio.gather(*(c.infer(_obs()) for c in clients for _ in range(2)))
            for client in clients:
                await client.close()
        finally:
            await server.stop()
        return [r["actions"] for r in replies]

    a1, a2, b1, b2, c1, c2 = asyncio.run(main())
    assert SharedModel.loads == 1 and model.most_inside == 1  # concurrent requests, one at a time inside
    np.testing.assert_array_equal(a1, b1)  # same seed, own streams: the same answers
    np.testing.assert_array_equal(a2, b2)
    assert not np.array_equal(a1, a2) and not np.array_equal(a1, c1)


# --- the openpi adapter, against a stand-in with openpi's signature ------------------------------


class OpenpiStandIn:
    """What openpi's `Policy` offers the adapter: `infer(obs, *, noise=None)`, noise of (horizon, dim)."""

    def __init__(self) -> None:
        self.noises: list[np.ndarray] = []

    def infer(self, obs: dict, *, noise: np.ndarray | None = None) -> dict:
        if noise is None:
            raise AssertionError("the adapter must always pass the noise")
        self.noises.append(noise)
        return {"actions": np.asarray(obs["state"], dtype=np.float32)[:DIM] + noise[:, :DIM]}


def test_the_openpi_adapter_draws_each_connections_noise_from_its_seed():
    stand_in = OpenpiStandIn()
    served = OpenpiServed(stand_in, (CHUNK, 32), action_horizon=5)

    async def main():
        server = PolicyServer(served.session, served.metadata())
        url = await server.start()
        try:
            async with await WebsocketPolicyClient.connect(url) as a, await WebsocketPolicyClient.connect(url) as b:
                meta = dict(a.metadata)
                await a.infer(_obs())  # a's stream moves; b's does not
                for client in (a, b):
                    await client.reset_rng(9)
                first = [(await a.infer(_obs()))["actions"], (await b.infer(_obs()))["actions"]]
                before = await a.rng_state()
                await a.infer(_obs())
                after = await a.rng_state()
                await b.reset_rng(10)
                other = (await b.infer(_obs()))["actions"]
                return meta, first, before, after, other
        finally:
            await server.stop()

    meta, (a, b), before, after, other = asyncio.run(main())
    assert meta["rescue_rng"] == 1 and meta["stateless"] is True
    assert meta["action_horizon"] == 5 and meta["observation"] == "openpi-libero"
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, other)
    assert before.digest != after.digest and after.requests == 2
    assert all(n.shape == (CHUNK, 32) and n.dtype == np.float32 for n in stand_in.noises)
    np.testing.assert_array_equal(stand_in.noises[1], np.random.default_rng(9).standard_normal((CHUNK, 32)).astype(np.float32))


def test_rescue_serve_openpi_without_openpi_says_so_in_one_line():
    out = subprocess.run([sys.executable, "-m", "rescue_serve.cli", "openpi", "--config", "pi05_libero", "--dir", "x"],
                         cwd=SERVE, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "openpi is not importable in this environment" in out.stderr


# --- the LeRobot adapter's choices (the real LeRobot runs in the interop tier: tests/test_lerobot_interop.py) ----


class _Chunker:
    def predict_action_chunk(self, batch): ...

    def select_action(self, batch): ...


class _Stepper:
    def select_action(self, batch): ...


def test_the_lerobot_mode_follows_the_observation_history():
    from rescue_serve.lerobot import _choose_mode

    assert _choose_mode("act", 1, "auto", _Chunker) == _choose_mode("act", 1, "auto", _Chunker, []) == ("chunk", "")
    assert _choose_mode("diffusion", 2, "auto", _Chunker) == ("step", "n_obs_steps = 2: an observation history")
    assert _choose_mode("act", 1, "step", _Chunker) == ("step", "asked with --mode step")
    # State beyond the action queue (ACT's temporal ensembler): served as select_action serves it.
    assert _choose_mode("act", 1, "auto", _Chunker, ["temporal_ensembler"]) == (
        "step", "select_action keeps temporal_ensembler between calls")
    with pytest.raises(wire.BadInput, match="n_obs_steps = 2 needs every step's observation"):
        _choose_mode("diffusion", 2, "chunk", _Chunker)
    with pytest.raises(wire.BadInput, match="select_action keeps temporal_ensembler between calls, so its chunks are "
                                            "other actions: it is served at C = 1 with --mode step"):
        _choose_mode("act", 1, "chunk", _Chunker, ["temporal_ensembler"])
    with pytest.raises(wire.BadInput, match="cannot be served in chunk mode: it has no predict_action_chunk"):
        _choose_mode("vqbet", 1, "auto", _Stepper)


@pytest.mark.parametrize("make,expected", [
    (lambda tmp: tmp / "nothing-here", "is not a saved LeRobot policy directory (no config.json)"),
    (lambda tmp: (tmp / "config.json").write_text("{}") and tmp, "lerobot is not importable in this environment"),
])
def test_rescue_serve_lerobot_bad_input_is_one_line(tmp_path, make, expected):
    path = make(tmp_path)
    out = subprocess.run([sys.executable, "-m", "rescue_serve.cli", "lerobot", str(path)],
                         cwd=SERVE, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and expected in out.stderr



class _Base:
    def reset(self):
        self._queues = {}


class _Streaming(_Base):
    """reset() through super(), a helper of its own, an attribute reset in place and one only read."""

    def reset(self):
        super().reset()
        self._clear()
        self.ensembler.reset()
        self._queue = [] * self.config.n_action_steps

    def _clear(self):
        self._cache[0] = None


def test_the_episode_state_is_what_reset_resets():
    from rescue_serve.lerobot_state import _reset_names, beyond_action_queue

    assert _reset_names(_Streaming) == {"_queues", "_cache", "ensembler", "_queue"}
    assert beyond_action_queue(["_action_queue", "_queues", "temporal_ensembler"]) == ["temporal_ensembler"]


def test_an_episode_start_resets_the_connections_policy():
    resets = []

    class Counted:
        action_horizon = CHUNK

        def infer(self, obs: dict) -> dict:
            return {"actions": np.zeros((CHUNK, DIM), dtype=np.float32)}

        def reset(self) -> None:
            resets.append(1)

    async def main():
        server = PolicyServer(Counted, {})
        url = await server.start()
        try:
            async with await WebsocketPolicyClient.connect(url) as client:
                await client.episode_start("e", "t", "1")
                await client.infer(_obs())
                await client.episode_end(True)
                await client.episode_start("e", "t", "2")
        finally:
            await server.stop()

    asyncio.run(main())
    assert len(resets) == 2  # at each episode_start, never at an episode's end
