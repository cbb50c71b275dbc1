"""A websocket client that speaks frame by frame over a plain socket, for clients a library would never be:
one that stops in the middle of a frame, one that trickles a frame's bytes, one that splits a frame anywhere.

    sock = open_websocket(port)            # the opening handshake; the server's metadata frame is next
    sock.sendall(frame_header(61 << 20))   # announce 61 MiB ...
    sock.sendall(bytes(60 << 20))          # ... send 60 and stop
    closed_with(sock)                      # (code, reason) of the server's close frame, or None at EOF

Frames are masked with the key 0 (the payload goes out as it is; RFC 6455 asks a client for a random key, a
server cannot tell). Used by tests/test_hostile_clients.py, tests/test_framing_properties.py and
benchmarks/hostile_clients.py.
"""

from __future__ import annotations

import base64
import os
import socket
import struct

BINARY, CLOSE, PING = 0x2, 0x8, 0x9


def open_websocket(port: int, host: str = "127.0.0.1", timeout: float | None = None) -> socket.socket:
    """A socket past the opening handshake with ws://HOST:PORT/ (AssertionError when the server refuses it)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            raise AssertionError(f"the server closed during the handshake: {head!r}")
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def frame_header(length: int, opcode: int = BINARY, fin: bool = True) -> bytes:
    """The header of a masked client frame announcing `length` payload bytes (mask key 0)."""
    first = (0x80 if fin else 0) | opcode
    if length < 126:
        size = struct.pack("!B", 0x80 | length)
    elif length < 1 << 16:
        size = struct.pack("!BH", 0x80 | 126, length)
    else:
        size = struct.pack("!BQ", 0x80 | 127, length)
    return struct.pack("!B", first) + size + b"\0\0\0\0"


def frame(payload: bytes, opcode: int = BINARY, fin: bool = True) -> bytes:
    """A whole masked client frame."""
    return frame_header(len(payload), opcode, fin) + payload


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """The server's next frame (opcode, payload; servers never mask), or None at EOF."""
    head = _exactly(sock, 2)
    if head is None:
        return None
    length = head[1] & 0x7F
    if length == 126:
        length = struct.unpack("!H", _exactly(sock, 2) or b"\0\0")[0]
    elif length == 127:
        length = struct.unpack("!Q", _exactly(sock, 8) or bytes(8))[0]
    payload = _exactly(sock, length)
    return None if payload is None else (head[0] & 0x0F, payload)


def closed_with(sock: socket.socket) -> tuple[int, str] | None:
    """Read until the server's close frame: its (code, reason); None when the connection ends without one."""
    while True:
        try:
            got = read_frame(sock)
        except (ConnectionResetError, BrokenPipeError):
            return None
        if got is None:
            return None
        opcode, payload = got
        if opcode == CLOSE:
            code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
            return code, payload[2:].decode(errors="replace")
