"""Paired comparison of two policies: pairing and figures (pure), two real journals, and a real `rescue compare`."""

from __future__ import annotations

import json
import math
import sqlite3

import numpy as np
import pytest
from conftest import kill_mid_study, rescue_cli

from rescue.core.configuration.config import StudyConfig
from rescue.core.digest import digest_text
from rescue.core.figures.evaluation import classify_episode, episode_cases, summarize_eval, summarize_labels
from rescue.core.manifest import Case, parse_manifest
from rescue.core.records import ArmResult, Assistance
from rescue.core.verdicts import Verdict
from rescue.core.figures.exact_stats import paired_diff_ci
from rescue.core.figures.comparison import Episode, compare_episodes, pair_episodes
from rescue.run.compare import (
    PLAN_FILE,
    RESULT_FILE,
    ComparePlan,
    CompareRequest,
    Side,
    compare_studies,
    create_compare,
    load_plan,
    side_config,
)
from rescue.run.recovery import recover
from rescue.study.folder import StudyError, create_study
from rescue.study.journal import Journal

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

FP = digest_text("the same initial state")


def ep(case_id: str, label: str | None, task: str = "t0", group: str = "g", fingerprint: str | None = FP) -> Episode:
    return Episode(case_id=case_id, task=task, group=group, label=label, fingerprint=fingerprint if label else None)


def seed_sides(rng_seed: int = 7) -> tuple[list[Episode], list[Episode]]:
    """The seed's confirmation: 600 pairs on 30 tasks x 20 seeds; A 413 successes, B 419; B wins 53, loses 47."""
    outcomes = ["both_success"] * 366 + ["win"] * 53 + ["loss"] * 47 + ["both_fail"] * 134
    np.random.default_rng(rng_seed).shuffle(outcomes)
    a, b = [], []
    for i, outcome in enumerate(outcomes):
        task = f"task{i // 20}"
        a_ok = outcome in ("both_success", "loss")
        b_ok = outcome in ("both_success", "win")
        a.append(ep(f"ep{i}", "success" if a_ok else "failure", task))
        b.append(ep(f"ep{i}", "success" if b_ok else "failure", task))
    return a, b


# --- (a) the seed's paired figures ---------------------------------------------------


def test_seed_confirmation_figures():
    a, b = seed_sides()
    c = compare_episodes(a, b, seed=11)
    k, v = c.counts, c.counts.versus
    t = v.pairs  # B first: wins are first_only, losses second_only
    assert (k.n, v.k, t.first_only, t.second_only, t.both_success + t.both_fail) == (600, 600, 53, 47, 500)
    assert (t.both_success, t.both_fail) == (366, 134)
    assert (v.first, v.second) == ("b", "a")
    assert round(100 * c.a_rate, 2) == 68.83 and round(100 * c.b_rate, 2) == 69.83
    assert v.diff == pytest.approx(6 / 600)
    assert round(v.mcnemar_p, 4) == 0.6173
    assert c.excluded == {}

    # Newcombe's paired interval, B minus A: the analytic one over the same 2x2.
    lo, hi = v.diff_ci
    assert (lo, hi) == paired_diff_ci(53, 47, 600, 0.95, both_success=366)
    assert (round(lo, 4), round(hi, 4)) == (-0.0228, 0.0428)
    assert -1 < lo < 0 < v.diff < hi < 1  # not a reliable improvement
    wider = compare_episodes(a, b, seed=11, confidence=0.99).counts.versus.diff_ci
    assert wider[0] < lo and wider[1] > hi

    # The task-block bootstrap: reproducible from the recorded seed, around the point estimate.
    assert c.bootstrap_seed == 11 and c.bootstrap_reps == 2000
    blo, bhi = c.bootstrap_ci
    assert blo < v.diff < bhi and blo < 0 < bhi
    assert compare_episodes(a, b, seed=11).bootstrap_ci == (blo, bhi)
    assert compare_episodes(a, b, seed=12).bootstrap_ci != (blo, bhi)

    # Each side over all its episodes.
    assert (c.a.overall.success, c.a.overall.n) == (413, 600)
    assert (c.b.overall.success, c.b.overall.n) == (419, 600)
    assert sum(t.versus.k for t in c.per_task.values()) == 600 and len(c.per_task) == 30


