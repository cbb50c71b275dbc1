"""Query-point arithmetic (DESIGN §2): where the assisted arm asks the VLM."""

from __future__ import annotations

from fractions import Fraction


def _positive_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a horizon is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def query_point(horizon: int, interval: int, fraction: float | Fraction = Fraction(1, 2)) -> int:
    """First regular policy query step at or after fraction * H: ceil(f * H / C) * C (the pre-registered query
    point is f = 1/2, DESIGN §2; a declared extra one any 0 < f < 1, DESIGN §14)."""
    h = _positive_int("horizon", horizon)
    c = _positive_int("interval", interval)
    f = as_fraction(fraction)
    # Integer ceiling division on the fraction's own terms: no float rounding at large horizons.
    return -(-(f.numerator * h) // (f.denominator * c)) * c


def as_fraction(value: float | Fraction) -> Fraction:
    """A query point's fraction of the horizon, exactly (0.25 is 1/4, not its binary neighbour); 0 < f < 1."""
    f = value if isinstance(value, Fraction) else Fraction(str(value)).limit_denominator(10**6)
    if not 0 < f < 1:
        raise ValueError(f"a query point is a fraction of the horizon between 0 and 1, got {value}")
    return f
