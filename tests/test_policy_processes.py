"""The in-process policy served from processes of its own (`[policy] processes`, `--policy-processes`).

A policy process outlives a terminal's Ctrl-C (the arms in flight still need it) and is stopped by the
driver; the connections go to each process in turn; the arms are the same as with the policy served in the
command process; a factory that cannot be served stops the command with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, arm_rows, case_states, cli_env, events_of, rescue_cli, write_cases
from helpers.foreground import ctrl_c_mid_arm, group_members, start_foreground

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

# What a run's arm records hold that depends on the clock, on call ids or on which simulator happened to be free,
# not on what the arm did: `restored_render` is there only when another arm took the simulator while this one
# waited for the VLM (its proof is checked by `rescue verify`, not compared here).
_UNSTABLE = ("started_at", "finished_at", "assistance", "restored_render")
_ASSISTANCE_STABLE = ("status", "query_step", "subgoal", "instruction_digest", "source")


def _comparable(data: str) -> dict:
    row = json.loads(data)
    stable = {k: v for k, v in row.items() if k not in _UNSTABLE}
    stable["assistance"] = {k: (row.get("assistance") or {}).get(k) for k in _ASSISTANCE_STABLE}
    return stable


def _started(study) -> dict:
    return next(e for e in events_of(study) if e["event"] == "policy.processes")


def _stopped(study) -> list[dict]:
    return [e for e in events_of(study) if e["event"] == "policy.process_stopped"]


def test_ctrl_c_leaves_the_policy_process_serving_until_the_driver_stops_it_then_resume_runs_the_rest(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 3, horizon=40)
    study = tmp_path / "study"
    proc = start_foreground("run", str(manifest), "--study", str(study), "--cases-in-flight", "1",
                            "--policy-processes", "1")

    def grouped() -> None:
        # The terminal's Ctrl-C reaches the policy process too: it shares the command's process group.
        assert set(_started(study)["pids"]) <= set(group_members(proc.pid))

    in_flight = ctrl_c_mid_arm(proc, study, grouped)
    started = _started(study)
    states = case_states(study)
    # The arms in flight finished against the policy process: it outlived the signal.
    assert [states[c] for c in in_flight] == ["finished"]
    assert "pending" in states.values() and "claimed" not in states.values()
    rows = {k: json.loads(v) for k, v in arm_rows(study).items()}
    assert {rows[(in_flight[0], arm)]["status"] for arm in ("control", "assisted")} == {"complete"}
    # It answered the driver's stop with what it served: alive until the driver's shutdown.
    [stopped] = _stopped(study)
    assert stopped["pid"] == started["pids"][0] and stopped["requests"] > 0
    rescue_cli("resume", str(study))
    assert set(case_states(study).values()) == {"finished"}
    assert rescue_cli("verify", str(study)).returncode == 0


def test_two_policy_processes_share_the_arms_and_give_the_arms_of_the_command_process(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=40)
    processes, command = tmp_path / "processes", tmp_path / "command"
    rescue_cli("run", str(manifest), "--study", str(processes), "--policy-processes", "2", "--cases-in-flight", "2")
    rescue_cli("run", str(manifest), "--study", str(command), "--policy-processes", "0", "--cases-in-flight", "2")
    stopped = _stopped(processes)
    assert len(stopped) == 2 and all(s["connections"] > 0 for s in stopped)
    assert sum(s["requests"] for s in stopped) > 0
    assert (processes / "policy.log").is_file()
    assert _stopped(command) == [] and not any(e["event"] == "policy.processes" for e in events_of(command))
    # Each connection builds its own seeded policy: where it is served changes nothing, arm for arm.
    a, b = arm_rows(processes), arm_rows(command)
    assert a.keys() == b.keys() and len(a) == 4
    for key in a:
        assert _comparable(a[key]) == _comparable(b[key]), key


def test_a_factory_that_cannot_be_served_stops_the_command_with_one_line(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=40)
    proc = rescue_cli("run", str(manifest), "--study", str(tmp_path / "study"), "--policy-factory", "nosuch:thing",
                      "--policy-processes", "1", check=False)
    assert proc.returncode != 0
    assert "nosuch:thing" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_policy_process_that_fails_to_start_is_refused_in_one_line(tmp_path):
    # The child's own failure (the command loads the factory itself first, and refuses a bad one before).
    code = ("from rescue.run.policy_processes import PolicyProcessError, serve_in_processes\n"
            "if __name__ == '__main__':\n"
            "    try:\n"
            f"        serve_in_processes('nosuch:thing', 2, {str(tmp_path / 'policy.log')!r})\n"
            "    except PolicyProcessError as exc:\n"
            "        print(exc)\n")
    script = tmp_path / "start.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=cli_env())
    assert out.returncode == 0, out.stderr
    [line] = out.stdout.strip().splitlines()
    assert "'nosuch:thing'" in line and "ModuleNotFoundError" in line
    assert "ModuleNotFoundError" in (tmp_path / "policy.log").read_text()  # the traceback went to the log
