"""The work a study may ask for, in one place: at most `MAX_ARMS_PER_CASE` arms per case (arms × continuations)
and, with a manifest, at most `MAX_ARM_STEPS` arm-steps in all, and no declared query point that cannot fire
within a case's horizon. Each refusal is one line naming the product. The service's `[limits]` may lower both.
"""

from __future__ import annotations

from collections.abc import Iterable

from rescue.core.arms import query_point_arm
from rescue.core.configuration.config import StudyConfig

MAX_ARMS_PER_CASE = 64
MAX_ARM_STEPS = 20_000_000


def arms_problem(arms_per_case: int, parts: str, limit: int = MAX_ARMS_PER_CASE, where: str = "") -> str | None:
    """Why a case's arms are too many, naming the product (`parts`: how they multiply); None: within `limit`."""
    if arms_per_case <= limit:
        return None
    return f"{where}{parts} = {arms_per_case:,} arms per case; the limit is {limit:,}"


def arm_steps_problem(arms_per_case: int, horizons: Iterable[int], limit: int = MAX_ARM_STEPS) -> str | None:
    """Why a manifest's cases ask for too many arm-steps (each arm runs up to its case's horizon); None: within."""
    horizons = list(horizons)
    steps = arms_per_case * sum(horizons)
    if steps <= limit:
        return None
    return (f"{len(horizons):,} cases × {arms_per_case:,} arms per case, {sum(horizons):,} horizon steps in all = "
            f"{steps:,} arm-steps; the limit is {limit:,}")


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


def config_work_problem(config: StudyConfig, horizons: list[int], max_arm_steps: int = MAX_ARM_STEPS) -> str | None:
    """Why a manifest's cases ask this configuration for too much work (arm-steps past `max_arm_steps`), or a
    declared query point can fire in none of them (its q at or past every case's horizon H; C must be known:
    `policy.replan_interval`), in one line; None: neither."""
    problem = arm_steps_problem(len(config.case_arms), horizons, max_arm_steps)
    if problem is not None or not config.query_points or config.policy.replan_interval is None or not horizons:
        return problem
    for point in config.query_points:
        steps = {h: config.query_step(query_point_arm(config.primary_arm, point.name), h) for h in horizons}
        never = sorted({h for h, q in steps.items() if q >= h})
        if never:
            h = never[0]
            return (f"query_points: {point.name!r} (fraction {point.fraction:g}) asks at step {steps[h]}, which a case "
                    f"of horizon {h} never reaches (C = {config.interval}): it cannot fire within H")
    return None
