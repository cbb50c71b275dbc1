"""A real `rescue serve-policy` in a process of its own, serving a factory of the tests' modules (tests/ on its path)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from conftest import HANG_S, ROOT, cli_env, free_port


def serve_policy(factory: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """Start the server in a session of its own and wait until it listens (a hang is bounded, not its speed);
    the process and its ws:// URL. The caller stops it."""
    port = port or free_port()
    env = cli_env()
    env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "serve-policy", "--policy", factory, "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.time() + HANG_S
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"ws://127.0.0.1:{port}"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"{factory} never listened on {port}")
