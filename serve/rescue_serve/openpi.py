"""An openpi checkpoint served with seeded noise: `rescue-serve openpi --config NAME --dir CHECKPOINT`.

openpi's `Policy.infer(obs, *, noise=None)` takes the flow-matching noise as
an argument. The checkpoint is loaded once per process; each connection draws
its noise from its own numpy stream (seeded by `reset_rng`), so two
connections seeded alike get the same actions, and openpi's own key (split
on every call for the life of the process) is never used. openpi is imported
only when a checkpoint is loaded: this module runs in openpi's environment.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from rescue_serve.wire import ACTION_HORIZON_KEY, OBSERVATION_KEY, STATELESS_KEY, BadInput


class OpenpiServed:
    """One loaded openpi policy (anything with `infer(obs, *, noise=None)`) and the noise shape it takes."""

    def __init__(self, policy: Any, noise_shape: tuple[int, int], action_horizon: int = 5,
                 observation: str = "openpi-libero", name: str = "openpi") -> None:
        self.policy = policy
        self.noise_shape = tuple(int(n) for n in noise_shape)
        self.action_horizon = int(action_horizon)
        self.observation = observation
        self.name = name

    @classmethod
    def load(cls, config: str, checkpoint: str, default_prompt: str | None = None, action_horizon: int = 5,
             observation: str = "openpi-libero") -> OpenpiServed:
        """Load openpi's trained policy for `config` from `checkpoint`; BadInput when openpi or the config is missing."""
        try:
            from openpi.policies import policy_config
            from openpi.training import config as openpi_config
        except ImportError as exc:
            raise BadInput(f"openpi is not importable in this environment ({exc}); run rescue-serve in openpi's "
                           "environment (uv run --with ./serve rescue-serve openpi ...)") from None
        try:
            train_config = openpi_config.get_config(config)
        except ValueError as exc:
            raise BadInput(f"--config {config!r}: {' '.join(str(exc).split())[:300]}") from None
        policy = policy_config.create_trained_policy(train_config, checkpoint, default_prompt=default_prompt)
        shape = (train_config.model.action_horizon, train_config.model.action_dim)
        return cls(policy, shape, action_horizon, observation, name=f"openpi:{config}")

    def metadata(self) -> dict[str, Any]:
        """What every connection's first frame announces."""
        return {
            "policy": self.name,
            ACTION_HORIZON_KEY: self.action_horizon,
            OBSERVATION_KEY: self.observation,
            STATELESS_KEY: True,  # openpi's Policy.infer keeps no state between calls
        }

    def session(self) -> OpenpiSession:
        """A connection's view of the policy: its own noise stream."""
        return OpenpiSession(self)


class OpenpiSession:
    """One connection: the shared policy, this connection's seeded noise."""

    def __init__(self, served: OpenpiServed) -> None:
        self._served = served
        self.action_horizon = served.action_horizon
        self.observation = served.observation
        self.stateless = True
        self.reset_rng(0)

    def infer(self, obs: dict) -> dict:
        noise = self._rng.standard_normal(self._served.noise_shape).astype(np.float32)
        return dict(self._served.policy.infer(obs, noise=noise))

    def reset(self) -> None:
        pass

    def reset_rng(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def rng_state(self) -> str:
        state = json.dumps(self._rng.bit_generator.state, sort_keys=True, default=int)
        return hashlib.sha256(state.encode()).hexdigest()
