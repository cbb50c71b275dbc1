"""A policy's action chunk, checked before any of it reaches the simulator (pure).

The rule, the same for every arm, every query and every policy:

- refused: a reply without `actions`; actions that are not a numeric array of one
  action (1-D) or of a chunk (2-D); fewer actions than the steps to the next query;
  another number of dimensions per action than the simulator's action space has;
  any NaN or infinity among the actions that would run;
- clipped: finite values outside the action space's bounds are clipped to them,
  elementwise, before they run (and before the trace digests them). This is what
  the benchmark itself does with them (robosuite's controllers clip their input to
  `[-1, 1]`, the gripper reads only the sign), so a policy whose outputs stray a
  little past the bounds runs as under the benchmark's own evaluation, and an
  adapter whose simulator does not clip gets the same guarantee.

A refused chunk ends the arm as an `error` (`BadActionChunk: ...`) naming the
policy and the step of the query; nothing of it runs. Only the actions that will
run are checked: a chunk's tail past the replan interval is dropped unread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ActionSpace:
    """The simulator's action space: one bound per action dimension (the adapter reports it at reset)."""

    low: tuple[float, ...]
    high: tuple[float, ...]

    @property
    def dim(self) -> int:
        """Dimensions of one action."""
        return len(self.low)


class BadActionChunk(ValueError):
    """A policy answered an action chunk the simulator must not run (the first line names policy and step)."""


def checked_chunk(reply: Any, *, interval: int, due: int, space: ActionSpace | None, policy: str, step: int) -> np.ndarray:
    """The actions to run for one query (at most `interval` of them, float64, clipped to `space`),
    or BadActionChunk. `due`: the steps to the next query (the chunk must cover them)."""

    def refuse(what: str, detail: str = "") -> BadActionChunk:
        return BadActionChunk(f"policy {policy} answered {what} at step {step}; nothing of it ran"
                              + (f"\n{detail}" if detail else ""))

    if not isinstance(reply, dict) or "actions" not in reply:
        raise refuse("no actions", f"reply keys: {sorted(reply) if isinstance(reply, dict) else type(reply).__name__}")
    try:
        arr = np.asarray(reply["actions"], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise refuse("actions that are not a numeric array", str(exc)) from None
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise refuse(f"an action chunk of shape {arr.shape}", "expected (actions, dimensions)")
    chunk = arr[:interval]
    if len(chunk) < due:
        # A short chunk would move the next query off the 0, C, 2C, ... grid.
        raise refuse(f"a chunk of {len(chunk)} actions, fewer than the {due} steps to the next query")
    if space is not None and chunk.shape[1] != space.dim:
        raise refuse(f"actions of {chunk.shape[1]} dimensions", f"the simulator's actions have {space.dim}")
    bad = ~np.isfinite(chunk[:due])
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        value = chunk[row, col]
        kind = "NaN" if np.isnan(value) else ("+Inf" if value > 0 else "-Inf")
        raise refuse(f"a chunk with {kind}", f"action {row} (step {step + row}), dimension {col}; "
                     f"{int(bad.sum())} non-finite values of {bad.size}")
    if space is not None:
        chunk = np.clip(chunk, np.asarray(space.low), np.asarray(space.high))
    return chunk

