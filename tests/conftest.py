"""Shared helpers: small manifests on the embedded LIBERO default, a way to run the CLI, free ports,
and readers of a study folder's journal, export and events.

The test tiers (every module declares one) are a plugin of their own, tests/tiers_plugin.py, registered here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The bound on a wait that would otherwise hang (a child that never answers, a server that never
# listens): far beyond what a busy machine makes of a few seconds, never a claim about speed.
# Tests assert behaviour; speed is measured in benchmarks/.
HANG_S = 600

# The tiers, the run's caches and the order the groups go out in: tests/tiers_plugin.py.
pytest_plugins = ("tiers_plugin",)


# The policy of the studies whose subject is not what a policy sees (the journal, a signal, the service, the ledger,
# the simulators, a broken peer): it reads the simulator's state, so its arms render no camera, where the embedded
# default (a vision-language policy) renders two views at every query.
SCRIPTED_POLICY = "rescue.embedded.scripted:make_policy"
SCRIPTED_ARGS = ("--policy-factory", SCRIPTED_POLICY)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def cli_env(own_simulators: bool = False) -> dict[str, str]:
    """The environment of a command a test starts. `own_simulators`: its studies start simulators of their own
    instead of leasing the run's warm ones (tests/tiers_plugin.py), for a test that counts, kills or measures them."""
    env = dict(os.environ)
    if own_simulators:
        env["RESCUE_WARM_SIMULATORS"] = "off"
    env.setdefault("MUJOCO_GL", "egl")
    # The CLI's tables as on a terminal-less run (132 columns), whatever width the test runner's own terminal (or a
    # pytest-xdist worker) left in COLUMNS.
    env["COLUMNS"] = "132"
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


def kill_mid_study(args: list[str], study: Path, timeout: float = 300, also=None) -> None:
    """Start `rescue ARGS` in its own process group and SIGKILL the group once `study`
    has a finished case and a case in flight (and `also(states)` holds, when given)."""
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
                if "finished" in states and "claimed" in states and (also is None or also(case_states(study))):
                    return
            time.sleep(0.05)
        raise AssertionError(f"{study} never reached a finished case and a case in flight")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def resolved_config(interval: int, **fields):
    """A study configuration with its identity resolved (C fixed, nothing announced), as a created study holds."""
    from rescue.core.configuration.config import StudyConfig

    config = StudyConfig(**fields)
    policy = config.policy.model_copy(update={"replan_interval": interval, "announced": {}})
    return config.model_copy(update={"policy": policy})


def arm_rows(study: Path) -> dict[tuple[str, str], str]:
    """Each arm record's JSON as the journal stores it, by (case_id, arm), read-only."""
    import sqlite3

    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        return {(c, a): d for c, a, d in con.execute("SELECT case_id, arm, data FROM arms")}
    finally:
        con.close()


def export_of(study: Path) -> dict:
    """`rescue export STUDY`, read back."""
    rescue_cli("export", str(study))
    return json.loads((study / "export.json").read_text())


def events_of(study: Path) -> list[dict]:
    """The study's structured log, one dict per event (none yet: empty)."""
    path = study / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def arms_started(study: Path, case_id: str, arms: tuple[str, ...] = ("control", "assisted")) -> bool:
    """Each of `arms` of the case has started (its `arm.started` is in the study's log): the case is mid-arm from
    then until its verdict, whatever the machine's speed."""
    started = {e.get("arm") for e in events_of(study) if e.get("event") == "arm.started" and e.get("case_id") == case_id}
    return set(arms) <= started


def wait_until(predicate, what: str, timeout: float = HANG_S, proc: subprocess.Popen | None = None) -> None:
    """Until predicate() holds (timeout bounds a hang, not speed); when `proc`, the command that should make it
    hold, exits first, fail at once with what it printed."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"never: {what}; the command exited {proc.returncode} first: {(out or '') + (err or '')}")
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def states_before_resume(study: Path) -> tuple[dict, set, set, set]:
    """Right after a kill: the arm rows, and the finished, in-flight and never-started case ids."""
    states = case_states(study)
    by = {state: {c for c, s in states.items() if s == state} for state in ("finished", "claimed", "pending")}
    return arm_rows(study), by["finished"], by["claimed"], by["pending"]


def assert_resumed_without_rerun(by_id: dict, before: dict, after: dict, finished, in_flight, never) -> None:
    """After a kill and a resume: finished cases keep their arm records byte for byte, cases in
    flight are unknown (interrupted) with nothing of them run again, never-started ones finished."""
    for case_id in finished:
        assert by_id[case_id]["state"] == "finished"
        for arm in ("control", "assisted"):
            assert after[(case_id, arm)] == before[(case_id, arm)]
    for case_id in in_flight:
        assert by_id[case_id]["state"] == "interrupted"
        assert by_id[case_id]["label"] == "unknown"
        assert "interrupted" in by_id[case_id]["reason"]
        for arm in ("control", "assisted"):
            assert after.get((case_id, arm)) == before.get((case_id, arm))
    for case_id in never:
        assert by_id[case_id]["state"] == "finished"


def ensure_stopped(proc: subprocess.Popen) -> None:
    """Kill a process started in its own session, and all it started, if it still runs."""
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_healthy(port: int, what: str, proc: subprocess.Popen | None = None, timeout_s: float = HANG_S,
                 path: str = "/healthz") -> None:
    """Until `what`, started as `proc`, answers 200 on http://127.0.0.1:PORT/healthz (or `path`); RuntimeError when
    it exits first (with what it printed on a piped stderr) or never answers."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            said = proc.stderr.read().decode(errors="replace") if proc.stderr is not None else ""
            raise RuntimeError(f"{what} exited {proc.returncode}: {said}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not become healthy") from None
            time.sleep(0.1)


def ray_session_processes(driver_pid: int) -> dict[int, str]:
    """The live raylet and GCS of the one-machine Ray cluster process `driver_pid` started, with their command lines.

    Ray names a session's folder after the pid of the process that started it (`session_<date>_<pid>`), and
    both carry that folder on their command line; a zombie (a command line of nothing) is not counted."""
    import re

    mark = re.compile(rf"/session_[0-9_-]+_{driver_pid}/")
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue  # gone meanwhile
            program = Path(line.split(" ")[0]).name
            if program in ("raylet", "gcs_server") and mark.search(line):
                found[int(entry.name)] = line[:160]
    return found


def assert_cluster_stopped(driver_pid: int) -> None:
    """The cluster `driver_pid` started stops with it: its raylet and GCS exit (within the hang bound: a
    SIGKILLed process on a loaded machine takes a moment to go)."""
    import time

    deadline = time.monotonic() + HANG_S
    while (left := ray_session_processes(driver_pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the cluster process {driver_pid} started outlived it: {left}"


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (children, their children, ...), read from /proc; `pid` itself not included."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
