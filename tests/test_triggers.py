"""Whether and when to ask (DESIGN §18), pure: each trigger's decision on recorded queries, the random placebo's
seeded draws and its declared rate, asking again, and the classification of a trigger's arm from the re-derived
firing (forked there, not asked, or asked where its trigger does not fire)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers.case_records import FP, ORIGINAL, injected

from rescue.core.asking import AskingConfig, TriggerConfig
from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.config_files import ConfigError, validate_config
from rescue.core.digest import digest_text
from rescue.core.manifest import Case
from rescue.core.records import ArmResult, Assistance, QueryRecord, Receipt
from rescue.core.trace import TraceRow
from rescue.core.triggers import (
    call_steps,
    closes,
    dispersion,
    earliest_step,
    fires,
    first_firing,
    placebo_rate,
    random_step,
)
from rescue.study.folder import case_record, classify_case

pytestmark = pytest.mark.fast

C, H = 8, 64
STALL = TriggerConfig(name="stall", kind="stall", window=2, distance=0.01)
PLACEBO = TriggerConfig(name="placebo", kind="random", matches="stall", rate=1.0, seed=3)


def rows(positions, objects=None, gripper=None, dispersions=None) -> list[QueryRecord]:
    """One query every C steps at these end-effector positions (and object positions, gripper commands, spreads)."""
    out = []
    for i, p in enumerate(positions):
        out.append(QueryRecord(step=i * C, ee_pos=p, object_pos=None if objects is None else objects[i],
                               gripper=None if gripper is None else gripper[i],
                               dispersion=None if dispersions is None else dispersions[i]))
    return out


MOVING = [(0.1 * i, 0.0, 0.0) for i in range(8)]
STILL_FROM_8 = [(0.0, 0.0, 0.0)] + [(0.1, 0.0, 0.0)] * 7  # moves once, then stands still from step 8


def test_stall_fires_where_the_end_effector_and_the_object_stood_still_over_its_window():
    still = rows(STILL_FROM_8)
    # From step 8 on it stands; a window of 2 queries (16 steps) is first all still at step 24.
    assert [s for s in range(0, H, C) if fires(STALL, still, s, "c", H, C)] == [24, 32, 40, 48, 56]
    assert first_firing(STALL, still, "c", H, C) == 24
    assert first_firing(STALL, rows(MOVING), "c", H, C) is None
    # The task's object moving (knocked, dragged) is progress, not a stall; an object it does not read is ignored.
    sliding = rows(STILL_FROM_8, objects=[(0.0, 0.02 * i, 0.0) for i in range(8)])
    assert first_firing(STALL, sliding, "c", H, C) is None
    blind = STALL.model_copy(update={"objects": False})
    assert first_firing(blind, sliding, "c", H, C) == 24
    # A query missing in the window, or one without a position, is no evidence of a stall.
    assert first_firing(STALL, [r for r in still if r.step != 16], "c", H, C) == 40
    assert earliest_step(STALL, C) == 16 and not fires(STALL, still, 0, "c", H, C)


def test_gripper_counts_the_closes_of_the_chunks_before_the_step():
    commands = [-1, 1, -1, 1, -1, 1, 1, 1]  # closes at steps 8, 24 and 40
    records = rows(MOVING, gripper=commands)
    assert [closes(records, before=s) for s in (8, 9, 24, 25, 41)] == [0, 1, 1, 2, 3]
    two = TriggerConfig(name="g", kind="gripper", cycles=2)
    # More than 2 closes: the third close's chunk was queried at 40, so it fires at the next query, 48.
    assert first_firing(two, records, "c", H, C) == 48
    assert closes(records, before=H, since=24) == 2  # counted again from the last call


def test_uncertainty_fires_where_the_drawn_chunks_disagree():
    a = np.zeros((8, 7))
    assert dispersion([a, a, a], 8) == 0.0
    b = a.copy()
    b[:, 0] = 0.3
    assert dispersion([a, a, b], 8) == pytest.approx(0.3)
    assert dispersion([a, b], 2) == pytest.approx(0.3)  # only what would run
    u = TriggerConfig(name="u", kind="uncertainty", threshold=0.1)
    assert first_firing(u, rows(MOVING, dispersions=[0.0, 0.05, 0.2, 0.3, 0, 0, 0, 0]), "c", H, C) == 16


def test_a_random_placebo_draws_per_case_from_its_seed_at_its_declared_rate():
    half = PLACEBO.model_copy(update={"rate": 0.4})
    draws = [random_step(half, f"case-{i}", 280, C, None, [STALL, half]) for i in range(2000)]
    asked = [d for d in draws if d is not None]
    assert abs(len(asked) / len(draws) - 0.4) < 0.04
    # Never before its matched trigger's first possible step, always on the grid and within the horizon.
    assert min(asked) >= earliest_step(STALL, C) and max(asked) < 280 and all(d % C == 0 for d in asked)
    # The same for every reading: seeded by the trigger and the case alone, another seed draws otherwise.
    assert draws == [random_step(half, f"case-{i}", 280, C, None, [STALL, half]) for i in range(2000)]
    other = half.model_copy(update={"seed": 4})
    assert draws != [random_step(other, f"case-{i}", 280, C, None, [STALL, other]) for i in range(2000)]
    step = random_step(PLACEBO, "c", H, C, None, [STALL, PLACEBO])
    assert first_firing(PLACEBO, rows(MOVING), "c", H, C, triggers=[STALL, PLACEBO]) == step


def test_the_placebos_rate_is_raised_by_the_drawn_steps_short_episodes_never_reach():
    # Half the pilot's episodes were asked; a quarter of them end at step 100 of 280, the rest run to the end.
    lengths = [100] * 25 + [280] * 75
    rate = placebo_rate(0.5, lengths, PLACEBO, 280, C, [STALL, PLACEBO])
    grid = list(range(16, 280, C))
    reached = (0.25 * sum(s < 100 for s in grid) + 0.75 * len(grid)) / len(grid)
    assert rate == pytest.approx(0.5 / reached)
    # Simulated through the placebo's own draws, it asks about half of such episodes.
    declared = PLACEBO.model_copy(update={"rate": rate})
    asked = 0
    for i in range(4000):
        step = random_step(declared, f"e{i}", 280, C, None, [STALL, declared])
        asked += step is not None and step < lengths[i % 100]
    assert abs(asked / 4000 - 0.5) < 0.03
    assert placebo_rate(0.9, [16], PLACEBO, 280, C, [STALL, PLACEBO]) == 1.0  # what cannot be matched is capped


def test_the_leaders_decision_query_by_query_is_the_one_verify_derives_from_the_whole_record():
    # The leader decides before each query on the rows before it and the current step's observation; verify
    # reads the whole record afterwards. Random walks that stall now and then, with gripper commands.
    rng = random.Random(0)
    gripper = TriggerConfig(name="g", kind="gripper", cycles=1)
    for trial in range(200):
        pos, positions, commands = 0.0, [], []
        for _ in range(H // C):
            pos += rng.choice([0.0, 0.0, 0.05])
            positions.append((pos, 0.0, 0.0))
            commands.append(rng.choice([-1.0, 1.0]))
        whole = rows(positions, gripper=commands)
        for trigger in (STALL, gripper):
            online = None
            for i, row in enumerate(whole):
                # What the leader holds at this step: the rows before it, and the current one without its chunk.
                now = row.model_copy(update={"gripper": None})
                if fires(trigger, [*whole[:i], now], row.step, "c", H, C):
                    online = row.step
                    break
            assert online == first_firing(trigger, whole, "c", H, C), (trial, trigger.kind)


def test_asking_again_every_n_queries_or_when_the_trigger_fires_again():
    every = AskingConfig(max_calls=3, again="every", every_queries=2)
    records = rows(STILL_FROM_8)
    assert call_steps(24, every, STALL, records, "c", H, C) == [24, 40, 56]
    assert call_steps(24, every.model_copy(update={"max_calls": 2}), STALL, records, "c", H, C) == [24, 40]
    assert call_steps(48, every, STALL, records, "c", H, C) == [48]  # the episode ends first
    assert call_steps(24, every, STALL, records[:4], "c", H, C) == [24]  # the arm's records end at 24
    assert call_steps(None, every, STALL, records, "c", H, C) == []
    fires_again = AskingConfig(max_calls=3, again="fires", every_queries=1)
    # Its window counts from the last call: still from 24 on, the stall fires again two queries later.
    assert call_steps(24, fires_again, STALL, records, "c", H, C) == [24, 40, 56]
    assert call_steps(24, fires_again, None, records, "c", H, C) == [24, 32, 40]  # no trigger: every_queries


def test_triggers_are_arms_of_the_primary_after_the_query_points_and_part_of_the_identity():
    base = {"policy": {"replan_interval": C}, "sham": {"source": "fixed"}}
    config = StudyConfig.model_validate({**base, "query_point": [{"name": "early", "fraction": 0.25}],
                                         "trigger": [{"name": "stall", "kind": "stall"},
                                                     {"name": "placebo", "kind": "random", "matches": "stall",
                                                      "rate": 0.3}],
                                         "asking": {"max_calls": 2}})
    assert config.arms == ("control", "assisted", "assisted@early", "assisted@stall", "assisted@placebo", "sham")
    assert config.trigger_of("assisted@stall").window == 4 and config.trigger_of("assisted@early") is None
    assert config.max_calls == 2 and config.forked is False and config.fork_at_q is None
    with pytest.raises(ValueError, match="decided while the episode runs"):
        config.query_step("assisted@stall", 280)
    # Part of the identity; a configuration without them hashes as it always has.
    plain = StudyConfig.model_validate(base)
    other = StudyConfig.model_validate({**base, "trigger": [{"name": "stall", "kind": "stall", "window": 3}]})
    assert len({config.sha256(), other.sha256(), plain.sha256()}) == 3
    assert plain.sha256() == StudyConfig.model_validate({**base, "asking": None, "triggers": None}).sha256()
    for data, words in (
        ({"trigger": [{"name": "s", "kind": "stall", "cycles": 2}]}, "cycles is not a parameter of a stall trigger"),
        ({"trigger": [{"name": "p", "kind": "random", "rate": 0.2}]}, "names the trigger it matches"),
        ({"trigger": [{"name": "p", "kind": "random", "matches": "nope", "rate": 0.2}]}, "which is no other [[trigger]]"),
        ({"trigger": [{"name": "x", "kind": "stall"}], "query_point": [{"name": "x", "fraction": 0.5}]},
         "declare each [[query_point]] and [[trigger]] once"),
        ({"trigger": [{"name": "s", "kind": "stall"}], "fork_at_q": False}, "need fork_at_q"),
        ({"trigger": [{"name": "s", "kind": "stall", "window": 0}]}, "triggers.0.window"),
        ({"trigger": [{"name": "p", "kind": "random", "matches": "s", "rate": 1.5}]}, "triggers.0.rate"),
        ({"asking": {"max_calls": 2}, "continuations": 2}, "asking.max_calls above 1 with continuations above 1"),
        ({"asking": {"max_calls": 0}}, "asking.max_calls"),
    ):
        with pytest.raises(ConfigError) as exc:
            validate_config(data, "study.toml")
        assert words in str(exc.value) and "\n" not in str(exc.value).strip(), str(exc.value)


# --- a forked case with a stall trigger, judged from the re-derived firing ------------------------------------


def _config(**extra) -> StudyConfig:
    return StudyConfig.model_validate({"policy": {"replan_interval": C}, "fork_at_q": True,
                                       "trigger": [STALL.model_dump(), PLACEBO.model_dump()], **extra})


def _rows(tag: str, start: int, end: int, instruction: str) -> list[TraceRow]:
    return [TraceRow(step=s, state=digest_text(f"{tag}-{s}"), images={}, instruction=digest_text(instruction),
                     actions=digest_text(f"{tag}-a-{s}")) for s in range(start, end, C)]


def _fork_case(positions, outcome: str = "failure", success: bool = True):
    """The leader (control) with its queries at `positions`, the stall trigger's arm forked where it fires (or not
    asked), and the placebo's where its seeded draw asks."""
    config = _config()
    case = Case.model_validate({"case_id": "k", "suite": "libero_object", "task_id": 0, "init_state_index": 0,
                                "env_seed": 7, "horizon": H, "group": "g", "instruction": ORIGINAL,
                                "fingerprint": FP, "outcome": outcome})
    queries = rows(positions)
    fired = {t.name: first_firing(t, queries, "k", H, C, triggers=[STALL, PLACEBO]) for t in (STALL, PLACEBO)}
    states = {s: digest_text(f"state-{s}") for s in range(0, H, C)}
    control = ArmResult(case_id="k", arm="control", status="complete", success=outcome == "success", steps=H,
                        fingerprint=FP, trace=_rows("control", 0, H, ORIGINAL), queries=queries, mode="fork",
                        assistance=Assistance(status="control"), trigger_steps=fired, q_state=states[32],
                        fork_states={s: states[s] for s in fired.values() if s is not None and s != 32})
    arms, receipts = {"control": control}, {}
    for name, step in fired.items():
        arm = f"assisted@{name}"
        if step is None:
            arms[arm] = control.model_copy(update={"arm": arm, "assistance": Assistance(status="not_asked"),
                                                   "trigger_steps": {}, "fork_states": {}, "q_state": None})
            continue
        subgoal = f"grasp it ({name})"
        text = injected(ORIGINAL, subgoal)
        call, req = f"call-{name}", f"req-{name}"
        arms[arm] = ArmResult(case_id="k", arm=arm, status="complete", success=success, steps=H, fingerprint=FP,
                              mode="fork", q_state=states[step], queries=queries,
                              trace=[r for r in control.trace if r.step < step] + _rows(arm, step, H, text),
                              assistance=Assistance(status="applied", query_step=step, subgoal=subgoal,
                                                    instruction=text, instruction_digest=digest_text(text),
                                                    call_id=call, request_id=req))
        receipts[call] = Receipt(kind="outcome", call_id=call, attempt=1, request_ids=[req], tokens={req: "t"},
                                 case_ids=["k"], model_requested="m", endpoint_kind="chat", prompt_template="p",
                                 prompt_template_sha256="0" * 64, prompt_sha256="0" * 64, started_at=0.0,
                                 status="ok", subgoals={req: subgoal})
    arms["assisted"] = None  # the primary's arm is not the point here
    return config, case, arms, receipts


