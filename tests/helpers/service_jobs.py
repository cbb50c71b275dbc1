"""A worker that runs jobs, as the service tests start it: `rescue serve` in a process group of its own with its output
discarded (a long job would fill a pipe nobody reads), small jobs submitted, its JSON API read, the study a job made."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import ROOT, cli_env, rescue_cli


# The scripted policy reads the simulator's state and renders no camera: these tests' subject is the queue,
# its worker and signals, not what a policy sees.
SMALL = ("--cases-in-flight", "1", "--simulators", "1", "--policy", "scripted")


def start_worker(queue: Path, port: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """`rescue serve` in a process group of its own: a SIGKILL of the group takes the worker, its job child and
    simulators, as a crash would."""
    return subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "serve", "--queue", str(queue), "--port", str(port), *extra],
        cwd=ROOT, env=env or cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


def get_json(port: int, path: str, key: str | None = None) -> tuple[int, dict]:
    """GET a path of the worker's API: (status, the JSON body)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until the worker answers /healthz; fails if it exits first or never answers within `timeout`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"rescue serve exited {proc.returncode}"
        try:
            if get_json(port, "/healthz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("rescue serve never answered /healthz")


def job_study(queue: Path, job_id: str) -> Path:
    """The study folder a job runs in."""
    return queue / "jobs" / job_id / f"study-{job_id.removeprefix('job-')}"


def submit_small(manifest: Path, name: str, queue: Path) -> str:
    """`rescue submit` of a manifest as a small job (SMALL); its job id."""
    out = rescue_cli("submit", str(manifest), "--queue", str(queue), "--name", name, *SMALL)
    return out.stdout.split()[1]
