"""Properties of the policy server's framing, on real sockets (hypothesis): a request split at any points, sent
in any number of fragments with pings between them, interleaved with other clients' requests, is answered as
if it came whole; a message at the size limit is answered and one byte over it is refused (close 1009) before
its payload is sent."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import HANG_S
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from identity_policies import make_echo_policy
from raw_websocket import BINARY, PING, closed_with, frame, frame_header, open_websocket, read_frame

from rescue_serve import msgpack_numpy
from rescue_serve.server import PolicyServer

pytestmark = pytest.mark.fast

LIMIT = 4096  # the server's message limit here: small, so that sizes around it are cheap
CONT = 0x0
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """A PolicyServer of the echo policy, served from a thread of its own for the module's tests."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    async def serve() -> None:
        server = PolicyServer(make_echo_policy, {}, max_msg_size=LIMIT, max_connections=64)
        box["url"] = await server.start()
        box["stop"] = asyncio.Event()
        started.set()
        await box["stop"].wait()
        await server.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(HANG_S)
    yield int(box["url"].rsplit(":", 1)[1].strip("/"))
    loop.call_soon_threadsafe(box["stop"].set)
    thread.join(HANG_S)


def _request(state: np.ndarray, size: int | None = None) -> bytes:
    """A request frame's payload carrying `state`, padded to exactly `size` bytes when given."""
    body = msgpack_numpy.packb({"state": state})
    if size is None:
        return body
    for pad in range(max(0, size - len(body) - 8), size):
        padded = msgpack_numpy.packb({"state": state, "pad": b"x" * pad})
        if len(padded) == size:
            return padded
    raise AssertionError(f"no padding makes a request of {size} bytes")


def _client(port: int) -> socket.socket:
    sock = open_websocket(port, timeout=HANG_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each piece leaves as it is sent
    assert read_frame(sock)[0] == BINARY  # the metadata frame
    return sock


def _pieces(wire: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(wire), *(c % (len(wire) + 1) for c in cuts)})
    return [wire[a:b] for a, b in zip(points, points[1:])]


def _fragments(payload: bytes, cuts: list[int], pings: bool) -> bytes:
    """The payload as one message of fragments (BINARY, then CONT, the last with FIN), pings between them."""
    parts = _pieces(payload, cuts) or [b""]
    out = b""
    for i, part in enumerate(parts):
        out += frame(part, opcode=BINARY if i == 0 else CONT, fin=i == len(parts) - 1)
        if pings and i < len(parts) - 1:
            out += frame(b"p", opcode=PING)
    return out


def _answer(sock: socket.socket) -> np.ndarray:
    """The actions of the next data frame (pongs skipped)."""
    while True:
        got = read_frame(sock)
        assert got is not None, "the server closed the connection"
        opcode, payload = got
        if opcode == BINARY:
            return msgpack_numpy.unpackb(payload)["actions"]
        assert opcode == 0xA, (opcode, payload)  # a pong for a ping of ours


states = st.lists(st.floats(-1e6, 1e6, width=32), min_size=8, max_size=8).map(lambda v: np.asarray(v, np.float32))
cuts = st.lists(st.integers(0, 10_000), max_size=12)


@SETTINGS
@given(state=states, wire_cuts=cuts, fragment_cuts=cuts, pings=st.booleans())
def test_a_request_split_anywhere_is_answered_as_if_whole(port, state, wire_cuts, fragment_cuts, pings):
    with contextlib.closing(_client(port)) as sock:
        wire = _fragments(_request(state), fragment_cuts, pings)
        for piece in _pieces(wire, wire_cuts):
            sock.sendall(piece)
        assert np.array_equal(_answer(sock), np.tile(state[:7], (10, 1)))


@SETTINGS
@given(state=states, over=st.integers(-3, 3), fragment_cuts=cuts)
def test_a_message_is_answered_up_to_the_limit_and_refused_past_it_before_its_payload(port, state, over, fragment_cuts):
    size = LIMIT + over
    with contextlib.closing(_client(port)) as sock:
        if size <= LIMIT:
            sock.sendall(_fragments(_request(state, size), fragment_cuts, pings=False))
            assert np.array_equal(_answer(sock), np.tile(state[:7], (10, 1)))
        else:
            # Fragments within the limit, then one whose declared size passes it: its header alone is refused.
            first = min(fragment_cuts or [0]) % LIMIT
            sock.sendall(frame(b"\0" * first, fin=False) + frame_header(size - first, opcode=CONT))
            code, reason = closed_with(sock)
            assert code == 1009 and str(LIMIT) in reason, reason


@SETTINGS
@given(data=st.data(), n=st.integers(2, 4))
def test_clients_interleaved_piece_by_piece_each_get_their_own_answer(port, data, n):
    clients = [_client(port) for _ in range(n)]
    try:
        wanted = [data.draw(states) for _ in range(n)]
        queues = [_pieces(frame(_request(s)), data.draw(cuts)) for s in wanted]
        while any(queues):
            i = data.draw(st.sampled_from([k for k, q in enumerate(queues) if q]))
            clients[i].sendall(queues[i].pop(0))
        for sock, state in zip(clients, wanted):
            assert np.array_equal(_answer(sock), np.tile(state[:7], (10, 1)))
    finally:
        for sock in clients:
            sock.close()
