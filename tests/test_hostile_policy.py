"""A policy server that turns hostile mid-episode (NaN, Inf, the wrong action dimensions): its chunk is
refused before the simulator runs any of it, the arm ends as an error naming the policy and the step, and
the fail-fast stop counts it like any other policy error. Real `rescue serve-policy` servers, real runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from conftest import rescue_cli, write_cases
from helpers.policy_server import serve_policy

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

EXIT_STOPPED = 3
# H = 48 and the scripted policy's C = 8: queries at steps 0, 8, 16, 24 (= q), 32, 40.
HORIZON, Q = 48, 24


def _run_against(factory: str, tmp_path, cases: int = 3) -> tuple[subprocess.CompletedProcess, list[dict], str]:
    manifest = write_cases(tmp_path / "m.jsonl", cases, horizon=HORIZON)
    study = tmp_path / "study"
    server, url = serve_policy(factory)
    try:
        proc = rescue_cli("run", str(manifest), "--study", str(study), "--policy-url", url, "--simulators", "1",
                          "--cases-in-flight", "1", check=False)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert rescue_cli("export", str(study), "--partial", check=False).returncode == 0
    exported = json.loads((study / "export.json").read_text())["cases"]
    log = (study / "simulator.log").read_text(errors="replace") if (study / "simulator.log").exists() else ""
    return proc, exported, url + "\n" + log


def _assert_refused(proc, cases, url_and_log, step: int, what: str) -> None:
    url, log = url_and_log.split("\n", 1)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    # The first 3 arms failed alike: the study stops claiming, naming the cause.
    assert proc.returncode == EXIT_STOPPED, out
    assert "first 3 arms" in out and "BadActionChunk" in out and url in out, out
    finished = [c for c in cases if c["state"] == "finished"]
    assert len(finished) == 2 and [c["state"] for c in cases].count("pending") == 1
    for case in finished:
        assert case["label"] == "unknown" and url in case["reason"], case
        for arm in (case["arms"]["control"], case["arms"]["assisted"]):
            assert arm["status"] == "error" and arm["success"] is None, arm
            assert arm["error"].startswith("BadActionChunk: ") and f"policy {url}" in arm["error"], arm["error"]
            assert f"at step {step}" in arm["error"] and what in arm["error"], arm["error"]
            assert arm["steps"] == step  # nothing of the refused chunk ran
    # MuJoCo never saw it.
    assert "Nan, Inf or huge value" not in log


def test_a_policy_answering_nan_before_q_is_refused_before_the_simulator(tmp_path):
    proc, cases, url_and_log = _run_against("identity_policies:make_nan_from_second_query", tmp_path)
    _assert_refused(proc, cases, url_and_log, step=8, what="NaN")
    assert all(c["arms"]["assisted"]["assistance"] == "not_reached" for c in cases if c["state"] == "finished")


def test_a_policy_answering_inf_after_q_is_refused_before_the_simulator(tmp_path):
    proc, cases, url_and_log = _run_against("identity_policies:make_inf_from_fifth_query", tmp_path)
    _assert_refused(proc, cases, url_and_log, step=32, what="+Inf")
    # The assisted arm got its subgoal at q; the policy's answer after it is what was refused.
    assert all(c["arms"]["assisted"]["query_step"] == Q for c in cases if c["state"] == "finished")


def test_a_policy_answering_the_wrong_action_dimensions_is_refused(tmp_path):
    proc, cases, url_and_log = _run_against("identity_policies:make_six_dims_from_fifth_query", tmp_path)
    _assert_refused(proc, cases, url_and_log, step=32, what="actions of 6 dimensions")
