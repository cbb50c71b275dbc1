"""The `vla-eval-libero` observation profiles: what vla-eval's LIBERO benchmark (0.8.0) sends its model server.

Read from the harness's source (`benchmarks/libero/benchmark.py`, `make_obs`), written here on our own:
- `images`: `agentview` (and `wrist`, the eye-in-hand camera, when the server's HELLO asks `send_wrist_image`),
  each LIBERO's 256x256 camera image flipped in both axes (`[::-1, ::-1]`), uint8, no resize; nested under
  `images` on the wire (our flat keys `images/agentview`, `images/wrist`);
- `task_description`: the task's `task.language`;
- with `send_state`: `states` = eef position (3) + axis-angle of the eef quaternion (3) + gripper joints (2),
  float64, where the axis-angle is the harness's own: the quaternion flipped to w >= 0 (antipodal), then
  `xyz / sqrt(1 - w^2) * 2 acos(w)` in float64 and cast to float32 (`quat_no_antipodal`: robosuite's formula,
  cast to float32); and `controller_states` (float32) = the OSC controller's `ee_pos` + the axis-angle of its
  `ee_ori_mat` (cast to float32, to a quaternion by Shepperd's method in float64, then as above) + gripper.

A server's HELLO says which variant it needs (`observation_params`); the variant's name says it too:
`vla-eval-libero`, `+wrist`, `+state`, `+no-antipodal` (`vla-eval-libero+wrist+state`). This module is data and
pure arithmetic; rescue.core.observation builds the profiles from it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

BASE = "vla-eval-libero"
# The harness's LIBERO render size (LIBERO_ENV_RESOLUTION).
RENDER_SIZE = 256
# The observation_params a profile variant honours; others are the episode's (rescue.core.vla_eval_settings).
PROFILE_PARAMS = ("send_wrist_image", "send_state", "quat_no_antipodal")


def axisangle_antipodal(quat: np.ndarray) -> np.ndarray:
    """The harness's axis-angle (3, float32) of an (x, y, z, w) quaternion: flipped to w >= 0 first."""
    q = -np.asarray(quat) if quat[3] < 0 else np.array(quat, copy=True)
    w = float(np.clip(q[3], -1.0, 1.0))
    sin_half = np.sqrt(1.0 - w * w)
    if sin_half < 1e-8:
        return np.zeros(3, dtype=np.float32)
    return (q[:3] / sin_half * (2.0 * np.arccos(w))).astype(np.float32)


def axisangle_no_flip(quat: np.ndarray) -> np.ndarray:
    """The harness's `quat_no_antipodal` axis-angle (3, float32): robosuite's formula, cast to float32."""
    q = np.array(quat, copy=True)
    q[3] = min(max(q[3], -1.0), 1.0)
    den = np.sqrt(1.0 - q[3] * q[3])
    if math.isclose(den, 0.0):
        return np.zeros(3, dtype=np.float32)
    return (q[:3] * 2.0 * math.acos(q[3]) / den).astype(np.float32)


def matrix_to_quat(matrix: np.ndarray) -> np.ndarray:
    """An (x, y, z, w) quaternion of a 3x3 rotation matrix, by Shepperd's method in float64 (the harness's)."""
    m = np.asarray(matrix, dtype=np.float64)
    trace = m[0, 0] + m[1, 1] + m[2, 2]
    if trace > 0:
        s = 2.0 * np.sqrt(trace + 1.0)
        w, x, y, z = 0.25 * s, (m[2, 1] - m[1, 2]) / s, (m[0, 2] - m[2, 0]) / s, (m[1, 0] - m[0, 1]) / s
    elif m[0, 0] > m[1, 1] and m[0, 0] > m[2, 2]:
        s = 2.0 * np.sqrt(1.0 + m[0, 0] - m[1, 1] - m[2, 2])
        w, x, y, z = (m[2, 1] - m[1, 2]) / s, 0.25 * s, (m[0, 1] + m[1, 0]) / s, (m[0, 2] + m[2, 0]) / s
    elif m[1, 1] > m[2, 2]:
        s = 2.0 * np.sqrt(1.0 + m[1, 1] - m[0, 0] - m[2, 2])
        w, x, y, z = (m[0, 2] - m[2, 0]) / s, (m[0, 1] + m[1, 0]) / s, 0.25 * s, (m[1, 2] + m[2, 1]) / s
    else:
        s = 2.0 * np.sqrt(1.0 + m[2, 2] - m[0, 0] - m[1, 1])
        w, x, y, z = (m[1, 0] - m[0, 1]) / s, (m[0, 2] + m[2, 0]) / s, (m[1, 2] + m[2, 1]) / s, 0.25 * s
    return np.array([x, y, z, w])


