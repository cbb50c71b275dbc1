"""Capture what our simulator hands the `lerobot-libero` profile, and what the profile sends (run in this venv).

    python tests/lerobot_capture.py OUT.npz [PROTOCOL]

One libero_object case under the given episode protocol (default `lerobot`): at the
reset and after one chunk, the raw observables and camera renders the profile was given
(`raw_<stage>_<name>`) and the observation it made (`ours_<stage>_<key>`), for
tests/lerobot_conformance.py to run through LeRobot's own pipeline; and the profile's axis-angle of
4,004 quaternions (`axis_quats`, `axis_ours`).
"""

from __future__ import annotations

import sys

import numpy as np

import rescue.env.libero as libero
from rescue.core.manifest import Case
from rescue.core.observation import quat2axisangle_float32

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
    # The state's axis-angle on many quaternions (and the edges: no rotation, half a turn, w past 1), for
    # LeRobot's own function to give its bytes for the same inputs.
    rng = np.random.default_rng(0)
    quats = rng.standard_normal((4000, 4))
    quats /= np.linalg.norm(quats, axis=1, keepdims=True)
    quats = np.concatenate([quats, [[0, 0, 0, 1.0], [1.0, 0, 0, 0], [0, 0, 0, -1.0], [0, 0, 0, 1 + 1e-9]]])
    arrays |= {"axis_quats": quats, "axis_ours": np.stack([quat2axisangle_float32(q) for q in quats])}
    np.savez(out, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