def test_swapping_the_sides_mirrors_the_figures():
    a, b = seed_sides()
    ab, ba = compare_episodes(a, b, seed=3), compare_episodes(b, a, seed=3)
    t, ab, ba = ba.counts.versus.pairs, ab.counts.versus, ba.counts.versus
    assert (t.first_only, t.second_only, t.both_success + t.both_fail) == (47, 53, 500)
    assert ba.diff == pytest.approx(-ab.diff)
    assert ba.mcnemar_p == pytest.approx(ab.mcnemar_p)
    assert ba.diff_ci == pytest.approx((-ab.diff_ci[1], -ab.diff_ci[0]))


def test_excluded_pairs_are_counted_and_named_but_leave_the_paired_figures_alone():
    a, b = seed_sides()
    extra_a = [
        ep("moved", "success", "task0", fingerprint=digest_text("state A")),
        ep("crashed", "unknown", "task1", fingerprint=None),
        ep("half-run", "failure", "task2"),
        ep("only-a", "success", "task3"),
        ep("unknown-but-moved", "unknown", "task4", fingerprint=digest_text("state A")),
    ]
    extra_b = [
        ep("moved", "failure", "task0", fingerprint=digest_text("state B")),
        ep("crashed", "success", "task1"),
        ep("half-run", None, "task2"),
        ep("unknown-but-moved", "failure", "task4", fingerprint=digest_text("state B")),
        ep("only-b", "failure", "task5"),
    ]
    base = compare_episodes(a, b, seed=5)
    c = compare_episodes(a + extra_a, b + extra_b, seed=5)
    k = c.counts
    assert k.n == 606 and k.versus.k == 600
    assert (k.fingerprint_mismatch, k.unknown, k.unexecuted, k.unmatched) == (2, 1, 1, 2)
    assert k.n == k.versus.k + k.fingerprint_mismatch + k.unknown + k.unexecuted + k.unmatched
    assert c.excluded == {
        "fingerprint_mismatch": ["moved", "unknown-but-moved"],
        "unknown": ["crashed"],
        "unexecuted": ["half-run"],
        "unmatched": ["only-a", "only-b"],
    }
    for field in ("a_rate", "b_rate", "bootstrap_ci"):
        assert getattr(c, field) == getattr(base, field), field
    assert c.counts.versus == base.counts.versus  # the 2x2, diff, McNemar p and Newcombe interval
    # The sides' own rates keep every episode in the denominator.
    assert (c.a.overall.n, c.a.overall.unknown, c.a.overall.success) == (605, 2, 415)
    assert (c.b.overall.n, c.b.overall.unexecuted) == (605, 1)
    assert c.per_task["task0"].fingerprint_mismatch == 1 and c.per_task["task0"].versus.k == 20
    by_id = {p.case_id: p for p in c.pairs}
    assert by_id["moved"].status == "fingerprint_mismatch" and by_id["moved"].outcome is None
    assert by_id["moved"].a_fingerprint != by_id["moved"].b_fingerprint


def test_pairing_rules():
    pairs = pair_episodes(
        [ep("x", "success"), ep("y", "failure", fingerprint=None), ep("z", "success", task="t1")],
        [ep("x", "failure"), ep("y", "failure"), ep("z", "success", task="t2")],
    )
    assert [(p.status, p.outcome) for p in pairs] == [
        ("paired", "loss"),
        ("fingerprint_mismatch", None),  # a completed episode without a fingerprint proves nothing
        ("unmatched", None),  # one id, two different tasks
    ]
    with pytest.raises(ValueError, match="twice"):
        pair_episodes([ep("x", "success"), ep("x", "failure")], [])


def test_nothing_paired():
    c = compare_episodes([ep("x", "unknown")], [ep("x", "success")])
    v = c.counts.versus
    assert v.k == 0 and c.counts.unknown == 1
    assert c.a_rate is None and v.diff is None and v.diff_ci is None and c.bootstrap_ci is None
    assert v.mcnemar_p == 1.0
    assert math.isclose(c.b.overall.rate, 1.0)


