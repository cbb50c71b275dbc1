"""Query-point arithmetic (DESIGN §2): where the assisted arm asks the VLM."""

from __future__ import annotations


def _positive_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a horizon is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def query_point(horizon: int, interval: int) -> int:
    """First regular policy query step at or after H/2: ceil(H / 2 / C) * C."""
    h = _positive_int("horizon", horizon)
    c = _positive_int("interval", interval)
    # Integer ceiling division: no float rounding at large horizons.
    return -(-h // (2 * c)) * c
