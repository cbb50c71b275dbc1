"""The adapter's step (FastStep) is LIBERO's own `env.step` + `check_success`, bit for bit.

On a libero_object, a libero_spatial and a libero_goal task, the same actions (random arm motion, the
gripper closing and opening, exact-zero rotations) run through an adapter that steps with LIBERO's own
code (`libero_step=True`) and through one that uses FastStep. After every step, everything the next step
or a query reads must be equal: all of MjData, every controller attribute, the robots' buffers, the
gripper's smoothed action, every observable's clock and value, the observation cache, the model fields
the env writes, the env's counters and the objects' site flags; every 8 steps, the policy's observation
(its images captured inside the step by the views' observables) and renders of three cameras. The goal
task turns its stove on half way (the knob set by hand): the success check, the burner's flag and its
site's visibility must follow alike, and both runs must stop at the same step.
"""

from __future__ import annotations

import numpy as np
import pytest
from restore_probe import UNINITIALISED, _digest

from rescue.env.fast_step import FastStep
from rescue.env.libero import ROBOT_STATE, LiberoAdapter

pytestmark = pytest.mark.sim

CASES = [
    {"suite": "libero_object", "task_id": 2, "init_state_index": 1, "env_seed": 1},
    {"suite": "libero_spatial", "task_id": 3, "init_state_index": 0, "env_seed": 0},
    {"suite": "libero_goal", "task_id": 7, "init_state_index": 2, "env_seed": 2},  # turn on the stove
]
STEPS, QUERY_EVERY, STOVE_AT = 64, 8, 40
CAMERAS = ["agentview", "frontview", "robot0_eye_in_hand"]


def _actions(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, (STEPS, 7))
    a[16:32, 3:6] = 0.0  # exact zeros: OSC keeps its orientation goal
    a[:, 6] = np.where((np.arange(STEPS) // 12) % 2 == 0, -1.0, 1.0)
    return a


def _state(adapter: LiberoAdapter) -> dict[str, str]:
    """Digests of everything a continuation reads (no render)."""
    env = adapter._env.env
    m, d = env.sim.model._model, env.sim.data._data
    out = {}
    for name in dir(d):
        if not name.startswith("_") and name not in UNINITIALISED:
            value = getattr(d, name, None)
            if isinstance(value, np.ndarray):
                out[f"mjdata.{name}"] = _digest(value)
    for name in ("time", "ncon", "nefc", "solver_iter"):
        out[f"mjdata.{name}"] = repr(getattr(d, name))
    for i, robot in enumerate(env.robots):
        out.update({f"controller{i}.{k}": _digest(v) for k, v in vars(robot.controller).items() if k != "sim"})
        out.update({f"robot{i}.{k}": _digest(getattr(robot, k)) for k in ROBOT_STATE})
        out[f"gripper{i}"] = _digest(robot.gripper.current_action)
    for name, o in env._observables.items():
        out[f"observable.{name}"] = f"{o._time_since_last_sample!r}|{o._current_delay!r}|{o._sampled!r}|{_digest(o._current_observed_value)}"
    out.update({f"cache.{k}": _digest(v) for k, v in env._obs_cache.items()})
    for name in ("body_pos", "body_quat", "site_rgba", "site_size"):
        out[f"model.{name}"] = _digest(getattr(m, name))
    for name, obj in {**env.objects_dict, **env.fixtures_dict}.items():
        out[f"sites.{name}"] = repr(obj.object_properties.get("vis_site_names"))
    out["counters"] = repr((env.timestep, env.cur_time, env.done))
    return out


def _turn_on_stove(adapter: LiberoAdapter) -> None:
    env = adapter._env.env
    stove = env.get_object("flat_stove_1")
    on = min(stove.object_properties["articulation"]["default_turnon_ranges"])
    for joint in stove.joints:
        env.sim.data.set_joint_qpos(joint, on + 0.05)


def _run(case: dict, libero_step: bool) -> list:
    adapter = LiberoAdapter(libero_step=libero_step)
    try:
        seen = [("reset", adapter.reset(case, "openpi-libero").fingerprint, _state(adapter))]
        if not libero_step:
            assert isinstance(adapter._step(), FastStep), adapter._fast_steps
        for k, action in enumerate(_actions(case["task_id"])):
            if case["suite"] == "libero_goal" and k == STOVE_AT:
                _turn_on_stove(adapter)
            query = (k + 1) % QUERY_EVERY == 0
            chunk = adapter.run_chunk(action[None], 1, "always" if query else "never")
            row = [k, chunk.steps, chunk.success, _state(adapter)]
            if query:
                row.append({key: _digest(v) for key, v in chunk.obs.items()})
                row.append({cam: _digest(f) for cam, f in adapter.render(CAMERAS, 128).items()})
            seen.append(tuple(row))
            if chunk.success:
                break
        return seen
    finally:
        adapter.close()


@pytest.mark.parametrize("case", CASES, ids=[c["suite"] for c in CASES])
def test_the_fast_step_is_libero_s_step_bit_for_bit(case):
    reference, fast = _run(case, libero_step=True), _run(case, libero_step=False)
    assert len(fast) == len(reference)
    for theirs, ours in zip(reference, fast):
        if theirs != ours:
            differ = sorted(k for k in theirs[-1] if theirs[-1][k] != ours[-1].get(k)) if isinstance(theirs[-1], dict) else []
            pytest.fail(f"{case['suite']}: step {theirs[0]} differs ({', '.join(differ[:8]) or 'steps, success or frames'})")
    if case["suite"] == "libero_goal":
        assert reference[-1][2] is True and reference[-1][0] == STOVE_AT  # the stove's success was reached and seen
        assert "True" in reference[-1][3]["sites.flat_stove_1"]
