"""Rescue as a service on real LIBERO: submit, `rescue serve`, SIGKILL mid-job, restart, and the HTTP API."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    arm_rows,
    assert_resumed_without_rerun,
    case_states,
    cli_env,
    ensure_stopped,
    free_port,
    rescue_cli,
    states_before_resume,
    write_cases,
)
from helpers.service_jobs import get_json, job_study, start_worker, submit_small, wait_healthy

pytestmark = [pytest.mark.sim, pytest.mark.e2e]


def _post(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _jobs(queue: Path) -> list[str]:
    folder = queue / "jobs"
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


_arms = arm_rows


def _crash(proc: subprocess.Popen, queue: Path) -> None:
    """What a crash of the machine's service does: SIGKILL to the worker's process group and to the
    running job's, which is a session of its own (so a Ctrl-C meant for the worker never reaches it)."""
    jobs = [json.loads(p.read_text()).get("pid") for p in (queue / "jobs").glob("*/state.json")]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in filter(None, jobs):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_serve_survives_sigkill_mid_job_and_resumes_as_rescue_resume(tmp_path):
    queue = tmp_path / "queue"
    first = submit_small(write_cases(tmp_path / "a.jsonl", 2, horizon=48), "first", queue)
    second = submit_small(write_cases(tmp_path / "b.jsonl", 3, horizon=48), "second", queue)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"case_id": "x", "suite": "libero_nowhere", "task_id": 3}\nnot json\n')
    refused = rescue_cli("submit", str(bad), "--queue", str(queue), check=False)
    assert refused.returncode == 2
    problems = refused.stderr.strip().splitlines()
    assert len(problems) >= 2 and all(str(bad) in line for line in problems)
    assert _jobs(queue) == sorted([first, second])  # nothing queued for the malformed manifest

    port = free_port()
    proc = start_worker(queue, port)
    try:
        wait_healthy(port, proc)
        # The API refuses a malformed manifest the same way, and queues a good one after the others.
        status, body = _post(port, "/jobs", {"manifest": bad.read_text(), "name": "bad"})
        assert status == 400 and any("libero_nowhere" in p for p in body["problems"])
        assert len(_jobs(queue)) == 2
        good = write_cases(tmp_path / "c.jsonl", 2, horizon=48).read_text()
        status, body = _post(port, "/jobs", {"manifest": good, "name": "third",
                                             "config": {"cases_in_flight": 1, "env": {"simulators": 1},
                                                        "policy": {"name": "scripted"}}})
        assert status == 201
        third = body["job_id"]
        # Kill the whole service once the second job's study has a finished case and one in flight.
        study_b = job_study(queue, second)
        deadline = time.time() + 400
        while time.time() < deadline:
            if (study_b / "journal.sqlite").exists():
                states = list(case_states(study_b).values())
                if "finished" in states and "claimed" in states:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the second job never had a finished case and a case in flight")
    finally:
        _crash(proc, queue)

    before_arms, finished, in_flight, never = states_before_resume(study_b)
    assert finished and in_flight
    assert not job_study(queue, third).exists()  # submission order: the third had not started
    listed = {row["job_id"]: row["state"] for row in json.loads(rescue_cli("queue", "--queue", str(queue), "--json").stdout)}
    assert listed == {first: "finished", second: "running", third: "queued"}

    proc = start_worker(queue, port)
    try:
        wait_healthy(port, proc)
        deadline = time.time() + 600
        while time.time() < deadline:
            jobs = get_json(port, "/jobs")[1]["jobs"]
            if all(j["state"] not in ("queued", "running") for j in jobs):
                break
            time.sleep(0.5)
        assert [j["job_id"] for j in jobs] == [first, second, third]
        assert {j["job_id"]: j["state"] for j in jobs} == {first: "finished", second: "finished", third: "finished"}

        status, view = get_json(port, f"/jobs/{second}")
        assert status == 200 and view["runs"] == 2 and view["done"] == 3 and view["report"]
        status, body = get_json(port, f"/jobs/{second}/export")
        assert status == 200 and body["partial"] is False
        by_id = {c["case_id"]: c for c in body["export"]["cases"]}
        assert_resumed_without_rerun(by_id, before_arms, _arms(study_b), finished, in_flight, never)
        for job_id in (first, third):
            status, body = get_json(port, f"/jobs/{job_id}/export")
            assert body["partial"] is False
            assert {c["state"] for c in body["export"]["cases"]} == {"finished"}
        assert get_json(port, "/jobs/job-nope")[0] == 404

        dom = subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}",
             "--virtual-time-budget=3000", "--dump-dom", f"http://127.0.0.1:{port}/"],
            capture_output=True, text=True, timeout=120,
        ).stdout
        for job_id in (first, second, third):
            assert f'data-job="{job_id}" data-state="finished"' in dom
            assert f'href="/jobs/{job_id}/study/report.html"' in dom
        assert 'data-live="1"' in dom  # the page's script fetched /jobs and rebuilt the table
        report = urllib.request.urlopen(f"http://127.0.0.1:{port}/jobs/{second}/study/report.html", timeout=30)
        assert report.status == 200
        cases = urllib.request.urlopen(f"http://127.0.0.1:{port}/jobs/{second}/study/report_files/cases.js", timeout=30)
        assert cases.status == 200 and "object-3-ep0" in cases.read().decode()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        ensure_stopped(proc)
    for job_id in (first, second, third):
        assert rescue_cli("verify", str(job_study(queue, job_id))).returncode == 0


