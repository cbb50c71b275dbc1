"""How far one image arm is from this CPU's physical limit: its physics and its renders against bare MuJoCo.

One control arm of the embedded vision-language policy (libero_object task 0, initial state 0, the
`openpi-libero` profile: two 256x256 views per policy query, H steps, a query every C steps) runs
through the simulator adapter in this process, as a simulator process runs it. Its CPU time
(`time.process_time`: every thread of the process, the CPU renderer's included) is split into:
- renders: robosuite's `MjSim.render` calls (the policy's frames);
- observation: shaping what the policy reads after a chunk (state, frame copies);
- physics: the rest of the adapter's control steps (the fast step: 25 substeps, the controller, the
  observables' clocks, the success predicate).
Then the same work done bare, from the states the arm passed through:
- physics: from the state before each control step, with the controls the step ended with, 25
  `mujoco.mj_step` calls, nothing else;
- renders: a `mujoco.Renderer` of the same model and size, the same cameras at the same states.
Printed: each part per arm, and the ratios arm / bare for physics and for rendering. The arm's
pass and the bare pass alternate REPEATS times; the medians are printed.

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/physical_limit.py [H] [C] [REPEATS]
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rescue, whatever is installed

import numpy as np  # noqa: E402

from rescue.core.manifest import Case  # noqa: E402

CASE = dict(case_id="limit-0", suite="libero_object", task_id=0, init_state_index=0, env_seed=0, group="object")
PROFILE = "openpi-libero"


class Clock:
    """Process CPU seconds spent inside the wrapped calls (not counting calls nested in a timed one)."""

    def __init__(self) -> None:
        self.seconds, self.calls, self._depth = 0.0, 0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - t0
                self.calls += 1
                self._depth -= 1

        return timed


def arm_pass(adapter, policy, horizon: int, interval: int, render: Clock):
    """One image arm through the adapter: (physics s, render s, observation s, steps, frames, states)."""
    render.seconds, render.calls = 0.0, 0
    result = adapter.reset(Case(**CASE, horizon=horizon), PROFILE)
    d = adapter._env.env.sim.data._data
    shaping = {"observe": 0.0, "render": 0.0}  # CPU in the observation's shaping, and renders inside it
    own = type(adapter)._observe.__get__(adapter)

    def observe():
        r0, t0 = render.seconds, time.process_time()
        try:
            return own()
        finally:
            shaping["observe"] += time.process_time() - t0
            shaping["render"] += render.seconds - r0

    adapter._observe = observe
    obs, steps, chunk_cpu, chunk_render, success = result.obs, 0, 0.0, 0.0, False
    before, frames = [], [copy.copy(d)]  # (data before a control step, the controls it ended with); data at each frame
    try:
        while steps < horizon and not success:
            actions = np.asarray(policy.infer({**obs, "prompt": result.instruction})["actions"], dtype=np.float64)
            n = min(interval, horizon - steps, len(actions))
            for i in range(n):
                start = copy.copy(d)
                r0, t0 = render.seconds, time.process_time()
                out = adapter.run_chunk(actions[i : i + 1], 1, "always" if i == n - 1 else "never")
                chunk_cpu += time.process_time() - t0
                chunk_render += render.seconds - r0  # the reset's renders are not the steps'
                before.append((start, np.array(d.ctrl)))
                steps += out.steps
                success = out.success
                if success:
                    break
            if not success:
                frames.append(copy.copy(d))
            obs = out.obs
    finally:
        del adapter._observe
    observation = shaping["observe"] - shaping["render"]
    physics = chunk_cpu - chunk_render - observation
    return physics, render.seconds, observation, steps, render.calls, before, frames


def bare_pass(model, before, frames, cameras, size: int, substeps: int) -> tuple[float, float, float]:
    """The same steps and frames, bare: (physics s, render s, three-pass physics s)."""
    import mujoco

    physics = passes = 0.0
    for start, ctrl in before:
        d = copy.copy(start)
        d.ctrl[:] = ctrl
        t0 = time.process_time()
        for _ in range(substeps):
            mujoco.mj_step(model, d)
        physics += time.process_time() - t0
        # The MuJoCo work of robosuite's substep that a bit-exact step keeps: a forward pass (its
        # constraint solution is the next pass's warm start), the controller's pass (acceleration
        # stage), then mj_step's own (acceleration stage and integration).
        d = copy.copy(start)
        d.ctrl[:] = ctrl
        t0 = time.process_time()
        for _ in range(substeps):
            mujoco.mj_forward(model, d)
            mujoco.mj_forwardSkip(model, d, mujoco.mjtStage.mjSTAGE_VEL, 0)
            mujoco.mj_step2(model, d)
        passes += time.process_time() - t0
    renderer = mujoco.Renderer(model, size, size)
    t0 = time.process_time()
    for d in frames:
        for cam in cameras:
            renderer._gl_context.make_current()  # robosuite's context was current
            renderer.update_scene(d, camera=cam)
            renderer.render()
    render = time.process_time() - t0
    return physics, render, passes


def warm_start_chained(model, start) -> bool:
    """Whether a forward pass writes the constraint solver's warm start (so a later pass depends on it)."""
    import mujoco

    d = copy.copy(start)
    mujoco.mj_forward(model, d)
    d.qacc_warmstart[:] += 1e-3
    before = np.array(d.qacc_warmstart)
    mujoco.mj_forward(model, d)
    return not np.array_equal(before, d.qacc_warmstart)


