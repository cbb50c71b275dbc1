"""Performance modes that must not change results: fork at q, and letting go of the simulator while waiting."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, arm_rows, cli_env, events_of, rescue_cli, write_cases

pytestmark = [pytest.mark.sim, pytest.mark.e2e]


def _arms(study: Path) -> dict[tuple[str, str], dict]:
    return {key: json.loads(data) for key, data in arm_rows(study).items()}


_events = events_of


def test_fork_at_q_gives_the_independent_replays_result(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=64)
    independent, forked = tmp_path / "independent", tmp_path / "forked"
    (tmp_path / "fork.toml").write_text("fork_at_q = true\n")
    rescue_cli("run", str(manifest), "--study", str(independent))
    rescue_cli("run", str(manifest), "--study", str(forked), "--config", str(tmp_path / "fork.toml"))
    a, b = _arms(independent), _arms(forked)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key]["mode"] == "independent" and b[key]["mode"] == "fork"
        # The snapshot at q is exact and the policy replays its prefix: the same rows, row by row.
        assert a[key]["trace"] == b[key]["trace"], key
        assert (a[key]["success"], a[key]["steps"]) == (b[key]["success"], b[key]["steps"])
    for case_id in {c for c, _ in b}:
        control, assisted = b[(case_id, "control")], b[(case_id, "assisted")]
        assert control["q_state"] and control["q_state"] == assisted["q_state"]
    assert rescue_cli("verify", str(forked)).returncode == 0


def test_assisted_arm_lets_another_arm_use_its_simulator_while_waiting(tmp_path):
    endpoint = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "serve-vlm", "--port", "0", "--latency", "4"],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, text=True,
    )
    try:
        url = re.search(r"(http://\S+/v1)", endpoint.stdout.readline()).group(1)
        manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=64)
        study, held = tmp_path / "released", tmp_path / "held"
        (tmp_path / "held.toml").write_text("release_simulator_while_waiting = false\n")
        common = ["--vlm-url", url, "--simulators", "1", "--cases-in-flight", "2"]
        rescue_cli("run", str(manifest), "--study", str(study), *common)
        rescue_cli("run", str(manifest), "--study", str(held), "--config", str(tmp_path / "held.toml"), *common)
    finally:
        endpoint.terminate()
        endpoint.wait(timeout=10)
    events = _events(study)
    suspended = [e for e in events if e["event"] == "sim.suspended"]
    assert len(suspended) == 2
    first = events.index(suspended[0])
    resumed = next(i for i, e in enumerate(events) if i > first and e["event"] == "sim.resumed")
    # With one simulator, some other arm's steps ran while the first assisted arm waited.
    between = [e for e in events[first:resumed] if e["event"] in ("arm.started", "arm.finished")]
    assert between, "no other arm used the simulator during the VLM wait"
    # Letting go and coming back (restored from a snapshot when another arm used it) changes nothing.
    assert {k: v["trace"] for k, v in _arms(study).items()} == {k: v["trace"] for k, v in _arms(held).items()}
    assert not [e for e in _events(held) if e["event"] == "sim.suspended"]
    assert rescue_cli("verify", str(study)).returncode == 0


def test_fork_with_a_permuted_sham_and_two_cases_in_flight_never_starves(tmp_path):
    # Two forked cases in flight on two simulators: each case's followers (assisted, sham) wait
    # for simulators, and a sham waits for its donor in the other case. A follower that finished
    # must give its simulator back at once; held until its case ended, the two cases' finished
    # followers starved each other's waiting ones and the run never ended.
    manifest = write_cases(tmp_path / "m.jsonl", 4, horizon=64)
    config = tmp_path / "c.toml"
    config.write_text('fork_at_q = true\ncases_in_flight = 2\n[env]\nsimulators = 2\n[sham]\nsource = "permuted"\n')
    study = tmp_path / "s"
    # Bounds a hang (the starvation this tests), generously: a busy machine may take minutes.
    rescue_cli("run", str(manifest), "--study", str(study), "--config", str(config), timeout=1200)
    assert rescue_cli("verify", str(study)).returncode == 0
    rescue_cli("export", str(study), "--out", str(tmp_path / "e.json"))
    cases = json.loads((tmp_path / "e.json").read_text())["cases"]
    assert len(cases) == 4 and all(c["state"] == "finished" and "sham" in c["verdicts"] for c in cases)


def _case_lines(tasks: list[int], horizon: int) -> str:
    return "".join(json.dumps({"case_id": f"object-{t}-ep0", "suite": "libero_object", "task_id": t, "init_state_index": 0,
                               "env_seed": 0, "horizon": horizon, "group": "object"}) + "\n" for t in tasks)


def test_an_image_policy_fork_study_is_the_same_on_one_simulator_and_on_two(tmp_path):
    # Followers restore the leader's snapshot at q into whichever simulator is free: on one simulator
    # the one the leader used, on two often the other, one that never built that task or last held
    # another. Every arm's trace, and every follower's first render at q, must not care which.
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(_case_lines([1, 2, 7], 64))
    config = tmp_path / "fork.toml"
    config.write_text('fork_at_q = true\ncases_in_flight = 2\nkeyframes = false\n[policy]\n'
                      'factory = "rescue.embedded.vision_language:make_policy"\n[sham]\nsource = "permuted"\n')
    one, two = tmp_path / "one", tmp_path / "two"
    rescue_cli("run", str(manifest), "--study", str(one), "--config", str(config), "--simulators", "1", timeout=900)
    rescue_cli("run", str(manifest), "--study", str(two), "--config", str(config), "--simulators", "2", timeout=900)
    a, b = _arms(one), _arms(two)
    assert a.keys() == b.keys() and len(a) == 9
    for key in a:
        assert a[key]["mode"] == "fork" and a[key]["status"] == "complete", (key, a[key]["error"])
        assert a[key]["trace"] == b[key]["trace"], key
        assert a[key]["trace"][0]["images"], key  # the image profile: every query carries its images
        assert a[key]["q_render"] and a[key]["q_render"] == b[key]["q_render"], key
    for case_id in {c for c, _ in b}:
        leader = b[(case_id, "control")]["q_render"]
        assert all(b[(case_id, arm)]["q_render"] == leader for arm in ("assisted", "sham"))
    assert rescue_cli("verify", str(two)).returncode == 0
    # A follower whose render at q differs from the leader's, re-hashed to hide it: verify rejects the study.
    import sqlite3

    from rescue.study.journal import stored_arm_digest

    con = sqlite3.connect(two / "journal.sqlite")
    with con:
        (data,) = con.execute("SELECT data FROM arms WHERE case_id = 'object-2-ep0' AND arm = 'assisted'").fetchone()
        record = json.loads(data)
        record["q_render"]["robot0_eye_in_hand"] = "0" * 64
        data = json.dumps(record)
        con.execute("UPDATE arms SET data = ?, digest = ? WHERE case_id = 'object-2-ep0' AND arm = 'assisted'",
                    (data, stored_arm_digest(data)))
    con.close()
    tampered = rescue_cli("verify", str(two), check=False)
    # (rule 5: the edited render now differs from the leader's, and from the render after the VLM wait)
    assert tampered.returncode == 1 and "recomputed unknown (rule 5" in tampered.stdout, tampered.stdout
    assert "render" in tampered.stdout.split("recomputed unknown (rule 5", 1)[1].split("\n")[0], tampered.stdout
