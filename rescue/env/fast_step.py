"""LIBERO's step, exact and faster: `env.step(action)` then `env.check_success()`, bit for bit, without
the work that changes nothing (`FastStep`), and the observables' clocks it advances together (`_Clocks`).

The adapter (`rescue.env.libero`) steps with it where its versions and its robot are the ones it was
proved on (`tests/test_fast_step.py`), and with LIBERO's own step otherwise.
"""

from __future__ import annotations

import numpy as np

# The versions the fast step was proved bit-identical on (tests/test_fast_step.py); others step as LIBERO does.
FAST_STEP_VERSIONS = {"mujoco": "2.3.7", "robosuite": "1.4.0"}
# MuJoCo's mj_checkPos/mj_checkVel reset the data at a NaN or a value beyond mjMAXVAL (1e10); below this, surely not.
SAFE = 1e9


class FastStep:
    """LIBERO's `env.step(action)` followed by `env.check_success()`, bit for bit, without the work that
    changes nothing.

    robosuite runs 25 physics substeps per control step, each: a forward pass, the controller (whose state
    update runs a second forward pass) and `mj_step` (a third). In MuJoCo 2.3.7 every forward pass counts:
    its constraint solver warm-starts from the previous pass's solution, and its kinematics normalize the
    quaternions in qpos in place. But when qpos is already a fixed point of that normalization (about 99%
    of substeps, checked with MuJoCo's own `mju_normalize4`), the second and third passes' position and
    velocity stages recompute exactly what the first computed: they run only the acceleration stage
    (`mj_forwardSkip`, then `mj_step2`). Gone as well: the observation dict `env.step` builds and nobody
    reads, two of its three evaluations of the success predicate (a pure function of the state: the
    stove's burner flag ends as the last evaluation leaves it), the per-substep recomputation of constants
    (action and torque limits, actuator and site ids, four Jacobians where one call gives both halves),
    and the observables' clocks advanced one by one while they tick together. What a step reads and writes
    otherwise is robosuite's own code: set_goal, run_controller, the gripper's smoothing, the observables'
    sensors (rendered views included), `_post_process`.
    """

    def __init__(self, env):
        import mujoco
        import robosuite
        from robosuite.controllers.osc import OperationalSpaceController
        from robosuite.robots.single_arm import SingleArm

        self.env, self.e = env, env.env
        e = self.e
        m = self.m = e.sim.model._model
        self.d = e.sim.data._data
        versions = {"mujoco": mujoco.__version__, "robosuite": robosuite.__version__}
        robot = e.robots[0] if len(e.robots) == 1 else None
        reasons = [
            versions != FAST_STEP_VERSIONS and f"versions {versions}",
            robot is None and f"{len(e.robots)} robots",
            robot is not None and type(robot) is not SingleArm and type(robot).__name__,
            robot is not None and type(robot.controller) is not OperationalSpaceController and type(robot.controller).__name__,
            robot is not None and not robot.has_gripper and "no gripper",
            m.nmocap and "mocap bodies",
            m.opt.integrator == mujoco.mjtIntegrator.mjINT_RK4 and "the RK4 integrator",
            m.opt.enableflags & mujoco.mjtEnableBit.mjENBL_FWDINV and "forward-inverse comparison",
        ]
        self.unsupported = [r for r in reasons if r]
        if self.unsupported:
            return
        self._mujoco = mujoco
        self.robot, c = robot, robot.controller
        self.substeps = int(e.control_timestep / e.model_timestep)
        self.quats = [int(m.jnt_qposadr[j]) + (3 if m.jnt_type[j] == mujoco.mjtJoint.mjJNT_FREE else 0)
                      for j in range(m.njnt) if m.jnt_type[j] in (mujoco.mjtJoint.mjJNT_FREE, mujoco.mjtJoint.mjJNT_BALL)]
        self._fixed = False
        # Constants robosuite looks up again at every substep.
        self.site = e.sim.model.site_name2id(c.eef_name)
        self.arm_dim = c.control_dim
        self.torque_low, self.torque_high = robot.torque_limits
        self.arm_actuators = robot._ref_joint_actuator_indexes
        self.grip_actuators = [e.sim.model.actuator_name2id(a) for a in robot.gripper.actuators]
        ctrl_range = e.sim.model.actuator_ctrlrange[self.grip_actuators]
        self.grip_bias = 0.5 * (ctrl_range[:, 1] + ctrl_range[:, 0])
        self.grip_weight = 0.5 * (ctrl_range[:, 1] - ctrl_range[:, 0])
        self._spans()

    def _fixed_point(self) -> bool:
        """Whether MuJoCo's kinematics would leave qpos as it is (no quaternion it would renormalize)."""
        q = self.d.qpos.copy()
        self._mujoco.mj_normalizeQuat(self.m, q)
        return bool((q == self.d.qpos).all())

    def _forward_again(self) -> None:
        """A forward pass on the state the substep's first pass just computed (the controller's)."""
        if self._fixed:
            self._mujoco.mj_forwardSkip(self.m, self.d, self._mujoco.mjtStage.mjSTAGE_VEL, 0)
        else:
            self._mujoco.mj_forward(self.m, self.d)
            self._fixed = self._fixed_point()

    def _update(self, force: bool = False) -> None:
        """robosuite's Controller.update (1.4.0): its forward pass as `_forward_again`, the Jacobian computed
        once, the arm's entries taken by slices where robosuite takes them by lists (see `_spans`)."""
        c, d, nv = self.robot.controller, self.d, self.m.nv
        if not (c.new_update or force):
            return
        self._forward_again()
        c.ee_pos = np.array(d.site_xpos[self.site])
        c.ee_ori_mat = np.array(d.site_xmat[self.site].reshape([3, 3]))
        jacp, jacr = np.zeros((3, nv)), np.zeros((3, nv))
        self._mujoco.mj_jacSite(self.m, d, jacp, jacr, self.site)
        qvel = d.qvel
        c.ee_pos_vel = np.array(np.dot(jacp, qvel))
        c.ee_ori_vel = np.array(np.dot(jacr, qvel))
        qp, qv = self._qpos_index, self._qvel_index
        c.joint_pos = np.array(d.qpos[qp])
        c.joint_vel = np.array(qvel[qv])
        c.J_pos = np.array(self._columns(jacp))
        c.J_ori = np.array(self._columns(jacr))
        c.J_full = np.array(np.vstack([c.J_pos, c.J_ori]))
        mass_matrix = np.ndarray(shape=(nv, nv), dtype=np.float64, order="C")
        self._mujoco.mj_fullM(self.m, mass_matrix, d.qM)
        c.mass_matrix = self._columns(mass_matrix[qv, :])
        c.new_update = False

    def _columns(self, a: np.ndarray) -> np.ndarray:
        """`a[:, qvel_index]` as robosuite takes it (numpy gives a new array in Fortran order)."""
        if isinstance(self._qvel_index, slice):
            return np.asfortranarray(a[:, self._qvel_index])
        return a[:, self._qvel_index]

    def _spans(self) -> None:
        """The arm's qpos and qvel indices as slices when they are runs (cheaper than lists), if on this
        numpy that gives what robosuite's list indexing gives: the same values in the same memory order."""
        c = self.robot.controller
        self._qpos_index, self._qvel_index = c.qpos_index, c.qvel_index
        runs = [slice(i[0], i[-1] + 1) if len(i) and list(i) == list(range(i[0], i[-1] + 1)) else None
                for i in (c.qpos_index, c.qvel_index)]
        if None in runs:
            return
        probe = np.random.default_rng(0).random((self.m.nv, self.m.nv))
        theirs = (probe[0][c.qpos_index], probe[:3].reshape((3, -1))[:, c.qvel_index], probe[c.qvel_index, :][:, c.qvel_index])
        self._qpos_index, self._qvel_index = runs
        ours = (np.array(probe[0][runs[0]]), np.array(self._columns(probe[:3])), self._columns(probe[runs[1], :]))
        if not all(np.array_equal(a, b) and a.strides == b.strides for a, b in zip(theirs, ours)):
            self._qpos_index, self._qvel_index = c.qpos_index, c.qvel_index

    def _control(self, action: np.ndarray) -> None:
        """robosuite's SingleArm.control (1.4.0) between policy steps, its constants looked up once."""
        robot, d = self.robot, self.d
        torques = robot.controller.run_controller()
        robot.torques = np.clip(torques, self.torque_low, self.torque_high)
        applied = self.grip_bias + self.grip_weight * robot.gripper.format_action(action[self.arm_dim:])
        d.ctrl[self.grip_actuators] = applied
        d.ctrl[self.arm_actuators] = robot.torques

    def __call__(self, action) -> bool:
        """One control step of `action`; True when the task's goal holds after it."""
        e, m, d, mj = self.e, self.m, self.d, self._mujoco
        if e.action_dim == 4 and len(action) > 4:  # LIBERO's own conversion of a pose action for OSC_POSITION
            action = np.concatenate((np.array(action)[:3], np.array(action)[-1:]), axis=-1)
        if e.done:
            raise ValueError("executing action in terminated episode")
        e.timestep += 1
        clocks = _Clocks(e)
        sim, controller = e.sim, self.robot.controller
        sim.forward, controller.update = self._forward_again, self._update
        try:
            for i in range(self.substeps):
                mj.mj_forward(m, d)
                self._fixed = self._fixed_point()
                if i == 0:
                    e._pre_action(action, True)  # robosuite's own: the goal, the buffers
                else:
                    self._control(action)
                # mj_step = checks (a bad qpos or qvel resets the data), a forward pass, mj_step2. Values far
                # from bad need no check; a state that is a fixed point needs only the acceleration stage.
                if not (self._fixed and np.abs(d.qpos).max() < SAFE and np.abs(d.qvel).max() < SAFE):
                    mj.mj_step1(m, d)
                mj.mj_step2(m, d)
                clocks.tick(e.model_timestep)
        finally:
            del sim.forward, controller.update  # the class's own methods again
            clocks.close()
        e.cur_time += e.control_timestep
        e.done = (e.timestep >= e.horizon) and not e.ignore_done
        e._post_process()
        return bool(e._check_success())


class _Clocks:
    """robosuite's `_update_observables`, exactly: every enabled observable's clock advanced by one substep,
    sampled when it is due. While all clocks stand alike (they start so, with no delay) one clock is
    advanced and the observables are written back at the end; otherwise each goes as robosuite's own."""

    def __init__(self, e):
        self.e = e
        self.obs = [o for o in e._observables.values() if o._enabled]
        first = self.obs[0] if self.obs else None
        state = lambda o: (o._time_since_last_sample, o._sampled, o._sampling_timestep, o._current_delay)  # noqa: E731
        self.shared = first is not None and all(state(o) == state(first) for o in self.obs)
        if self.shared:
            self.t, self.sampled, self.period, self.delay = state(first)

    def _sample(self, o) -> None:
        # Observable.update's sampling, verbatim.
        cache = self.e._obs_cache
        obs = np.array(o._filter(o._corrupter(o._sensor(cache))))
        o._current_observed_value = obs[0] if len(obs.shape) == 1 and obs.shape[0] == 1 else obs
        cache[o.name] = np.array(o._current_observed_value)
        o._current_delay = o._delayer()

    def tick(self, dt: float) -> None:
        """One substep of every clock (Observable.update with force=False)."""
        if not self.shared:
            self.e._update_observables()
            return
        self.t += dt
        if not self.sampled and self.period - self.delay >= self.t:
            for o in self.obs:
                self._sample(o)
            self.sampled = True
            if not self._agree():
                for o in self.obs:  # the rest of each one's update: the end of its period
                    if o._time_since_last_sample >= o._sampling_timestep:
                        o._time_since_last_sample %= o._sampling_timestep
                        o._sampled = False
                return
        if self.t >= self.period:
            if not self.sampled:
                for o in self.obs:
                    print(f"Warning: sampling rate for observable {o.name} is either too low or delay is too high. "
                          f"Please adjust one (or both)")
                    self._sample(o)
                self._agree()
            self.t %= self.period
            self.sampled = False
            if not self.shared:
                for o in self.obs:
                    o._time_since_last_sample, o._sampled = self.t, False

    def _agree(self) -> bool:
        """After samples (each observable drew its next delay): whether one clock still serves them all;
        if not, the clocks are written back and each observable goes its own way from here."""
        delays = {o._current_delay for o in self.obs}
        if len(delays) == 1:
            self.delay = delays.pop()
            return True
        self.close()
        self.shared = False
        return False

    def close(self) -> None:
        """Write the shared clock back into every observable."""
        if self.shared:
            for o in self.obs:
                o._time_since_last_sample, o._sampled = self.t, self.sampled
