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


def case_states(study: Path) -> dict[str, str]:
    """Each case's queue state, read from the journal file directly (read-only)."""
    import sqlite3

    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        return dict(con.execute("SELECT case_id, state FROM cases"))
    finally:
        con.close()


def kill_mid_study(args: list[str], study: Path, timeout: float = 300) -> None:
    """Start `rescue ARGS` in its own process group and SIGKILL the group once `study`
    has a finished case and a case in flight."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", *args],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if (study / "journal.sqlite").exists():
                states = list(case_states(study).values())
                if "finished" in states and "claimed" in states:
                    return
            time.sleep(0.05)
        raise AssertionError(f"{study} never reached a finished case and a case in flight")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def resolved_config(interval: int, **fields):
    """A study configuration with its identity resolved (C fixed, nothing announced), as a created study holds."""
    from rescue.config import StudyConfig

    config = StudyConfig(**fields)
    policy = config.policy.model_copy(update={"replan_interval": interval, "announced": {}})
    return config.model_copy(update={"policy": policy})
