"""A test policy that accepts exactly what openpi's LIBERO policies read, served by the real openpi server.

openpi's `LiberoInputs` reads `observation/image` and `observation/wrist_image`
(uint8 images; the LIBERO client sends 224x224x3), `observation/state` (8
floats) and `prompt` (a string). This policy checks those and nothing more
generous, and answers with a deterministic (10, 7) action chunk.

Run as a script it serves the policy with `openpi_server.WebsocketPolicyServer`
and openpi's empty metadata (no `action_horizon`): `python
tests/openpi_libero_policy.py --port 8123`. `openpi_server()` starts that in its
own process on a free port and yields the URL. With `received_dir`, the
policy saves every observation it received there (`0001.npz`, ...), so a test
can compare what the server's policy saw with what the client recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from conftest import free_port

CHUNK = 10
IMAGE_SHAPE = (224, 224, 3)
HERE = Path(__file__).resolve().parent
# Where the served policy saves what it received (unset: nothing is saved).
RECEIVED_DIR_ENV = "OPENPI_TEST_RECEIVED_DIR"


class OpenpiLiberoPolicy:
    """Checks openpi's LIBERO inputs; replies with small deterministic motions."""

    def __init__(self, received_dir: str | Path | None = None) -> None:
        self.requests = 0
        self.received_dir = Path(received_dir) if received_dir else None

    def infer(self, obs: dict) -> dict:
        """Validate one observation as LiberoInputs would need it; return {"actions": (10, 7)}."""
        for key in ("observation/image", "observation/wrist_image"):
            if key not in obs:
                raise KeyError(f"missing {key!r} (got keys {sorted(obs)})")
            img = obs[key]
            if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.shape != IMAGE_SHAPE:
                raise ValueError(f"{key} must be uint8 {IMAGE_SHAPE}, got {getattr(img, 'dtype', type(img))} {getattr(img, 'shape', '')}")
        if "observation/state" not in obs:
            raise KeyError(f"missing 'observation/state' (got keys {sorted(obs)})")
        state = np.asarray(obs["observation/state"])
        if state.shape != (8,) or not np.issubdtype(state.dtype, np.floating):
            raise ValueError(f"observation/state must be 8 floats, got {state.dtype} {state.shape}")
        if "prompt" not in obs:
            raise KeyError(f"missing 'prompt' (got keys {sorted(obs)})")
        if not isinstance(obs["prompt"], str):
            raise ValueError(f"prompt must be str, got {type(obs['prompt']).__name__}")
        self.requests += 1
        if self.received_dir is not None:
            np.savez(
                self.received_dir / f"{self.requests:04d}.npz",
                **{key.replace("/", "__"): np.asarray(obs[key]) for key in ("observation/image", "observation/wrist_image", "observation/state")},
                prompt=np.array(obs["prompt"]),
            )
        t = np.arange(CHUNK, dtype=np.float64)[:, None]
        actions = np.zeros((CHUNK, 7))
        actions[:, :3] = 0.2 * np.sin(0.3 * t + np.array([0.0, 1.0, 2.0]))
        actions[:, 6] = -1.0
        # The digest of what arrived lets a client check the server saw its exact pixels.
        return {"actions": actions, "received_sha256": received_sha256(obs), "requests": self.requests}

    def reset(self) -> None:
        """Nothing to reset (a plain openpi policy)."""


def received_sha256(obs: dict) -> str:
    """Digest of the images, state and prompt of an observation (the policy echoes it)."""
    h = hashlib.sha256()
    for key in ("observation/image", "observation/wrist_image", "observation/state"):
        h.update(np.ascontiguousarray(obs[key]).tobytes())
    h.update(obs["prompt"].encode("utf-8"))
    return h.hexdigest()


def load_received(received_dir: Path) -> list[dict]:
    """The observations the served policy saved, in the order it received them."""
    out = []
    for path in sorted(Path(received_dir).glob("*.npz")):
        with np.load(path) as data:
            obs = {key.replace("__", "/"): data[key] for key in data.files if key != "prompt"}
            obs["prompt"] = str(data["prompt"])
        out.append(obs)
    return out


@contextlib.contextmanager
def openpi_server(timeout_s: float = 60.0, received_dir: Path | None = None) -> Iterator[str]:
    """Serve OpenpiLiberoPolicy with the real openpi server in its own process; yield its ws:// URL.

    With `received_dir`, the policy saves each observation it receives there (see `load_received`).
    """
    import urllib.request

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "openpi_libero_policy.py"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", RECEIVED_DIR_ENV: str(received_dir or "")},
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"openpi server exited {proc.returncode}: {proc.stderr.read().decode(errors='replace')}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("openpi server did not become healthy") from None
                time.sleep(0.1)
        yield f"ws://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def main() -> None:
    """Serve the policy on 127.0.0.1 with openpi's own server and empty metadata."""
    from openpi_server import WebsocketPolicyServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    policy = OpenpiLiberoPolicy(os.environ.get(RECEIVED_DIR_ENV) or None)
    WebsocketPolicyServer(policy, host="127.0.0.1", port=args.port, metadata={}).serve_forever()


if __name__ == "__main__":
    main()
