"""A LIBERO adapter that can also say, as digests, everything a continuation reads (for the restore probe)."""

from __future__ import annotations

import hashlib

import numpy as np

from rescue.env.libero import LiberoAdapter

# MjData arrays MuJoCo 2.3.7 leaves uninitialised here (arena garbage, different even between an
# MjData and its own pickle): the PGS/noslip rows (LIBERO's solver is Newton) and the sparse
# Jacobian's index arrays and transpose (the model is dense).
UNINITIALISED = {"efc_AR", "efc_AR_colind", "efc_AR_rowadr", "efc_AR_rownnz", "efc_J_rowadr", "efc_J_rownnz",
                 "efc_J_rowsuper", "efc_J_colind", "efc_JT", "efc_JT_colind", "efc_JT_rownnz", "efc_JT_rowadr",
                 "efc_JT_rowsuper"}
CAMERAS = ("agentview", "robot0_eye_in_hand")


def _digest(value) -> str:
    if isinstance(value, np.ndarray) or (isinstance(value, (list, tuple)) and value and not isinstance(value[0], str)):
        a = np.asarray(value)
        if a.dtype != object:
            return hashlib.sha256(f"{a.shape}{a.dtype}".encode() + np.ascontiguousarray(a).tobytes()).hexdigest()[:16]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return "{" + ",".join(f"{k}:{_digest(v)}" for k, v in sorted(vars(value).items())) + "}"
    return repr(value)


class ProbeAdapter(LiberoAdapter):
    """The adapter, plus `probe()`: digests of the full MjData, the controller, the robots, the gripper,
    the observables, the model fields the env writes, and the frames of the profile's cameras."""

    def probe(self) -> dict[str, str]:
        env = self._env.env
        m, d = env.sim.model._model, env.sim.data._data
        out: dict[str, str] = {}
        for name in dir(d):
            if name.startswith("_") or name in UNINITIALISED:
                continue
            try:
                value = getattr(d, name)
            except Exception:
                continue
            if isinstance(value, np.ndarray):
                out[f"mjdata.{name}"] = _digest(value)
        for name in ("time", "ncon", "nefc"):
            out[f"mjdata.{name}"] = repr(getattr(d, name))
        for i, robot in enumerate(env.robots):
            for name, value in vars(robot.controller).items():
                if name != "sim":
                    out[f"controller{i}.{name}"] = _digest(value)
            for name in ("torques", "recent_qpos", "recent_actions", "recent_torques", "recent_ee_pose"):
                out[f"robot{i}.{name}"] = _digest(getattr(robot, name))
            out[f"gripper{i}.current_action"] = _digest(robot.gripper.current_action)
        for name, o in env._observables.items():
            out[f"observable.{name}"] = f"{o._time_since_last_sample!r}|{o._sampled!r}"
        for name in ("body_pos", "body_quat", "site_rgba"):
            out[f"model.{name}"] = _digest(getattr(m, name))
        for camera, frame in self.render(list(CAMERAS), 256).items():
            out[f"frame.{camera}"] = _digest(frame)
        out["timestep"] = repr(env.timestep)
        return out
