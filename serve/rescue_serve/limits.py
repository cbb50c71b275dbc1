"""What the policy server holds each client to, so that no client can hold its memory or its connections.

- **A frame's size.** A message whose declared size passes `max_frame` is refused before its payload is read
  (the websockets library's own `max_size`: close code 1009, "message too big").
- **A frame's time.** Once the first byte of a frame (of a fragmented message: of its first fragment) has come,
  the whole must come within `frame_timeout_s`; else the connection is closed with code 1008 and the reason, and
  what it had sent is let go. A client that sends most of a frame and stops, or trickles one, holds nothing for
  long. The library stops reading a client once more than one frame waits for the server (`max_queue`), so a
  client that sends many frames without waiting for the answers holds a few at most.
- **Connections.** At most `max_connections` at once; one more is closed with code 1013 ("try again later") and
  the reason, before its policy is built.
- **Idleness.** `idle_timeout_s` counts complete frames only (a ping is one), from when the server last waited
  on the client: bytes of an unfinished frame are not activity.

Worst case, the server holds a few times `max_connections` x `max_frame` of its clients' frames (per connection:
the message being answered and its decoded copy, two waiting, part of the next), a partial one for at most
`frame_timeout_s` (docs/own-vla.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.frames import DATA_OPCODES, CloseCode, Frame
from websockets.protocol import State

DEFAULT_MAX_FRAME = 64 * 1024 * 1024
DEFAULT_FRAME_TIMEOUT_S = 30.0
# A study opens a connection per arm of each case in flight (4 cases x up to 64 arms by default).
DEFAULT_MAX_CONNECTIONS = 256
# The library pauses reading a client once more than this many frames wait for the server: a client sends one
# request at a time (openpi's protocol), and each frame waiting may hold `max_frame`.
READ_AHEAD = 1


@dataclass(frozen=True)
class Limits:
    """The bounds of every connection; None: no bound."""

    max_frame: int = DEFAULT_MAX_FRAME
    """Bytes of one message at most; a larger declared size is refused before it is read (close 1009)."""
    frame_timeout_s: float | None = DEFAULT_FRAME_TIMEOUT_S
    """Seconds from a frame's first byte to its last at most (close 1008)."""
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS
    """Connections served at once at most; one more is closed with 1013."""
    idle_timeout_s: float | None = None
    """Seconds without a complete frame, while the server waits on the client, at most (close 1001)."""

    def serve_options(self) -> dict[str, Any]:
        """The websockets library's own limits, as `serve()` takes them."""
        return {"max_size": self.max_frame, "max_queue": READ_AHEAD, "open_timeout": 10}

    def full_reason(self) -> str:
        """The reason a connection past `max_connections` is closed with."""
        return f"server full: {self.max_connections} connections at once (--max-connections)"


class BoundedSocket(ServerConnection):
    """A server connection that knows when its peer last completed a frame, and closes it when a frame stays
    unfinished past the frame timeout."""

    def __init__(self, *args: Any, frame_timeout_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.frame_timeout_s = frame_timeout_s
        self.last_frame = time.monotonic()
        self.unfinished_since: float | None = None  # the first byte of the frame (message) still incomplete
        self.cut_reason: str | None = None  # why the server cut it (the frame or the idle timeout)
        self._fragmented = False  # a message's first fragments came, not its last
        self._completed = False  # a message or a control frame completed in the bytes just received
        self._timer: Any = None
        self._closing: Any = None  # the close task the frame timeout started (held, so it runs to its end)

    def data_received(self, data: bytes) -> None:
        self._completed = False
        super().data_received(data)
        if self.protocol.state is not State.OPEN:
            self._clock(None)  # the handshake has the library's open_timeout; a closing socket, close_timeout
        elif self.protocol.reader.buffer or self._fragmented:  # bytes of a frame the parser still waits for
            if self.unfinished_since is None or self._completed:
                self._clock(time.monotonic())
        else:
            self._clock(None)

    def process_event(self, event: Any) -> None:
        super().process_event(event)
        if isinstance(event, Frame):
            self.last_frame = time.monotonic()
            if event.opcode in DATA_OPCODES:
                self._fragmented = not event.fin
                self._completed = event.fin
            elif not self._fragmented:
                self._completed = True  # a control frame between a message's fragments completes nothing

    def connection_lost(self, exc: Exception | None) -> None:
        self._clock(None)
        super().connection_lost(exc)

    def _clock(self, since: float | None) -> None:
        """Start (or stop, None) the clock of the unfinished frame."""
        self.unfinished_since = since
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if since is not None and self.frame_timeout_s is not None:
            self._timer = self.loop.call_later(self.frame_timeout_s, self._overdue)

    def cut(self, code: CloseCode, reason: str) -> None:
        """Close with `code` and `reason` now, letting go of any unfinished frame at once."""
        if self.protocol.state is not State.OPEN:
            return
        self.cut_reason = reason
        self._clock(None)
        # As the library fails a connection itself (a frame too big): the close frame goes out and the unfinished
        # bytes are dropped now, not when the peer answers; close() then gives the peer close_timeout to go.
        self.protocol.fail(code, reason)
        self.send_data()
        self._closing = self.loop.create_task(self.close())

    def _overdue(self) -> None:
        self._timer = None
        self.cut(CloseCode.POLICY_VIOLATION,
                 f"frame not complete {self.frame_timeout_s:g} s after its first byte (--frame-timeout)")
