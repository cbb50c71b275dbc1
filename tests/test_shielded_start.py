"""A terminal's Ctrl-C reaches every process of the foreground group, simulators included: a simulator must not
die of it, even while it boots (before it can ignore the signal), or the arm it was started for errs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, cli_env

pytestmark = pytest.mark.fast

# A fresh interpreter: its first spawned process also starts multiprocessing's resource tracker, which is where
# the shield was once lost. The SIGINT lands at once, while the child is still booting.
BOOTING = """
import os, signal, sys, time
from pathlib import Path
from rescue.env.pool import SimProcess

sim = SimProcess("slow_adapter:SlowBootAdapter", name="booting")
pid = sim._proc.pid
os.kill(pid, signal.SIGINT)
bit = 1 << (signal.SIGINT - 1)

def status(key):
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line.split()[1] for line in lines if line.startswith(key + ":")), 16)

# Until the child ignores SIGINT (it then builds its adapter, which sleeps), it must have held it blocked.
deadline = time.monotonic() + 120
while sim.alive() and not status("SigIgn") & bit and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.2)
print("alive" if sim.alive() else f"died with exit code {sim._proc.exitcode}")
sim._proc.kill()
"""


def test_a_simulator_sent_sigint_while_it_boots_lives_on():
    env = {**cli_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    out = subprocess.run([sys.executable, "-c", BOOTING], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "alive", out.stdout + out.stderr
