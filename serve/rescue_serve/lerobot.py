"""A saved LeRobot policy served as it is: `rescue-serve lerobot PATH [--rename-map JSON] [--mode auto|chunk|step]`.

What LeRobot's own evaluation does between the env and the policy, minus the
env-side step: the client (the `lerobot-libero` profile) already sends what
`LiberoEnv` → `LiberoProcessorStep` makes (images rotated 180°, the 8-float
state), as uint8 HxWx3 images and float32 arrays. Here they become float CHW
tensors / 255 with a batch dimension (LeRobot's `preprocess_observation`), then
go through the policy directory's own preprocessor (rename, batch, device,
normaliser), the policy, and its own postprocessor. `LiberoProcessorStep` is
never applied here: it would rotate the images a second time.

- **Mode from the policy.** A policy with an observation history
  (`n_obs_steps > 1`: Diffusion) is served at C = 1 through `select_action`
  and announces itself stateful (replayed, never forked); any other answers
  `predict_action_chunk` (its first `n_action_steps`) and is stateless.
- **One model, one stream per connection.** The policy is loaded once. Each
  connection keeps its own torch RNG state and its own per-episode state (the
  policy's queues), swapped in for its calls; the server's lock serialises
  the calls. `reset_rng(seed)` sets the connection's generator state, and
  `rng_state()` reports its digest.
- **Threads pinned.** torch's thread count is set at load and announced
  (`torch_threads`): a sampling policy's outputs differ across thread counts.

torch and lerobot are imported only here, when a policy is loaded: this module
runs in LeRobot's environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from rescue_serve.wire import ACTION_HORIZON_KEY, OBSERVATION_KEY, STATELESS_KEY, TORCH_THREADS_KEY, BadInput

# Per-episode state a LeRobot policy keeps between select_action calls (Diffusion's observation and action
# queues, ACT's action queue); each connection has its own, swapped in around its calls.
EPISODE_ATTRS = ("_queues", "_action_queue")
# Policy types that do not map one observation to robot actions (reinforcement-learning critics, reward models).
UNSERVABLE_TYPES = ("sac", "gaussian_actor", "reward_classifier", "tdmpc")
IMAGES_PREFIX = "observation.images."
INSTRUCTION_KEYS = ("task", "prompt")  # the lerobot-libero profile sends `task`


class LeRobotServed:
    """A LeRobot policy loaded once, with its processors and the mode it is served in."""

    def __init__(self, policy: Any, preprocessor: Any, postprocessor: Any, *, mode: str, policy_type: str,
                 observation: str, threads: int, action_dim: int, rename_map: dict[str, str]) -> None:
        import torch

        self.torch = torch
        self.policy = policy
        self.preprocessor = preprocessor
        self.postprocessor = postprocessor
        self.mode = mode
        self.policy_type = policy_type
        self.observation = observation
        self.threads = threads
        self.action_dim = action_dim
        self.rename_map = dict(rename_map)
        config = policy.config
        self.reads = sorted(config.input_features)  # what the policy's preprocessor must find, after renaming
        self.action_horizon = 1 if mode == "step" else int(config.n_action_steps)

    @classmethod
    def load(cls, path: str, *, rename_map: dict[str, str] | None = None, mode: str = "auto",
             observation: str = "lerobot-libero", device: str = "cpu", threads: int = 1,
             action_dim: int = 7) -> LeRobotServed:
        """Load the policy directory at `path` (offline: nothing from a hub); BadInput names what is wrong."""
        rename_map = dict(rename_map or {})
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise BadInput(f"{path} is not a saved LeRobot policy directory (no config.json)")
        try:
            import torch
            from lerobot.configs.policies import PreTrainedConfig
            from lerobot.policies.factory import get_policy_class, make_pre_post_processors
        except ImportError as exc:
            raise BadInput(f"lerobot is not importable in this environment ({exc}); install rescue-serve into the "
                           "venv your LeRobot policy runs in") from None
        torch.set_num_threads(threads)
        # LeRobot prints while loading; stdout is the server's (its first line is the url it serves at).
        with contextlib.redirect_stdout(sys.stderr):
            config = PreTrainedConfig.from_pretrained(folder)
            policy_type = str(config.type)
            if policy_type in UNSERVABLE_TYPES:
                raise BadInput(f"policy type {policy_type!r} cannot be served: it does not map an observation to "
                               "robot actions")
            config.device = device
            try:
                policy_class = get_policy_class(policy_type)
            except (ValueError, ImportError, KeyError) as exc:
                raise BadInput(f"policy type {policy_type!r} cannot be served: {' '.join(str(exc).split())}") from None
            history = int(getattr(config, "n_obs_steps", 1) or 1)
            chosen = _choose_mode(policy_type, history, mode, policy_class)
            policy = policy_class.from_pretrained(folder, config=config)
            policy.eval()
            preprocessor, postprocessor = make_pre_post_processors(
                config,
                pretrained_path=str(folder),
                preprocessor_overrides={
                    "device_processor": {"device": device},
                    "rename_observations_processor": {"rename_map": rename_map},
                },
            )
        return cls(policy, preprocessor, postprocessor, mode=chosen, policy_type=policy_type, observation=observation,
                   threads=threads, action_dim=action_dim, rename_map=rename_map)

    def describe(self) -> str:
        """One line: what is served, how, and why."""
        if self.mode == "step":
            how = (f"step mode: select_action at C = 1, stateful (n_obs_steps = {self.policy.config.n_obs_steps}: "
                   "an observation history), replayed, never forked")
        else:
            how = f"chunk mode: predict_action_chunk, C = {self.action_horizon}, stateless (forks at q)"
        return f"{self.policy_type} policy, {how}; torch threads {self.threads}"

    def metadata(self) -> dict[str, Any]:
        """What every connection's first frame announces."""
        return {
            "policy": f"lerobot:{self.policy_type}",
            "lerobot_mode": self.mode,
            ACTION_HORIZON_KEY: self.action_horizon,
            OBSERVATION_KEY: self.observation,
            STATELESS_KEY: self.mode == "chunk",
            TORCH_THREADS_KEY: self.threads,
        }

    def session(self) -> LeRobotSession:
        """A connection's view of the policy: its own RNG stream and per-episode state."""
        return LeRobotSession(self)

    def fresh_episode(self) -> dict[str, Any]:
        """The policy's per-episode state right after `reset()` (new objects each time)."""
        self.policy.reset()
        return {name: getattr(self.policy, name) for name in EPISODE_ATTRS if hasattr(self.policy, name)}

    def batch(self, obs: dict) -> dict[str, Any]:
        """The observation as LeRobot's `preprocess_observation` makes it, before the policy's preprocessor."""
        torch = self.torch
        out: dict[str, Any] = {}
        for key, value in obs.items():
            if key in INSTRUCTION_KEYS:
                out["task"] = [str(value)]
            elif isinstance(value, np.ndarray) and key.startswith(IMAGES_PREFIX):
                if value.dtype != np.uint8 or value.ndim != 3 or value.shape[2] != 3:
                    raise ValueError(f"{key}: expected a uint8 HxWx3 image, got {value.dtype}{value.shape}")
                image = torch.from_numpy(value).unsqueeze(0).permute(0, 3, 1, 2).contiguous()
                out[key] = image.type(torch.float32) / 255
            elif isinstance(value, np.ndarray):
                out[key] = torch.from_numpy(np.asarray(value)).float().reshape(1, -1)
        renamed = {self.rename_map.get(key, key) for key in out}
        missing = [key for key in self.reads if key not in renamed]
        if missing:
            raise ValueError(self._missing_line(missing[0], sorted(out)))
        return out

    def _missing_line(self, key: str, sent: list[str]) -> str:
        spare = [k for k in sent if k not in self.rename_map and k not in self.reads
                 and k.startswith(IMAGES_PREFIX) == key.startswith(IMAGES_PREFIX)]
        fix = {**self.rename_map, (spare[0] if spare else "<key the client sends>"): key}
        return (f"the policy reads {key!r}, which the observation lacks (it sent {', '.join(sent)}); "
                f"serve it with --rename-map '{json.dumps(fix)}'")

    def act(self, batch: dict[str, Any]) -> np.ndarray:
        """The actions for one preprocessed batch, (C, action_dim) float32; ValueError on the wrong dimension."""
        torch = self.torch
        with torch.inference_mode():
            processed = self.preprocessor(batch)
            if self.mode == "step":
                actions = self.policy.select_action(processed)
            else:
                actions = self.policy.predict_action_chunk(processed)[:, : self.action_horizon]
            actions = self.postprocessor(actions)
        out = actions.detach().to("cpu").numpy().astype(np.float32)
        out = out.reshape(-1, out.shape[-1])  # (1, C, D) or (1, D) -> (C, D)
        if out.shape[-1] != self.action_dim:
            raise ValueError(f"the policy's actions have {out.shape[-1]} dimensions; the simulator takes "
                             f"{self.action_dim} (--action-dim): this policy was trained for another robot")
        return out


