"""Correction rules between a remote policy and the simulator: switched by configuration, logged in arm records."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import rescue_cli, write_cases
from rescue_serve.server import PolicyServer

from rescue.core.configuration.config_files import load_config
from rescue.core.digest import digest_array
from rescue.core.manifest import load_manifest
from rescue.env.pool import SimPool
from rescue.policy.bundled import serve_factory
from rescue.policy.client import WebsocketPolicyClient
from rescue.run.arm import ArmSpec, run_arm
from rescue.study.journal import Journal
from wrappers.async_rules import AsyncRuleWrapper, RulesConfig, rule_inputs_problems
from wrappers.rules import chunk_digest

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

CHUNK = 10


class StagedPolicy:
    """Replies with a fixed-gripper chunk and a stage (under "phase"): the stage it was handed back, else 5."""

    def __init__(self) -> None:
        self.action_horizon = CHUNK
        self._rng = np.random.default_rng(0)

    def infer(self, obs: dict) -> dict:
        actions = np.zeros((CHUNK, 7))
        actions[:, :3] = self._rng.uniform(-0.5, 0.5, (CHUNK, 3))
        actions[:, 6] = 1.0
        return {"actions": actions, "phase": int(obs.get("wrapper_stage", 5))}

    def reset(self) -> None:
        pass

    def reset_rng(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def rng_state(self) -> str:
        return json.dumps(self._rng.bit_generator.state, sort_keys=True, default=int)


def _obs() -> dict:
    return {"robot0_gripper_qpos": np.array([0.0005, -0.0005]), "prompt": "pick up the cup"}


RULE_ALONE = {
    "stage_rollback": {},
    "gripper_recovery": {},
    "chunk_compression": {},  # the defaults compress 8 of the 10 actions into 6
}


@pytest.mark.parametrize("rule", sorted(RULE_ALONE))
def test_each_rule_switched_on_alone_fires_alone(rule):
    rules = RulesConfig(enabled=[rule], params={rule: RULE_ALONE[rule]})

    async def main():
        server = PolicyServer(StagedPolicy, {"action_horizon": CHUNK})
        url = await server.start()
        try:
            wrapped = AsyncRuleWrapper(await WebsocketPolicyClient.connect(url), rules)
            plain = await WebsocketPolicyClient.connect(url)
            try:
                assert wrapped.supports_rng
                for client in (wrapped, plain):
                    await client.reset()
                    await client.reset_rng(3)
                got = await wrapped.infer(_obs(), step=16)
                raw = await plain.infer(_obs())
                probe = await wrapped.keepalive()
                assert probe == await wrapped.rng_state() and probe.requests == 1
                return got, raw, list(wrapped.firings)
            finally:
                await wrapped.close()
                await plain.close()
        finally:
            await server.stop()

    got, raw, firings = asyncio.run(main())
    assert [(f["rule"], f["step"]) for f in firings] == [(rule, 16)]
    assert firings[0]["before"] == digest_array(raw["actions"])
    assert firings[0]["after"] == digest_array(got["actions"])
    if rule == "stage_rollback":  # it rolls the stage back, never the chunk
        np.testing.assert_array_equal(got["actions"], raw["actions"])
    elif rule == "gripper_recovery":  # hold still with the closed gripper commanded open
        assert not got["actions"][:, :6].any() and (got["actions"][:, 6] == -1.0).all()
    else:
        assert len(got["actions"]) == CHUNK - 2


def test_no_rule_enabled_passes_replies_through():
    async def main():
        server = PolicyServer(StagedPolicy, {"action_horizon": CHUNK})
        url = await server.start()
        try:
            wrapped = AsyncRuleWrapper(await WebsocketPolicyClient.connect(url), RulesConfig())
            try:
                replies = [await wrapped.infer(_obs()) for _ in range(3)]
                return replies, list(wrapped.firings)
            finally:
                await wrapped.close()
        finally:
            await server.stop()

    replies, firings = asyncio.run(main())
    assert firings == [] and all(r["actions"].shape == (CHUNK, 7) for r in replies)


def test_stage_rollback_hands_the_stage_back_to_the_policy():
    rules = RulesConfig(enabled=["stage_rollback"], params={"stage_rollback": {"from_stage": 4, "to_stage": 2}},
                        stage_obs_key="wrapper_stage")

    async def main():
        server = PolicyServer(StagedPolicy, {"action_horizon": CHUNK})
        url = await server.start()
        try:
            wrapped = AsyncRuleWrapper(await WebsocketPolicyClient.connect(url), rules)
            try:
                stages = [(await wrapped.infer(_obs(), step=s))["phase"] for s in (0, 10)]
                return stages, list(wrapped.firings)
            finally:
                await wrapped.close()
        finally:
            await server.stop()

    stages, firings = asyncio.run(main())
    # The first reply reports stage 5: the rule rolls it back to 2, which the second query carries.
    assert stages == [5, 2]
    assert [(f["rule"], f["step"]) for f in firings] == [("stage_rollback", 0)]


def test_unknown_rule_or_parameter_is_refused_when_the_config_loads():
    with pytest.raises(ValueError, match="unknown rules"):
        load_config(None, {"rules.enabled": ["gripper_rescue"]})
    with pytest.raises(ValueError, match="bad rule parameters"):
        load_config(None, {"rules.params": {"chunk_compression": {"ratio": 0.5}}})
    assert load_config().rules.enabled == []  # every rule is off by default


# --- real arms on LIBERO through the engine -------------------------------------------

HORIZON = 48


def _study(tmp_path: Path, name: str, toml: str) -> dict:
    """Run a control-only study of one case with a TOML config; return its control arm record."""
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=HORIZON)
    config = tmp_path / f"{name}.toml"
    config.write_text('arms = ["control"]\ncases_in_flight = 1\n[env]\nsimulators = 1\n' + toml)
    study = tmp_path / name
    rescue_cli("run", str(manifest), "--study", str(study), "--config", str(config))
    with Journal.open(study, readonly=True) as journal:
        arm = journal.arms("object-3-ep0")["control"]
    assert arm.status == "complete", arm.error
    return arm.model_dump()


def test_gripper_recovery_in_a_real_arm_and_off_by_default(tmp_path):
    # Thresholds chosen to fire on every query: an open finger (~0.04) counts as closed,
    # and the scripted policy's "phase" serves as the stage (always >= 0).
    on = _study(
        tmp_path,
        "on",
        '[rules]\nenabled = ["gripper_recovery"]\nstage_key = "phase"\n'
        "[rules.params.gripper_recovery]\nclosed_at = 0.05\nmin_stage = 0\n",
    )
    off = _study(tmp_path, "off", "")
    assert off["rule_firings"] == []
    steps = [row["step"] for row in on["trace"]]
    assert steps == list(range(0, HORIZON, 8))
    firings = on["rule_firings"]
    assert [f["step"] for f in firings] == steps
    assert {f["rule"] for f in firings} == {"gripper_recovery"}
    by_step = {row["step"]: row for row in on["trace"]}
    for firing in firings:
        assert firing["before"] != firing["after"]
        # The trace digests the chunk that ran: the rule's output.
        assert by_step[firing["step"]]["actions"] == firing["after"]
    # Same initial state and policy seed: the first chunk before the rule is the one the plain arm ran.
    assert on["fingerprint"] == off["fingerprint"]
    assert firings[0]["before"] == off["trace"][0]["actions"]
    assert on["trace"][0]["actions"] != off["trace"][0]["actions"]
    assert on["policy_rng_control"] is True and off["policy_rng_control"] is True


def test_chunk_compression_in_a_real_arm_replanning_within_the_compressed_chunk(tmp_path):
    # The scripted policy plans 8 actions; compressing them to 6 leaves enough for a replan interval of 4.
    arm = _study(
        tmp_path,
        "compress",
        '[policy]\nreplan_interval = 4\n[rules]\nenabled = ["chunk_compression"]\n'
        "[rules.params.chunk_compression]\nkeep = 6\nof = 8\nspan_threshold = 2.0\n",
    )
    steps = [row["step"] for row in arm["trace"]]
    assert steps == list(range(0, HORIZON, 4))
    assert [(f["rule"], f["step"]) for f in arm["rule_firings"]] == [("chunk_compression", s) for s in steps]


# --- the three rules on the embedded default (the learned policy), direct real arms ----

EMBEDDED = "rescue.embedded.learned:make_policy"


class RecordingRules(AsyncRuleWrapper):
    """The real rule wrapper, keeping each query's view of the rules (what an arm's query record reads)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[dict] = []
        self.chunks: dict[int | None, object] = {}  # the actions each query's reply carried, by step

    async def infer(self, obs: dict, step: int | None = None) -> dict:
        reply = await super().infer(obs, step=step)
        self.seen.append(dict(self.last_query))
        self.chunks[step] = reply["actions"]
        return reply


