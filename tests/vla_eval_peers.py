"""vla-eval model servers for tests: the harness's own `PredictModelServer`, served by the harness's own code.

`DeterministicModel` answers a chunk computed from what it receives (the agentview pixels, the wrist pixels
and the states when it asks for them, the task's words): equal inputs give bit-equal actions in any process,
and any difference in an image, a state or the instruction moves them. `SamplingModel` adds fresh noise to
every chunk (a flow-matching VLA behind its server: no RNG control). Both can be told to fail a call with an
error frame (`fail_at_call`) or to die at one (`die_at_call`), and to log every observation they receive and
every action they answer (`log_path`: one JSON line per observation, digests of its parts).

Run as a script it serves one with `vla_eval.model_servers.serve.run_server` (the harness's entry point):
`python tests/vla_eval_peers.py --address 127.0.0.1:8123 --args.chunk_size=5`; `--model sampling` serves the
sampling one. `vla_eval_server(...)` does that on a free port and yields its `vla-eval+ws://` URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from conftest import ensure_stopped, free_port, wait_healthy
from vla_eval.model_servers.base import SessionContext
from vla_eval.model_servers.predict import PredictModelServer
from vla_eval.specs import GRIPPER_CLOSE_POS, IMAGE_RGB, LANGUAGE, POSITION_DELTA, RAW, ROTATION_AA

HERE = Path(__file__).resolve().parent


def _digest(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return hashlib.sha256(f"{value.dtype.str}{value.shape}".encode() + np.ascontiguousarray(value).tobytes()).hexdigest()
    return hashlib.sha256(str(value).encode()).hexdigest()


class DeterministicModel(PredictModelServer):
    """A small deterministic numpy model over the harness's LIBERO observation."""

    def __init__(self, chunk_size: int | None = 5, send_wrist_image: bool = True, send_state: bool = True,
                 env_seed: int | None = None, quat_no_antipodal: bool = False, fail_at_call: int = 0,
                 die_at_call: int = 0, fail_episode_start: bool = False, log_path: str = "") -> None:
        super().__init__(chunk_size=chunk_size)
        self.fail_episode_start = fail_episode_start
        self.params: dict[str, Any] = {}
        if send_wrist_image:
            self.params["send_wrist_image"] = True
        if send_state:
            self.params["send_state"] = True
        if env_seed is not None:
            self.params["env_seed"] = env_seed
        if quat_no_antipodal:
            self.params["quat_no_antipodal"] = True
        self.fail_at_call, self.die_at_call, self.log_path = fail_at_call, die_at_call, log_path
        self.calls = 0

    def get_observation_params(self) -> dict[str, Any]:
        return dict(self.params)

    def get_action_spec(self) -> dict:
        return {"position": POSITION_DELTA, "rotation": ROTATION_AA, "gripper": GRIPPER_CLOSE_POS}

    def get_observation_spec(self) -> dict:
        spec = {"agentview": IMAGE_RGB, "language": LANGUAGE}
        if "send_state" in self.params:
            spec["state"] = RAW
        return spec

    def features(self, obs: dict) -> np.ndarray:
        """What the model reads: pixel statistics of each image, the states, the instruction's digest."""
        parts = []
        for name in sorted(obs.get("images", {})):
            img = np.asarray(obs["images"][name], dtype=np.float64) / 255.0
            parts += [img.mean(), img[::5, ::7].std(), img[100:160, 100:160].mean()]
        for key in ("states", "controller_states"):
            if key in obs:
                parts += list(np.asarray(obs[key], dtype=np.float64))
        words = hashlib.sha256(str(obs.get("task_description", "")).encode()).digest()
        parts.append(words[0] / 255.0)
        return np.asarray(parts)

    def chunk(self, obs: dict) -> np.ndarray:
        f = self.features(obs)
        k = np.arange(self.chunk_size or 5, dtype=np.float64)[:, None]
        phase = np.arange(7, dtype=np.float64)[None, :]
        actions = 0.6 * np.sin(3.0 * f.sum() + 0.7 * k + 1.3 * phase + 5.0 * f[0])
        actions[:, 6] = np.where(np.sin(11.0 * f.sum() + k[:, 0]) > 0, 1.0, -1.0)
        actions[:, 6][::4] = 0.0  # the harness sends +1 for it
        return actions.astype(np.float32)

    def _log(self, row: dict) -> None:
        if self.log_path:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    async def on_episode_start(self, config: dict, ctx: SessionContext) -> None:
        if self.fail_episode_start:
            raise RuntimeError(f"no episode of {config.get('task', {}).get('suite')} here")
        self._log({"kind": "episode_start", "session": ctx.session_id, "task": config.get("task")})
        await super().on_episode_start(config, ctx)

    async def on_observation(self, obs: dict, ctx: SessionContext) -> None:
        if self.log_path:
            self._log({"kind": "observation", "session": ctx.session_id, "step": ctx.step, "keys": sorted(obs),
                       "task": obs.get("task_description"),
                       "obs": {**{f"images/{k}": _digest(np.asarray(v)) for k, v in obs.get("images", {}).items()},
                               **{k: _digest(np.asarray(obs[k])) for k in ("states", "controller_states") if k in obs}}})
        await super().on_observation(obs, ctx)

    def predict(self, obs: dict, ctx: SessionContext) -> dict:
        self.calls += 1
        if self.calls == self.die_at_call:
            os._exit(17)
        if self.calls == self.fail_at_call:
            raise ValueError(f"the model refuses call {self.calls}")
        actions = self.chunk(obs)
        self._log({"kind": "predict", "session": ctx.session_id, "step": ctx.step, "call": self.calls,
                   "actions": actions.tolist()})
        return {"actions": actions}


