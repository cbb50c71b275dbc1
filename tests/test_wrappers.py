"""Wrappers: instruction injection and the rule framework."""

from __future__ import annotations

import numpy as np
import pytest

from rescue.core.digest import digest_array
from wrappers.injection import inject, parse_injection
from wrappers.rules import (
    ActionLayout,
    ChunkCompression,
    GripperRecovery,
    RuleSet,
    RuleWrapper,
    StageRollback,
    chunk_digest,
)

pytestmark = pytest.mark.fast

# --- injection -------------------------------------------------------------


def test_inject_is_exact():
    original = "put the bowl on the plate"
    got = inject(original, "  grasp the bowl rim \n")
    assert got == (
        "put the bowl on the plate\nImmediate next actions: grasp the bowl rim"
        "\nThen complete the original task."
    )


@pytest.mark.parametrize("subgoal", ["", "   ", "\n\t "])
def test_inject_refuses_empty_subgoal(subgoal):
    with pytest.raises(ValueError):
        inject("open the drawer", subgoal)


@pytest.mark.parametrize(
    "original,subgoal",
    [
        ("open the drawer", "move left"),
        ("pick up the cup", "line one\nline two"),
        ("", "x"),
    ],
)
def test_parse_injection_inverts_inject(original, subgoal):
    assert parse_injection(inject(original, subgoal)) == (original, subgoal)


def test_parse_injection_without_subgoal():
    assert parse_injection("open the drawer") == ("open the drawer", None)
    partial = "open the drawer\nImmediate next actions: x"
    assert parse_injection(partial) == (partial, None)


# --- rules -----------------------------------------------------------------


class StagePolicy:
    """A scripted LIBERO-shaped policy: fixed chunk, a stage vote in the reply."""

    def __init__(self, chunk: np.ndarray, stages: list[int] | None = None) -> None:
        self._chunk = chunk
        self._stages = list(stages or [])
        self.seen_obs: list[dict] = []

    def infer(self, obs: dict) -> dict:
        self.seen_obs.append(obs)
        reply = {"actions": self._chunk.copy()}
        if self._stages:
            reply["phase"] = self._stages.pop(0)  # the embedded policies' stage key
        return reply

    def reset(self) -> None:
        pass


def _smooth_chunk(n: int = 26, gripper: float = -1.0) -> np.ndarray:
    chunk = np.zeros((n, 7), dtype=np.float32)
    chunk[:, 0] = np.linspace(0.1, 0.5, n)  # x deltas
    chunk[:, 2] = -0.05
    chunk[:, 6] = gripper
    return chunk


def _obs(gripper_opening: float = 0.04) -> dict:
    state = np.array([0.1, 0.2, 0.3, 0.0, 0.0, 0.0, gripper_opening, -gripper_opening], dtype=np.float32)
    return {"observation/state": state, "prompt": "pick up the cup"}


def _assert_firing(firing: dict, rule: str, step: int, before: np.ndarray, after: np.ndarray):
    assert firing == {
        "step": step,
        "rule": rule,
        "before": digest_array(before),
        "after": digest_array(after),
    }


def test_a_firing_digests_a_chunk_as_the_trace_does():
    # The wrappers spell the digest themselves (they import nothing of rescue): byte for byte the trace's.
    chunks = [_smooth_chunk(), np.arange(12.0).reshape(3, 4).T, np.float64(3.5), np.zeros((0, 7)),
              np.array([[1, 2]], dtype=">i4"), np.ones((8, 7), dtype=np.float16)]
    for chunk in chunks:
        assert chunk_digest(chunk) == digest_array(chunk)
    with pytest.raises(TypeError):
        chunk_digest(np.array([1, "a"], dtype=object))


def test_rules_are_all_off_by_default():
    rules = RuleSet().rules()
    assert [r.name for r in rules] == ["stage_rollback", "gripper_recovery", "chunk_compression"]
    assert not any(r.enabled for r in rules)
    chunk = _smooth_chunk()
    inner = StagePolicy(chunk, stages=[4, 4])
    wrapper = RuleWrapper(inner, rules)
    for _ in range(2):
        out = wrapper.infer(_obs(gripper_opening=0.0))
        np.testing.assert_array_equal(out["actions"], chunk)
    assert wrapper.firings == []
    assert wrapper.stage == 4


def test_ruleset_refuses_unknown_names():
    with pytest.raises(ValueError):
        RuleSet(enabled=["gripper_recovery", "no_such_rule"]).rules()


