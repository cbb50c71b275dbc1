"""vla-eval's wire (AllenAI's vla-evaluation-harness, `vla-eval` 0.8.0): its frames and its codec.

Read from the harness's released source, written here on our own. Every frame is a msgpack map
`{type, payload, seq, timestamp}`; `type` is one of MESSAGE_TYPES. Inside a payload a numpy array travels as
`{"__ndarray__": True, "data", "dtype", "shape"}` with **str** keys (openpi's wire spells the same with bytes
keys: neither codec reads the other's arrays), and an image (an HxWxC uint8 array with 1, 3 or 4 channels) as
`{"__image__": True, "format": "png" | "jpeg" | "raw", "data", "shape"}` (`raw` adds `dtype`), PNG unless the
sender chose otherwise. Only bool, integer and float arrays are decoded, never pickle.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import numpy as np

MessageType = Literal["hello", "observation", "action", "episode_start", "episode_end", "error"]
MESSAGE_TYPES: tuple[str, ...] = ("hello", "observation", "action", "episode_start", "episode_end", "error")
# The harness's protocol version (its HELLO carries it).
PROTOCOL_VERSION = 1
NDARRAY_KEY = "__ndarray__"
IMAGE_KEY = "__image__"
ImageFormat = Literal["png", "jpeg", "raw"]
# Array kinds decoded: bool, signed and unsigned integers, floats (as the harness allows).
_DECODED_KINDS = frozenset("biuf")


@dataclass(frozen=True)
class Frame:
    """One frame of the wire."""

    type: MessageType
    payload: dict[str, Any]
    seq: int
    timestamp: float


def is_image(array: np.ndarray) -> bool:
    """Whether the wire sends this array as an image: HxWxC uint8 with 1, 3 or 4 channels."""
    return array.ndim == 3 and array.dtype == np.uint8 and array.shape[2] in (1, 3, 4)


def _encode_image(array: np.ndarray, image_format: ImageFormat) -> dict[str, Any]:
    if image_format == "raw":
        return {IMAGE_KEY: True, "format": "raw", "data": array.tobytes(), "dtype": array.dtype.str, "shape": list(array.shape)}
    from PIL import Image

    image = Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)
    buffer = io.BytesIO()
    if image_format == "jpeg":
        if image.mode != "RGB":
            raise ValueError(f"a JPEG image must be RGB, not {image.mode}")
        image.save(buffer, format="JPEG", quality=95)
    else:
        image.save(buffer, format="PNG")
    return {IMAGE_KEY: True, "format": image_format, "data": buffer.getvalue(), "shape": list(array.shape)}


def _encoder(image_format: ImageFormat):
    def encode(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in _DECODED_KINDS:
                raise ValueError(f"the vla-eval wire carries bool, integer and float arrays, not {obj.dtype}")
            if image_format != "raw" and is_image(obj):
                return _encode_image(np.ascontiguousarray(obj), image_format)
            return {NDARRAY_KEY: True, "data": obj.tobytes(), "dtype": obj.dtype.str, "shape": list(obj.shape)}
        if isinstance(obj, np.bool_):
            return bool(obj)
        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        raise TypeError(f"cannot send a {type(obj).__name__} over the vla-eval wire")

    return encode


def _array(data: Any, dtype: Any, shape: Any) -> np.ndarray:
    kind = np.dtype(dtype)
    if kind.kind not in _DECODED_KINDS:
        raise ValueError(f"refused an array of dtype {kind}: the vla-eval wire carries bool, integer and float arrays")
    dims = tuple(int(n) for n in shape)
    if len(data) != kind.itemsize * int(np.prod(dims, dtype=np.int64)):
        raise ValueError(f"an array payload of {len(data)} bytes does not fit {kind}{dims}")
    return np.frombuffer(data, dtype=kind).reshape(dims).copy()


def _decode(obj: dict) -> Any:
    if obj.get(IMAGE_KEY) is True:
        fmt = obj.get("format")
        if fmt == "raw":
            return _array(obj["data"], obj["dtype"], obj["shape"])
        if fmt not in ("png", "jpeg"):
            raise ValueError(f"refused an image of format {fmt!r} (png, jpeg or raw)")
        from PIL import Image

        with Image.open(io.BytesIO(obj["data"])) as image:
            return np.array(image)
    if obj.get(NDARRAY_KEY) is True:
        return _array(obj["data"], obj["dtype"], obj["shape"])
    return obj


def pack_frame(type: MessageType, payload: dict[str, Any], seq: int, image_format: ImageFormat = "png",
               timestamp: float | None = None) -> bytes:
    """One frame's bytes: the envelope around `payload`, its arrays and images encoded."""
    envelope = {"type": type, "payload": payload, "seq": int(seq), "timestamp": time.time() if timestamp is None else timestamp}
    return msgpack.packb(envelope, default=_encoder(image_format), use_bin_type=True)


def unpack_frame(data: bytes) -> Frame:
    """A frame from its bytes; ValueError naming what is wrong with it."""
    try:
        raw = msgpack.unpackb(data, object_hook=_decode, raw=False)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"a frame of {len(data)} bytes is not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"a frame is a msgpack map, not a {type(raw).__name__}")
    missing = [k for k in ("type", "payload", "seq", "timestamp") if k not in raw]
    if missing:
        raise ValueError(f"a frame without {', '.join(missing)} (it has {', '.join(map(str, raw))})")
    if raw["type"] not in MESSAGE_TYPES:
        raise ValueError(f"a frame of unknown type {raw['type']!r} (known: {', '.join(MESSAGE_TYPES)})")
    if not isinstance(raw["payload"], dict):
        raise ValueError(f"a {raw['type']} frame whose payload is a {type(raw['payload']).__name__}, not a map")
    return Frame(type=raw["type"], payload=raw["payload"], seq=int(raw["seq"]), timestamp=float(raw["timestamp"]))


def nested(obs: dict[str, Any]) -> dict[str, Any]:
    """A flat observation with `a/b` keys as the harness nests it (`{"a": {"b": ...}}`): images under `images`."""
    out: dict[str, Any] = {}
    for key, value in obs.items():
        parts = key.split("/")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"observation key {key!r} nests under {part!r}, which is already a value")
            node = child
        if parts[-1] in node:
            raise ValueError(f"observation key {key!r} is given twice")
        node[parts[-1]] = value
    return out
