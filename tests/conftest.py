"""Shared fixtures: small manifests on the embedded LIBERO default, and a way to run the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_cases(path: Path, n: int, horizon: int = 64, task_id: int = 3, **extra) -> Path:
    """A manifest of n libero_object cases on one task (one env build per simulator)."""
    lines = [
        json.dumps(
            {
                "case_id": f"object-{task_id}-ep{i}",
                "suite": "libero_object",
                "task_id": task_id,
                "init_state_index": i,
                "env_seed": i,
                "horizon": horizon,
                "group": "object",
                **extra,
            }
        )
        for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("MUJOCO_GL", "egl")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def rescue_cli(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run `rescue ARGS` in a fresh process, as a user would."""
    proc = subprocess.run(
        [sys.executable, "-m", "rescue.cli", *args],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"rescue {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc
