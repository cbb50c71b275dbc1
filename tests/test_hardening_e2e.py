"""Bad input and broken peers through the real CLI: one clear line, a meaningful exit code, nothing lost."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import HANG_S, ROOT, SCRIPTED_ARGS, case_states, cli_env, free_port, rescue_cli, write_cases

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_UNFINISHED = 2, 3, 5


def _one_clean_line(proc: subprocess.CompletedProcess) -> str:
    out = (proc.stdout + proc.stderr).strip()
    assert "Traceback" not in out, out
    return out


def _wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


def _serve(args: list[str], port: int, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", *args, "--port", str(port)], cwd=ROOT, env={**cli_env(), **(env or {})},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    _wait_port(port)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("command", ["status", "export", "report", "resume", "drain", "verify"])
def test_read_and_run_commands_on_a_folder_that_is_not_a_study(tmp_path, command):
    proc = rescue_cli(command, str(tmp_path), check=False)
    out = _one_clean_line(proc)
    assert proc.returncode != 0 and "not a study" in out and len(out.splitlines()) == 1, out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "toml, named",
    [
        ("[policy\nurl = 1", "not valid TOML"),
        ("[vlm]\nmodle = 'gpt-4.1'\n", "vlm.modle: unknown key"),
        ("cases_in_flight = 'many'\n", "cases_in_flight"),
        ("[env]\nsimulators = -1\n[rules]\nenabeld = []\n", "rules.enabeld: unknown key"),
    ],
)
def test_a_broken_config_is_one_line_and_writes_nothing(tmp_path, toml, named):
    config = tmp_path / "study.toml"
    config.write_text(toml)
    manifest = write_cases(tmp_path / "m.jsonl", 1)
    proc = rescue_cli("run", str(manifest), "--config", str(config), "--study", str(tmp_path / "study"), check=False)
    out = _one_clean_line(proc)
    assert proc.returncode == EXIT_BAD_INPUT and named in out and len(out.splitlines()) == 1, out
    assert not (tmp_path / "study").exists()


def test_a_dead_policy_server_stops_the_study_before_it_consumes_the_queue(tmp_path):
    """The server dies mid-study: no further case is claimed, the run exits 3, resume after a restart runs the rest."""
    port = free_port()
    manifest = write_cases(tmp_path / "m.jsonl", 4, horizon=48)
    study = tmp_path / "study"
    server = _serve(["serve-policy", "--policy", "rescue.embedded.scripted:make_policy"], port)
    url = f"ws://127.0.0.1:{port}"
    # The connection is tried again for 2 s while the port refuses (30 s unless set).
    config = tmp_path / "study.toml"
    config.write_text("[policy]\nconnect_timeout_s = 2\n")
    run = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study), "--policy-url", url,
         "--simulators", "1", "--cases-in-flight", "1", "--config", str(config)],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if (study / "journal.sqlite").exists() and "finished" in case_states(study).values():
                break
            time.sleep(0.05)
        _stop(server)
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == EXIT_STOPPED, out + err
    assert "Traceback" not in out + err and "unreachable" in err and "connect_timeout_s, now 2 s" in err, err
    states = list(case_states(study).values())
    # At most the case in flight when the server died is lost; the rest were never claimed.
    assert states.count("pending") >= 2 and states.count("claimed") == 0
    # The study is resumable once the server is back: the never-claimed cases run.
    server = _serve(["serve-policy", "--policy", "rescue.embedded.scripted:make_policy"], port)
    try:
        proc = rescue_cli("resume", str(study), check=False, timeout=600)
    finally:
        _stop(server)
    assert proc.returncode in (0, 4), proc.stdout + proc.stderr
    assert set(case_states(study).values()) <= {"finished", "interrupted"}
    assert rescue_cli("verify", str(study)).returncode == 0


def test_an_observation_mismatch_stops_after_k_arms_naming_the_key(tmp_path):
    """A policy that reads openpi's LIBERO keys behind the real openpi server, sent privileged observations."""
    sys.path.insert(0, str(ROOT / "tests"))
    from openpi_libero_policy import openpi_server

    config = tmp_path / "study.toml"
    config.write_text('[policy]\nreplan_interval = 5\nobservation = "privileged"\n')
    manifest = write_cases(tmp_path / "m.jsonl", 6, horizon=40)
    study = tmp_path / "study"
    with openpi_server() as url:
        proc = rescue_cli("run", str(manifest), "--study", str(study), "--config", str(config), "--policy-url", url,
                          "--simulators", "1", "--cases-in-flight", "1", check=False, timeout=600)
    out = _one_clean_line(proc)
    assert proc.returncode == EXIT_STOPPED, out
    assert "observation/image" in out and "first 3 arms" in out and "observation" in out
    states = list(case_states(study).values())
    assert states.count("finished") == 2 and states.count("pending") == 4  # 2 cases x 2 arms, then no claim
    export = rescue_cli("export", str(study), check=False)
    assert export.returncode == EXIT_UNFINISHED and "unfinished" in export.stderr
    assert not (study / "export.json").exists()
    assert rescue_cli("export", str(study), "--partial").returncode == 0
    cases = json.loads((study / "export.json").read_text())["cases"]
    finished = [c for c in cases if c["state"] == "finished"]
    assert all(c["label"] == "unknown" and "observation/image" in c["reason"] for c in finished)
    assert all("\n" not in c["reason"] for c in finished)  # one line; the server's traceback is kept apart


def test_a_rejected_vlm_key_is_found_before_anything_runs_or_stops_the_study_the_same_way(tmp_path):
    port = free_port()
    endpoint = _serve(["serve-vlm", "--api-key-env", "RIGHT_KEY"], port, env={"RIGHT_KEY": "the-right-key"})
    manifest = write_cases(tmp_path / "m.jsonl", 6, horizon=48)
    url = f"http://127.0.0.1:{port}/v1"
    unchecked = tmp_path / "unchecked.toml"
    unchecked.write_text('[vlm]\nstartup_check = "none"\n')
    try:
        env = {**cli_env(), "OPENAI_API_KEY": "a-wrong-key"}
        run = [sys.executable, "-m", "rescue.cli", "run", str(manifest), "--vlm-url", url, "--simulators", "2",
               "--cases-in-flight", "1", *SCRIPTED_ARGS]
        # The start's check (GET /models with the key) refuses it before the study exists.
        early = subprocess.run([*run, "--study", str(tmp_path / "early")], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=120)
        # Without it, the first 3 VLM calls fail alike and stop the study.
        proc = subprocess.run([*run, "--study", str(tmp_path / "study"), "--config", str(unchecked)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        _stop(endpoint)
    line = _one_clean_line(early)
    assert early.returncode == EXIT_STOPPED, line
    assert url in line and "HTTP 401" in line and "$OPENAI_API_KEY" in line and "nothing was claimed" in line
    assert not (tmp_path / "early").exists()
    out = _one_clean_line(proc)
    assert proc.returncode == EXIT_STOPPED, out
    assert "VLM auth" in out and "api_key_env" in out
    states = list(case_states(tmp_path / "study").values())
    assert states.count("finished") == 3 and states.count("pending") == 3


def test_an_unreachable_policy_server_or_vlm_endpoint_is_named_before_anything_runs(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=48)
    dead = free_port()  # nothing listens on it
    # The line says the 5 s bound the client waited; the run's timeout only bounds a hang.
    policy = rescue_cli("run", str(manifest), "--study", str(tmp_path / "a"), "--policy-url", f"ws://127.0.0.1:{dead}",
                        check=False, timeout=HANG_S)
    vlm = rescue_cli("run", str(manifest), "--study", str(tmp_path / "b"), "--vlm-url", f"http://127.0.0.1:{dead}/v1",
                     check=False, timeout=60)
    line = _one_clean_line(policy)
    assert policy.returncode == EXIT_STOPPED and f"ws://127.0.0.1:{dead}" in line and "within 5 s" in line, line
    line = _one_clean_line(vlm)
    assert vlm.returncode == EXIT_STOPPED and f"http://127.0.0.1:{dead}/v1" in line and "not reachable" in line, line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # A study whose VLM endpoint has gone away since it was created: resume names it, claims nothing.
    from conftest import resolved_config

    from rescue.core.manifest import load_manifest
    from rescue.study.folder import create_study

    config = resolved_config(8, vlm={"base_url": f"http://127.0.0.1:{dead}/v1"})
    config = config.model_copy(update={"policy": config.policy.model_copy(update={
        "factory": "rescue.embedded.scripted:make_policy", "observation": "privileged",
        "announced": {"action_horizon": 8, "observation": "privileged", "policy": "rescue.embedded.scripted:make_policy"}})})
    create_study(tmp_path / "c", load_manifest(manifest), config)
    resume = rescue_cli("resume", str(tmp_path / "c"), check=False, timeout=60)
    line = _one_clean_line(resume)
    assert resume.returncode == EXIT_STOPPED and "not reachable" in line, line
    assert set(case_states(tmp_path / "c").values()) == {"pending"}


def test_a_second_owner_is_refused_and_the_live_run_is_untouched(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 3, horizon=48)
    study = tmp_path / "study"
    run = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study), "--simulators", "1",
         "--cases-in-flight", "1", *SCRIPTED_ARGS],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if (study / "journal.sqlite").exists() and "claimed" in case_states(study).values():
                break
            time.sleep(0.05)
        second = rescue_cli("resume", str(study), check=False)
        assert second.returncode == EXIT_BAD_INPUT and f"in use by process {run.pid}" in second.stderr, second.stderr
        out, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out + err
    assert set(case_states(study).values()) == {"finished"}