def log_rows(path: Path, kind: str) -> list[dict]:
    """The rows of one kind (episode_start, observation, predict) a served model logged, in order."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).exists() else []
    return [row for row in rows if row["kind"] == kind]


def episodes_seen(path: Path) -> dict[tuple[int, int], list[dict]]:
    """What the model saw of each episode, by (task_id, episode_idx) of its episode_start: its observation and
    predict rows in order (one session may hold several episodes, one after another)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    current: dict[str, tuple[int, int]] = {}
    out: dict[tuple[int, int], list[dict]] = {}
    for row in rows:
        if row["kind"] == "episode_start":
            key = (row["task"]["task_id"], row["task"]["episode_idx"])
            current[row["session"]] = key
            out[key] = []
        elif row["session"] in current:
            out[current[row["session"]]].append({k: v for k, v in row.items() if k != "session"})
    return out


class SamplingModel(DeterministicModel):
    """The deterministic model plus fresh noise on every chunk, from one process-wide generator."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rng = np.random.default_rng()

    def chunk(self, obs: dict) -> np.ndarray:
        actions = super().chunk(obs)
        actions[:, :6] += self.rng.normal(0.0, 0.2, size=(len(actions), 6)).astype(np.float32)
        return actions


MODELS = {"deterministic": DeterministicModel, "sampling": SamplingModel}


@contextlib.contextmanager
def vla_eval_server(model: str = "deterministic", **args: Any) -> Iterator[str]:
    """Serve a model with the harness's own serving code in its own process; yield `vla-eval+ws://127.0.0.1:PORT`."""
    port = free_port()
    argv = [sys.executable, str(HERE / "vla_eval_peers.py"), "--model", model, "--address", f"127.0.0.1:{port}"]
    argv += [f"--args.{key}={json.dumps(value) if isinstance(value, bool) else value}" for key, value in args.items()]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(HERE)})
    try:
        wait_healthy(port, f"the vla-eval {model} server", proc, path="/health")
        yield f"vla-eval+ws://127.0.0.1:{port}"
    finally:
        ensure_stopped(proc)
        if proc.stderr is not None:
            proc.stderr.close()


def main() -> None:
    """`--model deterministic|sampling`, then the harness's own `run_server` arguments."""
    from vla_eval.model_servers.serve import run_server

    model = "deterministic"
    if "--model" in sys.argv:
        at = sys.argv.index("--model")
        model = sys.argv[at + 1]
        del sys.argv[at:at + 2]
    run_server(MODELS[model])


if __name__ == "__main__":
    main()
