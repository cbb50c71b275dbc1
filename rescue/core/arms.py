"""Arm names: one grammar for every arm a case runs (DESIGN §2, §8, §11, §13, §14).

    control | assisted | assisted:<advisor> | sham      the arm's kind (its base)
    ...@<query point>                                   an assisted arm asking at a declared extra query point
    ...#<k>                                             its k-th continuation from the snapshot at q (k >= 2)

A study's arms of continuation 1 are named without `#1`, so a study with one continuation per arm
reads exactly as before continuations existed.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated

from pydantic import Field

ADVISOR_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
QUERY_POINT_NAME = r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}"
ADVISOR_ARM_PREFIX = "assisted:"
_BASE = rf"(?:control|sham|assisted(?::{ADVISOR_NAME})?)"
_ARM = re.compile(rf"^(?P<base>{_BASE})(?:@(?P<qp>{QUERY_POINT_NAME}))?(?:#(?P<k>[2-9]|[1-9][0-9]{{1,3}}))?$")
ArmName = Annotated[str, Field(pattern=_ARM.pattern)]


def _parts(arm: str) -> re.Match[str]:
    found = _ARM.match(arm)
    if found is None:
        raise ValueError(f"{arm!r} is not an arm name")
    return found


def advisor_arm(advisor: str | None) -> str:
    """The arm an advisor's subgoals go to: `assisted:<name>`, or `assisted` for a study's one `[vlm]` (None)."""
    return "assisted" if advisor is None else f"{ADVISOR_ARM_PREFIX}{advisor}"


def arm_advisor(arm: str) -> str | None:
    """The advisor an arm belongs to (`assisted:gpt@early#2` -> `gpt`); None for `assisted`, `control` and `sham`."""
    base = base_arm(arm, query_point=False)
    return base[len(ADVISOR_ARM_PREFIX):] if base.startswith(ADVISOR_ARM_PREFIX) else None


def is_assisted(arm: str) -> bool:
    """Whether an arm asks a VLM at its query point: `assisted`, an advisor's `assisted:<name>`, any of their
    query-point arms or continuations."""
    base = base_arm(arm, query_point=False)
    return base == "assisted" or base.startswith(ADVISOR_ARM_PREFIX)


def base_arm(arm: str, query_point: bool = True) -> str:
    """The arm without its continuation (`assisted@early#3` -> `assisted@early`); with query_point=False,
    without its query point too (-> `assisted`)."""
    found = _parts(arm)
    if query_point and found["qp"]:
        return f"{found['base']}@{found['qp']}"
    return found["base"]


def continuation(arm: str) -> int:
    """Which continuation of its base arm an arm is: 1 for a name without `#k`."""
    k = _parts(arm)["k"]
    return int(k) if k else 1


def continuation_arm(arm: str, k: int) -> str:
    """The k-th continuation of a base arm (`control`, 3 -> `control#3`); k = 1 is the base arm itself."""
    if k < 1:
        raise ValueError(f"continuations are counted from 1, got {k}")
    name = base_arm(arm)
    return name if k == 1 else f"{name}#{k}"


def query_point_of(arm: str) -> str | None:
    """The declared extra query point an arm asks at (`assisted@early` -> `early`); None: the pre-registered q."""
    return _parts(arm)["qp"]


def query_point_arm(arm: str, point: str | None) -> str:
    """An assisted arm asking at a declared extra query point (`assisted`, `early` -> `assisted@early`)."""
    return arm if point is None else f"{base_arm(arm, query_point=False)}@{point}"


def continuation_seed(policy_seed: int, k: int) -> int:
    """The seed a policy with RNG control is reset to at q for continuation k >= 2 of every arm: the same for each
    arm's k-th continuation (its draws are paired across arms), independent of the others (DESIGN §13)."""
    if k < 2:
        raise ValueError(f"continuation 1 keeps the policy's own stream; got k = {k}")
    return int.from_bytes(hashlib.sha256(f"continuation:{int(policy_seed)}:{k}".encode()).digest()[:4], "big") >> 1


def answered_at_q(arm: str) -> bool:
    """Whether an arm is answered at its query point: an assisted arm (a VLM), or the sham (its declared source)."""
    return is_assisted(arm) or base_arm(arm, query_point=False) == "sham"


def shown(arm: str) -> str:
    """An arm as tables name it: an advisor's without the `assisted:` prefix (`gpt`, `gpt@early`), others as they are."""
    return arm[len(ADVISOR_ARM_PREFIX):] if arm.startswith(ADVISOR_ARM_PREFIX) else arm
