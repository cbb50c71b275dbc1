"""A policy connection that speaks vla-eval's wire to any of its model servers (`vla-eval+ws://host:port`).

The client speaks first (HELLO, answered by the server's HELLO with `observation_params`, `action_spec`,
`observation_spec`); then one observation frame per env step, each answered by one action frame carrying the
same `seq`, or by an `error` frame with the server's words (the connection stays open). `episode_start` and
`episode_end` go as the harness's LIBERO runner sends them and are not answered, but a failed
`episode_start` is: its `error` frame arrives before the next action.

Such a server keeps a chunk buffer per session (per connection) and plays it out one action per observation (a
`PredictModelServer` predicts every `chunk_size` observations and drops the buffer at episode start and end),
so an arm runs it stepwise: `stepwise` is true and every reply holds one action. It has no RNG control. The
connection's reader, pings and close are the openpi client's.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import numpy as np
from aiohttp import WSMsgType

from rescue.policy.client import PolicyConnectionClosed, PolicyServerError, WebsocketPolicyClient
from rescue_serve.wire import EPISODE_EXTENSION
from rescue.policy.vla_eval_wire import PROTOCOL_VERSION, Frame, nested, pack_frame, unpack_frame

SCHEME = "vla-eval+"
# The wire's name in the metadata this client presents (rescue.policy.wires reads it).
WIRE = "vla-eval"
# The harness benchmark whose observations the vla-eval-libero profile shapes (named in our HELLO).
LIBERO_BENCHMARK = "vla_eval.benchmarks.libero.benchmark:LIBEROBenchmark"


class VlaEvalError(PolicyServerError):
    """The vla-eval server answered an `error` frame; the message carries its words."""


def websocket_url(url: str) -> str:
    """The plain ws:// (wss://) URL of a `vla-eval+ws://` one."""
    return url.removeprefix(SCHEME)


def http_url(url: str, path: str) -> str:
    """The HTTP URL of `path` on the server's port (`/health`, `/config`)."""
    ws = websocket_url(url)
    base = "https://" + ws.removeprefix("wss://") if ws.startswith("wss://") else "http://" + ws.removeprefix("ws://")
    return base.rstrip("/") + path


async def health(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """`GET /health` of a vla-eval server: its JSON answer (`{"status": "ok"}` once its model is loaded)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(http_url(url, "/health"), timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            response.raise_for_status()
            return await response.json(content_type=None)


def metadata_of(hello: dict[str, Any]) -> dict[str, Any]:
    """What a study reads from a server's HELLO, in the keys every policy connection's metadata uses: the wire,
    the model server's class as `policy`, the HELLO's `observation_params`, and the whole HELLO."""
    return {"wire": WIRE, "policy": str(hello.get("model_server", "")),
            "observation_params": dict(hello.get("observation_params") or {}), EPISODE_EXTENSION: True,
            "vla_eval_hello": dict(hello)}


class VlaEvalPolicyClient(WebsocketPolicyClient):
    """One connection (one session) to a vla-eval model server. Use `await VlaEvalPolicyClient.connect(url)`."""

    stepwise = True

    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse, url: str) -> None:
        super().__init__(session, ws, url)
        self._seq = 0
        self._pending_start: int | None = None  # seq of an episode_start whose error may still come
        self._steps = 0

    @classmethod
    def _ws_url(cls, url: str) -> str:
        return websocket_url(url)

    async def _handshake(self) -> dict[str, Any]:
        """Our HELLO first, then the server's: its payload as `metadata_of` presents it."""
        hello = {"protocol_version": PROTOCOL_VERSION, "client": "vlm-rescue", "benchmark": LIBERO_BENCHMARK}
        return metadata_of((await self._exchange("hello", hello)).payload)

    @property
    def supports_rng(self) -> bool:
        """Never: the wire has no RNG control."""
        return False

    async def infer(self, obs: dict) -> dict:
        """One observation (flat keys; `images/agentview` travels nested) for one action: the reply's `actions`
        is that action as a chunk of one."""
        frame = await self._exchange("observation", nested(obs))
        self._steps += 1
        payload = dict(frame.payload)
        actions = np.asarray(payload.get("actions", payload.get("action")))
        if actions.ndim == 2 and actions.shape[0] != 1:
            raise VlaEvalError(f"the vla-eval server at {self.url} answered one observation with a chunk of shape "
                               f"{actions.shape}: the harness runs one action per observation (a server buffers its "
                               "chunk: give it a chunk_size)")
        payload["actions"] = actions[None, :] if actions.ndim == 1 else actions
        return payload

    async def reset(self) -> None:
        """Nothing to send: the server forgets an episode at `episode_start`."""

    async def reset_rng(self, seed: int) -> None:
        """The wire has no RNG control."""
        raise NotImplementedError("a vla-eval server gives no RNG control")

    async def episode_start(self, experiment: str, task: str, episode_id: str, task_info: dict | None = None) -> dict:
        """`episode_start` as the harness's runner sends it: `{"task": {name, suite, task_id, episode_idx}}`
        (the name is the instruction, the rest `task_info`'s). The server drops the session's chunk buffer."""
        async with self._lock:
            self._raise_if_closed()
            self._pending_start = await self._send("episode_start", {"task": {"name": task, **(task_info or {})}})
        self._steps = 0
        return {}

    async def episode_end(self, success: bool | None) -> dict:
        """`episode_end` with the episode's metrics and steps (no metrics after an arm that failed)."""
        metrics = {} if success is None else {"success": bool(success)}
        async with self._lock:
            self._raise_if_closed()
            await self._send("episode_end", {"metrics": metrics, "steps": self._steps})
        return {}

    async def _send(self, kind: str, payload: dict) -> int:
        self._seq += 1
        try:
            await self._ws.send_bytes(pack_frame(kind, payload, self._seq))  # type: ignore[arg-type]
        except (ConnectionError, aiohttp.ClientError) as exc:
            raise PolicyConnectionClosed(f"send to {self.url} failed: {exc}") from exc
        return self._seq

    async def _exchange(self, kind: str, payload: dict) -> Frame:
        """Send a frame and read the server's answer to it (`hello` for `hello`, `action` for `observation`)."""
        async with self._lock:
            self._raise_if_closed()
            seq = await self._send(kind, payload)
            frame = await self._next_frame()
            if frame.type == "error":
                started, self._pending_start = self._pending_start, None
                what = "episode_start" if frame.seq == started else kind
                raise VlaEvalError(f"the vla-eval server at {self.url} answered {what} with an error: "
                                   f"{frame.payload.get('error', frame.payload)}")
            wanted = "hello" if kind == "hello" else "action"
            if frame.seq != seq or frame.type != wanted:
                raise PolicyConnectionClosed(f"the vla-eval server at {self.url} answered {kind} {seq} with "
                                             f"{frame.type} {frame.seq}, not {wanted} {seq}")
            self._pending_start = None
            return frame

    async def _next_frame(self) -> Frame:
        msg = await self._inbox.get()
        if msg.type is WSMsgType.BINARY:
            try:
                return unpack_frame(msg.data)
            except ValueError as exc:
                raise PolicyConnectionClosed(f"the vla-eval server at {self.url} sent a bad frame: {exc}") from None
        if msg.type is WSMsgType.TEXT:
            raise PolicyConnectionClosed(f"the vla-eval server at {self.url} sent a text frame: {str(msg.data)[:200]}")
        self._inbox.put_nowait(msg)  # the close stays visible to later calls
        self._raise_if_closed()
        raise PolicyConnectionClosed(f"unexpected frame {msg.type!r}")
