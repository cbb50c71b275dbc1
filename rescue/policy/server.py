"""Serve a policy over openpi's websocket protocol, plus the rescue control messages.

Each connection gets its own policy instance from the factory, so two arms on
two connections never share an RNG or per-episode state. Wire behaviour
follows openpi: metadata frame first, one msgpack reply per request, a server
error is a text frame with the traceback followed by a close.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import WSCloseCode, WSMsgType, web

from rescue.core.identity import STATELESS_KEY
from rescue.core.names import EMBEDDED_POLICY, resolve
from rescue.policy import msgpack_numpy
from rescue.policy.protocol import (
    CONTROL_EXTENSION,
    CONTROL_KEY,
    EPISODE_CONTROL_KEY,
    EPISODE_EXTENSION,
    EPISODE_OPS,
    RNG_EXTENSION,
    Policy,
    SeededPolicy,
)

log = structlog.get_logger(__name__)

DEFAULT_MAX_MSG_SIZE = 64 * 1024 * 1024


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


    def rng_reply(self) -> dict[str, Any]:
        return {
            "digest": self.policy.rng_state(),
            "requests": self.requests,
            "connection_id": self.connection_id,
            "server_instance": self.server_instance,
        }


class PolicyServer:
    """An aiohttp websocket server for a policy factory."""

    def __init__(
        self,
        policy_factory: Callable[[], Policy],
        metadata: dict,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        idle_timeout_s: float | None = None,
        max_msg_size: int = DEFAULT_MAX_MSG_SIZE,
    ) -> None:
        self._factory = policy_factory
        self._metadata = dict(metadata)
        self._host = host
        self._port = port
        self._api_key = api_key
        self._idle_timeout_s = idle_timeout_s
        self._max_msg_size = max_msg_size
        self.instance_id = uuid.uuid4().hex
        self._runner: web.AppRunner | None = None
        self._sockets: set[web.WebSocketResponse] = set()
        self.url: str | None = None
        # Since start: websocket connections accepted, inference requests answered (what a policy process reports).
        self.connections = 0
        self.requests = 0

    async def start(self) -> str:
        """Bind and serve; returns the websocket url (ws://host:port/)."""
        app = web.Application()
        app.router.add_get("/healthz", _healthz)
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"ws://{host}:{port}/"
        log.info("policy_server.started", url=self.url, server_instance=self.instance_id)
        return self.url

    async def stop(self) -> None:
        """Close every connection and stop listening."""
        for ws in list(self._sockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        log.info("policy_server.stopped", server_instance=self.instance_id)

    def _authorized(self, request: web.Request) -> bool:
        if self._api_key is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Api-Key {self._api_key}".encode())

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            raise web.HTTPUnauthorized(text="missing or wrong api key\n")
        # autoping off: pings must reach us so they count as activity for the idle timeout.
        ws = web.WebSocketResponse(autoping=False, max_msg_size=self._max_msg_size, compress=False)
        await ws.prepare(request)
        self._sockets.add(ws)
        self.connections += 1
        try:
            try:
                conn = _Connection(await asyncio.to_thread(self._factory), self.instance_id)
                await ws.send_bytes(msgpack_numpy.packb(self._metadata_for(conn.policy)))
            except Exception:
                await _fail(ws)
                return ws
            log.info("policy_server.connected", connection_id=conn.connection_id)
            await self._serve(ws, conn)
            log.info("policy_server.disconnected", connection_id=conn.connection_id)
        finally:
            self._sockets.discard(ws)
        return ws

    def _metadata_for(self, policy: Policy) -> dict[str, Any]:
        meta = {**self._metadata, CONTROL_EXTENSION: 1, EPISODE_EXTENSION: 1}
        if isinstance(policy, SeededPolicy):
            meta[RNG_EXTENSION] = 1
        return meta

    async def _serve(self, ws: web.WebSocketResponse, conn: _Connection) -> None:
        while True:
            try:
                msg = await ws.receive(timeout=self._idle_timeout_s)
            except asyncio.TimeoutError:
                log.info("policy_server.idle_closed", connection_id=conn.connection_id)
                await ws.close(code=WSCloseCode.GOING_AWAY, message=b"idle timeout")
                return
            if msg.type is WSMsgType.PING:
                await ws.pong(msg.data)
            elif msg.type is WSMsgType.PONG:
                pass
            elif msg.type in (WSMsgType.BINARY, WSMsgType.TEXT):
                start = time.monotonic()
                try:
                    if msg.type is WSMsgType.TEXT:
                        raise ValueError("expected a binary msgpack frame, got text")
                    reply = await self._answer(conn, msgpack_numpy.unpackb(msg.data))
                    await ws.send_bytes(msgpack_numpy.packb(reply))
                except Exception:
                    await _fail(ws, connection_id=conn.connection_id)
                    return
                conn.prev_total_s = time.monotonic() - start
            else:  # close, closing, closed, error
                return

    async def _answer(self, conn: _Connection, request: Any) -> dict[str, Any]:
        if isinstance(request, dict) and CONTROL_KEY in request:
            return await self._control(conn, request)
        if isinstance(request, dict) and EPISODE_CONTROL_KEY in request:
            # An episode marker is never an observation: the policy does not see it.
            return self._episode(conn, request)
        start = time.monotonic()
        # A thread keeps the loop answering pings and other connections meanwhile.
        result = await asyncio.to_thread(conn.policy.infer, request)
        conn.requests += 1
        self.requests += 1
        reply = dict(result)
        reply["server_timing"] = {"infer_ms": (time.monotonic() - start) * 1000}
        if conn.prev_total_s is not None:
            # Like openpi: the previous round trip, since this one's send is not done yet.
            reply["server_timing"]["prev_total_ms"] = conn.prev_total_s * 1000
        return reply

    def _episode(self, conn: _Connection, request: dict) -> dict[str, Any]:
        """Answer openpi's episode_start / episode_end frames (logged, not passed to the policy)."""
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
            log.info("policy_server.episode_start", connection_id=conn.connection_id, **conn.episode)
            return {"ok": True, "ctrl": op, "episodes": conn.episodes, "requests": conn.requests}
        episode, conn.episode = conn.episode, None
        log.info(
            "policy_server.episode_end",
            connection_id=conn.connection_id,
            success=request.get("__success__"),
            episode_id=(episode or {}).get("episode_id"),
        )
        return {"ok": True, "ctrl": op, "episodes": conn.episodes, "requests": conn.requests}

    async def _control(self, conn: _Connection, request: dict) -> dict[str, Any]:
        op = request[CONTROL_KEY]
        if op == "reset":
            await asyncio.to_thread(conn.policy.reset)
            return {"ok": True}
        if not isinstance(conn.policy, SeededPolicy):
            raise ValueError(f"control {op!r}: this policy has no RNG extension")
        if op == "reset_rng":
            seed = int(request["seed"])
            await asyncio.to_thread(conn.policy.reset_rng, seed)
            conn.requests = 0
            log.info("policy_server.reset_rng", connection_id=conn.connection_id, seed=seed)
            return conn.rng_reply()
        if op == "rng_state":
            return conn.rng_reply()
        raise ValueError(f"unknown control message {op!r}")


async def _fail(ws: web.WebSocketResponse, **context: Any) -> None:
    """Send the current exception's traceback as a text frame and close (openpi's error path)."""
    log.warning("policy_server.error", exc_info=True, **context)
    if ws.closed:
        return
    try:
        await ws.send_str(traceback.format_exc())
        await ws.close(
            code=WSCloseCode.INTERNAL_ERROR,
            message=b"Internal server error. Traceback included in previous frame.",
        )
    except ConnectionError:
        pass  # the peer left first; there is no one to tell


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="OK\n")


def load_factory(spec: str) -> Callable[[], Policy]:
    """Import "package.module:attr" and return the policy factory it names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FACTORY, got {spec!r}")
    obj: Any = resolve(spec)
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
        metadata["action_horizon"] = int(horizon)
    observation = getattr(sample, "observation", None)
    if observation is not None:
        metadata["observation"] = str(observation)
    stateless = getattr(sample, "stateless", None)
    if isinstance(stateless, bool):
        metadata[STATELESS_KEY] = stateless  # whether a forked arm may skip replaying the prefix (DESIGN §13)
    return metadata


async def run_forever(server: PolicyServer) -> None:
    """Start server and serve until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = await server.start()
    print(f"serving policy at {url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


# openpi's servers listen on 8000; the local VLM endpoint's default is 8001.
DEFAULT_PORT = 8000


def serve_main(argv: list[str] | None = None) -> int:
    """CLI entry: rescue serve-policy [--policy MODULE:FACTORY] [--host] [--port] [--api-key-env]."""
    parser = argparse.ArgumentParser(
        prog="rescue serve-policy", description=serve_main.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--policy", default=EMBEDDED_POLICY, help="MODULE:FACTORY returning a policy (default: the embedded one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind (0: any free port)")
    parser.add_argument("--api-key-env", help="name of the environment variable holding the api key")
    parser.add_argument("--idle-timeout", type=float, default=None, help="close connections idle this many seconds")
    args = parser.parse_args(argv)

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"environment variable {args.api_key_env} is unset or empty")
    try:
        factory = load_factory(args.policy)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        print(f"rescue serve-policy: --policy {args.policy!r} cannot be loaded: {type(exc).__name__}: "
              f"{' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    server = PolicyServer(
        factory,
        # Clients read the replanning interval and the observation profile from it when declared.
        metadata=policy_metadata(factory, args.policy),
        host=args.host,
        port=args.port,
        api_key=api_key,
        idle_timeout_s=args.idle_timeout,
    )
    try:
        asyncio.run(run_forever(server))
    except OSError as exc:
        print(f"rescue serve-policy: cannot listen on {args.host}:{args.port}: {exc.strerror or exc} "
              "(is another server on that port? choose one with --port)", file=sys.stderr)
        return 2
    return 0
