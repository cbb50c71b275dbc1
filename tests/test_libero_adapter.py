"""The LIBERO adapter on real MuJoCo: bitwise replays, and a mid-episode snapshot that continues exactly."""

from __future__ import annotations

import numpy as np
import pytest

from rescue.env.libero import LiberoAdapter
from rescue.env.pool import SimProcess

pytestmark = pytest.mark.sim

CASE = {"suite": "libero_object", "task_id": 3, "init_state_index": 1, "env_seed": 1}


def _actions(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    acts = rng.uniform(-1, 1, (n, 7))
    acts[:, 6] = np.sign(acts[:, 6])  # the gripper's smoothed action is part of the state
    return acts


@pytest.fixture(scope="module")
def adapter():
    env = LiberoAdapter()
    yield env
    env.close()


def test_reset_is_bitwise_reproducible_after_other_episodes(adapter):
    first = adapter.reset(CASE)
    out1 = adapter.run_chunk(_actions(0, 40), 40)
    d1 = adapter.state_digest()
    # Another episode in between leaves gripper and controller state behind unless reset clears it.
    adapter.reset({**CASE, "init_state_index": 2, "env_seed": 2})
    adapter.run_chunk(_actions(1, 30), 30)
    again = adapter.reset(CASE)
    out2 = adapter.run_chunk(_actions(0, 40), 40)
    assert again.fingerprint == first.fingerprint
    assert adapter.state_digest() == d1
    for key in out1.obs:
        assert np.array_equal(out1.obs[key], out2.obs[key]), key


def test_fingerprint_tells_initial_states_apart(adapter):
    a = adapter.reset(CASE).fingerprint
    b = adapter.reset({**CASE, "init_state_index": 2}).fingerprint
    assert a != b


def test_snapshot_continues_exactly_in_another_process(adapter):
    adapter.reset(CASE)
    adapter.run_chunk(_actions(2, 24), 24)
    snap = adapter.snapshot()
    adapter.run_chunk(_actions(3, 24), 24)
    straight = adapter.state_digest()

    other = SimProcess("rescue.env.libero:LiberoAdapter", name="sim-snapshot-test")
    try:
        # A fresh process, whose env has run something else first.
        other._call("reset", {**CASE, "init_state_index": 4, "env_seed": 4})
        other._call("run_chunk", _actions(9, 10), 10)
        other._call("restore", snap)
        other._call("run_chunk", _actions(3, 24), 24)
        assert other._call("state_digest") == straight
    finally:
        other.stop()


def test_snapshot_without_gripper_state_diverges(adapter):
    # The recipe's parts matter: dropping the gripper's smoothed action changes the continuation.
    adapter.reset(CASE)
    adapter.run_chunk(_actions(2, 24), 24)
    snap = adapter.snapshot()
    adapter.run_chunk(_actions(3, 24), 24)
    straight = adapter.state_digest()
    broken = {**snap, "gripper": [np.zeros_like(g) for g in snap["gripper"]]}
    adapter.restore(broken)
    adapter.run_chunk(_actions(3, 24), 24)
    assert adapter.state_digest() != straight


def test_views_stay_fresh_after_other_envs_were_built_and_closed():
    adapter = LiberoAdapter()
    try:
        case = {**CASE, "task_id": 0}
        adapter.reset(case)
        first = adapter.render(["agentview", "frontview"], 64)
        # Two more tasks build their own envs and GL contexts in the same process.
        for task in (1, 2):
            adapter.reset({**CASE, "task_id": task})
            other = adapter.render(["agentview"], 64)
        adapter.reset(case)
        again = adapter.render(["agentview", "frontview"], 64)
        assert np.array_equal(first["agentview"], again["agentview"])
        assert np.array_equal(first["frontview"], again["frontview"])
        assert not np.array_equal(first["agentview"], other["agentview"])
        assert not np.array_equal(again["agentview"], again["frontview"])
    finally:
        adapter.close()
