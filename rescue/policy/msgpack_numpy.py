"""msgpack with numpy arrays: the serving distribution's codec (rescue_serve.msgpack_numpy), one source for both sides."""

from rescue_serve.msgpack_numpy import packb, unpackb

__all__ = ["packb", "unpackb"]
