"""The simulator seam: what the arm runner needs from any benchmark."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, Union

import numpy as np

from rescue.core.actions import ActionSpace
from rescue.core.episode_protocol import EpisodeProtocol
from rescue.core.manifest import Case
from rescue.core.observation import PRIVILEGED, ObservationProfile, get_profile

# A case as the adapter accepts it: the typed manifest case, or a mapping with the same fields.
CaseLike = Union[Case, Mapping[str, Any]]
# An observation profile, by value or by built-in name; None means `privileged`.
ProfileLike = Union[ObservationProfile, str, None]
# An episode protocol, by value or by built-in name; None means `rescue`.
ProtocolLike = Union[EpisodeProtocol, str, None]
# When run_chunk shapes an observation at the end of the chunk.
Observe = Literal["always", "unless_success", "never"]


class CaseRef(NamedTuple):
    """The fields of a case a simulator needs to reset it."""

    suite: str
    task_id: int
    init_state_index: int
    env_seed: int


def case_fields(case: CaseLike) -> CaseRef:
    """The reset fields of a typed Case or a case mapping."""
    if isinstance(case, Mapping):
        return CaseRef(str(case["suite"]), int(case["task_id"]), int(case["init_state_index"]), int(case["env_seed"]))
    return CaseRef(case.suite, case.task_id, case.init_state_index, case.env_seed)


def case_tags(case: CaseLike) -> Mapping[str, Any]:
    """The tags of a typed Case or a case mapping (empty when it has none)."""
    tags = case.get("tags") if isinstance(case, Mapping) else case.tags
    return tags if isinstance(tags, Mapping) else {}


def resolve_profile(profile: ProfileLike) -> ObservationProfile:
    """An ObservationProfile from a profile, a built-in name or None (privileged)."""
    if profile is None:
        return PRIVILEGED
    if isinstance(profile, str):
        return get_profile(profile)
    return profile


def process_info() -> dict[str, Any]:
    """Facts about the simulator process worth recording next to a fingerprint."""
    return {
        "pid": os.getpid(),
        "python_hash_seed": os.environ.get("PYTHONHASHSEED"),
        "hash_randomization": bool(sys.flags.hash_randomization),
    }


@dataclass
class ResetResult:
    """The state right after reset, before the first policy query."""

    obs: dict[str, np.ndarray]
    instruction: str
    fingerprint: str
    fingerprint_parts: dict[str, str] = field(default_factory=dict)
    # The simulator process's facts (pid, PYTHONHASHSEED); not part of the fingerprint.
    info: dict[str, Any] = field(default_factory=dict)
    # The bounds and dimensions of the actions it runs (None: unknown, only finiteness is checked).
    action_space: ActionSpace | None = None


@dataclass
class ChunkResult:
    """What running a chunk of actions produced: steps taken and the last observation."""

    obs: dict[str, np.ndarray]
    steps: int
    success: bool
    info: dict[str, Any] = field(default_factory=dict)


class EnvAdapter(Protocol):
    """A benchmark environment that replays a case from its initial state (runs in a simulator process)."""

    def task_instruction(self, case: CaseLike) -> str:
        """The task's own instruction for a case."""

    def reset(self, case: CaseLike, profile: ProfileLike = None, protocol: ProtocolLike = None) -> ResetResult:
        """Start the case's episode as `protocol` says (seeded, bitwise reproducible); observations follow `profile`."""

    def run_chunk(self, actions: np.ndarray, max_steps: int, observe: Observe = "always") -> ChunkResult:
        """Step through actions (at most max_steps), stopping early on success."""

    def render(self, cameras: list[str], size: int) -> dict[str, np.ndarray]:
        """Render the named cameras now, upright (uint8 HxWx3), for people and the VLM."""

    def snapshot(self) -> dict:
        """Everything a continuation depends on, picklable (restorable in another process)."""

    def restore(self, snap: dict) -> None:
        """Put the simulator in a snapshot's state."""

    def state_digest(self) -> str:
        """Digest of the full simulator state now."""

    def close(self) -> None:
        """Release the simulator."""
