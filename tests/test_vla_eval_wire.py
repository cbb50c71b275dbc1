"""vla-eval's wire against the harness's own code: its codec both ways, and our client against its own
`PredictModelServer` served by its own serving code on loopback (no simulator)."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
from vla_eval.protocol.image_codec import encode_image
from vla_eval.protocol.messages import Message, MessageType, pack_message, unpack_message
from vla_eval_peers import DeterministicModel, log_rows, vla_eval_server

from rescue_serve import msgpack_numpy
from rescue.policy.client import PolicyConnectionClosed
from rescue.policy.vla_eval_client import VlaEvalError, VlaEvalPolicyClient, health
from rescue.policy.vla_eval_wire import nested, pack_frame, unpack_frame
from rescue.policy.wires import connect, is_stepwise, wire_of

pytestmark = pytest.mark.fast

RNG = np.random.default_rng(3)
IMAGE = RNG.integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
WRIST = RNG.integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
OBS = {"images/agentview": IMAGE, "images/wrist": WRIST, "task_description": "put the bowl on the plate",
       "states": RNG.normal(size=8), "controller_states": RNG.normal(size=8).astype(np.float32)}


def test_the_harness_reads_our_frames():
    message = unpack_message(pack_frame("observation", nested(OBS), seq=4))
    assert message.type is MessageType.OBSERVATION and message.seq == 4
    payload = message.payload
    # The image went as a PNG and comes back bit for bit; the arrays keep their dtype.
    assert np.array_equal(payload["images"]["agentview"], IMAGE) and np.array_equal(payload["images"]["wrist"], WRIST)
    assert payload["states"].dtype == np.float64 and np.array_equal(payload["states"], OBS["states"])
    assert payload["controller_states"].dtype == np.float32
    assert payload["task_description"] == OBS["task_description"]


def test_we_read_the_harness_frames():
    actions = RNG.normal(size=7).astype(np.float32)
    frame = unpack_frame(pack_message(Message(type=MessageType.ACTION, payload={"actions": actions, "image": IMAGE}, seq=9)))
    assert frame.type == "action" and frame.seq == 9
    assert frame.payload["actions"].dtype == np.float32 and np.array_equal(frame.payload["actions"], actions)
    assert np.array_equal(frame.payload["image"], IMAGE)


def test_jpeg_and_raw_images_decode_as_the_harness_encodes_them():
    for fmt in ("jpeg", "raw"):
        data = msgpack.packb({"type": "action", "payload": {"image": encode_image(IMAGE, fmt)}, "seq": 1, "timestamp": 0.0},
                             use_bin_type=True)
        ours = unpack_frame(data).payload["image"]
        theirs = unpack_message(data).payload["image"]
        assert ours.shape == IMAGE.shape and np.array_equal(ours, theirs), fmt
    assert np.array_equal(unpack_frame(pack_frame("action", {"image": IMAGE}, 1, image_format="raw")).payload["image"], IMAGE)


def test_the_openpi_codec_does_not_read_vla_eval_arrays():
    # Why the wire needs a codec of its own: openpi's arrays are keyed by bytes, the harness's by str.
    raw = msgpack_numpy.unpackb(pack_message(Message(type=MessageType.ACTION, payload={"actions": np.zeros(7)}, seq=1)))
    assert isinstance(raw["payload"]["actions"], dict) and raw["payload"]["actions"]["__ndarray__"] is True


def test_frames_that_are_not_the_wire_are_refused_by_name():
    bad = msgpack.packb({"type": "action", "payload": {"a": {"__ndarray__": True, "data": b"12345678", "dtype": "|O8",
                                                              "shape": [1]}}, "seq": 1, "timestamp": 0.0})
    with pytest.raises(ValueError, match="dtype object"):
        unpack_frame(bad)
    with pytest.raises(ValueError, match="unknown type 'reset'"):
        unpack_frame(msgpack.packb({"type": "reset", "payload": {}, "seq": 1, "timestamp": 0.0}))
    with pytest.raises(ValueError, match="without timestamp"):
        unpack_frame(msgpack.packb({"type": "action", "payload": {}, "seq": 1}))
    with pytest.raises(ValueError, match="given twice|already a value"):
        nested({"images": 1, "images/agentview": IMAGE})


def test_the_url_scheme_names_the_wire():
    assert wire_of("vla-eval+ws://gpu:8000") == "vla-eval"
    assert wire_of("ws://gpu:8000") == "openpi" and wire_of(None) == "openpi"


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_one_action_per_observation_from_the_servers_chunk_buffer(tmp_path):
    log = tmp_path / "server.jsonl"
    chunk = DeterministicModel(chunk_size=3).chunk(nested(OBS))

    async def go(url):
        client = await connect(url, connect_timeout_s=30)
        try:
            assert isinstance(client, VlaEvalPolicyClient) and is_stepwise(client) and not client.supports_rng
            assert client.metadata["policy"] == "DeterministicModel"
            assert client.metadata["observation_params"] == {"send_wrist_image": True, "send_state": True}
            assert (await health(url)) == {"status": "ok"}
            await client.episode_start("x", OBS["task_description"], "case/control",
                                       task_info={"suite": "libero_object", "task_id": 2, "episode_idx": 4})
            first = [(await client.infer(OBS))["actions"] for _ in range(7)]
            # A new episode drops the buffer mid-chunk: the next observation is predicted again.
            await client.episode_start("x", OBS["task_description"], "case/assisted")
            second = (await client.infer(OBS))["actions"]
            await client.episode_end(False)
            await client.keepalive()
            return first, second
        finally:
            await client.close()

    with vla_eval_server(chunk_size=3, log_path=str(log)) as url:
        first, second = _run(go(url))
    assert all(a.shape == (1, 7) and a.dtype == np.float32 for a in first)
    assert [np.array_equal(a[0], chunk[i % 3]) for i, a in enumerate(first)] == [True] * 7
    assert np.array_equal(second[0], chunk[0])
    starts = log_rows(log, "episode_start")
    assert starts[0]["task"] == {"name": OBS["task_description"], "suite": "libero_object", "task_id": 2, "episode_idx": 4}
    # Predicted at steps 0, 3, 6 of the first episode, at step 0 of the second; all on one session.
    assert [r["step"] for r in log_rows(log, "predict")] == [0, 3, 6, 0]
    assert [r["step"] for r in log_rows(log, "observation")] == [0, 1, 2, 3, 4, 5, 6, 0]
    assert len({r["session"] for r in log_rows(log, "observation")}) == 1


def test_an_error_frame_is_the_servers_words_and_the_connection_stays(tmp_path):
    async def go(url):
        client = await connect(url, connect_timeout_s=30)
        try:
            await client.episode_start("x", "t", "e")
            await client.infer(OBS)
            with pytest.raises(VlaEvalError, match="observation_failed: ValueError: the model refuses call 2"):
                await client.infer({**OBS, "task_description": "another"})
            return (await client.infer({**OBS, "task_description": "a third"}))["actions"]
        finally:
            await client.close()

    with vla_eval_server(chunk_size=1, fail_at_call=2) as url:
        assert _run(go(url)).shape == (1, 7)


def test_a_failed_episode_start_is_named_at_the_next_observation():
    async def go(url):
        client = await connect(url, connect_timeout_s=30)
        try:
            await client.episode_start("x", "t", "e", task_info={"suite": "libero_90"})
            with pytest.raises(VlaEvalError, match="episode_start with an error: episode_start_failed: RuntimeError: "
                                                   "no episode of libero_90 here"):
                await client.infer(OBS)
        finally:
            await client.close()

    with vla_eval_server(fail_episode_start=True) as url:
        _run(go(url))


def test_a_server_that_dies_mid_episode_closes_the_connection():
    async def go(url):
        client = await connect(url, connect_timeout_s=30)
        try:
            await client.episode_start("x", "t", "e")
            await client.infer(OBS)
            with pytest.raises(PolicyConnectionClosed):
                await client.infer({**OBS, "task_description": "again"})
            assert client.closed
        finally:
            await client.close()

    with vla_eval_server(chunk_size=1, die_at_call=2) as url:
        _run(go(url))


def test_a_whole_chunk_for_one_observation_is_refused():
    # A server without a chunk_size hands out the model's whole chunk; the harness's LIBERO step would fail on it.
    async def go(url):
        client = await connect(url, connect_timeout_s=30)
        try:
            with pytest.raises(VlaEvalError, match=r"chunk of shape \(5, 7\)"):
                await client.infer(OBS)
        finally:
            await client.close()

    with vla_eval_server(chunk_size="null") as url:
        _run(go(url))
