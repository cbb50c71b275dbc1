"""Simulator adapter speed: steps per second through the adapter vs a raw LIBERO loop.

Both do the same physics (the same actions from the same initial state) and the
same renders (the three VLM views once, at the query point). The adapter is
measured in-process and through its simulator process (pipe and pickling), with
its own step (FastStep) and with LIBERO's `env.step` + `check_success`
(`libero_step=True`); the two must end in the same physics state, bit for bit
(tests/test_fast_step.py proves every step on three suites).
Target: the adapter's step at least 1.5x the raw loop.
Run: MUJOCO_GL=egl .venv/bin/python benchmarks/adapter_speed.py
"""

from __future__ import annotations

import os
import time

import numpy as np

os.environ.setdefault("MUJOCO_GL", "egl")

CASE = {"suite": "libero_object", "task_id": 0, "init_state_index": 0, "env_seed": 0}
H, C, REPEATS = 280, 8, 3
VIEWS = ["agentview", "frontview", "robot0_eye_in_hand"]


def _actions() -> np.ndarray:
    rng = np.random.default_rng(0)
    acts = rng.uniform(-0.5, 0.5, (H, 7))
    acts[:, 6] = -1.0
    return acts


def raw_loop() -> float:
    """LIBERO's own env, stepped directly: steps per second over H steps with the views rendered at q."""
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs.env_wrapper import ControlEnv

    suite = benchmark.get_benchmark_dict()[CASE["suite"]]()
    task = suite.get_task(CASE["task_id"])
    bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
    env = ControlEnv(bddl_file_name=bddl, use_camera_obs=False, has_offscreen_renderer=True, camera_names=VIEWS,
                     hard_reset=False, horizon=100_000)
    init = suite.get_task_init_states(CASE["task_id"])[CASE["init_state_index"]]
    acts, best = _actions(), 0.0
    for _ in range(REPEATS):
        env.seed(CASE["env_seed"])
        env.reset()
        env.set_init_state(init)
        t0 = time.perf_counter()
        for step, action in enumerate(acts):
            if step == H // 2:
                for cam in VIEWS:
                    env.sim.render(camera_name=cam, width=256, height=256)
            env.step(action)  # returns the observation, as the adapter's loop gets it
            env.check_success()
        best = max(best, H / (time.perf_counter() - t0))
    env.close()
    return best


def _adapter_run(call) -> tuple[float, bytes]:
    acts, best = _actions(), 0.0
    for _ in range(REPEATS):
        call("reset", {**CASE, "horizon": H})
        t0 = time.perf_counter()
        for step in range(0, H, C):
            if step == H // 2:
                call("render", VIEWS, 256)
            call("run_chunk", acts[step : step + C], C)
        best = max(best, H / (time.perf_counter() - t0))
    return best, call("snapshot")["state"]


def adapter_in_process(libero_step: bool = False) -> tuple[float, bytes]:
    """The adapter called directly (`libero_step`: stepping with LIBERO's own env.step)."""
    from rescue.env.libero import LiberoAdapter

    adapter = LiberoAdapter(libero_step=libero_step)
    try:
        return _adapter_run(lambda method, *args: getattr(adapter, method)(*args))
    finally:
        adapter.close()


def _physics(state: bytes) -> bytes:
    import pickle

    return pickle.loads(state)["physics"].tobytes()


def adapter_in_process_pool() -> tuple[float, bytes]:
    """The adapter in its simulator process, as the engine uses it."""
    from rescue.env.pool import SimProcess

    sim = SimProcess("rescue.env.libero:LiberoAdapter", name="bench")
    try:
        return _adapter_run(sim._call)
    finally:
        sim.stop()


def main() -> None:
    raw = raw_loop()
    libero, libero_state = adapter_in_process(libero_step=True)
    direct, direct_state = adapter_in_process()
    pooled, pooled_state = adapter_in_process_pool()
    same = _physics(libero_state) == _physics(direct_state) == _physics(pooled_state)
    print(f"raw LIBERO loop:                    {raw:7.1f} steps/s")
    print(f"adapter, LIBERO's step, in process: {libero:7.1f} steps/s  ratio {libero / raw:.3f}")
    print(f"adapter, in process:                {direct:7.1f} steps/s  ratio {direct / raw:.3f}")
    print(f"adapter, simulator process:         {pooled:7.1f} steps/s  ratio {pooled / raw:.3f}  (target >= 1.5)")
    print(f"final physics state identical to LIBERO's step: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
