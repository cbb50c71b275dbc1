"""A scripted reference policy for LIBERO pick-and-place tasks (libero_object).

This is NOT a learned policy. It reads privileged object poses from the
observation (`task/object_pos`, `task/target_pos`), plans an action chunk
with a phase machine, and draws a seeded grasp offset and execution noise so
that it fails sometimes, for its own reasons. It reads its instruction: an
injected subgoal asking to grasp again restarts the grasp when the object is
not held, which is how a subgoal can rescue a missed grasp.
"""

from __future__ import annotations

import numpy as np

from rescue.embedded.seeded import SeededNoise
from wrappers.injection import parse_injection

PHASES = ("approach", "descend", "grasp", "lift", "carry", "lower", "release", "retreat", "idle")
OPEN, CLOSE = -1.0, 1.0
# OSC_POSE maps an action of 1.0 to a 5 cm target offset; the arm covers
# roughly a third of that per control step, which the open-loop plan assumes.
STEP_GAIN = 0.05 * 0.3


class ScriptedPickPlace(SeededNoise):
    """Phase-machine pick-and-place with seeded grasp error; a reference, not a VLA."""

    # The observation profile it reads (DESIGN §7), announced in the server's metadata.
    observation = "privileged"
    # Its phase machine keeps state between calls: a fork replays the prefix to restore it (DESIGN §13).
    stateless = False

    def __init__(self, action_horizon: int = 8, grasp_noise: float = 0.013, action_noise: float = 0.08, seed: int = 0):
        self.action_horizon = action_horizon
        self.grasp_noise = grasp_noise
        self.action_noise = action_noise
        self.reset_rng(seed)
        self.reset()

    # -- Policy ----------------------------------------------------------
    def reset(self) -> None:
        """Forget the episode: back to the first phase."""
        self._phase = "approach"
        self._offset: np.ndarray | None = None
        self._grasp_z: float | None = None
        self._object_z0: float | None = None
        self._subgoal: str | None = None
        self._phase_queries = 0

    def _held(self, obs: dict) -> bool:
        obj = np.asarray(obs["task/object_pos"])
        eef = np.asarray(obs["robot0_eef_pos"])
        lifted = self._object_z0 is not None and obj[2] > self._object_z0 + 0.03
        return bool(lifted and np.linalg.norm(obj[:2] - eef[:2]) < 0.06)

    def _follow(self, subgoal: str, obs: dict) -> None:
        text = subgoal.lower()
        held = self._held(obs)
        if ("grasp" in text or "pick" in text) and not held:
            self._phase = "approach"
            self._offset = self._draw_offset()
        elif ("place" in text or "put" in text) and held and PHASES.index(self._phase) < PHASES.index("carry"):
            self._phase = "carry"
        elif "release" in text or "open the gripper" in text:
            self._phase = "release"
        self._phase_queries = 0

    def _draw_offset(self) -> np.ndarray:
        return np.r_[self._rng.normal(0.0, self.grasp_noise, 2), 0.0]

    def _waypoint(self, obs: dict) -> tuple[np.ndarray, float]:
        obj = np.asarray(obs["task/object_pos"])
        target = np.asarray(obs["task/target_pos"])
        eef = np.asarray(obs["robot0_eef_pos"])
        ph = self._phase
        if ph == "approach":
            return obj + self._offset + [0, 0, 0.07], OPEN
        if ph == "descend":
            return obj + self._offset + [0, 0, 0.005], OPEN
        if ph == "grasp":
            return eef, CLOSE
        if ph == "lift":
            return np.r_[eef[:2], self._grasp_z + 0.12], CLOSE
        if ph == "carry":
            return target + [0, 0, 0.13], CLOSE
        if ph == "lower":
            return target + [0, 0, 0.09], CLOSE
        if ph == "release":
            return eef, OPEN
        return np.r_[eef[:2], max(eef[2], target[2] + 0.2)], OPEN

    def _descended(self, obs: dict) -> bool:
        """Over the grasp point and low enough (the table may stop the fingers short of the goal)."""
        goal, _ = self._waypoint(obs)
        err = goal - np.asarray(obs["robot0_eef_pos"])
        return bool(np.linalg.norm(err[:2]) < 0.015 and err[2] > -0.025)

    def _advance(self, obs: dict) -> None:
        """Move to the next phase when the current one's goal is reached (checked at queries only)."""
        eef = np.asarray(obs["robot0_eef_pos"])
        goal, _ = self._waypoint(obs)
        near = np.linalg.norm(goal - eef)
        ph = self._phase
        nxt = {
            "approach": near < 0.02,
            "descend": self._descended(obs) or self._phase_queries >= 4,
            "grasp": self._phase_queries >= 2,
            "lift": self._grasp_z is not None and eef[2] > self._grasp_z + 0.09,
            "carry": near < 0.03 or self._phase_queries >= 8,
            "lower": near < 0.02 or self._phase_queries >= 3,
            "release": self._phase_queries >= 1,
            "retreat": near < 0.03,
            "idle": False,
        }[ph]
        if nxt:
            if ph == "descend":
                self._grasp_z = float(eef[2])
            self._phase = PHASES[PHASES.index(ph) + 1]
            self._phase_queries = 0

    def infer(self, obs: dict) -> dict:
        """Plan the next action chunk from privileged poses and the instruction."""
        if self._offset is None:
            self._offset = self._draw_offset()
            self._object_z0 = float(np.asarray(obs["task/object_pos"])[2])
        _, subgoal = parse_injection(str(obs.get("prompt", "")))
        if subgoal is not None and subgoal != self._subgoal:
            self._subgoal = subgoal
            self._follow(subgoal, obs)
        else:
            self._advance(obs)
        goal, grip = self._waypoint(obs)
        pos = np.asarray(obs["robot0_eef_pos"], dtype=np.float64).copy()
        chunk = np.zeros((self.action_horizon, 7))
        noise = self._rng.normal(0.0, self.action_noise, (self.action_horizon, 3))
        for i in range(self.action_horizon):
            delta = np.clip((goal - pos) / STEP_GAIN, -1.0, 1.0)
            chunk[i, :3] = np.clip(delta + noise[i], -1.0, 1.0)
            chunk[i, 6] = grip
            pos = pos + delta * STEP_GAIN
        self._phase_queries += 1
        return {"actions": chunk, "phase": PHASES.index(self._phase)}


def make_policy() -> ScriptedPickPlace:
    """Factory for `rescue serve-policy --policy rescue.embedded.scripted:make_policy`."""
    return ScriptedPickPlace()
