"""Hostile clients against the policy server, with real sockets, through both commands (`rescue serve-policy` and
`rescue-serve policy`): a client that stops inside a large frame, one that trickles a frame, one too many
connections, a frame declared too big. Each is closed with a code and a reason and lets go of what it held;
a normal client beside them is served throughout."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import HANG_S, ROOT, ensure_stopped, free_port, wait_healthy
from raw_websocket import closed_with, frame_header, open_websocket, read_frame

from rescue.policy.client import PolicyConnectionClosed, WebsocketPolicyClient

pytestmark = pytest.mark.fast

MIB = 1 << 20
POLICY = "identity_policies:make_echo_policy"
COMMANDS = {
    "rescue serve-policy": [sys.executable, "-m", "rescue.cli", "serve-policy", "--policy", POLICY],
    "rescue-serve policy": [sys.executable, "-m", "rescue_serve.cli", "policy", POLICY],
}


@contextlib.contextmanager
def _server(command: str, *flags: str) -> Iterator[tuple[int, subprocess.Popen]]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.Popen([*COMMANDS[command], "--port", str(port), *flags], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_healthy(port, command, proc)
        yield port, proc
    finally:
        ensure_stopped(proc)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_S  # bounds a hang, never a claim about speed
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.05)


def _normal_client_answers(port: int, clients: int = 1) -> None:
    """`clients` connections of the project's own client, each answered (its state echoed) twice."""
    async def main() -> None:
        url = f"ws://127.0.0.1:{port}/"
        held = [await WebsocketPolicyClient.connect(url, connect_timeout_s=HANG_S) for _ in range(clients)]
        for i, client in enumerate(held * 2):
            state = np.full(8, i, dtype=np.float32)
            assert np.array_equal((await client.infer({"state": state}))["actions"], np.tile(state[:7], (10, 1)))
        for client in held:
            await client.close()

    asyncio.run(main())


def _connected(port: int) -> object:
    sock = open_websocket(port, timeout=HANG_S)
    assert read_frame(sock)[0] == 0x2  # the metadata frame
    return sock


@pytest.mark.parametrize("command", COMMANDS)
def test_a_client_that_stops_inside_a_large_frame_is_closed_and_its_bytes_let_go(command):
    # 60 MiB of a 61 MiB frame (under the 64 MiB limit), then nothing: before, the server held the 60 MiB for as
    # long as the client kept the socket open.
    with _server(command, "--frame-timeout", "3") as (port, proc):
        _normal_client_answers(port)
        before = _rss_mib(proc.pid)
        hostile = _connected(port)
        hostile.sendall(frame_header(61 * MIB))
        hostile.sendall(bytes(60 * MIB))
        _until(lambda: _rss_mib(proc.pid) > before + 50, "the server read the 60 MiB")
        _normal_client_answers(port)  # served beside it
        code, reason = closed_with(hostile)
        assert (code, reason) == (1008, "frame not complete 3 s after its first byte (--frame-timeout)")
        _until(lambda: _rss_mib(proc.pid) < before + 20, "the server let the 60 MiB go")
        hostile.close()
        _normal_client_answers(port)


def _trickle(sock, stop: threading.Event) -> None:
    """100 bytes every 0.1 s into the frame until the server closes it."""
    with contextlib.suppress(OSError):
        while not stop.is_set():
            sock.sendall(b"x" * 100)
            time.sleep(0.1)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flags,closed", [
    (("--frame-timeout", "3"), (1008, "frame not complete 3 s after its first byte (--frame-timeout)")),
    # Bytes of an unfinished frame are no activity: before, any byte kept the connection open.
    (("--idle-timeout", "3"), (1001, "idle timeout")),
])
def test_a_client_trickling_into_a_frame_announcing_60_mb_is_closed(command, flags, closed):
    with _server(command, *flags) as (port, proc):
        hostile = _connected(port)
        hostile.sendall(frame_header(60_000_000))
        stop = threading.Event()
        trickler = threading.Thread(target=_trickle, args=(hostile, stop), daemon=True)
        trickler.start()
        try:
            _normal_client_answers(port)
            assert closed_with(hostile) == closed
        finally:
            stop.set()
            trickler.join()
            hostile.close()
        _normal_client_answers(port)


@pytest.mark.parametrize("command", COMMANDS)
def test_connections_past_the_cap_are_closed_with_a_code_and_a_reason(command):
    with _server(command, "--max-connections", "2") as (port, proc):
        first, second = _connected(port), _connected(port)
        third = open_websocket(port, timeout=HANG_S)
        assert closed_with(third) == (1013, "server full: 2 connections at once (--max-connections)")
        third.close()

        async def refused() -> str:
            with pytest.raises(PolicyConnectionClosed) as info:
                await WebsocketPolicyClient.connect(f"ws://127.0.0.1:{port}/", connect_timeout_s=HANG_S)
            return str(info.value)

        # The project's own client says why.
        assert "server full: 2 connections at once (--max-connections)" in asyncio.run(refused())
        first.close()
        _until(lambda: _served_one(port), "a connection is served once one of the two left")
        second.close()
        _normal_client_answers(port, clients=2)
    assert "policy_server.refused" in proc.stderr.read().decode()


def _served_one(port: int) -> bool:
    try:
        _normal_client_answers(port)
    except PolicyConnectionClosed:
        return False
    return True


@pytest.mark.parametrize("command", COMMANDS)
def test_a_frame_declared_above_the_limit_is_refused_before_it_is_read(command):
    with _server(command, "--max-frame-mb", "1") as (port, proc):
        hostile = _connected(port)
        hostile.sendall(frame_header(MIB + 1))  # the header only: the refusal cannot wait for the payload
        code, reason = closed_with(hostile)
        assert code == 1009 and str(MIB + 1) in reason and str(MIB) in reason, reason
        hostile.close()
        _normal_client_answers(port)


@pytest.mark.parametrize("flag,value", [("--max-connections", "0"), ("--frame-timeout", "nan"),
                                        ("--max-frame-mb", "-1"), ("--idle-timeout", "inf")])
def test_a_limit_that_bounds_nothing_is_refused(flag, value):
    out = subprocess.run([*COMMANDS["rescue-serve policy"], flag, value, "--port", str(free_port())], cwd=ROOT,
                         capture_output=True, text=True, timeout=HANG_S,  # a server that starts is a failure
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    assert out.returncode == 2 and f"{flag}: must be a finite number above 0, got {value!r}" in out.stderr


def test_the_limits_are_said_in_help():
    for command in COMMANDS.values():
        text = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        text = " ".join(text.split())
        for said in ("--max-connections MAX_CONNECTIONS connections served at once",
                     "(default: 256)", "--frame-timeout", "(default: 30.0)", "--max-frame-mb", "(default: 64.0)"):
            assert said in text, said