# --- (b) per-group rates through the evaluation and comparison summaries -------------------


SEED_GROUPS = {"Atomic-Seen": (12, 153), "Composite-Seen": (25, 321), "Composite-Unseen": (19, 530)}


def seed_group_episodes() -> list[Episode]:
    """Per group, the seed's successes among its episodes; a few unknown and never-run ones stay in N."""
    out = []
    for group, (wins, n) in SEED_GROUPS.items():
        for i in range(n):
            label = "success" if i < wins else "unknown" if i == wins else None if i == wins + 1 else "failure"
            out.append(ep(f"{group}-{i}", label, task=f"{group}/task{i % 7}", group=group))
    return out


def test_seed_group_rates_through_the_evaluation_summary():
    episodes = seed_group_episodes()
    summary = summarize_labels((e.task, e.group, e.label) for e in episodes)
    rates = {g: round(100 * r.rate, 2) for g, r in summary.per_group.items()}
    assert rates == {"Atomic-Seen": 7.84, "Composite-Seen": 7.79, "Composite-Unseen": 3.58}
    for group, (wins, n) in SEED_GROUPS.items():
        r = summary.per_group[group]
        assert (r.n, r.success, r.unknown, r.unexecuted, r.failure) == (n, wins, 1, 1, n - wins - 2)
    assert (summary.overall.success, summary.overall.n) == (56, 1004)
    assert round(100 * summary.overall.rate, 2) == 5.58
    assert sum(r.n for r in summary.per_task.values()) == 1004

    # The same through a study's cases and stored verdicts.
    cases = [
        Case(case_id=e.case_id, suite="s", task_id=0, init_state_index=0, env_seed=0, horizon=8, group=e.group)
        for e in episodes
    ]
    verdicts = {
        e.case_id: Verdict(case_id=e.case_id, label=e.label, rule=0, reason="-") for e in episodes if e.label
    }
    by_cases = summarize_eval(cases, verdicts)
    assert by_cases.per_group == summary.per_group and by_cases.overall == summary.overall


def test_seed_group_rates_through_the_comparison():
    b = seed_group_episodes()
    a = [e.model_copy(update={"label": "failure" if e.label else None}) for e in b]
    c = compare_episodes(a, b)
    assert {g: round(100 * r.rate, 2) for g, r in c.b.per_group.items()} == {
        "Atomic-Seen": 7.84, "Composite-Seen": 7.79, "Composite-Unseen": 3.58,
    }
    assert {g: (p.versus.pairs.first_only, p.unknown, p.unexecuted) for g, p in c.per_group.items()} == {
        g: (wins, 1, 1) for g, (wins, _) in SEED_GROUPS.items()
    }
    t = c.counts.versus.pairs
    assert t.first_only == 56 and t.second_only == 0 and t.k == 1004 - 6


# --- two real evaluation journals, no simulator ---------------------------------------------


def write_side(folder, cases: list[Case], results: dict[str, tuple[bool | None, str | None]], config: StudyConfig):
    """Play the engine's part on a real journal: claim, record the control arm, finish; None: crash mid-way."""
    manifest = parse_manifest("".join(c.model_dump_json() + "\n" for c in cases).encode(), "episodes")
    policy = config.policy.model_copy(update={"replan_interval": 8, "announced": {}})
    create_study(folder, manifest, config.model_copy(update={"policy": policy}), {"kind": "evaluation"})
    with Journal.open(folder) as journal:
        for case_id, (success, fingerprint) in results.items():
            journal.claim(case_id, "w0")
            if success is None:
                continue
            arm = ArmResult(
                case_id=case_id, arm="control", status="complete", success=success, steps=40 if success else 64,
                fingerprint=fingerprint, assistance=Assistance(status="control"),
            )
            journal.finish_case(case_id, [arm], classify_episode(case_id, arm, False))
    recover(folder)


