"""The LIBERO adapter on real MuJoCo: bitwise replays, a mid-episode snapshot that continues exactly,
fingerprints that do not depend on the process, observation profiles, and the typed simulator proxy."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest

from rescue.core.manifest import Case
from rescue.core.observation import get_profile
from rescue.env.libero import VIEW_PREFIX, LiberoAdapter
from rescue.env.pool import SimLease, SimPool, SimProcess

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


def test_the_model_digest_covers_every_byte_mujoco_saves_whatever_the_buffer_held(adapter):
    # The fingerprint's "model" part saves the compiled model into a buffer it does not clear first: it must be
    # the digest of the saved model alone, so MuJoCo must write every byte (a byte it skipped would carry
    # whatever the memory held, and two arms' fingerprints could differ by it).
    import hashlib

    import mujoco

    adapter.reset(CASE)
    model = adapter._env.sim.model._model
    saved = []
    for fill in (0x00, 0xFF, 0x5A):
        buf = np.full(mujoco.mj_sizeModel(model), fill, dtype=np.uint8)
        mujoco.mj_saveModel(model, None, buf)
        saved.append(hashlib.sha256(buf).hexdigest())
    assert saved[0] == saved[1] == saved[2] == adapter._model_digest()
    assert adapter.reset(CASE).fingerprint_parts["model"] == saved[0]


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
    state = pickle.loads(snap["state"])
    state["gripper"] = [np.zeros_like(g) for g in state["gripper"]]
    adapter.restore({**snap, "state": pickle.dumps(state)})
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


SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")


def test_fingerprints_do_not_depend_on_the_process_hash_seed():
    # LIBERO's XML text at env build depends on PYTHONHASHSEED for some suites; the fingerprint
    # digests the model after reset, so two processes with different hash seeds agree.
    sims = [SimProcess("rescue.env.libero:LiberoAdapter", name=f"sim-hash-{seed}", hash_seed=seed) for seed in (1, 2)]

    async def fingerprints(sim):
        out = {}
        for suite in SUITES:
            case = Case.model_validate(
                {"case_id": f"{suite}-0-0", "suite": suite, "task_id": 0, "init_state_index": 0, "env_seed": 7, "horizon": 100}
            )
            out[suite] = await sim.reset(case)
        return out

    async def both():
        return await asyncio.gather(*(fingerprints(sim) for sim in sims))

    try:
        one, two = asyncio.run(both())
    finally:
        for sim in sims:
            sim.stop()
    for suite in SUITES:
        assert one[suite].info["python_hash_seed"] == "1" and two[suite].info["python_hash_seed"] == "2"
        assert set(one[suite].fingerprint_parts) == {"physics", "proprio", "instruction", "scene", "model"}
        assert one[suite].fingerprint_parts == two[suite].fingerprint_parts, suite
        assert one[suite].fingerprint == two[suite].fingerprint, suite
    assert len({one[s].fingerprint for s in SUITES}) == len(SUITES)


def test_openpi_profile_is_reproducible_and_renders_only_its_cameras(adapter):
    case = Case.model_validate({**CASE, "case_id": "object-3-ep1", "horizon": 100})
    first = adapter.reset(case, "openpi-libero")
    chunk1 = adapter.run_chunk(_actions(5, 8), 8)
    views = sorted(k for k in adapter._env.env._observables if k.startswith(VIEW_PREFIX))
    assert views == ["rescue_view_agentview_256", "rescue_view_robot0_eye_in_hand_256"]
    adapter.reset({**CASE, "init_state_index": 3}, "privileged")
    adapter.run_chunk(_actions(6, 8), 8)
    again = adapter.reset(case, get_profile("openpi-libero"))
    chunk2 = adapter.run_chunk(_actions(5, 8), 8)
    assert again.fingerprint == first.fingerprint
    for a, b in ((first.obs, again.obs), (chunk1.obs, chunk2.obs)):
        assert set(a) == {"observation/image", "observation/wrist_image", "observation/state"}
        for key in a:
            assert np.array_equal(a[key], b[key]), key
    # The frames move with the robot: a stale capture would repeat the reset's.
    assert not np.array_equal(first.obs["observation/wrist_image"], chunk1.obs["observation/wrist_image"])
    # No observation is shaped (nothing rendered) when the caller knows the episode is over.
    assert adapter.run_chunk(_actions(7, 4), 4, observe="never").obs == {}


def test_privileged_profile_is_todays_observation(adapter):
    # The embedded policies read robot0_*, task/* and object/* keys; None and "privileged" agree.
    a = adapter.reset(CASE).obs
    b = adapter.reset(CASE, "privileged").obs
    assert {"robot0_eef_pos", "robot0_gripper_qpos", "task/object_pos", "task/target_pos"} <= set(a)
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert not any(k.startswith(VIEW_PREFIX) or k.endswith("_image") for k in a)


def test_lease_comes_back_restored_only_when_another_arm_used_its_simulator():
    import structlog

    async def go():
        pool = SimPool(1, "rescue.env.libero:LiberoAdapter")
        try:
            a, b = SimLease(pool), SimLease(pool)
            await a.acquire()
            await a.reset(CASE, "openpi-libero")
            await a.run_chunk(_actions(2, 16), 16)
            at_suspend = await a.state_digest()
            with structlog.testing.capture_logs() as logs:
                await a.suspend()
                await a.resume()  # nobody used it: no restore
                assert await a.state_digest() == at_suspend
                await a.suspend()
                await b.acquire()  # another arm takes the only simulator and moves it elsewhere
                await b.reset({**CASE, "init_state_index": 5}, "privileged")
                await b.run_chunk(_actions(3, 8), 8)
                b.release()
                await a.resume()  # restored from the snapshot, profile included
                assert await a.state_digest() == at_suspend
                chunk = await a.run_chunk(_actions(4, 8), 8)
            assert "observation/image" in chunk.obs
            resumed = [e["restored"] for e in logs if e["event"] == "sim.resumed"]
            assert resumed == [False, True]
            # The lease keeps its own bookkeeping: nothing is attached to the simulator process.
            sim = a.sim
            assert not hasattr(sim, "holder") and sim.task_key == ("libero_object", 3)
            a.release()
        finally:
            pool.close()

    asyncio.run(go())


def test_an_arm_goes_to_the_free_simulator_that_loaded_its_task():
    # Two simulators, each left holding another task's env: a lease for either task gets that one's
    # simulator whichever is first in the free list (placement changes where an arm runs, never its result).
    async def go():
        pool = SimPool(2, "rescue.env.libero:LiberoAdapter")
        try:
            by_task = {}
            first, second = SimLease(pool), SimLease(pool)
            for lease, task in ((first, 3), (second, 4)):
                await lease.acquire()
                await lease.reset({**CASE, "task_id": task}, "privileged")
                by_task[task] = lease.sim
            assert by_task[3] is not by_task[4]
            first.release()
            second.release()  # the free list holds task 3's simulator first
            for task in (4, 3, 4):
                lease = await SimLease(pool, task=("libero_object", task)).acquire()
                assert lease.sim is by_task[task], task
                assert lease.sim.loaded_tasks() == (("libero_object", task),)
                lease.release()
        finally:
            pool.close()

    asyncio.run(go())


def test_a_tasks_fingerprint_does_not_depend_on_the_other_envs_its_process_built():
    # A simulator process keeps every task env it built; an arm of task A that comes after one of
    # task B on the same process must fingerprint A exactly as a fresh process does.
    from rescue.env.libero import LiberoAdapter

    def case(task: int) -> Case:
        return Case(case_id=f"object-{task}", suite="libero_object", task_id=task, init_state_index=0, env_seed=0, horizon=64)

    fresh, busy = LiberoAdapter(), LiberoAdapter()
    try:
        alone = fresh.reset(case(1))
        busy.reset(case(1))
        busy.reset(case(2))
        again = busy.reset(case(1))
        assert again.fingerprint_parts == alone.fingerprint_parts
        assert again.fingerprint == alone.fingerprint
    finally:
        fresh.close()
        busy.close()


def test_a_suite_that_perturbs_only_its_bases_wording_is_priced_by_the_base_and_closes_nothing():
    # An env's memory is its scene's: libero_object_lan rewrites only the language of libero_object's BDDL files, so
    # once an env of libero_object was built, one of libero_object_lan is priced by that build and fits beside it.
    # (Priced on its own, it would be a suite never measured, built alone: the libero_object env closed first.)
    adapter = LiberoAdapter(max_rss_gb=20.0)
    try:
        for suite in ("libero_object", "libero_object_lan"):
            adapter.reset(Case(case_id=suite, suite=suite, task_id=0, init_state_index=0, env_seed=0, horizon=64))
        assert list(adapter._envs) == [("libero_object", 0), ("libero_object_lan", 0)]
        assert adapter._memory.price("libero_object_lan") is None  # never priced on its own
    finally:
        adapter.close()
