"""Simulators that outlive one study (rescue.env.warm), through the real CLI: `rescue serve-simulators` keeps
them, `rescue run --warm-simulators DIR` leases them. A study that leased them records arms equal to those of a
study that started its own; the envs built for one study serve the next without a build; a run killed with
SIGKILL hands its simulators back; a simulator that cannot be the run's own is refused; one that dies is
started again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import HANG_S, ROOT, SCRIPTED_ARGS, arms_started, case_states, cli_env, events_of, rescue_cli, wait_until, write_cases

from rescue.study.journal import Journal

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

BUILT = "rescue: built the env of"
# What an arm's record holds that is about when and where it ran, not what it did: its times, and the render
# digest of the snapshot it was restored from when it continued on another simulator after its VLM wait (which
# one was free then is the scheduler's doing).
WHEN = ("started_at", "finished_at", "restored_render")


@pytest.fixture(scope="module")
def warm():
    """`rescue serve-simulators` with two simulators, in a short folder of its own (a socket's path is short)."""
    folder = tempfile.mkdtemp(prefix="warm-test-")
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", "serve-simulators", folder, "--size", "2"], cwd=ROOT,
                            env=cli_env(own_simulators=True), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert "2 warm simulators" in line, line + proc.stdout.read()
        yield folder
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return write_cases(tmp_path_factory.mktemp("manifest") / "m.jsonl", 2, horizon=48)


@pytest.fixture(scope="module")
def own(manifest, tmp_path_factory):
    """The reference: the study run on simulators of its own."""
    study = tmp_path_factory.mktemp("own") / "study"
    rescue_cli("run", str(manifest), "--study", str(study), "--warm-simulators", "off", *SCRIPTED_ARGS)
    return study


def _arms(study: Path) -> dict[tuple[str, str], dict]:
    """Every arm's record but when it ran; an assisted arm's VLM call but its ids and receipt (new per call)."""
    with Journal.open(study, readonly=True) as journal:
        records = {(row.case_id, row.arm): json.loads(row.data) for row in journal.arm_rows()}
    for record in records.values():
        for key in WHEN:
            record.pop(key, None)
        assistance = record.get("assistance") or {}
        for key in ("receipt_ref", "call_id", "request_id"):
            assistance.pop(key, None)
    return records


def _leased(study: Path) -> list[int]:
    return sorted(e["pid"] for e in events_of(study) if e.get("event") == "warm.leased")


def _members(folder: str) -> list[int]:
    """The pids listening in the warm pool's folder (the server's children), by their sockets."""
    server = int((Path(folder) / "ready").read_text().split()[0])
    children = Path(f"/proc/{server}/task/{server}/children").read_text().split()
    return sorted(int(pid) for pid in children if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text())


def test_two_studies_lease_the_warm_simulators_keep_their_envs_and_record_the_arms_of_their_own(warm, manifest, own,
                                                                                                  tmp_path):
    assert _leased(own) == [] and BUILT in (own / "simulator.log").read_text()
    first, second = tmp_path / "first", tmp_path / "second"
    for study in (first, second):
        rescue_cli("run", str(manifest), "--study", str(study), "--warm-simulators", warm, *SCRIPTED_ARGS)
    assert _leased(first) == _leased(second) == _members(warm)
    # The second study found the env the first one built.
    assert BUILT not in (second / "simulator.log").read_text()
    reference = _arms(own)
    assert reference and _arms(first) == reference and _arms(second) == reference
    assert rescue_cli("verify", str(second)).returncode == 0


def test_a_run_killed_mid_case_hands_its_simulators_back(warm, manifest, own, tmp_path):
    members = _members(warm)
    study = tmp_path / "study"
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study),
                             "--cases-in-flight", "1", "--warm-simulators", warm, *SCRIPTED_ARGS], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline and "claimed" not in case_states_or_none(study):
            assert proc.poll() is None, f"the run ended ({proc.returncode}) before it claimed a case"
            time.sleep(0.05)
        (in_flight,) = [c for c, s in case_states(study).items() if s == "claimed"]
        # Its arms have started in the warm simulators: the case is mid-arm until its verdict.
        wait_until(lambda: arms_started(study, in_flight), "both arms of the case in flight started", proc=proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert "claimed" in case_states_or_none(study)  # killed mid case
    assert _leased(study) == members and _members(warm) == members  # they outlived the run
    rescue_cli("resume", str(study), "--warm-simulators", warm)
    assert _leased(study) == sorted(members * 2)
    arms, reference = _arms(study), _arms(own)
    finished = [key for key, record in arms.items() if record["status"] == "complete"]
    assert finished and all(arms[key] == reference[key] for key in finished)


def case_states_or_none(study: Path) -> list[str]:
    return list(case_states(study).values()) if (study / "journal.sqlite").exists() else []


def test_a_warm_simulator_that_differs_from_the_run_is_refused_and_the_run_starts_its_own(warm, manifest, own,
                                                                                         tmp_path):
    study = tmp_path / "study"
    env = {**cli_env(), "RESCUE_MODEL_CACHE": str(tmp_path / "another-cache")}
    proc = subprocess.run([sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study),
                           "--warm-simulators", warm, *SCRIPTED_ARGS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    refused = [e for e in events_of(study) if e.get("event") == "warm.refused"]
    assert _leased(study) == [] and refused and all("RESCUE_MODEL_CACHE" in e["reason"] for e in refused)
    assert BUILT in (study / "simulator.log").read_text()
    assert _arms(study) == _arms(own)


def test_a_warm_simulator_that_dies_is_started_again_and_serves_the_next_run(warm, manifest, own, tmp_path):
    before = _members(warm)
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            now = _members(warm)
        except OSError:
            now = []
        if len(now) == 2 and before[0] not in now:
            break
        time.sleep(0.2)
    assert len(now) == 2 and before[0] not in now and before[1] in now
    study = tmp_path / "study"
    rescue_cli("run", str(manifest), "--study", str(study), "--warm-simulators", warm, *SCRIPTED_ARGS)
    assert _leased(study) == now and _arms(study) == _arms(own)


def test_serve_simulators_refuses_what_it_cannot_do_in_one_line(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    for args, code, said in ((["--size", "0"], 2, "at least one"), ([], 1, "too long a path")):
        proc = subprocess.run([sys.executable, "-m", "rescue.cli", "serve-simulators", str(deep), *args], cwd=ROOT,
                              env=cli_env(), capture_output=True, text=True, timeout=120)
        out = (proc.stdout + proc.stderr).strip()
        assert proc.returncode == code and said in out and len(out.splitlines()) == 1, out


def test_a_worker_keeps_its_simulators_between_jobs_and_they_end_with_it(tmp_path):
    from conftest import ensure_stopped, free_port
    from helpers.service_jobs import get_json, job_study, start_worker, submit_small, wait_healthy

    queue, port = tmp_path / "queue", free_port()
    jobs = [submit_small(write_cases(tmp_path / f"{name}.jsonl", 1, horizon=48), name, queue) for name in ("a", "b")]
    proc = start_worker(queue, port, "--warm-simulators", "1", env=cli_env(own_simulators=True))
    try:
        wait_healthy(port, proc, timeout=300)
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:  # the worker's own view, over HTTP: no command process per look
            states = get_json(port, "/jobs")[1]["jobs"]
            if all(row["state"] == "finished" for row in states):
                break
            assert all(row["state"] in ("queued", "running", "finished") for row in states), states
            time.sleep(0.5)
        listed = json.loads(rescue_cli("queue", "--queue", str(queue), "--json").stdout)
        assert {row["job_id"]: row["state"] for row in listed} == dict.fromkeys(jobs, "finished")
        studies = [job_study(queue, job) for job in jobs]
        leased = [_leased(study) for study in studies]
        assert len(leased[0]) == 1 and leased[0] == leased[1]  # one simulator, the same for both jobs
        assert BUILT in (studies[0] / "simulator.log").read_text()
        assert BUILT not in (studies[1] / "simulator.log").read_text()
        warm_pid = leased[0][0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        ensure_stopped(proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and Path(f"/proc/{warm_pid}").exists() and "Z" not in _state(warm_pid):
        time.sleep(0.2)
    assert not Path(f"/proc/{warm_pid}").exists() or "Z" in _state(warm_pid), "the warm simulator outlived its worker"
    for study in studies:
        assert rescue_cli("verify", str(study)).returncode == 0


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
