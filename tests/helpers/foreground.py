"""A `rescue` command as a shell's foreground job, its Ctrl-C as a terminal sends it, and what is left of its
process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import HANG_S, ROOT, arms_started, case_states, cli_env, ensure_stopped, wait_until


SIGINT_BIT = 1 << (signal.SIGINT - 1)


def _as_a_terminal_starts_it() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def start_foreground(*args: str, cwd: Path = ROOT) -> subprocess.Popen:
    """`rescue ARGS` as a shell's foreground job: its own process group, SIGINT not ignored. Its simulators are
    its own (no warm pool's), in that group: a Ctrl-C reaches them too, and they must outlive it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", *args], cwd=cwd, env=cli_env(own_simulators=True), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_as_a_terminal_starts_it,
    )
    ignored = int(next(l for l in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if l.startswith("SigIgn"))
                  .split()[1], 16)
    assert not ignored & SIGINT_BIT, "the command started with SIGINT ignored: the test would prove nothing"
    return proc


def ctrl_c(proc: subprocess.Popen) -> None:
    """What the terminal does on Ctrl-C: SIGINT to every process of the foreground group."""
    os.killpg(proc.pid, signal.SIGINT)


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes of a process group (its simulators among them)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def claimed(study: Path) -> bool:
    return (study / "journal.sqlite").exists() and "claimed" in case_states(study).values()


def ctrl_c_mid_arm(proc: subprocess.Popen, study: Path, while_stepping=lambda: None) -> list[str]:
    """Ctrl-C a foreground run once its first case's arms have started (`while_stepping()` asserts what must hold
    then), and wait for the run to drain and exit 3: the cases that were in flight."""
    try:
        wait_until(lambda: claimed(study), "a case in flight", proc=proc)
        in_flight = [c for c, s in case_states(study).items() if s == "claimed"]
        wait_until(lambda: arms_started(study, in_flight[0]), "both arms of the case in flight started", proc=proc)
        while_stepping()
        ctrl_c(proc)
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 3, err
    assert "no new case is claimed" in out + err
    return in_flight
