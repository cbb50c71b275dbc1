"""Render cost per policy query: the `openpi-libero` profile (2 cameras at 256) vs `privileged` (none).

Runs control arms through the real arm runner (`rescue.run.arm.run_arm`) on one
LIBERO case, the simulator adapter in this process so its renders can be
timed, each policy behind the bundled websocket server on loopback:
- `privileged`: the scripted reference policy (it reads privileged keys);
- `openpi-libero`: the tests' `OpenpiLiberoPolicy`, which checks openpi's
  LIBERO inputs and returns fixed small motions.
It prints, per profile, the seconds spent in MuJoCo renders and in image
preparation (rotate, resize-with-pad) per policy query, and their share of
the arm's wall time. The env is built before timing (paid once per simulator
process and task).
Run: MUJOCO_GL=egl .venv/bin/python benchmarks/render_cost.py [H] [C] [ARMS]
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np  # noqa: E402

from rescue.core import observation  # noqa: E402
from rescue.core.manifest import Case  # noqa: E402
from rescue.core.observation import get_profile  # noqa: E402
from rescue.embedded.scripted import make_policy  # noqa: E402
from rescue.env.libero import LiberoAdapter  # noqa: E402
from rescue.env.pool import Simulator  # noqa: E402
from rescue.policy.client import WebsocketPolicyClient  # noqa: E402
from rescue_serve.server import PolicyServer, policy_metadata  # noqa: E402
from rescue.run.arm import ArmSpec, run_arm  # noqa: E402
from rescue.study import logs  # noqa: E402

CASE = dict(case_id="render-0", suite="libero_object", task_id=0, init_state_index=0, env_seed=0, group="object")


class Timer:
    """Accumulated seconds and calls of one wrapped function."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return timed


class InProcess(Simulator):
    """The adapter in this process, behind the arm's typed simulator interface."""

    def __init__(self, adapter: LiberoAdapter) -> None:
        self.adapter = adapter

    async def _invoke(self, method: str, *args):
        return getattr(self.adapter, method)(*args)


def openpi_factory():
    from openpi_libero_policy import OpenpiLiberoPolicy

    return OpenpiLiberoPolicy()


async def one_arm(case: Case, profile_name: str, factory, interval: int, sim: InProcess, render: Timer, prep: Timer) -> dict:
    server = PolicyServer(factory, policy_metadata(factory, profile_name))
    url = await server.start()
    try:
        await sim.reset(case, profile_name)  # builds the env and its camera observables before timing
        client = await WebsocketPolicyClient.connect(url)
        try:
            render.seconds = prep.seconds = 0.0
            render.calls = prep.calls = 0
            t0 = time.perf_counter()
            result = await run_arm(case, ArmSpec(arm="control", interval=interval, profile=get_profile(profile_name)), sim, client)
            wall = time.perf_counter() - t0
        finally:
            await client.close()
    finally:
        await server.stop()
    if result.status != "complete":
        raise RuntimeError(f"{profile_name}: arm {result.status}: {result.error}")
    return {"queries": len(result.trace), "steps": result.steps, "wall": wall, "render_s": render.seconds,
            "render_calls": render.calls, "prep_s": prep.seconds}


def main(horizon: int = 120, interval: int = 5, arms: int = 2) -> None:
    """Run `arms` control arms per profile on one case and print the render cost."""
    logs.configure(None, verbose=False)
    from robosuite.utils import binding_utils

    render, prep = Timer(), Timer()
    binding_utils.MjSim.render = render.wrap(binding_utils.MjSim.render)
    observation.prepare_image = prep.wrap(observation.prepare_image)
    sim = InProcess(LiberoAdapter())
    case = Case(**CASE, horizon=horizon)
    runs = {"privileged": (make_policy, []), "openpi-libero": (openpi_factory, [])}
    try:
        for _ in range(arms):
            for name, (factory, out) in runs.items():
                out.append(asyncio.run(one_arm(case, name, factory, interval, sim, render, prep)))
    finally:
        sim.adapter.close()
    print(f"libero_object task 0, H={horizon}, C={interval}, {arms} control arms per profile, CPU renderer "
          f"({os.environ['MUJOCO_GL']}), adapter in process, policy over loopback websocket")
    print(f"{'profile':14} {'queries':>7} {'renders':>7} {'render s/query':>14} {'prep s/query':>12} "
          f"{'arm wall s':>10} {'steps/s':>7} {'render share':>12} {'render+prep share':>17}")
    for name, (_, out) in runs.items():
        q = sum(r["queries"] for r in out)
        wall = sum(r["wall"] for r in out)
        rs, ps = sum(r["render_s"] for r in out), sum(r["prep_s"] for r in out)
        print(f"{name:14} {q:7d} {sum(r['render_calls'] for r in out):7d} {rs / q:14.4f} {ps / q:12.4f} "
              f"{wall / len(out):10.2f} {sum(r['steps'] for r in out) / wall:7.1f} {rs / wall:12.1%} {(rs + ps) / wall:17.1%}")
    base = np.mean([r["wall"] for r in runs["privileged"][1]])
    cams = np.mean([r["wall"] for r in runs["openpi-libero"][1]])
    print(f"arm wall time openpi-libero / privileged: {cams / base:.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
    sys.stdout.flush()
    # robosuite's EGL contexts raise from __del__ at interpreter exit; the figures are printed.
    os._exit(0)
