"""The simulator seam: what the arm runner needs from any benchmark."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# The three views sent to the VLM at the query point, in this fixed order.
VLM_VIEWS = ("agentview", "frontview", "robot0_eye_in_hand")


@dataclass
class ResetResult:
    """The state right after reset, before the first policy query."""

    obs: dict[str, np.ndarray]
    instruction: str
    fingerprint: str
    fingerprint_parts: dict[str, str] = field(default_factory=dict)


@dataclass
class ChunkResult:
    """What running a chunk of actions produced: steps taken and the last observation."""

    obs: dict[str, np.ndarray]
    steps: int
    success: bool
    info: dict[str, Any] = field(default_factory=dict)


class EnvAdapter(Protocol):
    """A benchmark environment that replays a case from its initial state."""

    def task_instruction(self, case: dict) -> str:
        """The task's own instruction for a case (manifest dict)."""

    def reset(self, case: dict) -> ResetResult:
        """Reset to the case's initial state (seeded, bitwise reproducible)."""

    def run_chunk(self, actions: np.ndarray, max_steps: int) -> ChunkResult:
        """Step through actions (at most max_steps), stopping early on success."""

    def render(self, cameras: list[str], size: int) -> dict[str, np.ndarray]:
        """Render the named cameras now (uint8 HxWx3)."""

    def close(self) -> None:
        """Release the simulator."""
