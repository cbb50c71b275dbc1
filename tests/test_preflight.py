"""`rescue preflight` on real LIBERO: passes on the embedded default, fails loudly on a broken policy or server."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, cli_env, free_port, rescue_cli, write_cases
from openpi_libero_policy import openpi_server
from rescue_serve.server import PolicyServer, policy_metadata

from rescue.core.configuration.config_files import load_config
from rescue.core.manifest import load_manifest
from rescue.core.records import ArmResult, Assistance
from rescue.core.trace import TraceRow
from rescue.embedded.endpoint import STATE as ENDPOINT_STATE
from rescue.embedded.endpoint import EndpointOptions, start_endpoint
from rescue.embedded.scripted import make_policy
from rescue.run.peers import resolved_config, start_peers
from rescue.run.preflight import agreement, run_preflight
from rescue.run.idle_hold import check_idle_hold
from rescue.study.layout import StudyLayout

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

HORIZON = 32


class IgnoresResetRng:
    """The scripted policy behind a broken RNG extension: reset_rng is accepted and ignored.

    Its stream starts from an unseeded (OS-random) state, so two connections never agree.
    """

    observation = "privileged"  # announced like the scripted policy it wraps (it reads privileged keys)

    def __init__(self) -> None:
        self._inner = make_policy()
        self._inner.reset_rng(secrets.randbits(63))
        self.action_horizon = self._inner.action_horizon

    def infer(self, obs: dict) -> dict:
        return self._inner.infer(obs)

    def reset(self) -> None:
        self._inner.reset()

    def reset_rng(self, seed: int) -> None:
        pass  # the bug under test

    def rng_state(self) -> str:
        return self._inner.rng_state()


def test_preflight_passes_on_the_embedded_default(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 3, horizon=HORIZON)
    out = rescue_cli("preflight", str(manifest), "--cases", "2", "--clients", "2", "--idle-s", "1").stdout
    lines = out.splitlines()
    assert "policy_rng_control = true" in lines[0]
    assert any(line.startswith("PASS  rng extension") for line in lines)
    assert "PASS  episode markers: sent around every arm: the server announces episode_start/episode_end" in lines
    determinism = [line for line in lines if "determinism" in line]
    # The first two cases only, each agreeing on both clients to the last row.
    assert len(determinism) == 2
    for case_id, line in zip(("object-3-ep0", "object-3-ep1"), determinism):
        assert line.startswith(f"PASS  determinism {case_id}: 2 clients agree")
        assert f"last at step {HORIZON - 8}" in line
    idle = next(line for line in lines if "idle hold" in line)
    assert idle.startswith("PASS") and "RNG digest, request counter (1)" in idle
    # A 1 s hold proves little about a 1200 s VLM wait, and the report says so.
    assert any(line.startswith("WARN  idle length") for line in lines)
    assert lines[-1] == "preflight: ok"


def test_preflight_fails_when_the_policy_ignores_reset_rng(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=HORIZON)
    port = free_port()
    env = {**cli_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    server = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "serve-policy", "--policy", "test_preflight:IgnoresResetRng", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        proc = rescue_cli(
            "preflight", str(manifest), "--cases", "1", "--clients", "2", "--idle-s", "0.5",
            "--policy-url", f"ws://127.0.0.1:{port}/", check=False,
        )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # The profile it announces passes the real query; the server claims the extension,
    # so only running the arms can reveal the broken determinism.
    assert lines[1].startswith("PASS  policy query: profile 'privileged'")
    assert any(line.startswith("PASS  rng extension") for line in lines)
    determinism = next(line for line in lines if "determinism" in line)
    assert determinism.startswith("FAIL  determinism object-3-ep0: 2 clients disagree")
    assert "trace differs from client 0 at step 0 (actions)" in determinism
    assert lines[-1] == "preflight: FAILED"


def test_idle_hold_fails_when_the_server_drops_connections_between_probes(tmp_path):
    # A server (or a proxy in front of it) that closes connections idle for 1 s, while the
    # study probes only every 30 s: the seed's 120 s keepalive behind a 60 s proxy limit, scaled down.
    case = load_manifest(write_cases(tmp_path / "m.jsonl", 1, horizon=HORIZON)).cases[0]

    async def main():
        server = PolicyServer(make_policy, policy_metadata(make_policy, "scripted"), idle_timeout_s=1.0)
        url = await server.start()
        try:
            config = await resolved_config(load_config(None, {"policy.url": url, "env.simulators": 1, "arms": ["control"]}))
            async with start_peers(config, StudyLayout.of(tmp_path)) as peers:
                sparse = await check_idle_hold(case, config.model_copy(update={"keepalive_s": 30.0}), peers, 3.0)
                dense = await check_idle_hold(case, config.model_copy(update={"keepalive_s": 0.3}), peers, 3.0)
            return sparse, dense
        finally:
            await server.stop()

    sparse, dense = asyncio.run(main())
    assert sparse.verdict == "fail"
    assert "connection was lost" in sparse.detail and "3 s idle hold with keepalive every 30 s" in sparse.detail
    assert "lower keepalive_s below its idle limit" in sparse.detail
    # Probing more often than the server's idle limit keeps the same connection and RNG state.
    assert dense.verdict == "pass", dense.detail
    assert "connection id and server instance unchanged" in dense.detail


def _arm(rows: list[tuple[int, str]], steps: int = 48, fingerprint: str = "f0") -> ArmResult:
    trace = [TraceRow(step=s, state="s", instruction="i", actions=a) for s, a in rows]
    return ArmResult(case_id="c", arm="control", status="complete", success=False, steps=steps,
                     fingerprint=fingerprint, trace=trace, assistance=Assistance(status="control"))


def test_agreement_names_the_first_difference():
    same = [(0, "a0"), (8, "a1"), (16, "a2")]
    assert agreement([_arm(same), _arm(same), _arm(same)]) is None
    assert agreement([_arm(same), _arm(same), _arm(same[:2] + [(16, "zz")])]) == (
        "client 2: trace differs from client 0 at step 16 (actions)"
    )
    assert agreement([_arm(same), _arm(same[:2], steps=16)]) == "client 1: 2 trace rows, client 0 has 3"
    assert "fingerprint" in agreement([_arm(same), _arm(same, fingerprint="f1")])


# --- the real calls: one policy query with the profile, one VLM call with the study's settings ----

VLM_KEY_ENV = "PREFLIGHT_TEST_VLM_KEY"
VLM_KEY = "sk-right-key-0123"


def _preflight_with_vlm(tmp_path, monkeypatch, presented_key: str):
    """Preflight (idle hold only) of one case with the local VLM endpoint demanding VLM_KEY."""
    monkeypatch.setenv(VLM_KEY_ENV, presented_key)
    manifest = load_manifest(write_cases(tmp_path / "m.jsonl", 1, horizon=HORIZON))

    async def main():
        runner, base_url = await start_endpoint(EndpointOptions(expected_api_key=VLM_KEY))
        try:
            config = load_config(None, {
                "policy.factory": "rescue.embedded.scripted:make_policy",
                "vlm.base_url": base_url, "vlm.api_key_env": VLM_KEY_ENV, "vlm.max_attempts": 2,
            })
            report = await run_preflight(list(manifest.cases), config, k=0, clients=1, idle_s=0.5)
            return report, list(runner.app[ENDPOINT_STATE].requests)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_preflight_makes_a_real_vlm_call_with_the_studys_settings(tmp_path, monkeypatch):
    report, requests = _preflight_with_vlm(tmp_path, monkeypatch, VLM_KEY)
    assert report.ok, report.render()
    names = [c.name for c in report.checks]
    assert names[:2] == ["policy query", "vlm call"]
    assert "the policy answered a (" in report.checks[0].detail
    assert "rescue-advisor-v0" in report.checks[1].detail and "structured output on" in report.checks[1].detail
    # One call, structured, carrying the three rendered views, with the right key.
    assert len(requests) == 1
    assert requests[0].structured and requests[0].key_matched and requests[0].outcome == "ok"
    assert requests[0].n_images >= 1


def test_preflight_fails_early_on_a_wrong_vlm_key(tmp_path, monkeypatch):
    report, requests = _preflight_with_vlm(tmp_path, monkeypatch, "sk-wrong-key-9876")
    assert not report.ok
    text = report.render()
    fails = [line for line in text.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith("FAIL  vlm call: the VLM refused the API key")
    assert f"put a valid key in ${VLM_KEY_ENV} (vlm.api_key_env)" in fails[0] and "401" in fails[0]
    assert "sk-wrong-key-9876" not in text  # the endpoint echoes the key; the report does not
    # Nothing else ran: no determinism, no idle hold.
    assert [c.name for c in report.checks] == ["policy query", "vlm call"]
    assert text.splitlines()[-1] == "preflight: FAILED"
    # A 401 is not retried.
    assert [r.outcome for r in requests] == ["401"]


def test_preflight_fails_early_when_the_policy_reads_other_keys(tmp_path):
    manifest = load_manifest(write_cases(tmp_path / "m.jsonl", 1, horizon=HORIZON))

    def run(observation: str, protocol: str | None = None):
        config = load_config(None, {
            "policy.url": url, "policy.replan_interval": 5, "policy.observation": observation, "arms": ["control"],
            **({"env.episode_protocol": protocol} if protocol else {}),
        })
        return asyncio.run(run_preflight(list(manifest.cases), config, k=0, clients=1, idle_s=0.5))

    with openpi_server() as url:
        wrong = run("privileged")
        right = run("openpi-libero")
        ours = run("openpi-libero", "rescue")
    assert [c.name for c in wrong.checks] == ["policy query"]
    line = wrong.render().splitlines()[1]
    assert line.startswith("FAIL  policy query: the policy server refused an observation of profile 'privileged'")
    assert "KeyError" in line and "'observation/image'" in line and "set [policy] observation" in line
    assert right.ok, right.render()
    assert right.checks[0].detail == "profile 'openpi-libero': the policy answered a (10, 7) chunk; C = 5"
    assert [c.name for c in right.checks] == ["policy query", "rng extension", "mode", "episode markers", "idle hold"]
    # openpi's server announces nothing and would infer on a control frame: no protocol sends it one.
    markers = {name: next(c.detail for c in report.checks if c.name == "episode markers")
               for name, report in (("openpi", right), ("rescue", ours))}
    assert markers == {
        "openpi": "not sent: the openpi protocol's own client sends none (the server does not announce them)",
        "rescue": "not sent: the server does not announce episode_start/episode_end; a server that does not know "
                  "them (openpi's) would pass them to its policy as an observation",
    }
