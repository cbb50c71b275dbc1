"""When to ask (DESIGN §14): declared extra query points, each an arm of the primary advisor's asking at
q_f = ceil(f*H/C)*C, forked from the one prefix at its own q, judged against the shared control arm and compared
with the pre-registered q's arm; the pre-registered q keeps the case's label."""

from __future__ import annotations

import math

import pytest
from helpers.case_records import C, FP, H, ORIGINAL, Q, injected, make_case, make_trace, with_arms

from rescue.core.classify import classify
from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.config_files import ConfigError, validate_config
from rescue.core.digest import digest_text
from rescue.core.querypoint import query_point
from rescue.core.records import ArmResult, Assistance, Receipt
from rescue.core.figures.stats import summarize
from rescue.core.figures.exact_stats import holm, mcnemar_exact

pytestmark = pytest.mark.fast

POINTS = [{"name": "early", "fraction": 0.25}, {"name": "late", "fraction": 0.75}]


def test_a_query_point_is_a_fraction_of_the_horizon_on_the_replan_grid():
    for horizon in range(1, 600, 7):
        for interval in (1, 5, 8, 16):
            assert query_point(horizon, interval) == math.ceil(horizon / 2 / interval) * interval
            assert query_point(horizon, interval, 0.25) == math.ceil(horizon / 4 / interval) * interval
    assert query_point(1800, 16) == 912  # the seed's
    assert query_point(280, 8, 0.75) == 216
    with pytest.raises(ValueError):
        query_point(280, 8, 1.0)


def test_query_points_are_arms_of_the_primary_part_of_the_identity_and_need_the_fork():
    config = StudyConfig.model_validate({"query_point": POINTS, "sham": {"source": "fixed"}, "policy": {"replan_interval": 8}})
    assert config.arms == ("control", "assisted", "assisted@early", "assisted@late", "sham")
    assert [config.query_step(a, 280) for a in ("assisted", "assisted@early", "assisted@late", "sham")] == [144, 72, 216, 144]
    with_advisors = StudyConfig.model_validate({"query_point": POINTS[:1], "advisor": [{"name": "a"}, {"name": "b"}]})
    assert with_advisors.arms == ("control", "assisted:a", "assisted:b", "assisted:a@early")
    # Part of the identity: another fraction is another study; a config without them hashes as before.
    other = StudyConfig.model_validate({"query_point": [{"name": "early", "fraction": 0.3}], "sham": {"source": "fixed"}})
    assert len({config.sha256(), other.sha256(), StudyConfig(sham={"source": "fixed"}).sha256()}) == 3
    for data, words in (({"query_point": POINTS, "fork_at_q": False}, "need fork_at_q"),
                        ({"query_point": [POINTS[0], POINTS[0]]}, "declare each [[query_point]] once"),
                        ({"query_point": [{"name": "x", "fraction": 1.5}]}, "query_points.0.fraction"),
                        ({"arms": ["control", "assisted@x"]}, "no [[query_point]] is declared"),
                        # Two arms that would ask at one q are one arm twice; a name that names an arm confuses them.
                        ({"query_point": [{"name": "a", "fraction": 0.25}, {"name": "b", "fraction": 0.25}]},
                         "'a' and 'b' both ask at fraction 0.25"),
                        ({"query_point": [{"name": "half", "fraction": 0.5}]}, "the pre-registered q's"),
                        ({"query_point": [{"name": "assisted", "fraction": 0.25}]}, "'assisted' names an arm")):
        with pytest.raises(ConfigError) as exc:
            validate_config(data, "study.toml")
        assert words in str(exc.value), str(exc.value)


def test_two_fractions_the_replan_grid_rounds_to_one_step_are_refused_for_the_cases_they_meet():
    from rescue.core.configuration.work_limit import config_work_problem

    config = StudyConfig.model_validate({"query_point": [{"name": "near", "fraction": 0.49}],
                                         "policy": {"replan_interval": 16}})
    problem = config_work_problem(config, [280])  # ceil(0.49 * 280 / 16) * 16 = 144 = the pre-registered q
    assert "'assisted' and 'assisted@near' both ask at step 144 of a case of horizon 280" in problem
    assert config_work_problem(config, [1000]) is None  # at H = 1000 they are apart: 496 and 512


def _point_arm(rec, name: str, q: int, success: bool, state_at_q: str) -> tuple[ArmResult, Receipt]:
    """The arm of query point `name` of a forked case: the leader's prefix to its q, its own call there."""
    subgoal = f"subgoal asked at {q}"
    instruction = injected(ORIGINAL, subgoal)
    call, req = f"call-{rec.case_id}-{name}", f"req-{rec.case_id}-{name}"
    # The leader's rows before its q, then its own, queried with the injected instruction.
    trace = [r for r in rec.control.trace if r.step < q] + [
        r.model_copy(update={"instruction": digest_text(instruction)}) for r in make_trace(name) if r.step >= q]
    arm = ArmResult(case_id=rec.case_id, arm=f"assisted@{name}", status="complete", success=success, steps=H,
                    fingerprint=FP, trace=trace, mode="fork", q_state=state_at_q,
                    assistance=Assistance(status="applied", query_step=q, subgoal=subgoal, instruction=instruction,
                                          instruction_digest=digest_text(instruction), call_id=call, request_id=req))
    receipt = rec.receipt.model_copy(update={"call_id": call, "request_ids": [req], "tokens": {req: "tok"},
                                             "subgoals": {req: subgoal}})
    return arm, receipt