def test_stage_rollback_alone_on_the_voted_stage_and_persisting():
    chunk = _smooth_chunk()
    votes = [1, 2, 2, 4, 4, 4, 4, 3]
    inner = StagePolicy(chunk, stages=list(votes))
    log: list[dict] = []
    wrapper = RuleWrapper(inner, RuleSet(enabled=["stage_rollback"]).rules(), log=log, stage_obs_key="stage")
    seen, after = [], []
    for i in range(len(votes)):
        out = wrapper.infer(_obs(gripper_opening=0.0), step=16 * i)
        np.testing.assert_array_equal(out["actions"], chunk)  # rollback does not rewrite actions
        seen.append(wrapper.last_query["stage"])
        after.append(wrapper.stage)
    # A stage moves when 2 of the last 3 votes agree; the first vote sets it.
    assert seen == [1, 1, 2, 2, 4, 2, 4, 2]
    # Each rollback clears the votes, so the stage stays 2 until two new votes agree on 4.
    assert after == [1, 1, 2, 2, 2, 2, 2, 2]
    assert [f["step"] for f in log] == [64, 96] and log is wrapper.firings
    _assert_firing(log[0], "stage_rollback", 64, chunk, chunk)
    # The query after a rollback is conditioned on the rolled-back stage.
    assert inner.seen_obs[5]["stage"] == 2
    assert wrapper.votes == [3]


def test_votes_must_be_a_strict_majority():
    for window, quorum in ((3, 1), (4, 2), (2, 3), (0, 0)):
        with pytest.raises(ValueError, match="strict majority"):
            RuleWrapper(StagePolicy(_smooth_chunk()), [], vote_window=window, votes_to_change=quorum)
    raw = RuleWrapper(StagePolicy(_smooth_chunk(), stages=[0, 3, 1]), [], vote_window=1, votes_to_change=1)
    assert [(raw.infer(_obs()), raw.stage)[1] for _ in range(3)] == [0, 3, 1]  # a window of one: the raw report


def test_gripper_recovery_alone_overwrites_whole_chunk():
    chunk = _smooth_chunk(gripper=1.0)  # policy keeps closing
    inner = StagePolicy(chunk, stages=[2, 2])
    wrapper = RuleWrapper(inner, [GripperRecovery(enabled=True), StageRollback(), ChunkCompression()])
    open_out = wrapper.infer(_obs(gripper_opening=0.03))  # not closed: no firing
    np.testing.assert_array_equal(open_out["actions"], chunk)
    out = wrapper.infer(_obs(gripper_opening=0.0005), step=16)
    expected = np.zeros_like(chunk)
    expected[:, 6] = -1.0  # hold still (zero deltas), gripper open
    np.testing.assert_array_equal(out["actions"], expected)
    assert len(wrapper.firings) == 1
    _assert_firing(wrapper.firings[0], "gripper_recovery", 16, chunk, expected)


def test_gripper_recovery_respects_stage_gate_and_absolute_layout():
    chunk = np.ones((5, 3), dtype=np.float64)
    layout = ActionLayout(
        action_dim=3,
        gripper_dims=(2,),
        open_value=1.0,
        close_value=0.0,
        relative=False,
        hold_state_dims=(0, 1, 2),
        state_key="state",
        gripper_state_dims=(2,),
    )
    obs = {"state": np.array([0.5, -0.25, 0.0])}
    rule = GripperRecovery(enabled=True)
    early = RuleWrapper(StagePolicy(chunk, stages=[1]), [rule], layout=layout)
    early.infer(obs)
    assert early.firings == []  # the seed's rule only acts from stage 2 on
    late = RuleWrapper(StagePolicy(chunk, stages=[3]), [rule], layout=layout)
    out = late.infer(obs)["actions"]
    np.testing.assert_array_equal(out, np.tile([0.5, -0.25, 1.0], (5, 1)))


def test_chunk_compression_alone():
    # The seed's 26 -> 20 of a 30-step chunk (the defaults fit 8-action chunks: 8 -> 6).
    chunk = np.concatenate([_smooth_chunk(26), _smooth_chunk(4)])
    rules = RuleSet(enabled=["chunk_compression"], params={"chunk_compression": {"keep": 20, "of": 26}}).rules()
    wrapper = RuleWrapper(StagePolicy(chunk), rules)
    out = wrapper.infer(_obs())["actions"]
    assert out.shape == (20 + 4, 7) and out.dtype == chunk.dtype
    # Relative actions: the compressed steps cover the same displacement.
    np.testing.assert_allclose(out[:20, :6].sum(axis=0), chunk[:26, :6].sum(axis=0), rtol=1e-5)
    np.testing.assert_array_equal(out[:20, 6], -1.0)
    np.testing.assert_array_equal(out[20:], chunk[26:])
    _assert_firing(wrapper.firings[0], "chunk_compression", 0, chunk, out)


