"""A service a submitter cannot turn against it: a real `rescue serve` on loopback, hostile requests, no simulation.

The hostile peer is a real OpenAI-compatible-looking server on loopback that records the
Authorization header of every request it gets; the worker runs with a secret of its own in
its environment. Nothing here runs a simulator: every job the tests place is refused before
a child would start (the one real job is in test_service.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
from conftest import HANG_S, ROOT, ensure_stopped, free_port, write_cases
from helpers.service_peer import Recorder, call, serve, stop, wait_up

pytestmark = pytest.mark.e2e


def place_by_hand(queue: Path, manifest: Path, config: dict, tmp: Path) -> str:
    """A job folder written past `rescue submit` (anyone who can write the queue folder can), moved in at once."""
    from rescue.core.configuration.config import StudyConfig
    from rescue.service.queue import jobs_dir, submit_job

    side = tmp / "side-queue"
    spec = submit_job(side, manifest.read_bytes(), str(manifest), StudyConfig(), "by hand")
    (jobs_dir(side) / spec.job_id / "config.json").write_text(json.dumps(config))
    jobs_dir(queue).mkdir(parents=True, exist_ok=True)
    os.rename(jobs_dir(side) / spec.job_id, jobs_dir(queue) / spec.job_id)
    shutil.rmtree(side)
    return spec.job_id


def wait_state(port: int, job_id: str, states: tuple[str, ...], timeout: float = 60, headers: dict | None = None) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        status, text = call(port, "GET", f"/jobs/{job_id}", headers=headers)
        if status == 200 and json.loads(text)["state"] in states:
            return json.loads(text)
        time.sleep(0.2)
    raise AssertionError(f"{job_id} never reached {states}: {text}")


def test_a_submitted_job_cannot_point_the_worker_at_a_host_a_file_or_code(tmp_path):
    queue = tmp_path / "queue"
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=48).read_text()
    port = free_port()
    with Recorder() as hostile:
        proc = serve(queue, port)
        try:
            wait_up(port, proc)
            # The reproduction: the job names the submitter's endpoint and the worker's own key variable.
            status, text = call(port, "POST", "/jobs", {"manifest": manifest, "name": "steal", "config": {
                "vlm": {"base_url": hostile.url, "api_key_env": "WORKER_SECRET"}}})
            problems = json.loads(text)["problems"]
            assert status == 400 and "vlm.base_url" in problems[0] and "vlm.api_key_env" in problems[0]
            for config, key in [
                ({"policy": {"factory": "os:system"}}, "policy.factory"),
                ({"policy": {"url": "ws://127.0.0.1:9"}}, "policy.url"),
                ({"policy": {"api_key_env": "WORKER_SECRET"}}, "policy.api_key_env"),
                ({"env": {"adapter": "os:system"}}, "env.adapter"),
                ({"vlm": {"prompt_root": "/etc"}}, "vlm.prompt_root"),
                ({"vlm": {"api_key": "mine"}}, "vlm.api_key"),
                ({"vlm": {"prompt_template": "../../../etc/passwd"}}, "vlm.prompt_template"),
                ({"vlm": {"endpoint": "elsewhere"}}, "vlm.endpoint"),
                ({"env": {"simulators": 10_000}}, "env.simulators"),
            ]:
                status, text = call(port, "POST", "/jobs", {"manifest": manifest, "config": config})
                assert status == 400 and key in json.loads(text)["problems"][0], (config, text)
            assert not (queue / "jobs").exists() or not any((queue / "jobs").iterdir())

            # Past the API: a job folder written by hand is checked again when the worker takes it.
            by_hand = place_by_hand(queue, tmp_path / "m.jsonl", {
                "vlm": {"base_url": hostile.url, "api_key_env": "WORKER_SECRET"}, "cases_in_flight": 1}, tmp_path)
            view = wait_state(port, by_hand, ("stopped", "finished"))
            assert view["state"] == "stopped" and view["exit_code"] == 2
            assert view["message"].startswith("refused:") and "vlm.base_url" in view["message"]
            assert not any(p.name.startswith("study-") for p in (queue / "jobs" / by_hand).iterdir())
            status, text = call(port, "GET", f"/jobs/{by_hand}/log")
            log = json.loads(text)
            assert status == 200 and "refused" in log["log"] and "vlm.base_url" in log["log"]

            # No answer names a path of the worker's host.
            answers = [call(port, "GET", path)[1] for path in
                       ("/jobs", f"/jobs/{by_hand}", f"/jobs/{by_hand}/log", "/jobs/job-nope", "/")]
            for text in answers:
                assert str(tmp_path) not in text and str(ROOT) not in text, text
        finally:
            stop(proc)
    assert hostile.requests == []  # not one request, so never the worker's secret


def test_a_post_is_json_bounded_and_for_a_loopback_host_and_log_and_cancel_are_http_routes(tmp_path):
    queue = tmp_path / "queue"
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=48).read_text()
    port = free_port()
    proc = serve(queue, port)
    try:
        wait_up(port, proc)
        good = json.dumps({"manifest": manifest, "config": {"env": {"simulators": 1000}}})
        # A cross-site form post cannot set Content-Type: application/json: every POST without it is refused.
        for ctype in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"):
            status, _ = call(port, "POST", "/jobs", good, {"Content-Type": ctype})
            assert status == 415, ctype
        status, _ = call(port, "POST", "/jobs", f"manifest={manifest}",
                         {"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 415
        # 400, not 500: a name that is not a text, a body nested too deep (past Python's recursion limit too),
        # text that is not Unicode, keys the body does not have.
        for body, words in [
            (json.dumps({"manifest": manifest, "name": 123}), "name"),
            (json.dumps({"manifest": manifest, "name": ["a"]}), "name"),
            (json.dumps({"manifest": manifest, "name": "two\nlines"}), "name"),
            ('{"manifest": "\\ud800"}', "Unicode"),
            ("[" * 100_000 + "]" * 100_000, "nests deeper"),
            (json.dumps({"manifest": manifest, "config": {"rules": {"params": {"x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}}}),
             "nests deeper"),
            (json.dumps({"manifest": manifest, "extra": 1}), "extra"),
            ("not json", "not JSON"),
            # A key given twice (json keeps the last silently): the one a reader sees may not be the one that runs.
            ('{"manifest": %s, "config": {"vlm": {"model": "a", "model": "b"}}}' % json.dumps(manifest), "'model' twice"),
        ]:
            status, text = call(port, "POST", "/jobs", body, {"Content-Type": "application/json"})
            assert status == 400 and words in text, (body[:80], status, text)
        status, _ = call(port, "POST", "/jobs", b"{" + b" " * (17 * 1024 * 1024) + b"}",
                         {"Content-Type": "application/json"})
        assert status == 413
        # A page of another site that rebinds its name to 127.0.0.1 names its own host: refused.
        assert call(port, "GET", "/jobs", headers={"Host": f"rebound.example:{port}"})[0] == 403
        assert call(port, "GET", "/jobs", headers={"Host": f"localhost:{port}"})[0] == 200
        assert not (queue / "jobs").exists() or not any((queue / "jobs").iterdir())

        # Log and cancel over HTTP; cancel too must be JSON.
        job_id = place_by_hand(queue, tmp_path / "m.jsonl", {"policy": {"factory": "os:system"}}, tmp_path)
        view = wait_state(port, job_id, ("stopped",))
        assert "policy.factory" in view["message"]
        status, text = call(port, "GET", f"/jobs/{job_id}/log?bytes=40")
        log = json.loads(text)
        assert status == 200 and log["truncated"] and len(log["log"].encode()) <= 40 and log["size"] > 40
        assert call(port, "POST", f"/jobs/{job_id}/cancel", "", {"Content-Type": "application/x-www-form-urlencoded"})[0] == 415
        status, text = call(port, "POST", f"/jobs/{job_id}/cancel", {})
        assert status == 200 and "already stopped" in json.loads(text)["message"]
        assert call(port, "POST", "/jobs/job-nope/cancel", {})[0] == 404
        assert call(port, "GET", "/jobs/job-nope/log")[0] == 404
    finally:
        stop(proc)


def test_the_api_key_is_read_from_the_authorization_header_only(tmp_path):
    queue = tmp_path / "queue"
    port = free_port()
    proc = serve(queue, port, "--api-key-env", "RESCUE_TEST_KEY", env={"RESCUE_TEST_KEY": "k3y"})
    try:
        wait_up(port, proc)
        job_id = place_by_hand(queue, write_cases(tmp_path / "m.jsonl", 1), {"env": {"adapter": "os:system"}}, tmp_path)
        bearer = {"Authorization": "Bearer k3y"}
        assert "env.adapter" in wait_state(port, job_id, ("stopped",), headers=bearer)["message"]
        assert call(port, "GET", "/jobs?key=k3y")[0] == 401  # a key in the URL lands in logs and histories
        assert call(port, "GET", "/jobs", headers={"X-API-Key": "k3y"})[0] == 401
        assert call(port, "GET", "/jobs", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(port, "GET", f"/jobs/{job_id}/log?key=k3y")[0] == 401
        assert call(port, "POST", f"/jobs/{job_id}/cancel?key=k3y", {})[0] == 401
        status, text = call(port, "GET", "/jobs", headers=bearer)
        assert status == 200 and json.loads(text)["jobs"][0]["job_id"] == job_id
        # The page is a shell anyone may load: it shows no job until its script asks with the key.
        status, text = call(port, "GET", "/?key=k3y")
        assert status == 200 and job_id not in text and 'id="jobs"></tbody>' in text
    finally:
        stop(proc)


def test_a_second_serve_on_an_idle_queue_is_refused_naming_the_first(tmp_path):
    queue = tmp_path / "queue"
    first_port = free_port()
    first = serve(queue, first_port)
    try:
        wait_up(first_port, first)
        second = serve(queue, free_port())
        try:
            _, err = second.communicate(timeout=60)
        finally:
            ensure_stopped(second)
        assert second.returncode == 2
        assert err.strip().splitlines() == [err.strip()] and f"process {first.pid}" in err
        assert json.loads((queue / "serve.json").read_text())["pid"] == first.pid  # the first one's, untouched
        assert call(first_port, "GET", "/healthz")[0] == 200
    finally:
        stop(first)
    # The lock dies with its holder: the next serve starts.
    again_port = free_port()
    again = serve(queue, again_port)
    try:
        wait_up(again_port, again)
    finally:
        stop(again)


def test_what_could_only_fail_when_the_job_starts_is_refused_at_submission_and_nothing_is_queued(tmp_path):
    queue = tmp_path / "queue"
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=48).read_text()  # libero_object task 3
    port = free_port()
    proc = serve(queue, port)
    try:
        wait_up(port, proc)
        for config, words in [
            ({"advisors": [{"name": "x"}], "advisors.x": 1}, "advisors.x: given both as a dotted key and in the table advisors"),
            ({"rules": 5, "rules.x": 1}, "rules.x: given both as a dotted key and in the table rules"),
            ({"rules.x": 1, "rules": 5}, "rules.x: given both as a dotted key and in the table rules"),
            ({"vlm.model": "x", "vlm": {"model": "y"}}, "vlm.model: given both as a dotted key and in the table vlm"),
            ({"policy.observation": "openpi_libero"}, "no observation profile 'openpi_libero'; did you mean openpi-libero?"),
            ({"env": {"episode_protocol": "nosuch"}}, "no episode protocol 'nosuch' (built in: rescue, openpi, lerobot, vla-eval)"),
            # A task of the catalog the manifest does not hold is fine (a file shared by studies); a typo is not.
            ({"sham": {"source": "fixed", "by_task": {"libero_object/7": "x", "libero_objet/3": "pick up the bowl"}}},
             "sham.by_task: 'libero_objet/3' names no task (`suite/task_id`) of the manifest (its tasks: "
             "libero_object/3) or of the LIBERO catalog"),
            ({"sham": {"source": "fixed", "by_task": {"libero_object:3": "x"}}}, "'libero_object:3' names no task"),
        ]:
            status, text = call(port, "POST", "/jobs", {"manifest": manifest, "config": config})
            assert status == 400 and words in json.loads(text)["problems"][0], (config, status, text)
        assert not (queue / "jobs").exists() or not any((queue / "jobs").iterdir())
        # A name is the submitter's words, markup and all: only host paths are cut from answers.
        status, text = call(port, "POST", "/jobs", {"manifest": manifest, "name": "</script><b>mine</b>"})
        assert status == 201 and json.loads(text)["name"] == "</script><b>mine</b>", text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=HANG_S)
        ensure_stopped(proc)
    assert "Traceback" not in proc.stderr.read()


def test_a_worker_whose_port_is_taken_exits_2_in_one_line_and_leaves_nothing(tmp_path):
    queue = tmp_path / "queue"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve(queue, port)
        _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 2 and err.strip().splitlines() == [err.strip()], err
    assert f"cannot listen on 127.0.0.1:{port}: the port is taken" in err
    assert not queue.exists()  # no queue folder, no lock file
