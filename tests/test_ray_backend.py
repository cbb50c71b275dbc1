"""The Ray backend on a real local cluster: a head and two worker nodes, one of them killed mid-arm.

The cluster is Ray's own (ray.cluster_utils.Cluster: each node a raylet process
with its workers); `rescue run --backend ray --address ...` joins it from a
process of its own, as on a real cluster. Killing a node means SIGKILL to its
raylet and every process it started, the actor serving an arm among them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import (
    ROOT,
    arm_rows,
    arms_started,
    assert_cluster_stopped,
    case_states,
    cli_env,
    descendants,
    ensure_stopped,
    events_of,
    export_of,
    rescue_cli,
    wait_until,
    write_cases,
)
from ray.cluster_utils import Cluster

# One worker at a time: the tests count the machine's Ray processes.
pytestmark = [pytest.mark.sim, pytest.mark.e2e, pytest.mark.xdist_group("ray")]



def _kill_node(node) -> None:
    raylet = node.all_processes["raylet"][0].process.pid
    for pid in [raylet, *descendants(raylet)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_events, _export = events_of, export_of


@pytest.fixture
def cluster():
    store = 80 * 1024 * 1024
    c = Cluster(initialize_head=True, connect=False,
                head_node_args=dict(num_cpus=1, resources={"simulator": 0}, object_store_memory=store))
    nodes = [c.add_node(num_cpus=1, resources={"simulator": 1}, object_store_memory=store) for _ in range(2)]
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        c.shutdown()


def test_a_worker_node_killed_mid_arm_loses_one_case_and_nothing_runs_twice(tmp_path, cluster):
    c, nodes = cluster
    manifest = write_cases(tmp_path / "m.jsonl", 5, horizon=64)
    study = tmp_path / "ray-study"
    # One case at a time: its two arms run together, one on each worker node's actor.
    args = ["run", str(manifest), "--study", str(study), "--backend", "ray", "--address", c.address,
            "--simulators", "2", "--cases-in-flight", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # Warm: one case finished (both actors built their scene); then kill during the next one's arms.
        def second_case_started() -> bool:
            states = case_states(study) if (study / "journal.sqlite").exists() else {}
            return "finished" in states.values() and "claimed" in states.values()

        wait_until(second_case_started, "one case finished and the next one claimed", proc=proc)
        placed = {e["node_id"] for e in _events(study) if e["event"] == "ray.actor_placed"}
        assert placed == {n.node_id for n in nodes}  # one actor on each worker node, none on the head
        in_flight = [cid for cid, s in case_states(study).items() if s == "claimed"]
        # Kill as soon as both of its arms have started (one on each worker node's actor): mid-arm whatever
        # the machine's speed, where a fixed sleep could land after the arms ended on a fast one.
        wait_until(lambda: arms_started(study, in_flight[0]), "the arms of the case in flight started", proc=proc)
        victim = nodes[0]
        _kill_node(victim)
        out, err = proc.communicate(timeout=600)
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 0, err
    assert "Traceback" not in out + err

    export = _export(study)
    by_id = {case["case_id"]: case for case in export["cases"]}
    assert all(case["state"] == "finished" for case in export["cases"])
    lost = [cid for cid, case in by_id.items() if case["label"] == "unknown"]
    assert lost == in_flight  # the case whose arm was on the killed node, and only it
    reason = by_id[lost[0]]["reason"]
    assert "worker_lost" in reason and victim.node_id in reason, reason
    # Nothing ran twice: every case claimed once, by the coordinator, and never claimed again.
    claims = [e["case_id"] for e in _events(study) if e["event"] == "case.claimed"]
    assert sorted(claims) == sorted(by_id)
    assert rescue_cli("verify", str(study)).returncode == 0

    # The same cases on the local backend: the same classification and the same trajectories for every case both
    # finished (the one the kill lost is not run again).
    both = [cid for cid in by_id if cid not in lost]
    assert len(both) == 4
    rows = [line for line in manifest.read_text().splitlines() if json.loads(line)["case_id"] in both]
    kept = tmp_path / "both.jsonl"
    kept.write_text("\n".join(rows) + "\n")
    local = tmp_path / "local-study"
    rescue_cli("run", str(kept), "--study", str(local), "--simulators", "2", "--cases-in-flight", "1")
    local_by_id = {case["case_id"]: case for case in _export(local)["cases"]}
    assert sorted(local_by_id) == sorted(both)
    for cid in both:
        assert by_id[cid]["label"] == local_by_id[cid]["label"], cid
        for arm in ("control", "assisted"):
            assert by_id[cid]["arms"][arm]["trace_sha256"] == local_by_id[cid]["arms"][arm]["trace_sha256"], (cid, arm)
            assert by_id[cid]["arms"][arm]["fingerprint"] == local_by_id[cid]["arms"][arm]["fingerprint"], (cid, arm)


def test_fork_sham_release_sigterm_status_and_resume_on_a_one_machine_cluster(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 6, horizon=64)
    config = tmp_path / "study.toml"
    config.write_text('fork_at_q = true\nrelease_simulator_while_waiting = true\ncases_in_flight = 2\n'
                      '[env]\nsimulators = 2\n[sham]\nsource = "permuted"\n')
    study = tmp_path / "study"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study), "--config", str(config),
         "--backend", "ray"],
        cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        wait_until(lambda: (study / "journal.sqlite").exists() and "finished" in case_states(study).values(),
                   "a finished case", proc=proc)
        # `status` reads the journal the coordinator writes, whatever runs the simulators.
        status = json.loads(rescue_cli("status", str(study), "--json").stdout)
        assert status["states"].get("finished", 0) >= 1, status
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 3, proc.stderr.read()  # drained: cases never run remain
    finally:
        ensure_stopped(proc)  # a hung run must not outlive the test (nor the cluster it started)
    states = case_states(study)
    assert "claimed" not in states.values() and "pending" in states.values(), states
    # The cluster this run started stopped with it.
    assert_cluster_stopped(proc.pid)

    rescue_cli("resume", str(study), "--backend", "ray")
    assert set(case_states(study).values()) == {"finished"}
    assert rescue_cli("verify", str(study)).returncode == 0
    export = _export(study)
    for case in export["cases"]:
        assert "sham" in case["verdicts"], case  # every case ran its sham arm with a donor's subgoal
        assert case["arms"]["sham"]["donor_case_id"] not in (None, case["case_id"]), case
    records = [json.loads(data) for data in arm_rows(study).values()]
    assert {r["mode"] for r in records} == {"fork"}
    # Every follower started from the one snapshot at q the control arm left.
    by_case: dict[str, set] = {}
    for r in records:
        by_case.setdefault(r["case_id"], set()).add(r["q_state"])
    assert all(len(qs) == 1 and None not in qs for qs in by_case.values()), by_case


def test_an_unreachable_cluster_or_a_stray_address_is_refused_before_the_study_exists(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=16)
    for extra, says in [(["--backend", "ray", "--address", "127.0.0.1:1"], "cannot join the Ray cluster at 127.0.0.1:1"),
                        (["--address", "127.0.0.1:1"], "--address needs --backend ray")]:
        study = tmp_path / "never"
        proc = rescue_cli("run", str(manifest), "--study", str(study), *extra, check=False, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert says in proc.stderr and "Traceback" not in proc.stderr
        assert not study.exists()


def test_no_room_for_any_actor_stops_the_study_at_once_with_what_is_missing(tmp_path):
    # Each actor asks for a GPU this machine lacks: no node can ever hold one, so the run does not
    # wait out the placement timeout; nothing is claimed.
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=16)
    study = tmp_path / "s"
    proc = rescue_cli("run", str(manifest), "--study", str(study), "--backend", "ray", "--ray-actor-gpus", "1",
                      check=False, timeout=180)
    assert proc.returncode == 3, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("rescue:")]
    assert len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "each simulator actor asks 1 GPU and no node has a GPU (--ray-actor-gpus)" in said[0], said
    assert set(case_states(study).values()) == {"pending"}