def test_chunk_compression_gated_by_gripper_span():
    chunk = _smooth_chunk(30)
    chunk[15:, 6] = 1.0  # a close inside the chunk: span 2 > 0.2
    wrapper = RuleWrapper(StagePolicy(chunk), [ChunkCompression(enabled=True)])
    np.testing.assert_array_equal(wrapper.infer(_obs())["actions"], chunk)
    assert wrapper.firings == []


def test_ruleset_params_reach_the_rule():
    rules = RuleSet(enabled=["chunk_compression"], params={"chunk_compression": {"keep": 5, "of": 10}}).rules()
    wrapper = RuleWrapper(StagePolicy(_smooth_chunk(10)), rules)
    assert wrapper.infer(_obs())["actions"].shape == (5, 7)


# --- inputs a study checks before it starts ----------------------------------------

from wrappers.async_rules import RulesConfig, ablation_configs, rule_inputs_problems  # noqa: E402

ALL_RULES = ["stage_rollback", "gripper_recovery", "chunk_compression"]


def _reply(n: int = 8, **extra) -> dict:
    return {"actions": np.zeros((n, 7)), **extra}


def test_embedded_replies_satisfy_the_default_rules():
    rules = RulesConfig(enabled=ALL_RULES)
    obs = {"robot0_gripper_qpos": np.array([0.04, -0.04])}
    assert rules.stage_key == "phase"
    assert rule_inputs_problems(rules, _reply(phase=0), interval=6, obs_sample=obs) == []
    assert rule_inputs_problems(RulesConfig(), _reply(), interval=8) == []  # nothing enabled, nothing needed


def test_rule_inputs_problems_names_each_missing_input():
    rules = RulesConfig(enabled=ALL_RULES)
    # No stage in the reply: both stage-gated rules are named, with the key to set.
    (problem,) = rule_inputs_problems(rules, _reply(stage=3), interval=6)
    assert "stage_rollback, gripper_recovery" in problem and "'phase'" in problem and "['actions', 'stage']" in problem
    assert rule_inputs_problems(rules.model_copy(update={"stage_key": "stage"}), _reply(stage=3), interval=6) == []
    # Without a stage gate, gripper recovery needs no stage.
    ungated = RulesConfig(enabled=["gripper_recovery"], params={"gripper_recovery": {"min_stage": None}})
    assert rule_inputs_problems(ungated, _reply(), interval=8) == []
    assert "not an integer" in rule_inputs_problems(rules, _reply(phase="carry"), interval=6)[0]
    # Chunks shorter than the compression's length, or a compressed chunk shorter than the interval.
    assert "can never fire" in rule_inputs_problems(rules, _reply(5, phase=0), interval=4)[0]
    (short,) = rule_inputs_problems(rules, _reply(8, phase=0), interval=8)
    assert "leaves 6 of 8" in short and "replan_interval <= 6" in short
    seed = RulesConfig(enabled=["chunk_compression"], params={"chunk_compression": {"keep": 20, "of": 26}})
    assert rule_inputs_problems(seed, _reply(30), interval=20) == []
    assert "can never fire" in rule_inputs_problems(seed, _reply(8), interval=8)[0]
    # The gripper opening must be in what the wrapper sees (an openpi-libero input has no robot0_gripper_qpos).
    (grip,) = rule_inputs_problems(rules, _reply(phase=0), interval=6, obs_sample={"observation/state": np.zeros(8)})
    assert "robot0_gripper_qpos" in grip and "rules.layout" in grip
    assert "2-D 'actions'" in rule_inputs_problems(rules, {"phase": 1}, interval=6)[-1]


def test_ablation_configs_differ_by_one_switch():
    base = RulesConfig(enabled=["stage_rollback"], params={"chunk_compression": {"keep": 5}}, vote_window=5, votes_to_change=3)
    configs = ablation_configs(base, ["gripper_recovery", "chunk_compression"])
    assert {k: v.enabled for k, v in configs.items()} == {
        "all_on": ["stage_rollback", "gripper_recovery", "chunk_compression"],
        "no_gripper_recovery": ["stage_rollback", "chunk_compression"],
        "no_chunk_compression": ["stage_rollback", "gripper_recovery"],
        "all_off": ["stage_rollback"],  # an unlisted rule keeps its base state
    }
    for config in configs.values():
        assert config.model_dump(exclude={"enabled"}) == base.model_dump(exclude={"enabled"})
    full = ablation_configs(RulesConfig(), ALL_RULES)
    assert list(full) == ["all_on", *(f"no_{r}" for r in ALL_RULES), "all_off"]
    assert full["all_off"].enabled == [] and full["all_on"].enabled == ALL_RULES
    for bad in ([], ["stage_rollback", "stage_rollback"], ["gripper_rescue"]):
        with pytest.raises(ValueError):
            ablation_configs(base, bad)
