"""Capture what our simulator hands the `lerobot-libero` profile, and what the profile sends (run in this venv).

    python tests/lerobot_capture.py OUT.npz [PROTOCOL]

One libero_object case under the given episode protocol (default `lerobot`): at the
reset and after one chunk, the raw observables and camera renders the profile was given
(`raw_<stage>_<name>`) and the observation it made (`ours_<stage>_<key>`), for
tests/lerobot_conformance.py to run through LeRobot's own pipeline.
"""

from __future__ import annotations

import sys

import numpy as np

import rescue.env.libero as libero
from rescue.core.manifest import Case

CASE = Case.model_validate({"case_id": "object-3-ep0", "suite": "libero_object", "task_id": 3, "init_state_index": 0,
                            "env_seed": 0, "horizon": 280})
RAW = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos")


def main(out: str, protocol: str = "lerobot") -> int:
    given: list[tuple[dict, dict]] = []
    shape = libero.shape_observation

    def recording(profile, raw, frames):  # the profile's own function, its inputs kept
        given.append(({k: np.array(raw[k]) for k in RAW}, {k: np.array(v) for k, v in frames.items()}))
        return shape(profile, raw, frames)

    libero.shape_observation = recording
    adapter = libero.LiberoAdapter()
    reset = adapter.reset(CASE, "lerobot-libero", protocol)
    chunk = adapter.run_chunk(np.array([[0.3, -0.2, 0.1, 0.0, 0.05, -0.05, -1.0]] * 5), 5)
    arrays: dict[str, np.ndarray] = {"task": np.array(reset.instruction), "suite": np.array(CASE.suite)}
    for stage, obs, (raw, frames) in (("reset", reset.obs, given[0]), ("chunk", chunk.obs, given[-1])):
        arrays |= {f"raw_{stage}_{k}": v for k, v in {**raw, **frames}.items()}
        arrays |= {f"ours_{stage}_{k}": np.asarray(v) for k, v in obs.items()}
    adapter.close()
    np.savez(out, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