def point_case(case_id: str, early: bool, primary: bool, late: bool, control: bool = False):
    rec = make_case(case_id, control_success=control, assisted_success=primary)
    q_early, q_late = Q - 2 * C, Q + 2 * C
    states = {Q: digest_text("state at q"), q_early: digest_text("state early"), q_late: digest_text("state late")}
    for arm in rec.arms.values():
        arm.mode, arm.q_state = "fork", states[Q]
    rec.control.fork_states = {q_early: states[q_early], q_late: states[q_late]}
    arms, receipts = {}, {}
    for name, q, ok in (("early", q_early, early), ("late", q_late, late)):
        arms[f"assisted@{name}"], receipts[f"assisted@{name}"] = _point_arm(rec, name, q, ok, states[q])
    return with_arms(rec, arms, receipts, query_steps={"assisted@early": q_early, "assisted@late": q_late})


def test_each_query_points_arm_is_judged_at_its_own_q_against_the_leaders_state_there():
    rec = point_case("c", early=True, primary=False, late=True)
    v = classify(rec)
    assert (v.label, v.rule) == ("not_rescued", 8)  # the pre-registered q's arm keeps the label
    assert (v.arms["assisted@early"].label, v.arms["assisted@late"].label) == ("rescued", "rescued")
    assert "applied at step" not in v.arms["assisted@early"].reason  # a verdict, not an evidence line
    # Restored into another state than the leader's at its q: not in M (rule 5), and only that arm.
    moved = rec.arms["assisted@early"].model_copy(update={"q_state": digest_text("elsewhere")})
    v = classify(with_arms(rec, {"assisted@early": moved}))
    assert (v.arms["assisted@early"].rule, v.arms["assisted@late"].label, v.label) == (5, "rescued", "not_rescued")
    # Its instruction tied to another query point's receipt line: no evidence (rule 6).
    stolen = rec.receipts["assisted@late"]
    v = classify(with_arms(rec, receipts={"assisted@early": stolen}))
    assert v.arms["assisted@early"].rule == 6 and v.arms["assisted@late"].rule == 9
    # Its prefix is the shared trace up to its own q: a row before it edited breaks it.
    edited = rec.arms["assisted@early"].model_copy(deep=True)
    edited.trace[1] = edited.trace[1].model_copy(update={"actions": digest_text("other")})
    assert classify(with_arms(rec, {"assisted@early": edited})).arms["assisted@early"].rule == 5


def test_every_query_point_is_compared_with_control_and_each_pair_of_them_holm_adjusted():
    outcomes = [(True, False, False)] * 6 + [(True, True, False)] * 3 + [(False, False, True)] * 1 + [(False, False, False)] * 4
    records = [point_case(f"k{i}", *row) for i, row in enumerate(outcomes)]
    s = summarize(records, [classify(r) for r in records])
    assert s.arm == "assisted" and s.r == 3
    figures = {f.arm: f for f in s.figures()}
    assert (figures["assisted@early"].r, figures["assisted@late"].r) == (9, 1)
    pairs = {(c.first, c.second): c for c in s.comparisons}
    assert list(pairs) == [("assisted", "assisted@early"), ("assisted", "assisted@late"), ("assisted@early", "assisted@late")]
    pe = pairs[("assisted", "assisted@early")]
    assert (pe.pairs.first_only, pe.pairs.second_only, pe.k) == (0, 6, 14)
    raw = [mcnemar_exact(0, 6), mcnemar_exact(3, 1), mcnemar_exact(9, 1)]
    assert [c.mcnemar_p for c in pairs.values()] == pytest.approx(raw)
    assert [c.holm_p for c in pairs.values()] == pytest.approx(holm(raw))


def _combination(advisors: int, points: int, sham: str, k: int) -> dict:
    data: dict = {"policy": {"replan_interval": 8}, "continuations": k, "sham": {"source": sham}}
    if advisors:
        data["advisor"] = [{"name": n} for n in ("wrongobj", "local")[:advisors]]
    if points:
        data["query_point"] = POINTS[:points]
    return data


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("sham", ["off", "fixed", "permuted"])
@pytest.mark.parametrize("points", [0, 1, 2])
@pytest.mark.parametrize("advisors", [0, 1, 2])
def test_every_combination_the_config_accepts_is_a_study_that_reads_back_and_whose_arms_all_have_a_source(
        tmp_path, advisors, points, sham, k):
    """The study folder holds its configuration as JSON; the study it creates must accept it back (it refused
    advisors with query points: `assisted:a@early` was taken for an advisor's arm), and every arm a case runs must
    have who answers it and where it asks."""
    from conftest import resolved_config

    from rescue.core.arms import arm_advisor, base_arm, is_assisted, query_point_of
    from rescue.core.manifest import parse_manifest
    from rescue.study.folder import create_study, load_study_config

    config = resolved_config(8, **_combination(advisors, points, sham, k))
    line = '{"case_id": "c0", "suite": "libero_object", "task_id": 0, "init_state_index": 0, "env_seed": 7, "horizon": 280}\n'
    create_study(tmp_path / "s", parse_manifest(line.encode(), "m.jsonl"), config)
    again = load_study_config(tmp_path / "s")
    assert again == config
    names = [a.name for a in config.advisors or []]
    asking = [a for a in again.arms if is_assisted(a)]
    assert len([a for a in asking if query_point_of(a) is None]) == max(1, advisors)
    assert [query_point_of(a) for a in asking if query_point_of(a)] == [p["name"] for p in POINTS[:points]]
    assert ("sham" in again.arms) == (sham != "off")
    assert len(again.case_arms) == len(again.arms) * k
    sources = {arm for _, arm, _ in again.advisor_configs()}
    for arm in again.case_arms:
        base = base_arm(arm, query_point=False)
        assert base in ("control", "sham") or base in sources, arm
        assert arm_advisor(arm) is None or arm_advisor(arm) in names
        assert again.query_step(arm, 280) % 8 == 0