def controller_matrices_us(robot, reps: int = 20000) -> float:
    """CPU microseconds per call of robosuite's `opspace_matrices` (numba-compiled in 1.4.0) on the arm's own
    matrices as the episode left them: the part of every substep's controller that is compiled already."""
    from robosuite.utils.control_utils import opspace_matrices

    c = robot.controller
    args = (c.mass_matrix, c.J_full, c.J_pos, c.J_ori)
    opspace_matrices(*args)
    t0 = time.process_time()
    for _ in range(reps):
        opspace_matrices(*args)
    return (time.process_time() - t0) / reps * 1e6


def main(horizon: int = 280, interval: int = 8, repeats: int = 3) -> None:
    from robosuite.utils import binding_utils

    from rescue.core.observation import get_profile
    from rescue.embedded.vision_language import make_policy
    from rescue.env.libero import LiberoAdapter
    from rescue.study import logs

    logs.configure(None, verbose=False)
    render = Clock()
    binding_utils.MjSim.render = render.wrap(binding_utils.MjSim.render)
    adapter, policy = LiberoAdapter(), make_policy()
    profile = get_profile(PROFILE)
    cameras = [c.camera for c in profile.cameras]
    size = profile.cameras[0].size
    rows = []
    try:
        adapter.reset(Case(**CASE, horizon=horizon), PROFILE)  # the env is built before timing
        model = adapter._env.env.sim.model._model
        substeps = int(adapter._env.env.control_timestep / adapter._env.env.model_timestep)
        for _ in range(repeats):
            policy.reset_rng(0)
            physics, rendered, observed, steps, frames_n, before, frames = arm_pass(adapter, policy, horizon, interval, render)
            bare_physics, bare_render, passes = bare_pass(model, before, frames, cameras, size, substeps)
            rows.append((physics, rendered, observed, bare_physics, bare_render, passes, steps, frames_n))
        chained = warm_start_chained(model, before[len(before) // 2][0])
        matrices_us = controller_matrices_us(adapter._env.env.robots[0])
    finally:
        adapter.close()
    med = [statistics.median(r[i] for r in rows) for i in range(6)]
    steps, frames_n = rows[-1][6], rows[-1][7]
    print(f"libero_object task 0, H={horizon}, C={interval}, profile {PROFILE}: {steps} steps, {frames_n} frames "
          f"({os.environ['MUJOCO_GL']}, LP_NUM_THREADS={os.environ.get('LP_NUM_THREADS', 'unset')}); "
          f"CPU seconds, median of {repeats}")
    print(f"{'part':12} {'arm':>8} {'bare':>8} {'arm/bare':>9} {'arm per unit':>16} {'bare per unit':>16}")
    print(f"{'physics':12} {med[0]:8.2f} {med[3]:8.2f} {med[0] / med[3]:9.2f} {med[0] / steps * 1e3:13.2f} ms "
          f"{med[3] / steps * 1e3:13.2f} ms  (per control step; bare = {substeps} mj_step)")
    print(f"{'  3 passes':12} {'-':>8} {med[5]:8.2f} {med[5] / med[3]:9.2f} {'':>16} {med[5] / steps * 1e3:13.2f} ms  "
          f"(MuJoCo's part of a bit-exact step, per control step; ratio to bare mj_step)")
    print(f"{'rendering':12} {med[1]:8.2f} {med[4]:8.2f} {med[1] / med[4]:9.2f} {med[1] / frames_n * 1e3:13.2f} ms "
          f"{med[4] / frames_n * 1e3:13.2f} ms  (per frame)")
    print(f"{'observation':12} {med[2]:8.2f} {'-':>8}")
    print(f"a forward pass writes the solver's warm start (each of the three passes feeds the next): "
          f"{'yes' if chained else 'no'}")
    budget = (2.0 * med[3] - med[5]) / steps / substeps * 1e6
    print(f"robosuite's compiled opspace_matrices: {matrices_us:.1f} us per substep; at 2.0x bare, everything a "
          f"substep runs besides MuJoCo's three passes would have {budget:.1f} us")
    print(f"arm total {sum(med[:3]):.2f} s; bare total {med[3] + med[4]:.2f} s; ratio {sum(med[:3]) / (med[3] + med[4]):.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
    sys.stdout.flush()
    os._exit(0)  # robosuite's EGL contexts raise from __del__ at interpreter exit; the figures are printed