def test_a_triggers_arm_is_judged_at_the_step_its_trigger_fires_on_the_control_arms_queries():
    config, case, arms, receipts = _fork_case(STILL_FROM_8)
    rec = case_record(case, arms, receipts, config, interrupted=False)
    assert rec.q_of("assisted@stall") == 24 and "assisted@stall" not in rec.unasked
    verdict = classify_case(config, case, arms, receipts, interrupted=False)
    assert verdict.arms["assisted@stall"].label == "rescued" and verdict.arms["assisted@stall"].in_e
    # The leader's queries edited so that the stall is elsewhere: the arm asked where its trigger does not fire.
    moved = dict(arms, control=arms["control"].model_copy(update={"queries": rows(MOVING)}))
    judged = classify_case(config, case, moved, receipts, interrupted=False).arms["assisted@stall"]
    assert (judged.label, judged.rule) == ("unknown", 6) and "never fires" in judged.reason


def test_a_trigger_that_never_fires_leaves_its_arm_the_control_not_asked_and_a_success_unexposed():
    config, case, arms, receipts = _fork_case(MOVING)
    judged = classify_case(config, case, arms, receipts, interrupted=False).arms["assisted@stall"]
    assert (judged.label, judged.rule, judged.in_m, judged.in_e) == ("not_rescued", 4, True, False)
    assert "never fired: not asked" in judged.reason
    config, case, arms, receipts = _fork_case(MOVING, outcome="success")
    judged = classify_case(config, case, arms, receipts, interrupted=False).arms["assisted@stall"]
    assert (judged.label, judged.rule) == ("kept", 4) and "kept by construction" in judged.reason
    # Not asked, though the trigger fires on the leader's queries: no evidence of not asking.
    still = dict(arms, control=arms["control"].model_copy(update={"queries": rows(STILL_FROM_8)}))
    judged = classify_case(config, case, still, receipts, interrupted=False).arms["assisted@stall"]
    assert (judged.label, judged.rule) == ("unknown", 6) and "fires at step 24" in judged.reason