def test_compare_studies_reads_two_journals(tmp_path):
    cases = episode_cases("libero_object", [3, 4], 2, 64)
    ids = [c.case_id for c in cases]
    config = StudyConfig(arms=("control",))
    other = digest_text("another layout")
    write_side(tmp_path / "a", cases, {ids[0]: (True, FP), ids[1]: (False, FP), ids[2]: (False, FP)}, config)
    write_side(tmp_path / "b", cases, {ids[0]: (True, FP), ids[1]: (True, FP), ids[2]: (True, other), ids[3]: (None, None)}, config)
    side = Side(name="x", config_sha256=config.sha256())
    plan = ComparePlan(suite="libero_object", tasks=[3, 4], episodes=2, horizon=64, seed=4, reps=500, a=side, b=side)
    (tmp_path / PLAN_FILE).write_text(plan.model_dump_json())

    c = compare_studies(tmp_path)
    k, t = c.counts, c.counts.versus.pairs
    assert (t.k, t.first_only, t.both_success, k.fingerprint_mismatch, k.unexecuted) == (2, 1, 1, 1, 1)
    assert c.excluded == {"fingerprint_mismatch": [ids[2]], "unexecuted": [ids[3]]}
    # ids[3] never ran on side a and was interrupted on side b: unexecuted there, unknown here.
    assert (c.a.overall.unexecuted, c.b.overall.unknown) == (1, 1)
    assert c.bootstrap_seed == 4 and c.bootstrap_reps == 500
    con = sqlite3.connect(tmp_path / "b" / "journal.sqlite")
    stored = dict(con.execute("SELECT case_id, digest FROM arms"))
    con.close()
    assert {p.case_id: p.b_result_sha256 for p in c.pairs if p.b_result_sha256} == stored

    # Two sides that ran different episodes are not paired at all.
    write_side(tmp_path / "c", episode_cases("libero_object", [3, 4], 3, 64), {}, config)
    (tmp_path / "b").rename(tmp_path / "b-real")
    (tmp_path / "c").rename(tmp_path / "b")
    with pytest.raises(StudyError, match="different episode manifests"):
        compare_studies(tmp_path)


def test_a_comparison_is_laid_out_before_either_side_runs(tmp_path):
    configs = (
        side_config(None, "rescue.embedded.scripted:make_policy")[0],
        side_config(None, "rescue.embedded.variants:make_steady_policy", {"cases_in_flight": 1})[0],
    )
    plan = create_compare(tmp_path, CompareRequest(suite="libero_object", tasks=[3, 4], episodes=2, horizon=64, seed=5),
                          configs, ("a", "b"))
    assert load_plan(tmp_path) == plan and plan.seed == 5
    metas = []
    for side, config in zip(("a", "b"), configs):
        with Journal.open(tmp_path / side, readonly=True) as journal:
            metas.append(journal.meta())
            assert journal.pending_ids() == [c.case_id for c in episode_cases("libero_object", [3, 4], 2, 64)]
        pinned = getattr(plan, side)
        assert metas[-1]["kind"] == "evaluation" and metas[-1]["config_sha256"] == pinned.config_sha256
        assert config.arms == ("control",) and pinned.config["arms"] == ["control"]
        # The side's identity was fixed when the comparison was laid out: C from the policy's metadata.
        assert pinned.config["policy"]["replan_interval"] == 8 and pinned.config["policy"]["observation"] == "privileged"
    assert metas[0]["manifest_sha256"] == metas[1]["manifest_sha256"]
    assert plan.a.config["policy"]["factory"] != plan.b.config["policy"]["factory"]
    with pytest.raises(StudyError, match="already holds a comparison"):
        create_compare(tmp_path, CompareRequest(suite="libero_object", tasks=[3], episodes=1, horizon=64), configs, ("a", "b"))
    with pytest.raises(StudyError, match="config file or a policy"):
        side_config(None, None)
    assert side_config(None, "ws://127.0.0.1:9")[0].policy.url == "ws://127.0.0.1:9"


# --- (d) a real `rescue compare` on LIBERO -----------------------------------------------------


