"""msgpack with numpy arrays, byte-compatible with openpi's wire encoding.

An ndarray travels as {b"__ndarray__": True, b"data", b"dtype", b"shape"} and a
numpy scalar as {b"__npgeneric__": True, b"data", b"dtype"}. Object, void and
complex dtypes are refused both ways, so nothing is ever unpickled or built
from an untrusted type description.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

# Object arrays would need pickle; void covers structured/opaque records;
# complex has no msgpack scalar. openpi refuses the same kinds.
_REFUSED_KINDS = ("V", "O", "c")


def _check_dtype(dtype: np.dtype) -> np.dtype:
    if dtype.kind in _REFUSED_KINDS:
        raise ValueError(f"Unsupported dtype: {dtype}")
    return dtype


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        _check_dtype(obj.dtype)
        return {
            b"__ndarray__": True,
            b"data": obj.tobytes(),  # C order, whatever the memory layout
            b"dtype": obj.dtype.str,
            b"shape": obj.shape,
        }
    if isinstance(obj, np.generic):
        _check_dtype(obj.dtype)
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def _decode(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        dtype = _check_dtype(np.dtype(obj[b"dtype"]))
        shape = tuple(int(n) for n in obj[b"shape"])
        data = obj[b"data"]
        if len(data) != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"ndarray payload of {len(data)} bytes does not fit {dtype}{shape}")
        # Copy so the receiver owns a writable array, not a view of the frame.
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    if b"__npgeneric__" in obj:
        dtype = _check_dtype(np.dtype(obj[b"dtype"]))
        return dtype.type(obj[b"data"])
    return obj


def packb(obj: Any) -> bytes:
    """Serialise obj (dicts, lists, scalars, ndarrays) to msgpack bytes."""
    return msgpack.packb(obj, default=_encode)


def unpackb(data: bytes) -> Any:
    """Deserialise msgpack bytes, rebuilding ndarrays and numpy scalars."""
    return msgpack.unpackb(data, object_hook=_decode)
