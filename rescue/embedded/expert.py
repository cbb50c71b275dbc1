"""A privileged scripted expert for LIBERO pick-and-place, used to make demonstrations.

It reads the true object and target positions (`task/object_pos`,
`task/target_pos`) and drives the OSC_POSE controller step by step through
the phases of `rescue.embedded.phases`. It is deterministic and closed-loop;
it notices a lost object and goes back to approach it. It is not the policy
under study: it is the teacher the learned policy imitates.
"""

from __future__ import annotations

import numpy as np

from rescue.embedded.phases import PHASES

OPEN, CLOSE = -1.0, 1.0
# OSC_POSE maps an action of 1.0 to a 5 cm target offset; this gain saturates
# at 4 cm of error and tapers as the gripper closes in.
GAIN = 25.0
ABOVE = 0.10  # approach height over the object's origin
CARRY = 0.22  # gripper height over the target while lifting and carrying: tall objects clear the rim
PLACE = 0.05  # height over the target of the held object's origin when letting go
GRASP_DZ = 0.01  # grasp height over the object's origin
CLOSE_STEPS = 12  # the fingers take about this long to close on an object
RELEASE_STEPS = 10


class Expert:
    """Closed-loop phase machine on privileged poses; `act(obs)` gives one action, `phase` names it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Back to the first phase."""
        self.phase = "approach"
        self._count = 0
        self._grasp_z: float | None = None
        self._object_z0: float | None = None

    def _held(self, obs: dict) -> bool:
        obj, eef = np.asarray(obs["task/object_pos"]), np.asarray(obs["robot0_eef_pos"])
        closed_on_something = float(obs["robot0_gripper_qpos"][0]) > 0.004
        near = np.linalg.norm(obj[:2] - eef[:2]) < 0.05 and abs(obj[2] - eef[2]) < 0.08
        return bool(closed_on_something and near)

    def _goal(self, obs: dict) -> tuple[np.ndarray, float]:
        obj = np.asarray(obs["task/object_pos"], dtype=np.float64)
        target = np.asarray(obs["task/target_pos"], dtype=np.float64)
        eef = np.asarray(obs["robot0_eef_pos"], dtype=np.float64)
        ph = self.phase
        if ph == "approach":
            return obj + [0, 0, ABOVE], OPEN
        if ph == "descend":
            return obj + [0, 0, GRASP_DZ], OPEN
        if ph == "grasp":
            return np.r_[obj[:2], eef[2]], CLOSE
        hang = max(0.0, float(eef[2] - obj[2]))  # how far the object's base is below the gripper
        if ph == "lift":
            return np.r_[eef[:2], target[2] + CARRY], CLOSE
        if ph == "carry":
            return target + [0, 0, CARRY], CLOSE
        if ph == "place":
            return target + [0, 0, PLACE + hang], CLOSE
        return np.r_[eef[:2], target[2] + CARRY], OPEN

    def _next(self, obs: dict) -> str | None:
        """The phase to switch to now, or None to stay."""
        eef = np.asarray(obs["robot0_eef_pos"])
        goal, _ = self._goal(obs)
        err = goal - eef
        ph, n = self.phase, self._count
        if ph in {"lift", "carry", "place"} and n > 3 and not self._held(obs):
            return "approach"  # dropped or missed: start over
        if ph == "approach" and np.linalg.norm(err[:2]) < 0.01 and abs(err[2]) < 0.02:
            return "descend"
        if ph == "descend" and ((np.linalg.norm(err[:2]) < 0.01 and abs(err[2]) < 0.008) or n >= 40):
            return "grasp"
        if ph == "grasp" and n >= CLOSE_STEPS:
            return "lift"
        if ph == "lift" and err[2] < 0.03:
            return "carry"
        if ph == "carry" and (np.linalg.norm(err[:2]) < 0.015 or n >= 60):
            return "place"
        if ph == "place" and (abs(err[2]) < 0.015 or n >= 30):
            return "release"
        return None

    def act(self, obs: dict) -> np.ndarray:
        """One OSC_POSE action (dx, dy, dz, 0, 0, 0, gripper) for this step."""
        nxt = self._next(obs)
        if nxt is not None:
            self.phase, self._count = nxt, 0
        goal, grip = self._goal(obs)
        action = np.zeros(7)
        action[:3] = np.clip((goal - np.asarray(obs["robot0_eef_pos"])) * GAIN, -1.0, 1.0)
        if self.phase == "grasp":
            action[:3] *= 0.3  # hold still while the fingers close
        action[6] = grip
        self._count += 1
        return action

    @property
    def phase_index(self) -> int:
        """The current phase as an index into PHASES."""
        return PHASES.index(self.phase)


def situation_phase(obs: dict) -> str:
    """The phase an expert would be in from this state alone (labels frames and picks the correct subgoal)."""
    obj = np.asarray(obs["task/object_pos"])
    target = np.asarray(obs["task/target_pos"])
    eef = np.asarray(obs["robot0_eef_pos"])
    finger = float(obs["robot0_gripper_qpos"][0])
    over_object = np.linalg.norm(obj[:2] - eef[:2]) < 0.035
    # Open fingers sit near 0.039; closed on nothing below 0.004; anything between is holding.
    held = 0.004 < finger < 0.0375 and over_object and abs(obj[2] - eef[2]) < 0.06
    if held:
        if np.linalg.norm(obj[:2] - target[:2]) < 0.03:
            return "place"
        return "lift" if eef[2] < target[2] + CARRY - 0.05 else "carry"
    if over_object:
        # A tall object stops the fingers at its shoulder, up to 5 cm over its origin: close there.
        return "grasp" if eef[2] - obj[2] < 0.05 else "descend"
    return "approach"