def _fill(path) -> None:
    """Write zeros until the file system is full (a disk the run has already filled stays full)."""
    try:
        with open(path, "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    except OSError:
        pass


def test_a_full_disk_fails_cleanly_and_the_study_resumes_after_space_is_freed(tmp_path):
    """A real, small tmpfs: creation on a full disk leaves nothing; a disk filling mid-run stops the
    run with one line; after space is freed, resume finishes the study and the journal is sound."""
    import sqlite3

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], check=True)
    try:
        manifest = write_cases(tmp_path / "m.jsonl", 4, horizon=48)
        study, filler = disk / "study", disk / "filler"
        _fill(filler)
        proc = rescue_cli("run", str(manifest), "--study", str(study), *SCRIPTED_ARGS, check=False)
        out = _one_clean_line(proc)
        # Refused before anything is made: the estimate against the file system's free space, in one line.
        assert proc.returncode != 0 and "not enough free disk" in out and "MB free" in out, out
        assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # no study, no half-made folder
        filler.unlink(missing_ok=True)

        run = subprocess.Popen(
            [sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study),
             "--simulators", "1", "--cases-in-flight", "1", *SCRIPTED_ARGS],
            cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            deadline = time.time() + 300
            while time.time() < deadline and "finished" not in (case_states(study).values() if (study / "journal.sqlite").exists() else ()):
                time.sleep(0.05)
            _fill(filler)
            out, err = run.communicate(timeout=300)
        finally:
            if run.poll() is None:
                run.kill()
        assert run.returncode != 0, out + err
        assert "Traceback" not in out + err and ("full" in err or "No space" in err), err
        # A resume while the disk is still full fails cleanly and strands nothing.
        still = rescue_cli("resume", str(study), check=False)
        assert still.returncode != 0 and "Traceback" not in still.stdout + still.stderr, still.stdout + still.stderr
        assert set(case_states(study).values()) <= {"pending", "claimed", "finished", "interrupted"}
        filler.unlink(missing_ok=True)
        # A resume killed (-9) as soon as it has settled a case: the next one settles the rest.
        if "claimed" in case_states(study).values():
            kill_mid = subprocess.Popen([sys.executable, "-m", "rescue.cli", "resume", str(study)], cwd=ROOT,
                                        env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
            deadline = time.time() + 120
            while time.time() < deadline and "interrupted" not in case_states(study).values():
                time.sleep(0.01)
            os.killpg(kill_mid.pid, signal.SIGKILL)
            kill_mid.wait()
        proc = rescue_cli("resume", str(study), check=False)
        assert proc.returncode in (0, 4), proc.stdout + proc.stderr
        assert rescue_cli("export", str(study)).returncode == 0  # every case has its verdict
        assert set(case_states(study).values()) <= {"finished", "interrupted"}
        con = sqlite3.connect(study / "journal.sqlite")
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        con.close()
        assert rescue_cli("verify", str(study)).returncode == 0
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_cases_are_claimed_only_with_a_simulator_in_hand(tmp_path):
    """More cases in flight than simulators: a kill leaves at most one case per simulator started."""
    from conftest import kill_mid_study

    manifest = write_cases(tmp_path / "m.jsonl", 6, horizon=48)
    study = tmp_path / "study"
    config = tmp_path / "study.toml"
    config.write_text("release_simulator_while_waiting = false\n")  # no simulator is lent during a VLM wait
    kill_mid_study(["run", str(manifest), "--study", str(study), "--simulators", "1", "--cases-in-flight", "4",
                    "--config", str(config), *SCRIPTED_ARGS], study)
    states = list(case_states(study).values())
    # One simulator: the case on it is claimed; the other workers wait for the simulator unclaimed.
    assert states.count("claimed") == 1 and states.count("pending") >= 3


def test_a_rule_that_cannot_fire_stops_the_study_unless_allowed(tmp_path):
    # The embedded policy reports its stage under "phase"; a rule told to read "stage" never fires.
    manifest = write_cases(tmp_path / "m.jsonl", 3, horizon=32)
    config = tmp_path / "study.toml"
    config.write_text('[rules]\nenabled = ["stage_rollback"]\nstage_key = "stage"\n')
    proc = rescue_cli("run", str(manifest), "--study", str(tmp_path / "strict"), "--config", str(config),
                      "--simulators", "1", "--cases-in-flight", "1", check=False)
    out = _one_clean_line(proc)
    assert proc.returncode == EXIT_STOPPED and "cannot fire" in out and "stage_rollback" in out and "'stage'" in out, out
    assert list(case_states(tmp_path / "strict").values()).count("pending") == 2

    config.write_text('allow_idle_rules = true\n[rules]\nenabled = ["stage_rollback"]\nstage_key = "stage"\n')
    proc = rescue_cli("run", str(manifest), "--study", str(tmp_path / "lenient"), "--config", str(config),
                      "--simulators", "1", "--cases-in-flight", "1", check=False)
    assert proc.returncode in (0, 4), proc.stdout + proc.stderr
    import sqlite3

    con = sqlite3.connect(tmp_path / "lenient" / "journal.sqlite")
    idle = [json.loads(d)["idle_rules"] for (d,) in con.execute("SELECT data FROM arms")]
    con.close()
    assert len(idle) == 6 and all(any("stage_rollback" in p for p in rules) for rules in idle)


def test_a_taken_port_is_one_clear_line(tmp_path):
    port = free_port()
    first = _serve(["serve-vlm"], port)
    try:
        proc = subprocess.run([sys.executable, "-m", "rescue.cli", "serve-vlm", "--port", str(port)], cwd=ROOT,
                              env=cli_env(), capture_output=True, text=True, timeout=60)
    finally:
        _stop(first)
    out = _one_clean_line(proc)
    assert proc.returncode == EXIT_BAD_INPUT and f":{port}" in out and "--port" in out, out


def test_a_key_given_in_the_toml_is_never_stored_and_resume_asks_for_it(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=32)
    config = tmp_path / "study.toml"
    config.write_text('[vlm]\napi_key = "sk-test-distinctive-0042"\napi_key_env = "RESCUE_TEST_KEY"\n')
    study = tmp_path / "study"
    proc = rescue_cli("run", str(manifest), "--study", str(study), "--config", str(config), check=False)
    assert proc.returncode in (0, 4), proc.stdout + proc.stderr
    stored = b"".join(p.read_bytes() for p in study.rglob("*") if p.is_file())
    assert b"sk-test-distinctive-0042" not in stored and b"**********" not in stored
    # The receipts show the key was sent and accepted (the local endpoint takes any key).
    receipts = (study / "receipts" / "receipts.jsonl").read_text()
    assert '"status":"ok"' in receipts
    # A resume has no key: it says how to give it, before anything is written.
    proc = rescue_cli("resume", str(study), check=False)
    out = _one_clean_line(proc)
    assert proc.returncode == EXIT_BAD_INPUT and "RESCUE_TEST_KEY" in out, out
