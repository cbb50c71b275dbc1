"""What `rescue verify` re-derives of whether and when an arm asked (DESIGN §18): each trigger's firing from the
control arm's recorded queries, each later call's step from the arm's own, and the instruction every row of an arm
that asked more than once carries. Each function returns the problems it finds, one line each."""

from __future__ import annotations

from rescue.core.configuration.config import StudyConfig
from rescue.core.digest import digest_text
from rescue.core.records import ArmResult, CaseRecord
from wrappers.injection import inject, parse_injection


def call_problems(name: str, arm: ArmResult, original_text: str | None, original: str | None) -> list[str]:
    """An arm that asked more than once: each applied call is inject(original, its subgoal), and every row carries
    the instruction of the last applied call at or before its step (the original before the first)."""
    calls = arm.calls()
    applied = [c for c in calls if c.status == "applied"]
    if original_text is None and applied and applied[0].instruction is not None:
        original_text, _ = parse_injection(applied[0].instruction)
    if original_text is None:
        return []
    original = original or digest_text(original_text)
    problems, by_step = [], {}
    for i, c in enumerate(calls, start=1):
        if c.status != "applied":
            continue
        expected = inject(original_text, c.subgoal or "")
        if not (c.subgoal or "").strip() or c.instruction != expected or c.instruction_digest != digest_text(expected):
            problems.append(f"{name} call {i} (step {c.query_step}): applied instruction is not inject(original, subgoal)")
        by_step[c.query_step] = digest_text(expected)
    current = original
    for row in sorted(arm.trace, key=lambda r: r.step):
        current = by_step.get(row.step, current)
        if row.instruction != current:
            problems.append(f"{name} trace row at step {row.step} does not carry the instruction of its last applied "
                            "call (the original before the first)")
            break
    return problems


def trigger_problems(arms: dict[str, ArmResult], rec: CaseRecord, config: StudyConfig) -> tuple[int, int, list[str]]:
    """Each trigger's firing derived again from the control arm's queries: the step the leader recorded, and the
    step its arm asked at (or not asked); each later call's step from the arm's own queries. Returns the firings
    and later calls checked, and the problems."""
    control = arms.get("control")
    firings = later = 0
    problems = []
    for name in [a for a in config.arms if config.trigger_of(a) is not None]:
        trigger, arm = config.trigger_of(name), arms.get(name)
        if control is None or arm is None or control.status != "complete":
            continue
        firings += 1
        derived = None if name in rec.unasked else rec.q_of(name)
        said = f"fires at step {derived}" if derived is not None else "never fires"
        if trigger.name not in control.trigger_steps or control.trigger_steps[trigger.name] != derived:
            problems.append(f"the control arm records trigger {trigger.name!r} at "
                            f"{control.trigger_steps.get(trigger.name, 'no step')}; on its recorded queries it {said}")
        asked = arm.assistance.query_step if arm.assistance.status != "not_asked" else None
        if arm.status == "complete" and asked != derived:
            problems.append(f"{name} asked at {asked if asked is not None else 'no step'}; its trigger {said} on the "
                            "control arm's queries")
    for name, arm in arms.items():
        if arm.again and arm.status == "complete":
            later += len(arm.again)
            wanted = rec.again_steps.get(name, [])
            asked_again = [c.query_step for c in arm.again]
            stopped_early = len(asked_again) < len(wanted) and arm.again[-1].status in ("applied", "declined")
            if asked_again != wanted[:len(asked_again)] or stopped_early:
                problems.append(f"{name} asked again at steps {asked_again}; the study's rule gives {wanted} on its "
                                "recorded queries")
    return firings, later, problems
