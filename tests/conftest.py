"""Shared fixtures: small manifests on the embedded LIBERO default, and a way to run the CLI.

Also the test tiers. Every test module declares one with a module-level
`pytestmark = pytest.mark.fast` (pure core and protocol), `pytest.mark.sim`
(LIBERO/MuJoCo), `pytest.mark.e2e` (CLI, servers or an install in
subprocesses) or `pytest.mark.interop` (against the real LeRobot in a venv of its
own: `bash scripts/test.sh interop`, in neither the fast nor the slow tier);
`sim` and `e2e` may go together. Collection refuses a module without a tier, and a test outside the `sim` tier that loads MuJoCo into the
test process fails, so `pytest -m "not sim and not e2e"` stays fast.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("fast", "sim", "e2e", "interop")
# The bound on a wait that would otherwise hang (a child that never answers, a server that never
# listens): far beyond what a busy machine makes of a few seconds, never a claim about speed.
# Tests assert behaviour; speed is measured in benchmarks/.
HANG_S = 600
# Modules only the simulator brings in: loading one means the test runs LIBERO.
SIM_MODULES = ("mujoco", "robosuite", "libero")
# What each of the longest test groups (a module, or an `xdist_group`) took in its tier, in seconds: the sum of
# `--durations=0` over its tests in one run of its tier (docs/benchmarks.md, "The test tiers"). Only an order: the
# tier hands out the longest first.
GROUP_SECONDS = {
    "ray": 624,
    "test_openpi_episodes.py": 480,
    "test_hardening_e2e.py": 452,
    "test_memory_budget.py": 398,
    "test_fork_and_release.py": 335,
    "test_sampling_policy.py": 328,
    "test_interrupt.py": 314,
    "test_manifest.py": 286,
    "test_sham.py": 276,
    "test_libero_pro.py": 272,
    "test_engine_e2e.py": 255,
    "test_service.py": 247,
    "test_vlm_faults_e2e.py": 166,
    "test_policy_processes.py": 153,
    "test_eval_e2e.py": 149,
    "test_libero_adapter.py": 142,
    "test_openpi_conformance.py": 139,
    "test_diagnose.py": 136,
    # the fast tier's longest (test_report_html.py also has slow tests: 55 s)
    "test_report_html.py": 21,
    "test_vlm.py": 20,
    "test_architecture.py": 9,
    "test_policy_wire.py": 9,
    "test_tiers.py": 7,
}


def module_tiers(module: object) -> set[str]:
    """The tier markers a test module declares in its `pytestmark`."""
    marks = getattr(module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    return {mark.name for mark in marks if getattr(mark, "name", None) in TIERS}


# The caches the whole run shares (each opt-in for a user): compiled MuJoCo models (rescue.env.model_cache) and
# the embedded policies' sentence embeddings (rescue.embedded.learned).
RUN_CACHES = ("RESCUE_MODEL_CACHE", "RESCUE_EMBEDDING_CACHE")


def pytest_configure(config: pytest.Config) -> None:
    """One cache of each kind in RUN_CACHES for the whole run: every simulator the tests start builds the same few
    LIBERO envs, and every embedded policy embeds the same few instructions; what was computed once is loaded
    byte for byte after. The pytest-xdist workers and every process they start inherit them; the process that
    made them removes them at the end. A cache the caller names (`off` included) is used as it is."""
    if hasattr(config, "workerinput"):
        return
    import tempfile

    config._rescue_caches = []
    for variable in RUN_CACHES:
        if os.environ.get(variable) is None:
            os.environ[variable] = made = tempfile.mkdtemp(prefix=f"{variable.lower().replace('_', '-')}-")
            config._rescue_caches.append((variable, made))


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    for variable, made in getattr(config, "_rescue_caches", []):
        shutil.rmtree(made, ignore_errors=True)
        del os.environ[variable]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: an unmarked module fails every tier's run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse test modules that declare no tier, or `fast` together with a slow tier."""
    problems: dict[str, str] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        tiers = module_tiers(module)
        if not tiers:
            problems[str(item.path)] = "declares no tier: add `pytestmark = pytest.mark.fast` (or sim, e2e)"
        elif "interop" in tiers and len(tiers) > 1:
            problems[str(item.path)] = f"declares interop together with {sorted(tiers - {'interop'})}"
        elif "fast" in tiers and len(tiers) > 1:
            problems[str(item.path)] = f"declares fast together with {sorted(tiers - {'fast'})}"
    if problems:
        raise pytest.UsageError("\n".join(f"{path}: {why}" for path, why in sorted(problems.items())))
    if "interop" not in (config.getoption("markexpr") or ""):
        # Only a run that asks for it (`-m interop`) builds the LeRobot venv: a plain `pytest` leaves it out.
        interop = [item for item in items if item.get_closest_marker("interop") is not None]
        if interop:
            config.hook.pytest_deselected(items=interop)
            items[:] = [item for item in items if item.get_closest_marker("interop") is None]
    _one_worker_per_module(items)


