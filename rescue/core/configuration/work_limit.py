"""The work a study may ask for, in one place, counted as it will run and priced for the machine.

A case runs its arms × continuations; forked arms (`fork_at_q`, query points, triggers, K > 1) share the case's
prefix up to their q, so a case costs H steps for its leader plus H - q for every other arm and continuation, not H
each (a trigger's q: the first step it can fire at). What a study asks is refused, in one line that gives the
estimate, when it would take longer than `MAX_HOURS` on its simulators (`rescue run --max-hours` raises it), or
more disk than the study's file system has free; and, as a guard on one case's records (its arms land in one
journal transaction), past `MAX_ARMS_PER_CASE` arms per case. No declared query point may be unable to fire within
a case's horizon, and no two asking arms may ask at one step of a case. The service's `[limits]` may lower the arms
per case and the arm-steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from rescue.core.arms import base_arm, query_point_arm, query_point_of
from rescue.core.configuration.config import StudyConfig
from rescue.core.triggers import earliest_step

# One case's arms × continuations: they are recorded in one journal transaction and fan out of one snapshot.
MAX_ARMS_PER_CASE = 1024
# A guard far above any week of this machine's work; the real bound is the time and disk the estimate says.
MAX_ARM_STEPS = 1_000_000_000
# What an arm-step costs, measured: the full-size study of benchmarks/full_study.py (docs/benchmarks.md, "A study at
# full size") took 20.2 CPU-s a case of 552 arm-steps (an image policy, renders, the VLM call), 0.037 CPU-s each;
# and 0.46 MB of study folder a three-arm case.
SECONDS_PER_ARM_STEP = 0.037
BYTES_PER_ARM = 160_000
# A study that would run longer than this on its simulators is refused unless it says so (`--max-hours`).
MAX_HOURS = 168.0


@dataclass(frozen=True)
class WorkEstimate:
    """What a manifest's cases will cost under a configuration, on its simulators."""

    cases: int
    arms_per_case: int
    arm_steps: int
    simulators: int

    @property
    def hours(self) -> float:
        """Wall hours at SECONDS_PER_ARM_STEP of CPU per arm-step, one simulator per core busy."""
        return self.arm_steps * SECONDS_PER_ARM_STEP / 3600.0 / max(1, self.simulators)

    @property
    def disk_bytes(self) -> int:
        """The study folder's size at BYTES_PER_ARM an arm."""
        return self.cases * self.arms_per_case * BYTES_PER_ARM

    def text(self) -> str:
        return (f"{self.cases:,} cases × {self.arms_per_case:,} arms per case = {self.arm_steps:,} arm-steps (forked "
                f"arms share each case's prefix), about {self.hours:,.1f} h on {self.simulators} simulator"
                f"{'s' * (self.simulators != 1)} and {size(self.disk_bytes)} of disk")


def size(n: int) -> str:
    """Bytes for a reader: GB from one up, MB below (a small study's 0.0 GB says nothing)."""
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def arms_problem(arms_per_case: int, parts: str, limit: int = MAX_ARMS_PER_CASE, where: str = "") -> str | None:
    """Why a case's arms are too many, naming the product (`parts`: how they multiply); None: within `limit`."""
    if arms_per_case <= limit:
        return None
    return f"{where}{parts} = {arms_per_case:,} arms per case; the limit is {limit:,}"


def forks(config: StudyConfig) -> bool:
    """Whether the study's arms will continue from snapshots at their q: fork_at_q set or resolved true, or
    implied by query points, triggers or continuations (an evaluation forks nothing)."""
    if config.is_evaluation or config.fork_at_q is False:
        return False
    return bool(config.fork_at_q) or bool(config.query_points) or bool(config.triggers) or config.continuations > 1


def _q(config: StudyConfig, arm: str, horizon: int) -> int:
    """An arm's q; before C is known, the fraction of H it asks at (q rounds that up to the grid of C). A trigger's
    arm asks where its trigger fires, decided while the episode runs: the first step it can fire at (with C
    unknown, 1 for C), so that the estimate is never under what runs."""
    trigger = config.trigger_of(arm)
    if trigger is not None:
        return min(horizon, earliest_step(trigger, config.policy.replan_interval or 1, config.triggers or ()))
    if config.policy.replan_interval is not None:
        return config.query_step(arm, horizon)
    point = query_point_of(arm)
    fraction = 0.5 if point is None else next(p.fraction for p in config.query_points or [] if p.name == point)
    return math.ceil(fraction * horizon)


