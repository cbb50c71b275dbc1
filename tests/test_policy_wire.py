"""The policy wire on real loopback sockets: encoding, server, client, RNG extension, openpi interop."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest
import structlog
from conftest import HANG_S, free_port
from openpi_client import msgpack_numpy as openpi_msgpack
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from openpi_server import WebsocketPolicyServer
from rescue_serve import msgpack_numpy
from rescue_serve.server import PolicyServer, policy_metadata
from rescue_serve.wire import EPISODE_EXTENSION, Policy, SeededPolicy

from rescue.policy.bundled import load_factory
from rescue.policy.client import PolicyConnectionClosed, PolicyServerError, WebsocketPolicyClient

pytestmark = pytest.mark.fast

CHUNK, DIM = 10, 7
ROOT = Path(__file__).resolve().parents[1]


class NoisePolicy:
    """A seeded test policy: state plus sampled noise, so the RNG shows in the actions."""

    def __init__(self) -> None:
        self.action_horizon = CHUNK
        self._rng = np.random.default_rng(0)

    def infer(self, obs: dict) -> dict:
        if obs.get("prompt") == "raise":
            raise ValueError("policy exploded on purpose")
        state = np.asarray(obs["state"], dtype=np.float32)
        noise = self._rng.standard_normal((CHUNK, DIM)).astype(np.float32)
        return {"actions": state[None, :DIM] + 0.01 * noise}

    def reset(self) -> None:
        pass

    def reset_rng(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def rng_state(self) -> str:
        return hashlib.sha256(json.dumps(self._rng.bit_generator.state, sort_keys=True).encode()).hexdigest()


class PlainPolicy:
    """A deterministic policy without the RNG extension."""

    def infer(self, obs: dict) -> dict:
        state = np.asarray(obs["state"], dtype=np.float32)
        return {"actions": np.tile(state[:DIM], (CHUNK, 1))}

    def reset(self) -> None:
        pass


def _obs(prompt: str = "pick up the cup") -> dict:
    return {
        "state": np.arange(8, dtype=np.float32) / 10,
        "observation/image": np.zeros((4, 4, 3), dtype=np.uint8),
        "prompt": prompt,
    }


def _http(url: str) -> str:
    return "http" + url[len("ws") :]


async def _served(factory=NoisePolicy, **kwargs) -> tuple[PolicyServer, str]:
    server = PolicyServer(factory, {"name": "test-policy", "action_horizon": CHUNK}, **kwargs)
    return server, await server.start()


# --- encoding ----------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "float16", "int8", "uint8", "int16", "uint16", "int64", "bool", "<U3"]
)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4)])
def test_ndarray_roundtrip_and_openpi_compat(dtype, shape):
    arr = (np.arange(int(np.prod(shape))) % 3).reshape(shape).astype(dtype)
    obj = {"a": arr, "nested": [arr, {"b": arr.T}]}
    data = msgpack_numpy.packb(obj)
    assert data == openpi_msgpack.packb(obj)  # byte-compatible with openpi
    back = msgpack_numpy.unpackb(data)
    for got in (back["a"], back["nested"][0], openpi_msgpack.unpackb(data)["a"]):
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)
    np.testing.assert_array_equal(back["nested"][1]["b"], arr.T)


def test_non_contiguous_arrays_travel_in_c_order():
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]
    np.testing.assert_array_equal(msgpack_numpy.unpackb(msgpack_numpy.packb(arr)), arr)
    fortran = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(msgpack_numpy.unpackb(msgpack_numpy.packb(fortran)), fortran)


@pytest.mark.parametrize("value", [np.float32(1.5), np.float64(-2.25), np.int64(3), np.uint8(200), np.bool_(True)])
def test_numpy_scalar_roundtrip(value):
    data = msgpack_numpy.packb({"v": value})
    assert data == openpi_msgpack.packb({"v": value})
    back = msgpack_numpy.unpackb(data)["v"]
    assert back == value
    # np.float64 subclasses float, so msgpack sends it as a plain float (openpi too).
    assert type(back) is (float if isinstance(value, float) else type(value))
    assert type(back) is type(openpi_msgpack.unpackb(data)["v"])


@pytest.mark.parametrize(
    "bad",
    [
        np.array([object(), 1], dtype=object),
        np.array([1 + 2j]),
        np.zeros(2, dtype=[("x", "f4"), ("y", "i4")]),
        np.complex64(1j),
    ],
)
def test_refuses_object_void_complex(bad):
    with pytest.raises(ValueError, match="Unsupported dtype"):
        msgpack_numpy.packb({"x": bad})


@pytest.mark.parametrize("dtype", ["|O", "<c16", "|V8"])
def test_decoding_refuses_dangerous_dtypes(dtype):
    frame = msgpack.packb({b"__ndarray__": True, b"data": b"\0" * 16, b"dtype": dtype, b"shape": [1]})
    with pytest.raises(ValueError):
        msgpack_numpy.unpackb(frame)


def test_decoding_refuses_payload_shape_mismatch():
    frame = msgpack.packb({b"__ndarray__": True, b"data": b"\0" * 12, b"dtype": "<f4", b"shape": [2]})
    with pytest.raises(ValueError):
        msgpack_numpy.unpackb(frame)


def test_test_policies_meet_the_protocols():
    assert isinstance(NoisePolicy(), SeededPolicy)
    assert isinstance(PlainPolicy(), Policy) and not isinstance(PlainPolicy(), SeededPolicy)


# --- our client against our server -----------------------------------------------


def test_infer_roundtrip_and_metadata():
    async def main():
        server, url = await _served()
        try:
            async with await WebsocketPolicyClient.connect(url) as client:
                assert client.metadata["name"] == "test-policy"
                assert client.metadata["rescue_rng"] == 1 and client.supports_rng
                reply = await client.infer(_obs())
                assert reply["actions"].shape == (CHUNK, DIM) and reply["actions"].dtype == np.float32
                assert reply["actions"].flags.writeable
                np.testing.assert_allclose(reply["actions"][0], np.arange(7) / 10, atol=0.05)
                assert "infer_ms" in reply["server_timing"]
                await client.reset()
                second = await client.infer(_obs())
                assert "prev_total_ms" in second["server_timing"]
        finally:
            await server.stop()

    asyncio.run(main())


def test_metadata_is_the_first_frame_and_healthz():
    async def main():
        server, url = await _served()
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(_http(url) + "healthz") as resp:
                    assert resp.status == 200
                async with session.ws_connect(url + "any/path") as ws:
                    first = await ws.receive(timeout=HANG_S)  # sent before we send anything
                    assert first.type is aiohttp.WSMsgType.BINARY
                    assert msgpack_numpy.unpackb(first.data)["name"] == "test-policy"
        finally:
            await server.stop()

    asyncio.run(main())


def test_api_key_accepted_and_refused():
    async def main():
        server, url = await _served(api_key="s3cret")
        try:
            for key in (None, "wrong"):
                with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                    await WebsocketPolicyClient.connect(url, api_key=key, connect_timeout_s=2)
                assert info.value.status == 401
            async with await WebsocketPolicyClient.connect(url, api_key="s3cret") as client:
                assert (await client.infer(_obs()))["actions"].shape == (CHUNK, DIM)
            async with aiohttp.ClientSession() as session:
                async with session.get(_http(url) + "healthz") as resp:
                    assert resp.status == 200  # health needs no key
        finally:
            await server.stop()

    asyncio.run(main())


def test_server_exception_arrives_as_policy_server_error():
    async def main():
        server, url = await _served()
        try:
            client = await WebsocketPolicyClient.connect(url)
            with pytest.raises(PolicyServerError, match="ValueError: policy exploded on purpose"):
                await client.infer(_obs("raise"))
            with pytest.raises(PolicyConnectionClosed):
                await client.infer(_obs())
            assert client.closed
            await client.close()
        finally:
            await server.stop()

    asyncio.run(main())


def test_connect_gives_up_when_nothing_listens():
    async def main():
        url = f"ws://127.0.0.1:{free_port()}/"
        # It gives up (the error) instead of retrying for ever; the outer bound catches only a hang
        # and is generous on purpose (a busy machine is slow, not that slow).
        with pytest.raises(aiohttp.ClientConnectorError):
            await asyncio.wait_for(WebsocketPolicyClient.connect(url, connect_timeout_s=0.5), HANG_S)

    asyncio.run(main())


# --- RNG extension ------------------------------------------------------------


async def _actions(client: WebsocketPolicyClient, n: int = 3) -> list[np.ndarray]:
    return [(await client.infer(_obs()))["actions"] for _ in range(n)]


def test_reset_rng_makes_connections_identical_and_isolated():
    async def main():
        server, url = await _served()
        try:
            a = await WebsocketPolicyClient.connect(url)
            b = await WebsocketPolicyClient.connect(url)
            await a.infer(_obs())  # advance a's RNG first: b must not be affected
            await a.reset_rng(7)
            await b.reset_rng(7)
            seq_a, seq_b = await _actions(a), await _actions(b)
            for x, y in zip(seq_a, seq_b):
                np.testing.assert_array_equal(x, y)
            await b.reset_rng(8)
            assert not np.array_equal((await _actions(b, 1))[0], seq_a[0])
            sa, sb = await a.rng_state(), await b.rng_state()
            assert sa.connection_id != sb.connection_id
            assert sa.server_instance == sb.server_instance == server.instance_id
            await a.close()
            await b.close()
        finally:
            await server.stop()

    asyncio.run(main())


def test_rng_state_unchanged_by_keepalive_changed_by_infer():
    async def main():
        server, url = await _served()
        try:
            async with await WebsocketPolicyClient.connect(url) as client:
                await client.reset_rng(3)
                start = await client.rng_state()
                assert start.requests == 0
                with structlog.testing.capture_logs() as logs:
                    probes = [await client.keepalive() for _ in range(3)]
                assert all(p == start for p in probes)
                events = [e for e in logs if e["event"] == "policy.keepalive"]
                assert len(events) == 3 and {e["mode"] for e in events} == {"rng_state"}
                await client.infer(_obs())
                after = await client.rng_state()
                assert after.digest != start.digest and after.requests == 1
                assert after.connection_id == start.connection_id
        finally:
            await server.stop()

    asyncio.run(main())


def test_policy_without_rng_extension():
    async def main():
        server, url = await _served(PlainPolicy)
        try:
            async with await WebsocketPolicyClient.connect(url) as client:
                assert not client.supports_rng and "rescue_rng" not in client.metadata
                assert await client.rng_state() is None
                with pytest.raises(NotImplementedError):
                    await client.reset_rng(1)
                await client.reset()  # the control message still works
                assert await client.keepalive() is None
                assert (await client.infer(_obs()))["actions"].shape == (CHUNK, DIM)
        finally:
            await server.stop()

    asyncio.run(main())


# --- keepalive across an idle timeout ---------------------------------------------
IDLE_S, WAIT_S, EVERY_S = 0.5, 2.0, 0.2


async def _hold(client: WebsocketPolicyClient) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT_S
    while loop.time() < end:
        await asyncio.sleep(EVERY_S)
        await client.keepalive()


@pytest.mark.parametrize("factory,mode", [(NoisePolicy, "rng_state"), (PlainPolicy, "ping")])
def test_keepalive_survives_a_wait_longer_than_idle_timeout(factory, mode):
    async def main():
        server, url = await _served(factory, idle_timeout_s=IDLE_S)
        try:
            async with await WebsocketPolicyClient.connect(url) as client:
                if client.supports_rng:
                    await client.reset_rng(11)
                    await client.infer(_obs())
                before = await client.rng_state()
                with structlog.testing.capture_logs() as logs:
                    await _hold(client)
                modes = {e["mode"] for e in logs if e["event"] == "policy.keepalive"}
                assert modes == {mode}
                assert not client.closed
                assert await client.rng_state() == before  # digest, counter, connection, instance
                assert (await client.infer(_obs()))["actions"].shape == (CHUNK, DIM)
        finally:
            await server.stop()

    asyncio.run(main())


def test_without_keepalive_the_idle_connection_is_closed():
    async def main():
        server, url = await _served(idle_timeout_s=IDLE_S)
        try:
            async with await WebsocketPolicyClient.connect(url) as client:
                await asyncio.sleep(IDLE_S * 3)
                assert client.closed
                with pytest.raises(PolicyConnectionClosed):
                    await client.infer(_obs())
        finally:
            await server.stop()

    asyncio.run(main())


# --- interop with the real openpi packages ---------------------------------------


def _drive_with_openpi_client(url: str) -> tuple[dict, list[np.ndarray]]:
    client = WebsocketClientPolicy(host=url.rstrip("/"))
    try:
        return client.get_server_metadata(), [client.infer(_obs())["actions"] for _ in range(2)]
    finally:
        client._ws.close()  # the openpi client has no public close


# The openpi client connects in a way the websockets library now deprecates.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_openpi_client_drives_our_server():
    async def main():
        server, url = await _served(PlainPolicy)
        try:
            metadata, actions = await asyncio.to_thread(_drive_with_openpi_client, url)
        finally:
            await server.stop()
        assert metadata["name"] == "test-policy"
        for chunk in actions:
            np.testing.assert_allclose(chunk, np.tile(np.arange(7, dtype=np.float32) / 10, (CHUNK, 1)))

    asyncio.run(main())


def test_our_client_against_openpi_server():
    async def main():
        port = free_port()
        openpi = WebsocketPolicyServer(PlainPolicy(), host="127.0.0.1", port=port, metadata={"name": "openpi"})
        task = asyncio.create_task(openpi.run())
        try:
            # The server starts concurrently: connect() retries while the port refuses.
            async with await WebsocketPolicyClient.connect(f"ws://127.0.0.1:{port}", connect_timeout_s=HANG_S) as client:
                assert client.metadata == {"name": "openpi"}
                assert not client.supports_rng
                reply = await client.infer(_obs())
                assert reply["actions"].shape == (CHUNK, DIM)
                assert "infer_ms" in reply["server_timing"]
                await client.reset()  # no control extension: nothing is sent
                with structlog.testing.capture_logs() as logs:
                    assert await client.keepalive() is None
                assert [e["mode"] for e in logs if e["event"] == "policy.keepalive"] == ["ping"]
                assert await client.rng_state() is None
                assert (await client.infer(_obs()))["actions"].shape == (CHUNK, DIM)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())


# --- openpi's episode control frames -------------------------------------------------


class RecordingPolicy:
    """Records every request handed to infer (class-level, shared by the connections of a test)."""

    seen: list[dict] = []

    def infer(self, obs: dict) -> dict:
        RecordingPolicy.seen.append(dict(obs))
        return {"actions": np.zeros((CHUNK, DIM), dtype=np.float32)}

    def reset(self) -> None:
        pass


def _ctrl_frames() -> list[dict]:
    # As a newer openpi client sends them: plain msgpack dicts on the inference socket.
    return [
        {"__ctrl__": "episode_start", "__experiment__": "exp", "__task__": "pick up the cup", "__episode_id__": "ep-1"},
        {"__ctrl__": "episode_end", "__success__": True},
    ]


def test_our_server_answers_episode_frames_without_feeding_the_policy():
    async def main():
        RecordingPolicy.seen = []
        server = PolicyServer(RecordingPolicy, {"name": "rec"})
        url = await server.start()
        try:
            async with await WebsocketPolicyClient.connect(url) as client:
                assert client.metadata[EPISODE_EXTENSION] == 1 and client.supports_episode_control
                start = await client.episode_start("exp", "pick up the cup", "ep-1")
                assert start == {"ok": True, "ctrl": "episode_start", "episodes": 1, "requests": 0}
                await client.infer(_obs())
                end = await client.episode_end(False)
                assert end == {"ok": True, "ctrl": "episode_end", "episodes": 1, "requests": 1}
            # The frames exactly as openpi's client packs them, on a raw socket.
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(url) as ws:
                    await ws.receive(timeout=HANG_S)  # metadata
                    for frame in _ctrl_frames():
                        await ws.send_bytes(openpi_msgpack.packb(frame))
                        reply = await ws.receive(timeout=HANG_S)
                        assert reply.type is aiohttp.WSMsgType.BINARY
                        answer = openpi_msgpack.unpackb(reply.data)
                        assert isinstance(answer, dict) and answer["ok"] is True and answer["ctrl"] == frame["__ctrl__"]
                    # An unknown control op is an error, still never an observation.
                    await ws.send_bytes(openpi_msgpack.packb({"__ctrl__": "episode_pause"}))
                    reply = await ws.receive(timeout=HANG_S)
                    assert reply.type is aiohttp.WSMsgType.TEXT and "unknown __ctrl__ message 'episode_pause'" in reply.data
        finally:
            await server.stop()
        assert len(RecordingPolicy.seen) == 1
        assert not any("__ctrl__" in obs for obs in RecordingPolicy.seen)

    asyncio.run(main())


def test_episode_frames_are_not_sent_to_a_plain_openpi_server():
    async def main():
        RecordingPolicy.seen = []
        port = free_port()
        openpi = WebsocketPolicyServer(RecordingPolicy(), host="127.0.0.1", port=port, metadata={})
        task = asyncio.create_task(openpi.run())
        try:
            async with await WebsocketPolicyClient.connect(f"ws://127.0.0.1:{port}", connect_timeout_s=HANG_S) as client:
                assert not client.supports_episode_control
                assert await client.episode_start("exp", "pick up the cup", "ep-1") is None
                await client.infer(_obs())
                assert await client.episode_end(True) is None
            assert [obs["prompt"] for obs in RecordingPolicy.seen] == ["pick up the cup"]
            # Why the client must hold back: openpi's server hands such a frame to the policy.
            async with await WebsocketPolicyClient.connect(f"ws://127.0.0.1:{port}", connect_timeout_s=HANG_S) as client:
                await client._request(_ctrl_frames()[0])
            assert RecordingPolicy.seen[-1]["__ctrl__"] == "episode_start"
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())


class LerobotShaped:
    """A wrapped LeRobot policy as the README describes it: announces its profile and chunk length."""

    observation = "lerobot-libero"
    action_horizon = CHUNK

    def infer(self, obs: dict) -> dict:
        return {"actions": np.zeros((CHUNK, DIM), dtype=np.float32)}

    def reset(self) -> None:
        pass


def test_a_served_policy_announces_its_profile_and_chunk_and_the_study_takes_them():
    from rescue.core.configuration.config_files import load_config
    from rescue.run.peers import config_with_identity

    async def main():
        server = PolicyServer(LerobotShaped, policy_metadata(LerobotShaped, "mine:make_policy"))
        url = await server.start()
        try:
            async with await WebsocketPolicyClient.connect(url) as client:
                return dict(client.metadata)
        finally:
            await server.stop()

    metadata = asyncio.run(main())
    assert metadata["observation"] == "lerobot-libero" and metadata["action_horizon"] == CHUNK
    config = config_with_identity(load_config(None, {"policy.url": "ws://127.0.0.1:1/"}), metadata)
    assert config.policy.observation == "lerobot-libero" and config.policy.replan_interval == CHUNK


# --- the CLI entry -------------------------------------------------------------------


def test_load_factory():
    assert load_factory("collections:OrderedDict") is __import__("collections").OrderedDict
    assert load_factory("os:path.join") is os.path.join
    with pytest.raises(ValueError):
        load_factory("no_colon_here")


def test_serve_main_in_a_subprocess():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "TEST_POLICY_KEY": "k1"}
    cmd = [
        sys.executable,
        "-c",
        "import sys; from rescue.cli import main; sys.exit(main(['serve-policy', *sys.argv[1:]]))",
        "--policy",
        "test_policy_wire:NoisePolicy",
        "--port",
        str(port),
        "--api-key-env",
        "TEST_POLICY_KEY",
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    async def main():
        async with await WebsocketPolicyClient.connect(
            f"ws://127.0.0.1:{port}/", api_key="k1", connect_timeout_s=HANG_S  # the subprocess's start
        ) as client:
            assert client.metadata["policy"] == "test_policy_wire:NoisePolicy"
            assert client.metadata["action_horizon"] == CHUNK
            assert client.supports_rng
            assert (await client.infer(_obs()))["actions"].shape == (CHUNK, DIM)

    try:
        asyncio.run(main())
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, err.decode()
    assert b"serving policy at ws://127.0.0.1:" in out