def _one_worker_per_module(items: list[pytest.Item]) -> None:
    """With pytest-xdist (`-n N --dist loadgroup`, as scripts/test.sh runs every tier), a module's tests run
    on one worker, in order, sharing its module-scoped fixtures; modules that must not overlap declare one
    `pytest.mark.xdist_group(name)` (the two that count the machine's Ray processes share one).

    The groups go out longest first (scripts/test.sh keeps this order with `--no-loadscope-reorder`): a long
    module started last would run alone on one worker while the others wait at the end of the tier. The
    measured ones (GROUP_SECONDS) lead; the rest follow by their number of tests, pytest-xdist's own order."""
    groups = {}
    for item in items:
        marker = item.get_closest_marker("xdist_group")
        if marker is None:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
            marker = item.get_closest_marker("xdist_group")
        groups[item.nodeid] = marker.args[0] if marker.args else marker.kwargs.get("name", "")
    order = {item.nodeid: i for i, item in enumerate(items)}
    size = collections.Counter(groups.values())

    def longest_first(item: pytest.Item) -> tuple:
        group = groups[item.nodeid]
        if group in GROUP_SECONDS:  # measured
            return 0, -GROUP_SECONDS[group], order[item.nodeid]
        return 1, -size[group], order[item.nodeid]  # the rest by their number of tests, as pytest-xdist orders

    items.sort(key=longest_first)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """Under `--dist loadgroup` every test a worker collected must carry its group, or the modules that must not
    overlap (the Ray tests) would run at once on two workers: pytest 9 with pytest-xdist 3.8 did that."""
    if node.config.getvalue("dist") == "loadgroup":
        ungrouped = [i for i in ids if "@" not in i.rpartition("]")[2]]
        if ungrouped:
            pytest.exit(f"pytest-xdist grouped none of {len(ungrouped)} tests under pytest {pytest.__version__} "
                        f"({ungrouped[0]}); install the versions pyproject.toml pins", returncode=4)


def _sim_loaded() -> bool:
    return any(name in sys.modules for name in SIM_MODULES)


def _guard_sim(item: pytest.Item, before: bool) -> None:
    if not before and _sim_loaded() and item.get_closest_marker("sim") is None:
        loaded = [name for name in SIM_MODULES if name in sys.modules]
        pytest.fail(f"{item.nodeid} loaded {loaded} but its module is not marked sim", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    """Fixtures of a test outside the sim tier must not start the simulator."""
    before = _sim_loaded()
    result = yield
    _guard_sim(item, before)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A test outside the sim tier must not start the simulator."""
    before = _sim_loaded()
    result = yield
    _guard_sim(item, before)
    return result


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
    from rescue.core.config import StudyConfig

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


def wait_healthy(port: int, what: str, proc: subprocess.Popen | None = None, timeout_s: float = HANG_S) -> None:
    """Until `what`, started as `proc`, answers 200 on http://127.0.0.1:PORT/healthz; RuntimeError when it exits
    first (with what it printed on a piped stderr) or never answers."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            said = proc.stderr.read().decode(errors="replace") if proc.stderr is not None else ""
            raise RuntimeError(f"{what} exited {proc.returncode}: {said}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as reply:
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
