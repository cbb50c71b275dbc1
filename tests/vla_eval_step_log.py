"""The LIBERO adapter with a step log, as vla-eval's LIBERO benchmark records its step rows: after every policy
step, the executed action and the post-step state `[eef pos, axis-angle, gripper qpos]`, both float32 (the state
through the vla-eval-libero profile's own arithmetic). `[env] adapter = "vla_eval_step_log:StepLogAdapter"`,
with VLA_EVAL_STEP_LOG naming the JSON-lines file; the physics is the adapter's own, untouched."""

from __future__ import annotations

import json
import os

import numpy as np

from rescue.core.observation import compose_state, get_profile
from rescue.env.libero import LiberoAdapter

LOG_ENV = "VLA_EVAL_STEP_LOG"
STATE = get_profile("vla-eval-libero+state").state.parts


class StepLogAdapter(LiberoAdapter):
    """Logs each step of each episode: case id, step, executed action and post-step state (float32 bytes, hex)."""

    def reset(self, case, profile=None, protocol=None):
        self._logged_case = case["case_id"] if isinstance(case, dict) else case.case_id
        self._logged_step = 0
        return super().reset(case, profile, protocol)

    def _step(self):
        step = super()._step()

        def logged(action) -> bool:
            done = step(action)
            raw = self._env.env._get_observations()
            row = {"case": self._logged_case, "step": self._logged_step,
                   "action": np.asarray(action, dtype=np.float32).tobytes().hex(),
                   "state": compose_state(STATE, raw).astype(np.float32).tobytes().hex(), "done": bool(done)}
            self._logged_step += 1
            with open(os.environ[LOG_ENV], "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            return done

        return logged
