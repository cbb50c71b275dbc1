"""Serve a policy over openpi's websocket protocol, plus the rescue control messages.

Each connection gets its own policy from the factory (its own RNG stream and
per-episode state); a factory that wraps one loaded model hands every
connection a light session on it. Every call into a policy, the factory's
included, holds one lock of the server, so connections never run the shared
model at once. Wire behaviour follows openpi: metadata frame first, one
msgpack reply per request, a server error is a text frame with the traceback
followed by a close; `GET /healthz` answers without a key. What a client may
hold of the server (a frame's size and time, connections, idleness): limits.py.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import importlib
import logging
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.protocol import State

from rescue_serve import msgpack_numpy
from rescue_serve.limits import (
    DEFAULT_FRAME_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_FRAME,
    BoundedSocket,
    Limits,
)
from rescue_serve.wire import (
    ACTION_HORIZON_KEY,
    CONTROL_EXTENSION,
    CONTROL_KEY,
    EPISODE_CONTROL_KEY,
    EPISODE_EXTENSION,
    EPISODE_OPS,
    OBSERVATION_KEY,
    RNG_EXTENSION,
    STATELESS_KEY,
    Policy,
    SeededPolicy,
)

log = logging.getLogger("rescue_serve")
# The websockets library's own lines (a handshake refused, a connection closed): warnings only, as the old server.
_wire_log = logging.getLogger("rescue_serve.websockets")
_wire_log.setLevel(logging.WARNING)

DEFAULT_MAX_MSG_SIZE = DEFAULT_MAX_FRAME
# openpi's servers listen on 8000; rescue's local VLM endpoint's default is 8001.
DEFAULT_PORT = 8000


def _event(name: str, **fields: Any) -> None:
    log.info("%s %s", name, " ".join(f"{k}={v}" for k, v in fields.items()))


class _IdleTimeout(Exception):
    pass


class _Connection:
    """One websocket's policy and its counters."""

    def __init__(self, policy: Policy, server_instance: str) -> None:
        self.policy = policy
        self.connection_id = uuid.uuid4().hex
        self.server_instance = server_instance
        self.requests = 0  # inference requests since the last reset_rng
        self.prev_total_s: float | None = None
        self.episode: dict[str, Any] | None = None  # the open episode_start's fields
        self.episodes = 0  # episode_start frames received

    def rng_reply(self, digest: str) -> dict[str, Any]:
        return {
            "digest": digest,
            "requests": self.requests,
            "connection_id": self.connection_id,
            "server_instance": self.server_instance,
        }


