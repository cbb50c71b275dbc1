"""What a LeRobot policy's preprocessor receives, by LeRobot's own LIBERO pipeline and by ours (run in LeRobot's venv).

    python tests/lerobot_conformance.py CAPTURED.npz POLICY_DIR     # prints one JSON object

CAPTURED.npz holds, per stage, the raw observables and camera renders our simulator
handed the `lerobot-libero` profile (`raw_*`) and what the profile made of them
(`ours_*`). LeRobot's side is what `lerobot-eval` does with a `LiberoEnv` observation:
`preprocess_observation` (uint8 HWC -> float CHW / 255), the task, the env preprocessor
of LeRobot's LIBERO config (`LiberoProcessorStep`: 180-degree flip, the 8-float state),
then the policy's own preprocessor. Ours is the profile's observation through
`rescue-serve lerobot`'s batch and the same policy preprocessor. Each tensor is compared
by dtype, shape and bytes (and, where the bytes differ, by how many float32 steps),
after the env step and after the policy's preprocessor. Besides: the render size
lerobot-eval's LIBERO config builds its env with against ours, and LeRobot's own
axis-angle function against the profile's on the same 4,004 quaternions.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from lerobot.configs.policies import PreTrainedConfig
from lerobot.envs.configs import LiberoEnv
from lerobot.envs.factory import make_env_pre_post_processors
from lerobot.envs.utils import preprocess_observation

from rescue_serve.lerobot import LeRobotServed


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many float32 steps apart the farthest pair of elements is (0: byte for byte)."""
    x = a.detach().cpu().numpy().astype(np.float32).view(np.int32).astype(np.int64)
    y = b.detach().cpu().numpy().astype(np.float32).view(np.int32).astype(np.int64)
    return int(np.abs(x - y).max()) if x.size else 0


def _same(a: object, b: object) -> dict:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return {"equal": False, "why": f"{a.dtype}{tuple(a.shape)} against {b.dtype}{tuple(b.shape)}"}
        equal = a.cpu().numpy().tobytes() == b.cpu().numpy().tobytes()
        diff = 0.0 if equal else float((a.double() - b.double()).abs().max())
        return {"equal": equal, "ulps": 0 if equal else _ulps(a, b), "max_abs": diff}
    return {"equal": a == b}


def _compare(theirs: dict, ours: dict) -> dict[str, dict]:
    keys = sorted(k for k in set(theirs) | set(ours) if k.startswith("observation.") or k == "task")
    return {k: _same(theirs[k], ours[k]) if k in theirs and k in ours else {"equal": False, "why": "missing"}
            for k in keys}


def main(captured_path: str, policy_dir: str) -> int:
    captured = dict(np.load(captured_path))
    task = str(captured["task"])
    served = LeRobotServed.load(policy_dir)
    config = PreTrainedConfig.from_pretrained(policy_dir)
    env_preprocessor, _ = make_env_pre_post_processors(env_cfg=LiberoEnv(task=str(captured["suite"])), policy_cfg=config)
    report: dict = {}
    for stage in sorted({k.split("_", 2)[1] for k in captured if k.startswith("raw_")}):
        raw = {k.split("_", 2)[2]: v for k, v in captured.items() if k.startswith(f"raw_{stage}_")}
        # A LiberoEnv observation as the vector env hands it over (a batch of one).
        env_obs = {
            "pixels": {"image": raw["agentview"][None], "image2": raw["robot0_eye_in_hand"][None]},
            "robot_state": {
                "eef": {"pos": raw["robot0_eef_pos"][None], "quat": raw["robot0_eef_quat"][None]},
                "gripper": {"qpos": raw["robot0_gripper_qpos"][None]},
            },
        }
        theirs = preprocess_observation(env_obs)
        theirs["task"] = [task]
        theirs = env_preprocessor(theirs)
        ours_obs = {k.split("_", 2)[2]: v for k, v in captured.items() if k.startswith(f"ours_{stage}_")}
        ours = served.batch({**ours_obs, "task": task})
        report[stage] = {"env": _compare(theirs, ours), "policy": _compare(served.preprocessor(dict(theirs)),
                                                                           served.preprocessor(dict(ours)))}
    # The render size lerobot-eval's LIBERO config builds its env with, and ours.
    report["render"] = {"lerobot_eval": [LiberoEnv().observation_height, LiberoEnv().observation_width],
                        "ours": {k.split("_", 2)[2]: list(v.shape) for k, v in captured.items()
                                 if k.startswith("raw_") and v.ndim == 3}}
    # LeRobot's own axis-angle (LiberoProcessorStep._quat2axisangle) on the same quaternions as the profile's.
    step = next(s for s in env_preprocessor.steps if hasattr(s, "_quat2axisangle"))
    theirs_axis = step._quat2axisangle(torch.from_numpy(captured["axis_quats"])).numpy()
    ours_axis = captured["axis_ours"]
    report["axisangle"] = {"n": len(ours_axis), "dtype": [str(theirs_axis.dtype), str(ours_axis.dtype)],
                           "differ": int((theirs_axis.view(np.int32) != ours_axis.view(np.int32)).any(axis=1).sum())}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
