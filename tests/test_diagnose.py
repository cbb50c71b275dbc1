"""Behaviour diagnostics: the seed's first table as a test vector for the aggregation."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rescue.core.digest import digest_array
from rescue.run.diagnose import (
    ArmBehaviour,
    QueryRecord,
    arm_metrics,
    diagnose,
    ee_position,
    from_arm_result,
    plot_timelines,
    query_record,
    summary_table,
    transitions_json,
    write_csv,
    write_transitions,
)

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
EVERY, FAIL_STEPS = 20, 3225  # the seed: a chunk every 20 steps; every failure ran 3225 steps
INSTANCES = [str(i) for i in range(301, 321)]
ALL_FAILED = ["301", "302", "305", "309", "310", "311", "314", "316", "317", "318", "319"]

# What the seed reports per instance (successes and their steps, stage entries, rule firings, paths);
# where it gives only totals, they are spread over instances as noted.
SEED = {
    "human": {
        "success": {"303": 1611, "304": 1118, "307": 1400, "308": 1300, "312": 1825, "313": 1500, "315": 1200, "320": 995},
        "stage2": {i: 600 if n < 10 else 760 for n, i in enumerate(INSTANCES)},  # median 680
        "rollbacks": {"301": 3, "302": 3, "305": 3, "309": 2},  # 11 in 4 episodes reaching stage 4
        "stage4_at": {},
        "recoveries": {"310": 2},
        "compression_skipped": 321,  # 12.88% of 2493 chunks
        "path": {**{i: 3.33 for i in ALL_FAILED}, "303": 3.25},
        "max_stage": {},
    },
    "codegen": {
        "success": {"306": 500},
        "stage2": {i: (180 if n < 9 else 200 if n == 9 else 220) for n, i in enumerate(i for i in INSTANCES if i != "304")},
        "rollbacks": {"303": 7, "306": 1, **{i: 10 for i in ALL_FAILED[:10]}, ALL_FAILED[10]: 9},  # 117 in 13
        "stage4_at": {"303": 460},
        "recoveries": {"304": 77, "308": 84, "313": 84},  # 245
        "compression_skipped": 1329,  # 42.83% of 3103 chunks
        "path": {**{i: 11.09 for i in ALL_FAILED}, "303": 17.37, "304": 2.12, "312": 12.48},
        "max_stage": {"304": 0},
    },
    "mix": {
        "success": {"312": 383},
        "stage2": {i: 220 if n < 10 else 260 for n, i in enumerate(INSTANCES)},  # median 240
        "rollbacks": {"303": 17, **{i: 10 for i in ALL_FAILED[:10]}, ALL_FAILED[10]: 13},  # 130 in 12
        "stage4_at": {"303": 460},
        "recoveries": {"304": 79, "320": 77, "313": 101},  # 257
        "compression_skipped": 700,  # 22.60% of 3098 chunks
        "path": {**{i: 8.02 for i in ALL_FAILED}, "303": 11.03, "304": 1.48, "320": 1.91},
        "max_stage": {"304": 3},
    },
}


def _spread(total: int, caps: list[int]) -> list[int]:
    """total split as evenly as the caps allow."""
    out = [0] * len(caps)
    while total:
        room = [i for i in range(len(caps)) if out[i] < caps[i]]
        for i in room[:total]:
            out[i] += 1
        total -= len(room[:total])
    return out


def _episode(config: str, case: str, seed: dict, skipped: int) -> ArmBehaviour:
    steps = seed["success"].get(case, FAIL_STEPS)
    grid = list(range(0, steps, EVERY))
    n = len(grid)
    stage2 = seed["stage2"].get(case)
    top = seed["max_stage"].get(case, 4 if case in seed["rollbacks"] else 3)
    stages = [0] * n
    if stage2 is not None:
        for k, step in enumerate(grid):
            stages[k] = 1 if step == stage2 - EVERY else 2 if step >= stage2 else 0
        if top == 3:
            stages[grid.index(stage2) + 2] = 3
    elif top:
        stages = [min(top, k // 10) for k in range(n)]
    rolled = set()
    if case in seed["rollbacks"]:
        start = grid.index(seed["stage4_at"].get(case, stage2 + 100 if steps > 1000 else stage2 + 80))
        # Each rollback: at stage 4, then two queries at 2 while new votes gather.
        rolled = {start + 3 * r for r in range(seed["rollbacks"][case])}
        for k in rolled:
            stages[k] = 4
    recover = set(range(1, 1 + seed["recoveries"].get(case, 0)))
    path = seed["path"].get(case, 2.0)
    xs = np.linspace(0.0, path, n)
    queries = []
    for k, step in enumerate(grid):
        fired = (["stage_rollback"] if k in rolled else []) + (["gripper_recovery"] if k in recover else [])
        fired += ["chunk_compression"] if k >= skipped else []
        rewrites = bool(set(fired) - {"stage_rollback"})
        queries.append(
            QueryRecord(
                step=step,
                stage=stages[k],
                wrapper_stage=stages[k],
                ee_pos=(float(xs[k]), 0.0, 1.0),
                fired=fired,
                chunk_before=f"{case}-{k}",
                chunk_after=f"{case}-{k}-rewritten" if rewrites else f"{case}-{k}",
            )
        )
    return ArmBehaviour(config=config, case_id=case, success=case in seed["success"], steps=steps, queries=queries)


def seed_arms() -> list[ArmBehaviour]:
    arms = []
    for config, seed in SEED.items():
        lengths = [len(range(0, seed["success"].get(c, FAIL_STEPS), EVERY)) for c in INSTANCES]
        skips = _spread(seed["compression_skipped"], lengths)
        arms += [_episode(config, case, seed, skip) for case, skip in zip(INSTANCES, skips)]
    return arms


def test_the_seed_table_is_reproduced():
    diag = diagnose(seed_arms())
    s = diag.summary
    assert diag.configs == ["human", "codegen", "mix"]
    # Row by row, the seed's first table (Human / Codegen / Mix 50:50).
    assert [s[c].successes for c in diag.configs] == [8, 1, 1]
    assert [s[c].episodes for c in diag.configs] == [20, 20, 20]
    assert [s[c].median_first_step[2] for c in diag.configs] == [680, 200, 240]
    assert [s[c].episodes_reaching[2] for c in diag.configs] == [20, 19, 20]  # codegen 304 stayed at stage 0
    assert [s[c].episodes_reaching[4] for c in diag.configs] == [4, 13, 12]
    assert [s[c].firings["stage_rollback"] for c in diag.configs] == [11, 117, 130]
    assert [s[c].firings["gripper_recovery"] for c in diag.configs] == [2, 245, 257]
    assert [s[c].chunks for c in diag.configs] == [2493, 3103, 3098]
    assert [f"{100 * s[c].firing_share['gripper_recovery']:.2f}%" for c in diag.configs] == ["0.08%", "7.90%", "8.30%"]
    skipped = [1 - s[c].firing_share["chunk_compression"] for c in diag.configs]
    assert [f"{100 * x:.2f}%" for x in skipped] == ["12.88%", "42.83%", "22.60%"]
    # Controlled for episode length: the 11 instances all three failed, each 3225 steps.
    assert diag.all_failed == ALL_FAILED
    restricted = diag.summary_all_failed
    assert [restricted[c].episodes for c in diag.configs] == [11, 11, 11]
    assert [restricted[c].mean_steps for c in diag.configs] == [3225, 3225, 3225]
    paths = [restricted[c].mean_path_length for c in diag.configs]
    assert paths == pytest.approx([3.33, 11.09, 8.02])
    assert [round(p / paths[0], 2) for p in paths[1:]] == [3.33, 2.41]


def test_csv_and_summary_carry_the_seed_numbers(tmp_path):
    diag = diagnose(seed_arms())
    path = write_csv(diag, tmp_path / "per_instance.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 60
    by = {(r["config"], r["case_id"]): r for r in rows}
    for config, want in (("human", 8), ("codegen", 1), ("mix", 1)):
        assert sum(int(r["success"]) for r in rows if r["config"] == config) == want
    assert sum(int(r["firings_stage_rollback"]) for r in rows if r["config"] == "mix") == 130
    # Instance 303: codegen and mix reach stage 4 at 460 and are rolled back 7 and 17 times.
    c303, m303, h303 = by["codegen", "303"], by["mix", "303"], by["human", "303"]
    assert (c303["first_step_stage_4"], c303["firings_stage_rollback"], float(c303["path_length_m"])) == ("460", "7", 17.37)
    assert (m303["first_step_stage_4"], m303["firings_stage_rollback"], float(m303["path_length_m"])) == ("460", "17", 11.03)
    assert (h303["success"], h303["steps"], h303["firings_stage_rollback"], h303["first_step_stage_4"]) == ("1", "1611", "0", "")
    # Instance 304: codegen never leaves stage 0 and 77 chunks are overwritten; mix reaches stage 3 with 79.
    c304, m304 = by["codegen", "304"], by["mix", "304"]
    assert (c304["max_stage"], c304["first_step_stage_2"], c304["firings_gripper_recovery"]) == ("0", "", "77")
    assert (m304["max_stage"], m304["firings_gripper_recovery"]) == ("3", "79")
    assert int(c304["rewritten"]) >= 77
    assert sum(int(r["all_failed"]) for r in rows) == 33
    assert {r["case_id"] for r in rows if r["all_failed"] == "1"} == set(ALL_FAILED)

    table = summary_table(diag)
    head, restricted = table.split("\n\n")
    assert "instances all configurations failed (11)" in restricted
    lines = {line.split("  ")[0].strip(): line.split() for line in head.splitlines()[2:]}
    assert lines["success"][-3:] == ["8/20", "1/20", "1/20"]
    assert lines["median first step, stage 2"][-3:] == ["680", "200", "240"]
    assert lines["episodes reaching stage 4"][-3:] == ["4", "13", "12"]
    assert lines["firings: stage_rollback"][-3:] == ["11", "117", "130"]
    assert lines["share of chunks: gripper_recovery"][-3:] == ["0.08%", "7.90%", "8.30%"]
    rest = {line.split("  ")[0].strip(): line.split() for line in restricted.splitlines()[2:]}
    assert rest["mean ee path"][-6:] == ["3.33", "m", "11.09", "m", "8.02", "m"]


def test_transitions_json_and_timeline_plot(tmp_path):
    arms = seed_arms()
    diag = diagnose(arms)
    data = json.loads(write_transitions(diag, tmp_path / "transitions.json").read_text())
    assert data["schema"] == "rescue.run.diagnose/1"
    c303 = data["configs"]["codegen"]["303"]
    assert c303[0] == {"step": 0, "from": None, "to": 0}
    assert sum(t["from"] == 4 and t["to"] == 2 for t in c303) == 7
    assert [t["to"] for t in data["configs"]["codegen"]["304"]] == [0]
    assert data == json.loads(json.dumps(transitions_json(diag)))
    png = plot_timelines(diag, arms, ["303", "304", "312"], tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_all_failed_needs_every_configuration_to_have_failed():
    def arm(config, case, success):
        return ArmBehaviour(config=config, case_id=case, success=success, steps=10)

    arms = [arm("a", "1", False), arm("b", "1", False), arm("a", "2", False), arm("b", "2", True),
            arm("a", "3", False), arm("b", "3", None), arm("a", "4", False)]
    diag = diagnose(arms)
    # 2: b succeeded; 3: b's arm did not complete; 4: b never ran it.
    assert diag.all_failed == ["1"]
    assert diag.summary["b"].successes == 1 and diag.summary["b"].mean_path_length is None


def test_query_records_from_an_arm_s_observation_and_reply():
    chunk = np.zeros((8, 7))
    obs = {"robot0_eef_pos": np.array([0.1, -0.2, 1.05]), "robot0_gripper_qpos": np.array([0.04, -0.04])}
    plain = query_record(16, obs, {"actions": chunk, "phase": np.int64(3)}, "phase")
    assert plain == QueryRecord(step=16, stage=3, ee_pos=(0.1, -0.2, 1.05),
                                chunk_before=digest_array(chunk), chunk_after=digest_array(chunk))
    assert not plain.rewritten
    ruled = query_record(24, obs, {"actions": chunk, "phase": 5}, "phase",
                         {"stage": 4, "fired": ["stage_rollback", "chunk_compression"], "before": "x", "after": "y"})
    assert (ruled.stage, ruled.wrapper_stage, ruled.fired, ruled.rewritten) == (5, 4, ["stage_rollback", "chunk_compression"], True)
    assert query_record(0, {}, {"actions": chunk}, "phase").ee_pos is None
    # openpi-libero's state vector starts with the end-effector position.
    assert ee_position({"observation/state": np.arange(8.0)}) == (0.0, 1.0, 2.0)
    m = arm_metrics(ArmBehaviour(config="c", case_id="x", success=False, steps=24, queries=[
        QueryRecord(step=0, stage=0, ee_pos=(0, 0, 0)), QueryRecord(step=8, stage=1, ee_pos=(3, 4, 0)),
        QueryRecord(step=16, stage=0, ee_pos=(3, 4, 0), fired=["gripper_recovery"], chunk_before="a", chunk_after="b")]))
    assert (m.path_length, m.first_entry, m.transitions, m.rewritten) == (5.0, {0: 0, 1: 8}, [(0, None, 0), (8, 0, 1), (16, 1, 0)], 1)
    assert m.firings == {"gripper_recovery": 1} and m.chunks == 3


def test_from_arm_result_reads_a_journal_arm():
    class Arm:  # the fields of rescue.core.records.ArmResult the diagnostics read
        case_id, status, success, steps = "c1", "complete", True, 40
        queries = [{"step": 0, "stage": 2, "ee_pos": [0.0, 0.0, 1.0]}]

    got = from_arm_result("study-a", Arm())
    assert got.queries[0].ee_pos == (0.0, 0.0, 1.0) and got.success is True
    Arm.status = "error"
    assert from_arm_result("study-a", Arm()).success is None


def test_diagnose_loads_no_runtime():
    code = (
        "import sys, json; import rescue.run.diagnose; "
        "print(json.dumps([m for m in ('openai','aiohttp','multiprocessing','torch','mujoco','robosuite','libero','matplotlib') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert json.loads(out.stdout) == []


@pytest.mark.sim
@pytest.mark.e2e
def test_rescue_diagnose_on_a_real_study_writes_csv_transitions_and_timeline(tmp_path):
    import csv
    import json

    from conftest import rescue_cli, write_cases

    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=64)
    study = tmp_path / "study"
    rescue_cli("run", str(manifest), "--study", str(study), check=False)
    out = tmp_path / "diag"
    proc = rescue_cli("diagnose", str(study), "--out", str(out), "--timeline", "object-3-ep0")
    rows = list(csv.DictReader((out / "instances.csv").open()))
    assert {r["config"] for r in rows} == {"study:control", "study:assisted"} and len(rows) == 2
    assert all(float(r["path_length_m"]) > 0 for r in rows), rows  # the end effector moved, measured in the world frame
    assert json.loads((out / "transitions.json").read_text())
    assert (out / "timeline.png").stat().st_size > 1000
    assert "study:control" in proc.stdout


@pytest.mark.sim
@pytest.mark.e2e
def test_rescue_ablate_runs_one_study_per_switch_and_pairs_them_against_all_on(tmp_path):
    import json

    from conftest import rescue_cli, write_cases

    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=48)
    config = tmp_path / "study.toml"
    config.write_text("[policy]\nreplan_interval = 6\n")  # compression keeps 6 of 8 actions
    root = tmp_path / "ablation"
    rescue_cli("ablate", str(manifest), "--rules", "gripper_recovery,chunk_compression",
               "--study", str(root), "--config", str(config), "--simulators", "2", timeout=900)
    rows = {r["setting"]: r for r in json.loads((root / "ablation.json").read_text())["rows"]}
    assert set(rows) == {"all_on", "no_gripper_recovery", "no_chunk_compression", "all_off"}
    assert sorted(rows["all_on"]["enabled"]) == ["chunk_compression", "gripper_recovery"]
    assert rows["all_off"]["enabled"] == [] and "chunk_compression" not in rows["no_chunk_compression"]["enabled"]
    for name, row in rows.items():
        cfg = json.loads((root / name / "config.json").read_text())
        assert sorted(cfg["rules"]["enabled"]) == sorted(row["enabled"]) and cfg["arms"] == ["control"]
        assert cfg["policy"]["replan_interval"] == 6 and row["n"] == 2 and row["paired"] + row["unknown"] >= 2
    assert rows["all_on"]["wins"] == rows["all_on"]["losses"] == 0  # all_on against itself
    # The switch is real: compression rewrites chunks when on, never when off.
    arms = {}
    import sqlite3
    for name in ("all_on", "no_chunk_compression"):
        con = sqlite3.connect(root / name / "journal.sqlite")
        arms[name] = [json.loads(d) for (d,) in con.execute("SELECT data FROM arms")]
        con.close()
    fired = {name: {f["rule"] for a in arms[name] for f in a["rule_firings"]} for name in arms}
    assert "chunk_compression" in fired["all_on"] and "chunk_compression" not in fired["no_chunk_compression"]


@pytest.mark.sim
@pytest.mark.e2e
def test_an_ablation_whose_rules_cannot_read_their_input_does_not_exit_0(tmp_path):
    from conftest import rescue_cli, write_cases

    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=16)
    config = tmp_path / "study.toml"
    # The gripper opening at an index the state vector does not have: every arm with the rule is unknown.
    config.write_text('[rules.layout]\nstate_key = "observation/state"\ngripper_state_dims = [99]\n')
    out = rescue_cli("ablate", str(manifest), "--rules", "gripper_recovery", "--study", str(tmp_path / "a"),
                     "--config", str(config), "--simulators", "1", check=False, timeout=600)
    assert out.returncode == 4, out.stdout + out.stderr
    assert "rescue: setting all_on: every one of the 1 cases is unknown" in out.stderr
