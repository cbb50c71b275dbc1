"""Hand out a policy's action chunk one action per step.

The inner policy is queried only when the current chunk is used up, or after
flush(): an instruction change must flush, or actions planned under the old
instruction would keep running (DESIGN §2, injection).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class ActionChunkBroker:
    """Wraps a chunking policy so each infer() returns one step of the chunk."""

    def __init__(self, policy: Any, action_horizon: int) -> None:
        if action_horizon < 1:
            raise ValueError("action_horizon must be at least 1")
        self._policy = policy
        self._action_horizon = action_horizon
        self._reply: dict | None = None
        self._length = 0
        self._cur = 0

    @property
    def remaining(self) -> int:
        """Actions left in the current chunk before the next query."""
        return 0 if self._reply is None else self._length - self._cur

    def infer(self, obs: dict) -> dict:
        """Return the reply for this step: chunked arrays sliced at the current index."""
        if self._reply is None:
            self._reply = self._policy.infer(obs)
            chunk = len(self._reply["actions"])
            # A chunk shorter than the horizon is used up early rather than overrun.
            self._length = min(self._action_horizon, chunk)
            self._cur = 0
        step = _slice(self._reply, self._cur, len(self._reply["actions"]))
        self._cur += 1
        if self._cur >= self._length:
            self._reply = None
        return step

    def flush(self) -> None:
        """Drop the rest of the current chunk; the next infer() queries the inner policy."""
        self._reply = None
        self._cur = 0

    def reset(self) -> None:
        """Reset the inner policy and drop the current chunk."""
        self._policy.reset()
        self.flush()


def _slice(tree: Any, i: int, chunk: int) -> Any:
    # Only arrays whose leading axis is the chunk are per-step; others (timing,
    # a stage scalar, a state vector) pass through whole.
    if isinstance(tree, dict):
        return {k: _slice(v, i, chunk) for k, v in tree.items()}
    if isinstance(tree, np.ndarray) and tree.ndim >= 1 and tree.shape[0] == chunk:
        return tree[i, ...]
    return tree
