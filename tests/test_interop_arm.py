"""A real arm against a policy served by the real openpi server, which has no RNG extension."""

from __future__ import annotations

import asyncio

import pytest
import structlog
from conftest import free_port, write_cases
from openpi_server import WebsocketPolicyServer

from rescue.core.configuration.config_files import load_config
from rescue.core.digest import digest_text
from rescue.core.manifest import load_manifest
from rescue.embedded.scripted import make_policy
from rescue.env.pool import SimPool
from rescue.policy.bundled import serve_factory
from rescue.policy.client import WebsocketPolicyClient
from rescue.run.arm import ArmSpec, run_arm
from rescue.run.preflight import run_preflight
from wrappers.async_rules import AsyncRuleWrapper, RulesConfig

pytestmark = pytest.mark.sim

HORIZON, INTERVAL = 48, 8
INSTRUCTION = "pick up the bbq sauce and place it in the basket"


async def _openpi(case) -> tuple[str, asyncio.Task]:
    """The scripted policy behind openpi's server: one shared instance, no reset, no RNG control."""
    policy = make_policy()
    policy.reset_rng(case.policy_seed)  # seeded once in process, as a plain openpi deployment would be
    port = free_port()
    server = WebsocketPolicyServer(policy, host="127.0.0.1", port=port, metadata={"action_horizon": INTERVAL})
    return f"ws://127.0.0.1:{port}", asyncio.create_task(server.run())


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _arm(url: str, case, sim) -> tuple:
    # As the engine connects: the client behind the (here rule-less) rule wrapper.
    policy = AsyncRuleWrapper(await WebsocketPolicyClient.connect(url, connect_timeout_s=10), RulesConfig())
    try:
        rng = policy.supports_rng
        with structlog.testing.capture_logs() as logs:
            result = await run_arm(case, ArmSpec(arm="control", interval=INTERVAL), sim, policy)
        return result, rng, logs
    finally:
        await policy.close()


def test_arm_completes_against_openpi_server_without_rng_extension(tmp_path):
    case = load_manifest(write_cases(tmp_path / "m.jsonl", 1, horizon=HORIZON)).cases[0]

    async def main():
        pool = SimPool(1, "rescue.env.libero:LiberoAdapter", log_path=str(tmp_path / "sim.log"))
        try:
            sim = await pool.acquire()
            url, task = await _openpi(case)
            try:
                openpi = await _arm(url, case, sim)
            finally:
                await _stop(task)
            # The same policy and seed behind our server, where the arm resets the RNG itself.
            ours = await serve_factory("rescue.embedded.scripted:make_policy")
            try:
                bundled = await _arm(ours.url, case, sim)
            finally:
                await ours.stop()
            return openpi, bundled
        finally:
            pool.close()

    (result, rng, logs), (reference, ref_rng, _) = asyncio.run(main())
    assert rng is False and ref_rng is True
    # reset() sent nothing to the plain server (it would have fed the control message to the policy).
    assert result.status == "complete", result.error
    assert [row.step for row in result.trace] == list(range(0, HORIZON, INTERVAL))
    assert result.steps == HORIZON
    assert {row.instruction for row in result.trace} == {digest_text(INSTRUCTION)}
    assert all(row.state and row.actions for row in result.trace)
    # The record says the server gave no RNG control; the log says what that makes of the arm.
    assert result.policy_rng_control is False and reference.policy_rng_control is True
    assert any(e["event"] == "arm.no_rng_control" and "fresh draw" in e["reason"] for e in logs)
    # A fresh, once-seeded openpi policy replays what our server's per-arm RNG reset gives.
    assert result.fingerprint == reference.fingerprint
    assert result.trace == reference.trace


def test_preflight_reports_a_server_without_rng_extension(tmp_path):
    manifest = load_manifest(write_cases(tmp_path / "m.jsonl", 1, horizon=HORIZON))
    case = manifest.cases[0]

    async def main():
        url, task = await _openpi(case)
        try:
            config = load_config(None, {"policy.url": url, "policy.observation": "privileged", "keepalive_s": 0.3})
            return await run_preflight(manifest.cases, config, k=0, idle_s=1.0)
        finally:
            await _stop(task)

    report = asyncio.run(main())
    assert report.policy_rng_control is False
    text = report.render()
    assert "policy_rng_control = false (prefix equality not guaranteed by the server)" in text
    rng = next(c for c in report.checks if c.name == "rng extension")
    assert rng.verdict == "warn" and "lacks the RNG extension" in rng.detail and "forks at q" in rng.detail
    idle = next(c for c in report.checks if c.name == "idle hold")
    # Plain openpi: the connection survives on pings; its RNG cannot be read.
    assert idle.verdict == "pass" and "ping keepalive" in idle.detail
    assert report.ok  # a warning, not a failure
