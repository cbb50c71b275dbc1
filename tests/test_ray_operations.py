"""Operating the Ray backend: a terminal's Ctrl-C, a cluster without room, SIGTERM while waiting for room.

Each run starts as a shell starts a foreground job (test_interrupt.start_foreground: a process
group of its own, SIGINT at its default disposition, checked). The clusters are Ray's own: the
one-machine cluster `rescue run --backend ray` starts for itself, or a head node started by
ray.cluster_utils.Cluster that the run joins with --address.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import HANG_S, ROOT, arms_started, assert_cluster_stopped, case_states, cli_env, descendants, ensure_stopped
from helpers.foreground import claimed, ctrl_c, group_members, start_foreground
from conftest import events_of, rescue_cli, wait_until, write_cases
from ray.cluster_utils import Cluster

# One worker at a time: the tests count the machine's Ray processes.
pytestmark = [pytest.mark.sim, pytest.mark.e2e, pytest.mark.xdist_group("ray")]

STORE = 80 * 1024 * 1024


def _descendants(pid: int) -> dict[int, str]:
    """Every live process under `pid`, with its command line (the Ray processes a run started)."""
    return {child: _cmdline(child) for child in descendants(pid)}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ctrl_c_mid_arm_on_the_cluster_the_run_started_drains_and_no_ray_process_dies_of_it(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=64)
    study = tmp_path / "study"
    proc = start_foreground("run", str(manifest), "--study", str(study), "--backend", "ray", "--simulators", "2",
                            "--cases-in-flight", "1")
    try:
        wait_until(lambda: claimed(study), "a case in flight", proc=proc)
        (in_flight,) = [c for c, s in case_states(study).items() if s == "claimed"]
        # Its arms have started on the two actors: the case is mid-arm until its verdict.
        wait_until(lambda: arms_started(study, in_flight), "both arms of the case in flight started", proc=proc)
        ray_processes = _descendants(proc.pid)
        in_group = set(group_members(proc.pid))
        # The run's Ctrl-C reaches the cluster's core processes: they share the run's process group.
        assert {"gcs_server", "raylet"} <= {Path(c.split(" ")[0]).name for p, c in ray_processes.items() if p in in_group}
        actors = [p for p, c in ray_processes.items() if c.startswith("ray::SimulatorActor")]
        assert len(actors) == 2, ray_processes
        ctrl_c(proc)
        # Ray starts its workers in groups of their own; an actor the signal reaches all the same lives too.
        for pid in actors:
            os.kill(pid, signal.SIGINT)
        # Until the case in flight has its verdict, every process of the cluster lives.
        while True:
            dead = {p: c for p, c in ray_processes.items() if not _alive(p)}
            if case_states(study)[in_flight] != "claimed":
                break
            assert not dead, f"died of the group's SIGINT: {dead}"
            time.sleep(0.1)
        out, err = proc.communicate(timeout=300)
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 3, err
    assert "no new case is claimed" in out + err and "Traceback" not in out + err
    states = case_states(study)
    assert states[in_flight] == "finished" and set(states.values()) == {"finished", "pending"}, states
    rescue_cli("export", str(study), "--partial", "--out", str(tmp_path / "e.json"))
    case = next(c for c in json.loads((tmp_path / "e.json").read_text())["cases"] if c["case_id"] == in_flight)
    assert case["label"] in ("rescued", "not_rescued"), case
    assert case["arms"]["control"]["status"] == case["arms"]["assisted"]["status"] == "complete"
    assert not [e for e in events_of(study) if e["event"].startswith("ray.actor_lost")]
    assert rescue_cli("verify", str(study)).returncode == 0
    assert_cluster_stopped(proc.pid)  # the run stopped the cluster it started, once it was done


@pytest.fixture
def head_without_simulators():
    """A head node that offers CPUs and no `simulator` resource."""
    c = Cluster(initialize_head=True, connect=False, head_node_args=dict(num_cpus=1, object_store_memory=STORE))
    try:
        yield c
    finally:
        c.shutdown()


def test_a_run_without_an_address_starts_its_own_cluster_beside_one_that_runs_here(tmp_path, head_without_simulators):
    # Another cluster runs on this machine (Ray's address file names it) and RAY_ADDRESS names it too: a run
    # without --address must start a cluster of its own, not join that one (which offers no simulator).
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=16)
    study = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study),
                           "--backend", "ray", "--simulators", "1"], cwd=ROOT, capture_output=True, text=True,
                          env={**cli_env(), "RAY_ADDRESS": head_without_simulators.address}, timeout=HANG_S)
    # That cluster could not have held a simulator actor: this run's were placed on a node of its own cluster.
    assert proc.returncode == 0, proc.stderr
    assert set(case_states(study).values()) == {"finished"}
    placed = {e["node_id"] for e in events_of(study) if e["event"] == "ray.actor_placed"}
    assert placed and head_without_simulators.head_node.node_id not in placed, placed


def test_a_cluster_without_the_simulator_resource_says_what_is_missing_before_placing_an_actor(tmp_path, head_without_simulators):
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=16)
    study = tmp_path / "s"
    # Said by the check before any actor is placed, not by the placement timeout (600 s; this bounds a hang).
    proc = rescue_cli("run", str(manifest), "--study", str(study), "--backend", "ray",
                      "--address", head_without_simulators.address, check=False, timeout=HANG_S)
    assert proc.returncode == 3, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("rescue:")]
    assert len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "no node offers the custom resource 'simulator'" in said[0], said
    assert """ray start --resources '{"simulator": N}'""" in said[0], said
    assert set(case_states(study).values()) == {"pending"}  # nothing claimed
    (failed,) = [e for e in events_of(study) if e["event"] == "ray.pool_failed"]
    assert failed["reason"].startswith("no simulator actor can be placed on"), failed  # not "... within 600 s"


# A driver of its own on the cluster holding its one `simulator`: the resource exists, and is busy.
HOLDER = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
holder = ray.remote(num_cpus=0, resources={"simulator": 1})(type("Holder", (), {"ping": lambda self: 1})).remote()
ray.get(holder.ping.remote())
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def busy_cluster():
    """A head node with one `simulator`, held by another driver's actor."""
    c = Cluster(initialize_head=True, connect=False,
                head_node_args=dict(num_cpus=1, resources={"simulator": 1}, object_store_memory=STORE))
    holder = None
    try:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, c.address], cwd=ROOT, env=cli_env(),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert holder.stdout.readline().strip() == "held"
        yield c
    finally:
        if holder is not None:
            ensure_stopped(holder)
        c.shutdown()


def test_sigterm_while_waiting_for_room_on_a_busy_cluster_stops_at_once_with_nothing_claimed(tmp_path, busy_cluster):
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=16)
    study = tmp_path / "s"
    proc = start_foreground("run", str(manifest), "--study", str(study), "--backend", "ray",
                            "--address", busy_cluster.address, "--simulators", "1")
    try:
        # Busy is not missing: the run keeps waiting, and says once what for.
        wait_until(lambda: any(e["event"] == "ray.waiting_for_room" for e in events_of(study)), "the waiting line",
                   proc=proc)
        waiting = next(e for e in events_of(study) if e["event"] == "ray.waiting_for_room")
        assert waiting["each_asks"] == "1 CPU, 1 'simulator'" and waiting["free"] == "1 CPU, 0 'simulator'", waiting
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)  # a run that waited for the placement timeout (600 s) fails here
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 3, err
    said = [line for line in err.splitlines() if line.startswith("rescue:")]
    assert len(said) == 1 and "SIGTERM stopped it claiming" in said[0] and "Traceback" not in out + err, err
    assert "ray.waiting_for_room" in err  # the line the terminal showed while it waited
    assert set(case_states(study).values()) == {"pending"}  # nothing claimed