def case_arm_steps(config: StudyConfig, horizon: int) -> int:
    """The env steps one case of horizon H runs: H for each arm run whole, or, forked, H for the leader and H - q
    for every other arm and continuation."""
    arms = config.case_arms
    if not forks(config):
        return len(arms) * horizon
    steps = horizon  # the leader: the control arm's first continuation, run whole
    for arm in arms:
        if arm == "control":
            continue
        steps += horizon - min(horizon, _q(config, base_arm(arm), horizon))
    return steps


def work_estimate(config: StudyConfig, horizons: Iterable[int]) -> WorkEstimate:
    """The estimate of a manifest's cases (their horizons) under `config`."""
    horizons = list(horizons)
    return WorkEstimate(cases=len(horizons), arms_per_case=len(config.case_arms),
                        arm_steps=sum(case_arm_steps(config, h) for h in horizons),
                        simulators=max(1, config.env.simulators))


def config_arms_problem(config: StudyConfig, limit: int = MAX_ARMS_PER_CASE) -> str | None:
    """Why a case of this configuration runs too many arms, naming the product; None: at most `limit`."""
    k = 1 if config.is_evaluation else config.continuations
    advisors = len(config.advisor_configs())
    points = len(config.query_points or [])
    triggers = len(config.triggers or [])
    parts = ["control"] if "control" in config.arms else []
    parts += [f"{advisors} advisor{'s' * (advisors != 1)}"] if advisors else []
    parts += [f"{points} query point{'s' * (points != 1)}"] if points else []
    parts += [f"{triggers} trigger{'s' * (triggers != 1)}"] if triggers else []
    parts += ["sham"] if "sham" in config.arms else []
    text = f"{', '.join(parts)} = {len(config.arms)} arms × {k} continuation{'s' * (k != 1)}"
    return arms_problem(len(config.case_arms), text, limit)


def config_work_problem(config: StudyConfig, horizons: list[int], max_arm_steps: int = MAX_ARM_STEPS,
                        max_hours: float = MAX_HOURS, free_disk: int | None = None) -> str | None:
    """Why a manifest's cases ask this configuration for more than the machine gives (past `max_hours` on its
    simulators, past `free_disk` bytes, past `max_arm_steps`), or a declared query point can fire in none of them
    (its q at or past every case's horizon H; C must be known: `policy.replan_interval`), or two asking arms ask at
    one step of a case, in one line with the estimate; None: none of these."""
    estimate = work_estimate(config, horizons)
    if estimate.arm_steps > max_arm_steps:
        return f"{estimate.text()}; the limit is {max_arm_steps:,} arm-steps"
    if estimate.hours > max_hours:
        return f"{estimate.text()}; the limit is {max_hours:,.0f} h (rescue run --max-hours raises it)"
    if free_disk is not None and estimate.disk_bytes > free_disk:
        return f"not enough free disk: {estimate.text()}; the study's file system has {size(free_disk)} free"
    if not config.query_points or config.policy.replan_interval is None or not horizons:
        return None
    for point in config.query_points:
        steps = {h: config.query_step(query_point_arm(config.primary_arm, point.name), h) for h in horizons}
        never = sorted({h for h, q in steps.items() if q >= h})
        if never:
            h = never[0]
            return (f"query_points: {point.name!r} (fraction {point.fraction:g}) asks at step {steps[h]}, which a case "
                    f"of horizon {h} never reaches (C = {config.interval}): it cannot fire within H")
    # Two arms asking at one step of a case would be one arm twice: the grid of C rounds fractions together.
    asking = [config.primary_arm, *(query_point_arm(config.primary_arm, p.name) for p in config.query_points)]
    for h in sorted(set(horizons)):
        at: dict[int, str] = {}
        for arm in asking:
            q = config.query_step(arm, h)
            if q in at:
                return (f"query_points: {at[q]!r} and {arm!r} both ask at step {q} of a case of horizon {h} "
                        f"(C = {config.interval}): move one of them")
            at[q] = arm
    return None