def test_rescue_compare_end_to_end(tmp_path):
    study = tmp_path / "cmp"
    out = rescue_cli(
        "compare",
        "--policy-a", "rescue.embedded.scripted:make_policy",
        "--policy-b", "rescue.embedded.variants:make_shaky_policy",
        "--suite", "libero_object", "--tasks", "3", "--first-init", "2", "--episodes", "2", "--horizon", "150",
        "--seed", "9", "--reps", "300", "--study", str(study),
    )
    for shown in ("wins / losses / ties", "exact McNemar p", "Newcombe", "task-bootstrap", "each side over all"):
        assert shown in out.stdout
    plan = json.loads((study / PLAN_FILE).read_text())
    assert plan["seed"] == 9 and plan["a"]["name"] != plan["b"]["name"]
    assert plan["a"]["config_sha256"] != plan["b"]["config_sha256"]
    result = json.loads((study / RESULT_FILE).read_text())
    assert result["schema_version"] == "rescue-comparison/2"
    k, v = result["counts"], result["counts"]["versus"]
    t = v["pairs"]  # B first: wins are first_only, losses second_only
    assert k["n"] == 2
    assert k["n"] == v["k"] + k["fingerprint_mismatch"] + k["unknown"] + k["unexecuted"] + k["unmatched"]
    assert v["k"] == t["first_only"] + t["second_only"] + t["both_success"] + t["both_fail"]
    assert result["bootstrap_seed"] == 9 and result["bootstrap_reps"] == 300

    # Both sides ran the same episodes from the same initial states; each pair's fingerprints match.
    metas = []
    for side in ("a", "b"):
        with Journal.open(study / side, readonly=True) as journal:
            metas.append(journal.meta())
            stored = {row.case_id: row.digest for row in journal.arm_rows()}
        assert metas[-1]["kind"] == "evaluation"
        assert {p["case_id"]: p[f"{side}_result_sha256"] for p in result["pairs"]} == stored
    assert metas[0]["manifest_sha256"] == metas[1]["manifest_sha256"]
    assert metas[0]["config_sha256"] == plan["a"]["config_sha256"] and metas[1]["config_sha256"] == plan["b"]["config_sha256"]
    for pair in result["pairs"]:
        assert pair["status"] == "paired" and pair["a_fingerprint"] and pair["a_fingerprint"] == pair["b_fingerprint"]
    successes = {side: sum(p[f"{side}_label"] == "success" for p in result["pairs"]) for side in ("a", "b")}
    assert result["a_rate"] == successes["a"] / 2 and result["b_rate"] == successes["b"] / 2
    assert t["first_only"] - t["second_only"] == successes["b"] - successes["a"]

    # Each side is an ordinary evaluation study: it re-verifies on its own.
    for side in ("a", "b"):
        assert rescue_cli("verify", str(study / side)).returncode == 0

    # Resuming a finished comparison runs nothing and reports the same figures.
    again = rescue_cli("compare", "--resume", str(study))
    assert "interrupted" not in again.stdout
    assert json.loads((study / RESULT_FILE).read_text())["counts"] == k


def test_sigkill_mid_compare_then_resume_excludes_interrupted_pairs_as_unknown(tmp_path):
    study = tmp_path / "cmp"
    kill_mid_study(
        ["compare", "--policy-a", "rescue.embedded.scripted:make_policy", "--policy-b", "rescue.embedded.variants:make_steady_policy",
         "--tasks", "3", "--episodes", "3", "--horizon", "48", "--cases-in-flight", "1", "--study", str(study)],
        study / "a",
    )
    with Journal.open(study / "a", readonly=True) as journal:
        in_flight = [row.case_id for row in journal.rows() if row.state == "claimed"]
        before = {row.case_id: row.digest for row in journal.arm_rows()}

    out = rescue_cli("compare", "--resume", str(study))
    assert "recorded as unknown (interrupted)" in " ".join(out.stdout.split())
    result = json.loads((study / RESULT_FILE).read_text())
    k = result["counts"]
    assert k["n"] == 3 and k["unknown"] == len(in_flight) and k["versus"]["k"] == 3 - len(in_flight)
    assert result["excluded"] == {"unknown": in_flight}
    assert result["a"]["overall"]["unknown"] == len(in_flight) and result["a"]["overall"]["unexecuted"] == 0
    with Journal.open(study / "a", readonly=True) as journal:
        after = {row.case_id: row.digest for row in journal.arm_rows()}
    # Finished episodes keep their records; the interrupted ones were not run again.
    assert {c: d for c, d in after.items() if c in before} == before
    assert all(after.get(c) == before.get(c) for c in in_flight)
