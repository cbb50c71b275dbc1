"""Our episodes are vla-eval's, step by step (DESIGN §19).

The harness's own LIBERO benchmark runs in this environment (`vla-eval run --no-docker`, step recording on)
against the harness's own `PredictModelServer` with a deterministic model: two libero_spatial tasks, two episodes
each, as shard 0 of 2 with nobody else claiming, so the shared queue hands it the episodes out of order (task 0's
0 and 1, then task 1's 1 before its 0: their reset ordinals are not their initial-state indices). Then rescue
imports the recording (`rescue manifest from-vla-eval`) and replays every episode through `rescue run` against a
fresh server of the same model, its simulator logging each step as the harness records it. At every step the
executed action and the post-step state are equal as float32 bytes, the outcomes and lengths are equal, and
the model saw the same observations (images, states, controller states, words) at every step.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, cli_env, rescue_cli
from vla_eval_peers import episodes_seen, vla_eval_server
from vla_eval_step_log import LOG_ENV

from rescue.core.manifest import load_manifest
from rescue.env.pool import SimProcess
from rescue.study.journal import Journal

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

HORIZON = 30  # the run's max_steps: six chunks of the server's five
CHUNK = 5
HARNESS = Path(sys.executable).with_name("vla-eval")


def _harness_run(url: str, out: Path) -> Path:
    """`vla-eval run --no-docker` of 2 tasks x 2 episodes as shard 0 of 2; its recording."""
    config = {"server": {"url": url.removeprefix("vla-eval+")}, "output_dir": str(out), "benchmarks": [{
        "benchmark": "vla_eval.benchmarks.libero.benchmark:LIBEROBenchmark",
        "params": {"suite": "libero_spatial", "seed": 7}, "episodes_per_task": 2, "max_tasks": 2, "max_steps": HORIZON}]}
    path = out / "run.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    eval_id = str(uuid.uuid4())
    proc = subprocess.run([str(HARNESS), "run", "--no-docker", "-c", str(path), "--shard-id", "0", "--num-shards", "2",
                           "--eval-id", eval_id], cwd=out, env=cli_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out / f"recording-{eval_id}.sqlite"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conformance")
    with vla_eval_server(chunk_size=CHUNK, log_path=str(tmp / "harness-server.jsonl")) as url:
        recording = _harness_run(url, tmp / "harness")
    manifest = tmp / "m.jsonl"
    rescue_cli("manifest", "from-vla-eval", str(recording), "--out", str(manifest), "--successes", "all")
    config = tmp / "replay.toml"
    config.write_text(f'arms = ["control"]\n[policy]\nreplan_interval = {CHUNK}\n'
                      '[env]\nepisode_protocol = "vla-eval"\nadapter = "vla_eval_step_log:StepLogAdapter"\n')
    steps = tmp / "steps.jsonl"
    study = tmp / "study"
    with vla_eval_server(chunk_size=CHUNK, log_path=str(tmp / "rescue-server.jsonl")) as url:
        env = {LOG_ENV: str(steps), "RESCUE_WARM_SIMULATORS": "off"}
        proc = subprocess.run([sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study),
                               "--config", str(config), "--policy-url", url, "--simulators", "1", "--cases-in-flight", "1"],
                              cwd=ROOT, env={**cli_env(), **env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"},
                              capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"recording": recording, "manifest": manifest, "steps": steps, "study": study, "tmp": tmp}


def _harness_episodes(recording: Path) -> dict[tuple[int, int], dict]:
    """The recording's episodes by (task_id, episode_idx): status, steps, and each step row's action and state."""
    con = sqlite3.connect(f"file:{recording}?mode=ro", uri=True)
    try:
        out = {}
        for sid, eid, status, steps, context in con.execute(
                "SELECT sid, eid, status, steps, context FROM episode_results ORDER BY rowid"):
            ctx = json.loads(context)
            rows = [json.loads(fields) for (fields,) in con.execute(
                "SELECT fields FROM step_rows WHERE sid = ? AND eid = ? ORDER BY step_id", (sid, eid))]
            out[(ctx["task_id"], ctx["episode_idx"])] = {
                "status": status, "steps": steps,
                "rows": [(np.asarray(r["action"], np.float32).tobytes().hex(), np.asarray(r["state"], np.float32).tobytes().hex())
                         for r in rows]}
        return out
    finally:
        con.close()


def _our_episodes(runs) -> dict[tuple[int, int], dict]:
    cases = {c.case_id: c for c in load_manifest(runs["manifest"]).cases}
    rows: dict[str, list] = {}
    for line in runs["steps"].read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["case"], []).append((row["action"], row["state"]))
    with Journal.open(runs["study"]) as journal:
        arms = {case_id: by_arm["control"] for case_id, by_arm in journal.all_arms().items()}
    return {(cases[cid].task_id, cases[cid].init_state_index): {
        "status": "success" if arm.success else "fail", "steps": arm.steps, "rows": rows[cid],
        "ordinal": cases[cid].tags["reset_ordinal"]} for cid, arm in arms.items()}


def test_the_queue_ran_episodes_out_of_their_initial_state_order(runs):
    cases = load_manifest(runs["manifest"]).cases
    ordinals = {(c.task_id, c.init_state_index): c.tags["reset_ordinal"] for c in cases}
    assert ordinals == {(0, 0): 0, (0, 1): 1, (1, 1): 0, (1, 0): 1}


def test_every_executed_action_and_post_step_state_is_the_harnesss(runs):
    theirs, ours = _harness_episodes(runs["recording"]), _our_episodes(runs)
    assert set(theirs) == set(ours) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for key in theirs:
        assert len(ours[key]["rows"]) == len(theirs[key]["rows"]) == theirs[key]["steps"], key
        for step, (mine, harness) in enumerate(zip(ours[key]["rows"], theirs[key]["rows"])):
            assert mine == harness, f"episode {key}, step {step}: action or state differs"
    # Not a standing robot: the states move, and the actions are not all one.
    rows = theirs[(1, 0)]["rows"]
    assert len({state for _, state in rows}) == len(rows) and len({action for action, _ in rows}) > 1


def test_the_outcomes_are_the_harnesss(runs):
    theirs, ours = _harness_episodes(runs["recording"]), _our_episodes(runs)
    assert {k: (v["status"], v["steps"]) for k, v in theirs.items()} == {k: (v["status"], v["steps"]) for k, v in ours.items()}


def test_the_model_saw_the_same_observations_at_every_step(runs):
    # The model's process-wide call number aside: the two runs went through the episodes in another order.
    harness, ours = ({key: [{k: v for k, v in row.items() if k != "call"} for row in rows] for key, rows in
                      episodes_seen(runs["tmp"] / f"{who}-server.jsonl").items()} for who in ("harness", "rescue"))
    assert set(harness) == set(ours) and len(harness) == 4
    for key in harness:
        assert len(harness[key]) == len(ours[key]) == HORIZON + HORIZON // CHUNK  # an observation per step, a predict per chunk
        assert harness[key] == ours[key], key
    first = next(row for row in harness[(0, 0)] if row["kind"] == "observation")
    assert first["keys"] == ["controller_states", "images", "states", "task_description"]


def test_the_reset_ordinal_decides_the_episode(runs):
    # The same case replayed as if its ordinal were its index (episodes in order, openpi's way) starts elsewhere.
    case = next(c for c in load_manifest(runs["manifest"]).cases if (c.task_id, c.init_state_index) == (1, 0))
    assert case.tags["reset_ordinal"] != case.init_state_index
    sim = SimProcess("rescue.env.libero:LiberoAdapter", name="sim-vla-eval-ordinal")

    async def resets():
        recorded = await sim.reset(case, "vla-eval-libero", "vla-eval")
        by_index = await sim.reset(case.model_copy(update={"tags": {}}), "vla-eval-libero", "vla-eval")
        return recorded, by_index

    try:
        recorded, by_index = asyncio.run(resets())
    finally:
        sim.stop()
    # The resets before it moved the fixtures (LIBERO places them from the env's random stream): another scene.
    assert recorded.fingerprint != by_index.fingerprint
    assert recorded.fingerprint_parts["model"] != by_index.fingerprint_parts["model"]
    assert not np.array_equal(recorded.obs["images/agentview"], by_index.obs["images/agentview"])