class LeRobotSession:
    """One connection: its torch RNG state and per-episode state over the shared policy."""

    def __init__(self, served: LeRobotServed) -> None:
        self._served = served
        self.action_horizon = served.action_horizon
        self.observation = served.observation
        self.stateless = served.mode == "chunk"
        self._episode = served.fresh_episode()
        self.reset_rng(0)

    def infer(self, obs: dict) -> dict:
        served = self._served
        torch = served.torch
        batch = served.batch(obs)
        outer = torch.get_rng_state()
        torch.set_rng_state(self._rng)
        for name, value in self._episode.items():
            setattr(served.policy, name, value)
        try:
            actions = served.act(batch)
        finally:
            self._rng = torch.get_rng_state()
            self._episode = {name: getattr(served.policy, name) for name in self._episode}
            torch.set_rng_state(outer)
        return {"actions": actions}

    def reset(self) -> None:
        self._episode = self._served.fresh_episode()

    def reset_rng(self, seed: int) -> None:
        self._rng = self._served.torch.Generator().manual_seed(int(seed)).get_state()

    def rng_state(self) -> str:
        return hashlib.sha256(self._rng.numpy().tobytes()).hexdigest()


def _choose_mode(policy_type: str, history: int, mode: str, policy_class: type) -> str:
    """chunk or step for a policy of this type and observation history; BadInput when the asked mode cannot work."""
    if mode == "chunk" and history > 1:
        raise BadInput(f"a {policy_type} policy with n_obs_steps = {history} needs every step's observation: "
                       "it is served at C = 1 with --mode step (or --mode auto)")
    if mode == "auto":
        mode = "step" if history > 1 else "chunk"
    needed = "select_action" if mode == "step" else "predict_action_chunk"
    if not callable(getattr(policy_class, needed, None)):
        raise BadInput(f"policy type {policy_type!r} cannot be served in {mode} mode: it has no {needed}")
    return mode
