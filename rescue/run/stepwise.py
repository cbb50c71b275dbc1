"""One chunk of an arm against a policy that answers one action per observation (vla-eval's wire).

Such a server replans every C steps on its own side (its `chunk_size`; the study's C) and plays the chunk out
one action per observation, so the arm sends it an observation at every env step, as the harness's runner
does: the first one is the query the trace row records; the others get the chunk's next actions (a
`PredictModelServer` does not read them, another server may). The executed actions, the gripper as the
episode protocol runs it, make the chunk the row digests.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import numpy as np

from rescue.core.actions import checked_chunk
from rescue.env.protocol import ChunkResult

Query = Callable[[Any, dict, int, Any], Awaitable[dict]]


async def run_stepwise(arm: Any, reply: dict, due: int, last: bool, query: Query) -> tuple[np.ndarray, ChunkResult]:
    """Step the arm (a rescue.run.arm.ArmRun) `due` steps from `reply` (the answer to the query at `arm.step`), sending each next
    observation for the next action; stop at a success. Returns the executed actions and the chunk's result (its
    observation: the one after the last step, none when the episode ends there)."""
    actions: list[np.ndarray] = []
    steps, obs, success = 0, arm.obs, False
    name = getattr(arm.policy, "url", type(arm.policy).__name__)
    for j in range(due):
        step = arm.step + j
        if j:
            reply = await query(arm.policy, arm.spec.profile.policy_input(obs, arm.instruction), step, arm.firings)
        action = arm.spec.protocol.executed(checked_chunk(reply, interval=1, due=1, space=arm.action_space,
                                                          policy=name, step=step))
        actions.append(action[0])
        final = j == due - 1
        result = await arm.sim.run_chunk(action, 1, "never" if final and last else "unless_success")
        steps += result.steps
        obs = result.obs
        if result.success:
            success = True
            break
    return np.stack(actions), ChunkResult(obs=obs, steps=steps, success=success)
