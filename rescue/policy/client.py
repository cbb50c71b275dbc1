"""An asyncio client for openpi-protocol policy servers, with the rescue extensions.

A background reader answers the server's pings at once, so a connection held
idle for a long VLM wait is not dropped by servers that ping (openpi's does).
Requests are strictly one at a time; the reply to a request is the next data
frame. Frames are msgpack with numpy arrays, never pickle.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import aiohttp
import structlog
from aiohttp import WSMsgType
from rescue_serve import msgpack_numpy
from rescue_serve.wire import CONTROL_EXTENSION, CONTROL_KEY, EPISODE_CONTROL_KEY, EPISODE_EXTENSION, RNG_EXTENSION

from rescue.policy.protocol import RngState

log = structlog.get_logger(__name__)

DEFAULT_MAX_MSG_SIZE = 64 * 1024 * 1024
_CLOSED_TYPES = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR)


class PolicyServerError(RuntimeError):
    """The server reported an error; the message is its traceback."""


class PolicyConnectionClosed(ConnectionError):
    """The connection to the policy server is gone."""


class WebsocketPolicyClient:
    """One websocket connection to a policy server. Use `await WebsocketPolicyClient.connect(url)`."""

    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse, url: str) -> None:
        self._session = session
        self._ws = ws
        self.url = url
        self._metadata: dict[str, Any] = {}
        self._inbox: asyncio.Queue[aiohttp.WSMessage] = asyncio.Queue()
        self._pong: asyncio.Future[None] | None = None
        self._lock = asyncio.Lock()
        self._closed_reason: str | None = None
        self._reader = asyncio.create_task(self._read_loop())

    @classmethod
    async def connect(
        cls,
        url: str,
        api_key: str | None = None,
        connect_timeout_s: float = 30.0,
        max_msg_size: int = DEFAULT_MAX_MSG_SIZE,
    ) -> WebsocketPolicyClient:
        """Connect, retrying only while the port refuses (server still starting), and read the metadata."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout_s
        headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
        session = aiohttp.ClientSession()
        delay = 0.05
        try:
            while True:
                try:
                    ws = await session.ws_connect(
                        cls._ws_url(url),
                        headers=headers,
                        max_msg_size=max_msg_size,
                        autoping=False,  # the reader answers pings and watches for our pongs
                        compress=0,
                        timeout=aiohttp.ClientWSTimeout(ws_close=10.0),
                    )
                    break
                except aiohttp.ClientConnectorError as exc:
                    # Anything but a refusal (auth, DNS, handshake) will not fix itself.
                    if not isinstance(exc.os_error, ConnectionRefusedError):
                        raise
                    if loop.time() + delay > deadline:
                        raise
                    log.debug("policy.connect_retry", url=url, delay_s=delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
            client = cls(session, ws, url)
        except BaseException:
            await session.close()
            raise
        try:
            metadata = await asyncio.wait_for(client._handshake(), max(deadline - loop.time(), 1.0))
        except BaseException:
            await client.close()
            raise
        client._metadata = metadata
        log.info("policy.connected", url=url, supports_rng=client.supports_rng)
        return client

    @classmethod
    def _ws_url(cls, url: str) -> str:
        """The websocket URL to open for `url` (a wire of its own may spell its URLs otherwise)."""
        return url

    async def _handshake(self) -> dict[str, Any]:
        """What the server says first: openpi's metadata frame."""
        return await self._next_reply()

    @property
    def metadata(self) -> dict[str, Any]:
        """The metadata frame the server sent first."""
        return self._metadata

    @property
    def supports_rng(self) -> bool:
        """Whether the server announced the RNG extension."""
        return bool(self._metadata.get(RNG_EXTENSION))

    @property
    def supports_episode_control(self) -> bool:
        """Whether the server announced that it answers openpi's episode_start/episode_end frames."""
        return bool(self._metadata.get(EPISODE_EXTENSION))

    @property
    def closed(self) -> bool:
        """True once the connection is gone (closed by either side)."""
        return self._closed_reason is not None or self._ws.closed

    async def infer(self, obs: dict) -> dict:
        """Send one observation; return the reply dict (with "actions")."""
        return await self._request(obs)

    async def reset(self) -> None:
        """Reset the server-side policy when supported (plain openpi has nothing to reset)."""
        if self._metadata.get(CONTROL_EXTENSION):
            await self._request({CONTROL_KEY: "reset"})

    async def reset_rng(self, seed: int) -> None:
        """Reset this connection's policy RNG to seed; the server's request counter restarts."""
        if not self.supports_rng:
            raise NotImplementedError("the policy server does not support the RNG extension")
        await self._request({CONTROL_KEY: "reset_rng", "seed": int(seed)})

    async def rng_state(self) -> RngState | None:
        """Read the RNG state without advancing it; None when the server lacks the extension."""
        if not self.supports_rng:
            return None
        return RngState.model_validate(await self._request({CONTROL_KEY: "rng_state"}))

    async def episode_start(self, experiment: str, task: str, episode_id: str, task_info: dict | None = None) -> dict | None:
        """Send openpi's episode_start frame when the server announced it; else nothing (returns None).

        A plain openpi server would hand the frame to its policy as an observation. `task_info` (the episode's
        suite, task id and initial state) is for wires that carry it; openpi's frame does not.
        """
        if not self.supports_episode_control:
            return None
        return await self._request(
            {
                EPISODE_CONTROL_KEY: "episode_start",
                "__experiment__": str(experiment),
                "__task__": str(task),
                "__episode_id__": str(episode_id),
            }
        )

    async def episode_end(self, success: bool | None) -> dict | None:
        """Send openpi's episode_end frame when the server announced it; else nothing (returns None)."""
        if not self.supports_episode_control:
            return None
        return await self._request({EPISODE_CONTROL_KEY: "episode_end", "__success__": success})

    async def keepalive(self, pong_timeout_s: float = 10.0) -> RngState | None:
        """Prove the connection alive without inference: an RNG probe when supported, else a ping."""
        start = time.monotonic()
        if self.supports_rng:
            state = await self.rng_state()
            assert state is not None
            log.info(
                "policy.keepalive",
                mode="rng_state",
                digest=state.digest,
                requests=state.requests,
                connection_id=state.connection_id,
                rtt_ms=(time.monotonic() - start) * 1000,
            )
            return state
        async with self._lock:
            self._raise_if_closed()
            self._pong = asyncio.get_running_loop().create_future()
            try:
                await self._ws.ping(os.urandom(8))
                await asyncio.wait_for(self._pong, pong_timeout_s)
            except (ConnectionError, aiohttp.ClientError) as exc:
                raise PolicyConnectionClosed(f"keepalive ping failed: {exc}") from exc
            finally:
                self._pong = None
        log.info("policy.keepalive", mode="ping", rtt_ms=(time.monotonic() - start) * 1000)
        return None

    async def close(self) -> None:
        """Close the connection and its session."""
        self._reader.cancel()
        try:
            await self._reader
        except (asyncio.CancelledError, Exception):
            pass
        await self._ws.close()
        await self._session.close()

    async def __aenter__(self) -> WebsocketPolicyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(self, payload: dict) -> dict:
        data = msgpack_numpy.packb(payload)
        async with self._lock:
            self._raise_if_closed()
            try:
                await self._ws.send_bytes(data)
            except (ConnectionError, aiohttp.ClientError) as exc:
                raise PolicyConnectionClosed(f"send failed: {exc}") from exc
            return await self._next_reply()

    async def _next_reply(self) -> Any:
        msg = await self._inbox.get()
        if msg.type is WSMsgType.BINARY:
            return msgpack_numpy.unpackb(msg.data)
        if msg.type is WSMsgType.TEXT:
            # openpi's convention: a text frame is the server's traceback, then it closes.
            self._closed_reason = "server error"
            raise PolicyServerError(f"Error in policy server:\n{msg.data}")
        self._inbox.put_nowait(msg)  # leave the close visible to later calls
        self._raise_if_closed()
        raise PolicyConnectionClosed(f"unexpected frame {msg.type!r}")

    def _raise_if_closed(self) -> None:
        if self._closed_reason is not None:
            raise PolicyConnectionClosed(f"connection to {self.url} closed: {self._closed_reason}")
        if self._ws.closed:
            raise PolicyConnectionClosed(f"connection to {self.url} closed")

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self._ws.receive()
                if msg.type is WSMsgType.PING:
                    await self._ws.pong(msg.data)
                elif msg.type is WSMsgType.PONG:
                    if self._pong is not None and not self._pong.done():
                        self._pong.set_result(None)
                else:
                    if msg.type in _CLOSED_TYPES:
                        # The server's reason, when it gave one (a limit it holds clients to says which).
                        why = f": {msg.extra}" if msg.type is WSMsgType.CLOSE and msg.extra else ""
                        self._closed_reason = f"{msg.type.name.lower()} (code {self._ws.close_code}{why})"
                        self._fail_pong()
                    self._inbox.put_nowait(msg)
                    if msg.type in _CLOSED_TYPES:
                        return
        except Exception as exc:
            self._closed_reason = f"reader failed: {exc!r}"
            self._fail_pong()
            self._inbox.put_nowait(aiohttp.WSMessage(WSMsgType.ERROR, exc, None))

    def _fail_pong(self) -> None:
        if self._pong is not None and not self._pong.done():
            self._pong.set_exception(PolicyConnectionClosed(f"connection closed: {self._closed_reason}"))
