"""No process a run starts outlives it: SIGKILL the driver of a real `rescue run` (only the driver, as
the OOM killer or `kill -9 PID` does) and its simulators and the multiprocessing resource tracker end too,
whether the simulators were stepping a case or still starting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, case_states, cli_env, descendants, write_cases

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

# Bounds a hang, which is what these tests are about; a simulator's watchdog reacts within 0.5 s
# (rescue/env/pool.py), the kernel's parent-death signal at once.
GONE_WITHIN_S = 60


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    # Simulators of the run's own (no warm pool's): they are what must die with it.
    return subprocess.Popen([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT,
                            env={**cli_env(own_simulators=True), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _kill_driver_and_watch(proc: subprocess.Popen, children: list[int]) -> list[int]:
    """SIGKILL the driver alone; the children still alive GONE_WITHIN_S later."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline and any(_alive(c) for c in children):
        time.sleep(0.2)
    return [c for c in children if _alive(c)]


def _cleanup(children: list[int]) -> None:
    for pid in children:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _wait_for_children(proc: subprocess.Popen, n: int, timeout: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = descendants(proc.pid)
        if len(found) >= n:
            return found
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before it started {n} children"
        time.sleep(0.1)
    raise AssertionError(f"the run never started {n} children")


def test_simulators_still_starting_die_with_a_killed_driver(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[env]\nadapter = "slow_adapter:SlowBootAdapter"\nsimulators = 2\n')
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=48)
    env = {"PYTHONPATH": str(ROOT / "tests") + os.pathsep + cli_env()["PYTHONPATH"]}
    proc = _start(["run", str(manifest), "--study", str(tmp_path / "s"), "--config", str(config)], env)
    children = []
    try:
        # Two simulators and the resource tracker; the simulators sleep in their adapter's constructor.
        children = _wait_for_children(proc, 3)
        time.sleep(1.0)  # past the simulators' own start (their watchdog is armed first thing)
        children = descendants(proc.pid)
        left = _kill_driver_and_watch(proc, children)
        assert left == [], f"still alive {GONE_WITHIN_S} s after the driver's SIGKILL: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _cleanup(children)


def test_simulators_of_a_study_in_flight_die_with_a_killed_driver(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 4, horizon=96)
    study = tmp_path / "s"
    proc = _start(["run", str(manifest), "--study", str(study), "--simulators", "2", "--cases-in-flight", "2"])
    children = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if (study / "journal.sqlite").exists() and "claimed" in case_states(study).values():
                break
            assert proc.poll() is None, proc.returncode
            time.sleep(0.1)
        time.sleep(2.0)  # into the arms' stepping
        children = descendants(proc.pid)
        assert len(children) >= 3  # two simulators and the resource tracker at least
        left = _kill_driver_and_watch(proc, children)
        assert left == [], f"still alive {GONE_WITHIN_S} s after the driver's SIGKILL: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _cleanup(children)