def test_serve_beyond_loopback_needs_an_api_key_and_asks_for_it(tmp_path):
    queue = tmp_path / "queue"
    refused = rescue_cli("serve", "--queue", str(queue), "--host", "0.0.0.0", "--port", str(free_port()), check=False)
    assert refused.returncode == 2 and "API key" in refused.stderr  # refused before binding anything
    port = free_port()
    env = {**cli_env(), "RESCUE_TEST_KEY": "s3cret"}
    # A key given on loopback is asked for too (the test binds nothing beyond loopback).
    proc = start_worker(queue, port, "--api-key-env", "RESCUE_TEST_KEY", env=env)
    try:
        wait_healthy(port, proc)
        assert get_json(port, "/jobs")[0] == 401
        assert get_json(port, "/jobs", key="wrong")[0] == 401
        assert get_json(port, "/jobs", key="s3cret") == (200, {"jobs": []})
        assert get_json(port, "/healthz")[0] == 200  # a health probe needs no key
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (already dead, not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_restart_after_only_the_worker_was_killed_drains_the_orphan_then_resumes(tmp_path):
    queue = tmp_path / "queue"
    job_id = submit_small(write_cases(tmp_path / "a.jsonl", 3, horizon=48), "orphaned", queue)
    study = job_study(queue, job_id)
    port = free_port()
    proc = start_worker(queue, port)
    deadline = time.time() + 400
    try:
        while time.time() < deadline:
            if (study / "journal.sqlite").exists() and "claimed" in case_states(study).values():
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the job never had a case in flight")
        child = json.loads((queue / "jobs" / job_id / "state.json").read_text())["pid"]
        os.kill(proc.pid, signal.SIGKILL)  # the worker alone: its job child lives on
        proc.wait()
        assert child and _alive(child)
        assert int((study / ".owner.lock").read_text()) == child  # the orphan still owns the study

        proc = start_worker(queue, port)
        wait_healthy(port, proc, timeout=400)  # the API starts once the orphan is handled
        while time.time() < deadline + 300:
            view = get_json(port, f"/jobs/{job_id}")[1]
            if view["state"] not in ("queued", "running"):
                break
            time.sleep(0.5)
        assert view["state"] == "finished" and view["runs"] == 2
        assert not _alive(child)
        states = case_states(study)
        # The orphan drained (its case in flight finished), so the resume had nothing interrupted.
        assert states == dict.fromkeys(states, "finished") and len(states) == 3
        arms = _arms(study)
        assert all((c, arm) in arms for c in states for arm in ("control", "assisted"))
        assert "0 started-unfinished case(s)" in (queue / "jobs" / job_id / "job.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        ensure_stopped(proc)
        with contextlib.suppress(ProcessLookupError, NameError, TypeError):
            os.kill(child, signal.SIGKILL)
    assert rescue_cli("verify", str(study)).returncode == 0


def _wait_claimed(study: Path, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (study / "journal.sqlite").exists() and "claimed" in case_states(study).values():
            return
        time.sleep(0.05)
    raise AssertionError(f"{study} never had a case in flight")


def test_cancel_drains_a_running_job_and_sigterm_puts_the_job_back_in_the_queue(tmp_path):
    queue = tmp_path / "queue"
    first = submit_small(write_cases(tmp_path / "a.jsonl", 3, horizon=48), "cancelled", queue)
    second = submit_small(write_cases(tmp_path / "b.jsonl", 3, horizon=48), "drained", queue)
    port = free_port()
    proc = start_worker(queue, port)
    try:
        _wait_claimed(job_study(queue, first))
        out = rescue_cli("cancel", first, "--queue", str(queue))
        assert "draining" in out.stdout
        _wait_claimed(job_study(queue, second))
        view = get_json(port, f"/jobs/{first}")[1]
        assert view["state"] == "stopped" and view["message"] == "cancelled"
        # Drained: the case in flight finished, nothing new was claimed, and it is never resumed.
        assert set(case_states(job_study(queue, first)).values()) == {"finished", "pending"}
        status, body = get_json(port, f"/jobs/{first}/export")
        assert status == 200 and body["partial"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0
    finally:
        ensure_stopped(proc)
    states = case_states(job_study(queue, second))
    assert "claimed" not in states.values() and "pending" in states.values()
    listed = {row["job_id"]: row["state"] for row in json.loads(rescue_cli("queue", "--queue", str(queue), "--json").stdout)}
    assert listed == {first: "stopped", second: "queued"}


def test_a_job_names_the_services_endpoint_a_second_serve_is_refused_and_log_and_cancel_work_over_http(tmp_path):
    """The one real job of the security tests: the operator's endpoint with its key, nothing else, and the
    running job untouched by a second `rescue serve` on its queue."""
    from helpers.service_peer import SECRET, Recorder, call, serve, stop, wait_up

    from rescue.embedded.endpoint import EndpointOptions, make_app

    queue = tmp_path / "queue"
    # The operator's endpoint: the bundled VLM on loopback, answering only its own key (others get a 401).
    with Recorder(make_app(EndpointOptions(expected_api_key="lab-key"))) as lab:
        service = tmp_path / "service.toml"
        service.write_text(f'[vlm.lab]\nbase_url = "{lab.url}"\napi_key_env = "LAB_KEY"\n'
                           'models = ["rescue-advisor-v0"]\n')
        env = {"RESCUE_SERVICE_CONFIG": str(service), "LAB_KEY": "lab-key"}
        port = free_port()
        proc = serve(queue, port, env=env)
        try:
            wait_up(port, proc)
            manifest = write_cases(tmp_path / "a.jsonl", 3, horizon=48).read_text()
            status, text = call(port, "POST", "/jobs", {"manifest": manifest, "name": "lab", "config": {
                "vlm": {"endpoint": "lab"}, "policy": {"name": "scripted"}, "cases_in_flight": 1, "env": {"simulators": 1}}})
            assert status == 201, text
            job_id = json.loads(text)["job_id"]
            study = job_study(queue, job_id)
            _wait_claimed(study)
            state_file = queue / "jobs" / job_id / "state.json"
            before = json.loads(state_file.read_text())

            second = serve(queue, free_port(), env=env)
            try:
                _, err = second.communicate(timeout=60)
            finally:
                ensure_stopped(second)
            assert second.returncode == 2
            assert len(err.strip().splitlines()) == 1 and f"process {proc.pid}" in err
            after = json.loads(state_file.read_text())
            assert (after["state"], after["runs"], after["pid"]) == ("running", 1, before["pid"])
            assert _alive(before["pid"]) and int((study / ".owner.lock").read_text()) == before["pid"]

            deadline = time.time() + 400
            while "finished" not in case_states(study).values():
                assert time.time() < deadline, "no case finished"
                time.sleep(0.2)
            status, text = call(port, "POST", f"/jobs/{job_id}/cancel", {})
            assert status == 200 and "draining" in json.loads(text)["message"]
            deadline = time.time() + 300
            while (view := json.loads(call(port, "GET", f"/jobs/{job_id}")[1]))["state"] == "running":
                assert time.time() < deadline, "the cancelled job never ended"
                time.sleep(0.5)
            assert view["state"] == "stopped" and view["message"] == "cancelled"
            assert view["study"] == f"jobs/{job_id}/{study.name}"
            finished = {c for c, s in case_states(study).items() if s == "finished"}
            assert finished and "claimed" not in case_states(study).values()

            status, text = call(port, "GET", f"/jobs/{job_id}/log")
            assert status == 200 and "--- run 1" in json.loads(text)["log"]
            status, export = call(port, "GET", f"/jobs/{job_id}/export")
            assert status == 200 and json.loads(export)["partial"] is True
            cases = {c["case_id"]: c for c in json.loads(export)["export"]["cases"]}
            assert any(cases[c]["arms"]["assisted"]["assistance"] == "applied" for c in finished)
            for answer in (text, export, call(port, "GET", "/jobs")[1]):
                assert str(tmp_path) not in answer and str(ROOT) not in answer
        finally:
            stop(proc)
    calls = [r for r in lab.requests if r["path"].endswith("/completions")]
    assert calls and {r["authorization"] for r in calls} == {"Bearer lab-key"}
    assert not any(SECRET in (r["authorization"] or "") for r in lab.requests)
    assert rescue_cli("verify", str(study)).returncode == 0