class PolicyServer:
    """A websocket server for a policy factory (called once per connection)."""

    def __init__(
        self,
        policy_factory: Callable[[], Policy],
        metadata: dict,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        idle_timeout_s: float | None = None,
        max_msg_size: int = DEFAULT_MAX_MSG_SIZE,
        frame_timeout_s: float | None = DEFAULT_FRAME_TIMEOUT_S,
        max_connections: int | None = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self._factory = policy_factory
        self._metadata = dict(metadata)
        self._host = host
        self._port = port
        self._api_key = api_key
        self.limits = Limits(max_frame=max_msg_size, frame_timeout_s=frame_timeout_s,
                             max_connections=max_connections, idle_timeout_s=idle_timeout_s)
        self._lock = threading.Lock()  # one call into the policies at a time, whatever the connection
        self.instance_id = uuid.uuid4().hex
        self._server: Any = None
        self._sockets: set[ServerConnection] = set()
        self.url: str | None = None
        # Since start: websocket connections accepted, inference requests answered (what a policy process reports).
        self.connections = 0
        self.requests = 0

    async def start(self) -> str:
        """Bind and serve; returns the websocket url (ws://host:port/)."""
        self._server = await serve(
            self._handle,
            self._host,
            self._port,
            create_connection=functools.partial(BoundedSocket, frame_timeout_s=self.limits.frame_timeout_s),
            process_request=self._process_request,
            compression=None,
            ping_interval=None,  # the server never pings; clients keep the connection alive
            logger=_wire_log,
            **self.limits.serve_options(),
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        self.url = f"ws://{host}:{port}/"
        _event("policy_server.started", url=self.url, server_instance=self.instance_id)
        return self.url

    async def stop(self) -> None:
        """Close every connection and stop listening."""
        for ws in list(self._sockets):
            await ws.close(CloseCode.GOING_AWAY, "server shutdown")
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        _event("policy_server.stopped", server_instance=self.instance_id)

    async def serve_until_signalled(self) -> None:
        """Start, print the url on stdout, and serve until SIGINT or SIGTERM."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        url = await self.start()
        print(f"serving policy at {url}", flush=True)
        try:
            await stop.wait()
        finally:
            await self.stop()

    def _process_request(self, connection: ServerConnection, request: Any) -> Any:
        """Health needs no key; everything else needs the key when the server has one."""
        if request.path.split("?", 1)[0] == "/healthz":
            return connection.respond(HTTPStatus.OK, "OK\n")
        if self._api_key is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Api-Key {self._api_key}".encode()):
                return connection.respond(HTTPStatus.UNAUTHORIZED, "missing or wrong api key\n")
        return None

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a policy call in a thread (the loop keeps answering pings), holding the server's lock."""

        def locked() -> Any:
            with self._lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    async def _handle(self, ws: BoundedSocket) -> None:
        cap = self.limits.max_connections
        # Open ones only: a connection the server cut (closing, waiting for its peer) holds no slot.
        served = sum(1 for other in self._sockets if other.state is State.OPEN)
        if cap is not None and served >= cap:
            _event("policy_server.refused", reason="server full", connections=served)
            await ws.close(CloseCode.TRY_AGAIN_LATER, self.limits.full_reason())
            return
        self._sockets.add(ws)
        self.connections += 1
        try:
            try:
                conn = _Connection(await self._call(self._factory), self.instance_id)
                await ws.send(msgpack_numpy.packb(self._metadata_for(conn.policy)))
            except ConnectionClosed:
                return
            except Exception:
                await _fail(ws)
                return
            _event("policy_server.connected", connection_id=conn.connection_id)
            await self._serve(ws, conn)
            _event("policy_server.disconnected", connection_id=conn.connection_id)
        finally:
            self._sockets.discard(ws)

    def _metadata_for(self, policy: Policy) -> dict[str, Any]:
        meta = {**self._metadata, CONTROL_EXTENSION: 1, EPISODE_EXTENSION: 1}
        if isinstance(policy, SeededPolicy):
            meta[RNG_EXTENSION] = 1
        return meta

    async def _receive(self, ws: BoundedSocket) -> Any:
        """The next data frame; _IdleTimeout when the peer completed no frame (not even a ping) for the idle
        timeout since the server began waiting on it (bytes of an unfinished frame are no activity)."""
        idle = self.limits.idle_timeout_s
        if idle is None:
            return await ws.recv()
        waiting_since = time.monotonic()
        while True:
            left = max(ws.last_frame, waiting_since) + idle - time.monotonic()
            if left <= 0:
                raise _IdleTimeout
            try:
                return await asyncio.wait_for(ws.recv(), left)  # cancelling recv() loses no frame
            except asyncio.TimeoutError:
                continue

    async def _serve(self, ws: BoundedSocket, conn: _Connection) -> None:
        while True:
            try:
                data = await self._receive(ws)
            except _IdleTimeout:
                _event("policy_server.idle_closed", connection_id=conn.connection_id)
                ws.cut(CloseCode.GOING_AWAY, "idle timeout")
                return
            except ConnectionClosed:
                if ws.cut_reason is not None:
                    _event("policy_server.frame_timeout", connection_id=conn.connection_id)
                return
            start = time.monotonic()
            try:
                if isinstance(data, str):
                    raise ValueError("expected a binary msgpack frame, got text")
                reply = await self._answer(conn, msgpack_numpy.unpackb(data))
                await ws.send(msgpack_numpy.packb(reply))
            except ConnectionClosed:
                return
            except Exception:
                await _fail(ws, connection_id=conn.connection_id)
                return
            conn.prev_total_s = time.monotonic() - start

    async def _answer(self, conn: _Connection, request: Any) -> dict[str, Any]:
        if isinstance(request, dict) and CONTROL_KEY in request:
            return await self._control(conn, request)
        if isinstance(request, dict) and EPISODE_CONTROL_KEY in request:
            # An episode marker is never an observation; an episode's start resets the policy's episode state,
            # as LeRobot's and openpi's loops reset their policy at each episode.
            reply = self._episode(conn, request)
            if reply["ctrl"] == "episode_start":
                await self._call(conn.policy.reset)
            return reply
        start = time.monotonic()
        result = await self._call(conn.policy.infer, request)
        conn.requests += 1
        self.requests += 1
        reply = dict(result)
        reply["server_timing"] = {"infer_ms": (time.monotonic() - start) * 1000}
        if conn.prev_total_s is not None:
            # Like openpi: the previous round trip, since this one's send is not done yet.
            reply["server_timing"]["prev_total_ms"] = conn.prev_total_s * 1000
        return reply

    def _episode(self, conn: _Connection, request: dict) -> dict[str, Any]:
        """Answer openpi's episode_start / episode_end frames (logged, never passed to the policy as an observation)."""
        op = request[EPISODE_CONTROL_KEY]
        if op not in EPISODE_OPS:
            raise ValueError(f"unknown {EPISODE_CONTROL_KEY} message {op!r} (known: {', '.join(EPISODE_OPS)})")
        if op == "episode_start":
            conn.episodes += 1
            conn.episode = {
                "experiment": request.get("__experiment__"),
                "task": request.get("__task__"),
                "episode_id": request.get("__episode_id__"),
            }
            _event("policy_server.episode_start", connection_id=conn.connection_id, **conn.episode)
        else:
            episode, conn.episode = conn.episode, None
            _event(
                "policy_server.episode_end",
                connection_id=conn.connection_id,
                success=request.get("__success__"),
                episode_id=(episode or {}).get("episode_id"),
            )
        return {"ok": True, "ctrl": op, "episodes": conn.episodes, "requests": conn.requests}

    async def _control(self, conn: _Connection, request: dict) -> dict[str, Any]:
        op = request[CONTROL_KEY]
        if op == "reset":
            await self._call(conn.policy.reset)
            return {"ok": True}
        if not isinstance(conn.policy, SeededPolicy):
            raise ValueError(f"control {op!r}: this policy has no RNG extension")
        if op == "reset_rng":
            seed = int(request["seed"])
            await self._call(conn.policy.reset_rng, seed)
            conn.requests = 0
            _event("policy_server.reset_rng", connection_id=conn.connection_id, seed=seed)
            return conn.rng_reply(await self._call(conn.policy.rng_state))
        if op == "rng_state":
            return conn.rng_reply(await self._call(conn.policy.rng_state))
        raise ValueError(f"unknown control message {op!r}")


async def _fail(ws: ServerConnection, **context: Any) -> None:
    """Send the current exception's traceback as a text frame and close (openpi's error path)."""
    log.warning("policy_server.error %s", " ".join(f"{k}={v}" for k, v in context.items()), exc_info=True)
    try:
        await ws.send(traceback.format_exc())
        await ws.close(CloseCode.INTERNAL_ERROR, "Internal server error. Traceback included in previous frame.")
    except ConnectionClosed:
        pass  # the peer left first; there is no one to tell


def import_attr(spec: str) -> Any:
    """The object "package.module:attr.sub" names."""
    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_factory(spec: str, resolve: Callable[[str], Any] = import_attr) -> Callable[[], Policy]:
    """Import "package.module:attr" (through `resolve`) and return the policy factory it names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FACTORY, got {spec!r}")
    obj = resolve(spec)
    if not callable(obj):
        raise TypeError(f"{spec} is not callable")
    return obj


def policy_metadata(factory: Callable[[], object], spec: str, served: bool = False) -> dict:
    """Metadata announced first on every connection: the factory, its action horizon and observation profile;
    `served`: with the RNG extension too where the server announces it (a seeded policy), as a connection sees it."""
    sample = factory()
    metadata: dict = {"policy": spec}
    if served and isinstance(sample, SeededPolicy):
        metadata[RNG_EXTENSION] = 1
    horizon = getattr(sample, "action_horizon", None)
    if horizon is not None:
        metadata[ACTION_HORIZON_KEY] = int(horizon)
    observation = getattr(sample, "observation", None)
    if observation is not None:
        metadata[OBSERVATION_KEY] = str(observation)
    stateless = getattr(sample, "stateless", None)
    if isinstance(stateless, bool):
        metadata[STATELESS_KEY] = stateless  # whether a forked arm may skip replaying the prefix
    return metadata
