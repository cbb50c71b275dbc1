"""Stable sha256 digests for arrays, text and JSON (traces, fingerprints, receipts)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np


def digest_bytes(b: bytes) -> str:
    """Hex sha256 of raw bytes."""
    return hashlib.sha256(b).hexdigest()


def digest_text(s: str) -> str:
    """Hex sha256 of a string's UTF-8 encoding."""
    return digest_bytes(s.encode("utf-8"))


def canonical_json(obj: Any) -> str:
    """The canonical JSON text that digest_json hashes (sorted keys, no spaces)."""
    # NaN/Infinity are not JSON; refusing them keeps digests portable.
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def digest_json(obj: Any) -> str:
    """Hex sha256 of the canonical JSON of obj."""
    return digest_text(canonical_json(obj))


def digest_array(a: Any) -> str:
    """Hex sha256 over an array's dtype, shape and C-order bytes."""
    arr = np.asarray(a)
    if arr.dtype.hasobject:
        # Object arrays hash pointers, not values.
        raise TypeError("cannot digest an object array")
    arr = np.ascontiguousarray(arr)
    h = hashlib.sha256()
    # The header makes equal bytes under another shape or dtype hash differently;
    # JSON keeps it unambiguous where the bytes begin.
    h.update(canonical_json([arr.dtype.str, list(arr.shape)]).encode("utf-8"))
    h.update(b"\n")
    h.update(arr.tobytes(order="C"))
    return h.hexdigest()


def digest_obs(d: Mapping[str, Any]) -> str:
    """Hex sha256 of a dict of arrays: each key with its array digest, keys sorted."""
    return digest_json({str(k): digest_array(v) for k, v in d.items()})
