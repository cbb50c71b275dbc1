"""A saved LeRobot policy served as it is: `rescue-serve lerobot PATH [--rename-map JSON] [--mode auto|chunk|step]`.

What LeRobot's own evaluation does between the env and the policy, minus the
env-side step: the client (the `lerobot-libero` profile) already sends what
`LiberoEnv` → `LiberoProcessorStep` makes (images rotated 180°, the 8-float
state), as uint8 HxWx3 images and float32 arrays. Here they become float CHW
tensors / 255 with a batch dimension (LeRobot's `preprocess_observation`), then
go through the policy directory's own preprocessor (rename, batch, device,
normaliser), the policy, and its own postprocessor. `LiberoProcessorStep` is
never applied here: it would rotate the images a second time.

- **Mode from the policy, as its `select_action` runs.** A policy whose
  `select_action` keeps state beyond its action queue (an observation history,
  `n_obs_steps > 1`: Diffusion; ACT's temporal ensembler; any other state its
  `reset()` resets: lerobot_state.py) is served at C = 1 through `select_action`
  and announces itself stateful (replayed, never forked); any other answers
  `predict_action_chunk` (its first `n_action_steps`: what its `select_action`
  would pop) and is stateless.
- **One model, one stream per connection.** The policy is loaded once. Each
  connection keeps its own torch RNG state (the CPU generator's and, on CUDA,
  the device's) and its own per-episode state (a copy of what `reset()` leaves),
  swapped in for its calls; the server's lock serialises the calls; an
  episode's start resets it. `reset_rng(seed)` sets the connection's generator
  states, and `rng_state()` reports their digest.
- **Bad input is one line** (exit 2 at load; at a request, the error frame's
  last line): a checkpoint LeRobot must migrate names LeRobot's migration, and
  advice names only a fix that can work.
- **Threads pinned.** torch's thread count is set at load and announced
  (`torch_threads`): a sampling policy's outputs differ across thread counts.

torch and lerobot are imported only here, when a policy is loaded: this module
runs in LeRobot's environment.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from rescue_serve.lerobot_state import beyond_action_queue, episode_state
from rescue_serve.wire import ACTION_HORIZON_KEY, OBSERVATION_KEY, STATELESS_KEY, TORCH_THREADS_KEY, BadInput

# LeRobot's own script that gives a policy saved before its processor files those files, run as installed.
MIGRATION = "python -m lerobot.processor.migrate_policy_normalization --pretrained-path"
# Policy types that do not map one observation to robot actions (reinforcement-learning critics, reward models).
UNSERVABLE_TYPES = ("sac", "gaussian_actor", "reward_classifier", "tdmpc")
IMAGES_PREFIX = "observation.images."
INSTRUCTION_KEYS = ("task", "prompt")  # the lerobot-libero profile sends `task`


class ObservationKeyError(KeyError):
    """A key the policy reads that the observation lacks (a KeyError, as a server that indexes the observation
    raises it: another observation profile may be the fix); its line as it is, unquoted."""

    def __str__(self) -> str:
        return str(self.args[0])


class LeRobotServed:
    """A LeRobot policy loaded once, with its processors and the mode it is served in."""

    def __init__(self, policy: Any, preprocessor: Any, postprocessor: Any, *, mode: str, policy_type: str,
                 observation: str, threads: int, action_dim: int, rename_map: dict[str, str],
                 episode: list[str] | None = None, why_step: str = "") -> None:
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
        self.why_step = why_step
        config = policy.config
        self.reads = sorted(config.input_features)  # what the policy's preprocessor must find, after renaming
        # The flat sizes of the non-image features it reads (LIBERO's state: 8 floats).
        self.sizes = {key: int(np.prod(feature.shape)) for key, feature in config.input_features.items()
                      if not key.startswith(IMAGES_PREFIX) and getattr(feature, "shape", None)}
        self.action_horizon = 1 if mode == "step" else int(config.n_action_steps)
        self.device = torch.device(config.device or "cpu")
        # One episode's state as reset() leaves it, copied for every connection and every episode.
        policy.reset()
        self._pristine = copy.deepcopy({name: getattr(policy, name) for name in (episode or [])})

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
            from lerobot.processor import pipeline
        except ImportError as exc:
            raise BadInput(f"lerobot is not importable in this environment ({exc}); install rescue-serve into the "
                           "venv your LeRobot policy runs in") from None
        torch.set_num_threads(threads)
        serving_device = _device(torch, device)
        # What LeRobot raises for a policy saved before its processor files (LeRobot 0.6), when it has it.
        needs_migration = getattr(pipeline, "ProcessorMigrationError", ())
        # LeRobot prints while loading; stdout is the server's (its first line is the url it serves at). What it
        # printed goes to stderr once the policy is loaded; a refusal is one line.
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                config = PreTrainedConfig.from_pretrained(folder)
            except Exception as exc:
                raise BadInput(f"{folder / 'config.json'} is not a LeRobot policy configuration: "
                               f"{_line(exc)}") from None
            policy_type = str(config.type)
            if policy_type in UNSERVABLE_TYPES:
                raise BadInput(f"policy type {policy_type!r} cannot be served: it does not map an observation to "
                               "robot actions")
            config.device = serving_device
            try:
                policy_class = get_policy_class(policy_type)
            except (ValueError, ImportError, KeyError) as exc:
                raise BadInput(f"policy type {policy_type!r} cannot be served: {_line(exc)}") from None
            try:
                preprocessor, postprocessor = make_pre_post_processors(
                    config,
                    pretrained_path=str(folder),
                    preprocessor_overrides={
                        "device_processor": {"device": serving_device},
                        "rename_observations_processor": {"rename_map": rename_map},
                    },
                )
            except needs_migration:
                raise BadInput(f"{path} was saved before LeRobot's processor files (policy_preprocessor.json, "
                               f"policy_postprocessor.json): migrate it with LeRobot's own script, `{MIGRATION} "
                               f"{path}`, and serve the folder it writes") from None
            except Exception as exc:
                raise BadInput(f"the processors saved in {path} cannot be loaded: {_line(exc)}") from None
            try:
                policy = policy_class.from_pretrained(folder, config=config)
            except Exception as exc:
                raise BadInput(f"the {policy_type} weights in {path} cannot be loaded: {_line(exc)}") from None
            policy.eval()
            policy.reset()
            episode, inside = episode_state(policy)
            if inside:
                raise BadInput(f"a {policy_type} policy keeps per-episode state inside its module "
                               f"{', '.join(inside)} (its reset() resets it): one loaded model cannot keep it per "
                               "connection")
            history = int(getattr(config, "n_obs_steps", 1) or 1)
            chosen, why = _choose_mode(policy_type, history, mode, policy_class, beyond_action_queue(episode))
        sys.stderr.write(printed.getvalue())
        return cls(policy, preprocessor, postprocessor, mode=chosen, policy_type=policy_type, observation=observation,
                   threads=threads, action_dim=action_dim, rename_map=rename_map, episode=episode, why_step=why)

    def describe(self) -> str:
        """One line: what is served, how, and why."""
        if self.mode == "step":
            how = f"step mode: select_action at C = 1, stateful ({self.why_step}), replayed, never forked"
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
        """The policy's per-episode state as `reset()` leaves it, a copy of its own (an ensembler's reset works in
        place: resetting the shared policy would reset another connection's)."""
        return copy.deepcopy(self._pristine)

    def seeded(self, seed: int) -> dict[str, Any]:
        """Generator states for `seed`: the CPU's and, on an accelerator, the device's."""
        torch = self.torch
        states = {"cpu": torch.Generator().manual_seed(int(seed)).get_state()}
        if self.device.type != "cpu":
            states[self.device.type] = torch.Generator(device=self.device).manual_seed(int(seed)).get_state()
        return states

    @contextlib.contextmanager
    def generators(self, states: dict[str, Any]) -> Any:
        """Run with the generators in `states` (updated in place as they draw), the outer ones kept."""
        torch = self.torch
        device = self.device
        outer = {"cpu": torch.get_rng_state()}
        torch.set_rng_state(states["cpu"])
        if device.type == "cuda":
            outer["cuda"] = torch.cuda.get_rng_state(device)
            torch.cuda.set_rng_state(states["cuda"], device)
        try:
            yield
        finally:
            states["cpu"] = torch.get_rng_state()
            torch.set_rng_state(outer["cpu"])
            if device.type == "cuda":
                states["cuda"] = torch.cuda.get_rng_state(device)
                torch.cuda.set_rng_state(outer["cuda"], device)

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
        renamed = {self.rename_map.get(key, key): key for key in out}
        missing = [key for key in self.reads if key not in renamed]
        if missing:
            self._refuse_missing(missing, sorted(out))
        for key, size in self.sizes.items():
            got = out[renamed[key]].shape[-1]
            if got != size:
                sent = "" if renamed[key] == key else f" (sent as {renamed[key]!r})"
                raise ValueError(f"{key}{sent} has {got} floats; the policy reads {size} (its input_features): "
                                 "the client sends another robot's state")
        return out

    def _refuse_missing(self, missing: list[str], sent: list[str]) -> None:
        """Raise for the first key the policy reads that the observation lacks, with a fix only where one can work:
        a camera or array the client sends that the policy does not read may be renamed to it; no rename adds a
        camera, and an instruction never becomes a state. KeyError: a key the observation lacks (a client may
        send another profile); ValueError: what no profile of this client can give."""
        key = missing[0]
        camera = key.startswith(IMAGES_PREFIX)
        cameras = [k for k in self.reads if k.startswith(IMAGES_PREFIX)]
        sent_cameras = [k for k in sent if k.startswith(IMAGES_PREFIX)]
        if camera and len(cameras) > len(sent_cameras) and sent_cameras:
            raise ValueError(f"the policy reads {len(cameras)} cameras ({', '.join(cameras)}); the observation has "
                             f"{len(sent_cameras)} ({', '.join(sent_cameras)}): no rename adds a camera, this "
                             "policy needs one the client does not send")
        spare = [k for k in sent if k not in self.rename_map and k not in self.reads and k not in INSTRUCTION_KEYS
                 and k.startswith(IMAGES_PREFIX) == camera]
        line = f"the policy reads {key!r}, which the observation lacks (it sent {', '.join(sent)})"
        if spare:
            line += f"; serve it with --rename-map '{json.dumps({**self.rename_map, spare[0]: key})}'"
        raise ObservationKeyError(line)

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
        batch = served.batch(obs)
        for name, value in self._episode.items():
            setattr(served.policy, name, value)
        try:
            with served.generators(self._rng):
                actions = served.act(batch)
        finally:
            self._episode = {name: getattr(served.policy, name) for name in self._episode}
        return {"actions": actions}

    def reset(self) -> None:
        self._episode = self._served.fresh_episode()

    def reset_rng(self, seed: int) -> None:
        self._rng = self._served.seeded(seed)

    def rng_state(self) -> str:
        digest = hashlib.sha256(self._rng["cpu"].numpy().tobytes())
        for device in sorted(set(self._rng) - {"cpu"}):  # the device's generator, where the policy draws on one
            digest.update(self._rng[device].numpy().tobytes())
        return digest.hexdigest()