def test_each_rule_fires_on_the_embedded_default_in_real_arms(tmp_path):
    case = load_manifest(write_cases(tmp_path / "m.jsonl", 1, horizon=120)).cases[0]
    all_on = RulesConfig(enabled=["stage_rollback", "gripper_recovery", "chunk_compression"])
    # With the default thresholds, gripper recovery fires only on a missed grasp (fingers fully
    # closed), which the embedded policy did not make on this task; here a grasp on the object
    # (fingers ~0.015 apart) counts as closed.
    grasp_counts = RulesConfig(enabled=["gripper_recovery"], params={"gripper_recovery": {"closed_at": 0.025}})

    async def main():
        pool = SimPool(1, "rescue.env.libero:LiberoAdapter", log_path=str(tmp_path / "sim.log"))
        server = await serve_factory(EMBEDDED)
        try:
            sim = await pool.acquire()
            probe = await WebsocketPolicyClient.connect(server.url)
            first = await probe.infer({**_first_input(), "prompt": "pick up the cup"})
            await probe.close()
            runs = {}
            for name, rules, interval in (("all_on", all_on, 6), ("grasp", grasp_counts, 8), ("plain", RulesConfig(), 8)):
                policy = RecordingRules(await WebsocketPolicyClient.connect(server.url), rules)
                try:
                    runs[name] = (await run_arm(case, ArmSpec(arm="control", interval=interval), sim, policy), policy)
                finally:
                    await policy.close()
            return first, runs
        finally:
            await server.stop()
            pool.close()

    first, runs = asyncio.run(main())
    # The embedded policy's reply has what every rule needs, once the interval fits the compressed chunk.
    assert rule_inputs_problems(all_on, first, interval=6, obs_sample=_first_input()) == []
    assert "replan_interval <= 6" in rule_inputs_problems(all_on, first, interval=8)[0]

    result, wrapper = runs["all_on"]
    assert result.status == "complete", result.error
    assert result.rule_firings == wrapper.firings
    fired = {f["rule"] for f in result.rule_firings}
    assert {"stage_rollback", "chunk_compression"} <= fired
    by_step = {row.step: row for row in result.trace}
    for f in result.rule_firings:
        if f["rule"] == "chunk_compression":  # 8 actions into 6, all of which run
            sent = wrapper.chunks[f["step"]]
            assert f["before"] != f["after"] == chunk_digest(sent) and len(sent) == 6
            # The trace holds the digest of what ran: the chunk as the arm checks it (float64, clipped to LIBERO's [-1, 1]).
            assert by_step[f["step"]].actions == digest_array(np.clip(np.asarray(sent, dtype=np.float64), -1.0, 1.0))
    # Rollbacks act on the voted stage and persist: the query after one runs under stage 2,
    # although the policy still reports carrying (4) or later.
    seen = wrapper.seen
    rolled = [i for i, q in enumerate(seen) if "stage_rollback" in q["fired"]]
    assert rolled
    for i in rolled:
        assert seen[i]["stage"] >= 4 and seen[i]["stage_after"] == 2
        if i + 1 < len(seen):
            assert seen[i + 1]["stage"] == 2 and seen[i + 1]["vote"] >= 4

    grasp, plain = runs["grasp"][0], runs["plain"][0]
    assert plain.rule_firings == [] and grasp.status == "complete"
    firings = grasp.rule_firings
    assert firings and {f["rule"] for f in firings} == {"gripper_recovery"}
    hold_open = np.zeros((8, 7))
    hold_open[:, 6] = -1.0
    grasp_steps = {row.step: row for row in grasp.trace}
    for f in firings:
        assert f["after"] == digest_array(hold_open) == grasp_steps[f["step"]].actions
    # Until the first firing nothing differed: the chunk it rewrote is the one the plain arm ran.
    plain_steps = {row.step: row for row in plain.trace}
    assert firings[0]["before"] == plain_steps[firings[0]["step"]].actions
    # The rewritten chunk ran: from the next query on, the arm is elsewhere.
    nxt = firings[0]["step"] + 8
    assert grasp_steps[nxt].state != plain_steps[nxt].state


def _first_input() -> dict:
    """A privileged observation of LIBERO's shape: the gripper open above the table."""
    return {
        "robot0_eef_pos": np.array([-0.1, 0.0, 1.0]),
        "robot0_gripper_qpos": np.array([0.039, -0.039]),
        "task/object_pos": np.array([0.0, 0.0, 0.9]),
        "task/target_pos": np.array([0.1, 0.1, 0.9]),
    }
