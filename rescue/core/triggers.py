"""When a trigger fires, and when an arm asks again (DESIGN §18), pure.

A trigger reads an arm's own recorded queries (`QueryRecord`: what the simulator showed at each policy query, the
gripper command each chunk ran with, the disagreement of chunks drawn there) up to a query step, never after it: at
step s it reads the end effector's and the object's positions and the disagreement at s and before, and the gripper
commands of the chunks before s (the chunk at s is what the policy answers after the decision). A trigger's arm
forks from the control arm at the first step where it fires on the control arm's records, so the prefix proof covers
what it read, and `rescue verify` re-derives each firing from them (`call_steps`).

A random placebo fires on no evidence: a case draws, from a stream seeded by the trigger's seed and name and the
case's id, whether it is asked (with probability `rate`) and at which query step of the grid (uniformly from the
step its matched trigger could first fire at, to the horizon); an episode that ended before that step is not asked.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

from rescue.core.asking import AskingConfig, TriggerConfig
from rescue.core.records import QueryRecord

# LIBERO's gripper command: -1 opens, +1 closes; an episode starts open (its settle steps send -1).
OPEN = -1.0


def earliest_step(trigger: TriggerConfig, interval: int, triggers: Sequence[TriggerConfig] = ()) -> int:
    """The first query step a trigger can fire at: never step 0 (a fork needs a prefix); a stall trigger needs its
    window, a gripper trigger a close per cycle; a placebo the step its matched trigger could first fire at."""
    if trigger.kind == "random":
        matched = next((t for t in triggers if t.name == trigger.matches), None)
        return earliest_step(matched, interval) if matched is not None else interval
    if trigger.kind == "stall":
        return max(1, trigger.window or 1) * interval
    if trigger.kind == "gripper":
        return (int(trigger.cycles or 0) + 1) * interval
    return interval


def _spread(points: Sequence[tuple[float, float, float]]) -> float:
    first = np.asarray(points[0], dtype=np.float64)
    return max(float(np.linalg.norm(np.asarray(p, dtype=np.float64) - first)) for p in points)


def _stalled(trigger: TriggerConfig, rows: Sequence[QueryRecord], step: int, since: int, interval: int) -> bool:
    start = step - int(trigger.window or 1) * interval
    if start < since:
        return False
    window = [r for r in rows if start <= r.step <= step]
    if len(window) != (step - start) // interval + 1 or any(r.ee_pos is None for r in window):
        return False  # a query missing in the window, or no position recorded: no evidence of a stall
    limit = float(trigger.distance or 0.0)
    if _spread([r.ee_pos for r in window]) >= limit:
        return False
    objects = [r.object_pos for r in window]
    if trigger.objects and all(o is not None for o in objects) and _spread(objects) >= limit:
        return False
    return True


def closes(rows: Sequence[QueryRecord], before: int, since: int = 0) -> int:
    """How many times the gripper closed (its command went from open to closed between two chunks, or in the first
    one) among the chunks queried at steps in [since, before)."""
    n, last = 0, OPEN
    for r in sorted(rows, key=lambda r: r.step):
        if r.step >= before:
            break
        if r.gripper is None:
            continue
        if last <= 0 < r.gripper and r.step >= since:
            n += 1
        last = r.gripper
    return n


def random_step(trigger: TriggerConfig, case_id: str, horizon: int, interval: int, since: int | None,
                triggers: Sequence[TriggerConfig] = ()) -> int | None:
    """The query step a random placebo asks a case at (after its call at `since`, when it asks again), or None:
    this draw does not ask. The same for every reading of the study: seeded by the trigger and the case alone."""
    rng = random.Random(f"{trigger.seed}:{trigger.name}:{case_id}:{since}")
    if rng.random() >= float(trigger.rate or 0.0):
        return None
    lowest = earliest_step(trigger, interval, triggers)
    low = lowest if since is None else since + lowest
    low = -(-low // interval) * interval
    grid = range(low, horizon, interval)
    return rng.choice(grid) if len(grid) else None


def fires(trigger: TriggerConfig, rows: Sequence[QueryRecord], step: int, case_id: str, horizon: int, interval: int,
          since: int | None = None, triggers: Sequence[TriggerConfig] = ()) -> bool:
    """Whether a trigger fires at query step `step` on an arm's records (read up to `step` only), counting from its
    last call at `since` (None: from the episode's start)."""
    if step < earliest_step(trigger, interval, triggers) + (since or 0) or (since is not None and step <= since):
        return False
    if trigger.kind == "random":
        return step == random_step(trigger, case_id, horizon, interval, since, triggers)
    if trigger.kind == "stall":
        return _stalled(trigger, rows, step, since or 0, interval)
    if trigger.kind == "gripper":
        return closes(rows, step, since or 0) > int(trigger.cycles or 0)
    now = next((r for r in rows if r.step == step), None)
    return now is not None and now.dispersion is not None and now.dispersion > float(trigger.threshold or 0.0)


def first_firing(trigger: TriggerConfig, rows: Sequence[QueryRecord], case_id: str, horizon: int, interval: int,
                 since: int | None = None, triggers: Sequence[TriggerConfig] = ()) -> int | None:
    """The first query step (after `since`) at which a trigger fires on an arm's records; None: it never does."""
    for r in sorted(rows, key=lambda r: r.step):
        if fires(trigger, rows, r.step, case_id, horizon, interval, since, triggers):
            return r.step
    return None


def next_call(asking: AskingConfig, trigger: TriggerConfig | None, rows: Sequence[QueryRecord], last: int,
              case_id: str, horizon: int, interval: int, triggers: Sequence[TriggerConfig] = ()) -> int | None:
    """The query step of an arm's next call after its call at `last`, on its own records: `every_queries` queries
    later, or (`again = "fires"`, an arm with a trigger) where the trigger fires again; None: the arm never reached
    it."""
    if asking.again == "fires" and trigger is not None:
        return first_firing(trigger, rows, case_id, horizon, interval, since=last, triggers=triggers)
    step = last + asking.every_queries * interval
    return step if any(r.step == step for r in rows) else None


def call_steps(first: int | None, asking: AskingConfig | None, trigger: TriggerConfig | None,
               rows: Sequence[QueryRecord], case_id: str, horizon: int, interval: int, calls: int | None = None,
               triggers: Sequence[TriggerConfig] = ()) -> list[int]:
    """The query steps an arm asks at, re-derived from its own records: its first q (a fixed query point's, or the
    step its trigger first fired at on the shared prefix; None: it never asked), then each next call by the rule, up
    to `max_calls`, or to `calls` when the arm stopped asking earlier (a call that failed ends its asking)."""
    if first is None or not any(r.step == first for r in rows):
        return []
    most = asking.max_calls if asking is not None else 1
    if calls is not None:
        most = min(most, calls)
    steps = [first]
    while len(steps) < most:
        found = next_call(asking, trigger, rows, steps[-1], case_id, horizon, interval, triggers)
        if found is None:
            break
        steps.append(found)
    return steps


def dispersion(chunks: Sequence[np.ndarray], executed: int) -> float:
    """How much chunks drawn for one observation disagree: the largest mean distance, over two chunks' first
    `executed` actions (what would run), between their actions."""
    if len(chunks) < 2:
        return 0.0
    arrays = [np.asarray(c, dtype=np.float64)[:executed] for c in chunks]
    worst = 0.0
    for i, a in enumerate(arrays):
        for b in arrays[i + 1:]:
            n = min(len(a), len(b))
            worst = max(worst, float(np.linalg.norm(a[:n] - b[:n], axis=-1).mean()) if n else 0.0)
    return worst


def placebo_rate(asked_share: float, lengths: Sequence[int], trigger: TriggerConfig, horizon: int, interval: int,
                 triggers: Sequence[TriggerConfig] = ()) -> float:
    """The `rate` a random placebo declares to ask about as many episodes as its matched trigger did in a pilot
    (`asked_share` of the pilot's episodes), given the pilot's episode lengths in env steps: a drawn step after an
    episode's end asks nothing, so the rate is raised by the share of drawn steps the episodes reach (at most 1)."""
    low = earliest_step(trigger, interval, triggers)
    grid = list(range(-(-low // interval) * interval, horizon, interval))
    if not grid or not lengths:
        return 0.0
    reached = math.fsum(sum(s < length for s in grid) / len(grid) for length in lengths) / len(lengths)
    return 1.0 if reached <= 0 else min(1.0, asked_share / reached)