def _choose_mode(policy_type: str, history: int, mode: str, policy_class: type,
                 kept: list[str] | None = None) -> tuple[str, str]:
    """(chunk or step, why step) for a policy of this type, observation history and episode state beyond its
    action queue (`kept`); BadInput when the asked mode cannot serve it as its select_action does."""
    why = ""
    if history > 1:
        why = f"n_obs_steps = {history}: an observation history"
    elif kept:
        why = f"select_action keeps {', '.join(kept)} between calls"
    if mode == "chunk" and history > 1:
        raise BadInput(f"a {policy_type} policy with n_obs_steps = {history} needs every step's observation: "
                       "it is served at C = 1 with --mode step (or --mode auto)")
    if mode == "chunk" and kept:
        raise BadInput(f"this {policy_type} policy's select_action keeps {', '.join(kept)} between calls, so its "
                       "chunks are other actions: it is served at C = 1 with --mode step (or --mode auto)")
    if mode == "auto":
        mode = "step" if why else "chunk"
    needed = "select_action" if mode == "step" else "predict_action_chunk"
    if not callable(getattr(policy_class, needed, None)):
        raise BadInput(f"policy type {policy_type!r} cannot be served in {mode} mode: it has no {needed}")
    return mode, (why or "asked with --mode step") if mode == "step" else ""


def _device(torch: Any, device: str) -> str:
    """The torch device to serve on, when its generator can be kept per connection; BadInput otherwise."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise BadInput(f"--device {device!r} is not a torch device: {_line(exc)}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"--device {device}: torch finds no CUDA device here (torch.cuda.is_available() is False); "
                       "serve on --device cpu or where a GPU is")
    if parsed.type not in ("cpu", "cuda"):
        raise BadInput(f"--device {device}: each connection's seed is kept for cpu and cuda generators only; a "
                       f"{parsed.type} device would draw from one stream shared by every connection")
    return device


def _line(exc: BaseException) -> str:
    """An exception as one line: its kind and its first line."""
    text = " ".join(str(exc).split("\n\n")[0].split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