def _controller_axisangle(matrix: np.ndarray) -> np.ndarray:
    return axisangle_antipodal(matrix_to_quat(np.asarray(matrix, dtype=np.float32)))


# State parts the profiles add (part -> (raw observable, length)); `controller/*` are the adapter's readings of
# the robot's OSC controller, given only to a profile that asks (CONTROLLER_PARTS).
STATE_PARTS: dict[str, tuple[str, int]] = {
    "eef_axisangle_vla_eval": ("robot0_eef_quat", 3),
    "eef_axisangle_vla_eval_no_flip": ("robot0_eef_quat", 3),
    "controller_eef_pos": ("controller/ee_pos", 3),
    "controller_eef_axisangle": ("controller/ee_ori_mat", 3),
}
# How a part is derived from its raw observable.
DERIVED_PARTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "eef_axisangle_vla_eval": axisangle_antipodal,
    "eef_axisangle_vla_eval_no_flip": axisangle_no_flip,
    "controller_eef_axisangle": _controller_axisangle,
}
CONTROLLER_PARTS = ("controller_eef_pos", "controller_eef_axisangle")


def variant_name(wrist: bool, state: bool, antipodal: bool = True) -> str:
    """The profile's name for these observation params (`+no-antipodal` only with a state)."""
    return BASE + ("+wrist" if wrist else "") + ("+state" if state else "") + ("" if antipodal or not state else "+no-antipodal")


def name_for(params: dict[str, Any]) -> str:
    """The variant a server's `observation_params` ask for."""
    return variant_name(bool(params.get("send_wrist_image")), bool(params.get("send_state")),
                        not params.get("quat_no_antipodal"))


def profile_data() -> list[dict[str, Any]]:
    """Every variant's definition, as the fields of an ObservationProfile."""
    out = []
    for wrist in (False, True):
        for state in (False, True):
            for antipodal in ((True, False) if state else (True,)):
                cameras = [{"camera": "agentview", "key": "images/agentview", "size": RENDER_SIZE, "rotate_180": True}]
                if wrist:
                    cameras.append({"camera": "robot0_eye_in_hand", "key": "images/wrist", "size": RENDER_SIZE,
                                    "rotate_180": True})
                aa = "eef_axisangle_vla_eval" if antipodal else "eef_axisangle_vla_eval_no_flip"
                profile: dict[str, Any] = {
                    "name": variant_name(wrist, state, antipodal), "cameras": cameras,
                    "state": ({"composition": "concat", "parts": ["eef_pos", aa, "gripper_qpos"], "key": "states"}
                              if state else {"composition": "spread", "parts": []}),
                    "instruction_key": "task_description",
                }
                if state:
                    profile["extra_states"] = [{"composition": "concat", "key": "controller_states", "dtype": "float32",
                                                "parts": ["controller_eef_pos", "controller_eef_axisangle", "gripper_qpos"]}]
                out.append(profile)
    return out


def reads_controller(profile: Any) -> bool:
    """Whether a profile's state reads the robot's OSC controller (the adapter then hands it `controller/*`)."""
    specs = (profile.state, *getattr(profile, "extra_states", ()))
    return any(part in CONTROLLER_PARTS for spec in specs for part in spec.parts)
