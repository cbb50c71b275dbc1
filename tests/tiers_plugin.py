"""The test tiers, as a pytest plugin (registered by tests/conftest.py).

Every test module declares a tier with a module-level `pytestmark = pytest.mark.fast` (pure core and
protocol), `pytest.mark.sim` (LIBERO/MuJoCo), `pytest.mark.e2e` (CLI, servers or an install in
subprocesses) or `pytest.mark.interop` (against the real LeRobot in a venv of its own: `bash scripts/test.sh
interop`, in neither the fast nor the slow tier); `sim` and `e2e` may go together. Collection refuses a module without a tier, and a test
outside the `sim` tier that loads MuJoCo into the test process fails, so `pytest -m "not sim and not e2e"`
stays fast. The plugin also hands the longest test groups out first to the pytest-xdist workers, and gives
the whole run one cache of each kind in RUN_CACHES.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest

TIERS = ("fast", "sim", "e2e", "interop")
# Modules only the simulator brings in: loading one means the test runs LIBERO.
SIM_MODULES = ("mujoco", "robosuite", "libero")
# What each of the longest test groups (a module, or an `xdist_group`) took in its tier, in seconds: the sum of
# `--durations=0` over its tests in one run of its tier (docs/benchmarks-history.md, "The test tiers"). Only an
# order: the tier hands out the longest first.
GROUP_SECONDS = {
    # the slow tier, `SKIP_SETUP=1 bash scripts/test.sh slow -q --durations=0`, 2026-12-05, ab265a1, AMD EPYC, 2 cores
    "test_openpi_episodes.py": 212,
    "ray": 207,
    "test_memory_budget.py": 202,
    "test_fork_and_release.py": 132,
    "test_manifest.py": 128,
    "test_sampling_policy.py": 121,
    "test_interrupt.py": 119,
    "test_hardening_e2e.py": 117,
    "test_libero_pro.py": 114,
    "test_warm_simulators.py": 95,
    "test_engine_e2e.py": 85,
    "test_service.py": 78,
    "test_libero_adapter.py": 73,
    "test_sham.py": 71,
    "test_preflight.py": 68,
    "test_diagnose.py": 64,
    "test_openpi_conformance.py": 62,
    "test_policy_processes.py": 60,
    "test_lab_budget_race_e2e.py": 49,
    "test_exact_restore.py": 47,
    "test_vlm_faults_e2e.py": 46,
    "test_harm_e2e.py": 42,
    "test_fast_step.py": 42,
    "test_eval_e2e.py": 41,
    "test_compare.py": 40,
    "test_lab_budget_e2e.py": 31,
    "test_bad_input_cli.py": 31,
    "test_advisors_e2e.py": 30,
    "test_query_points_e2e.py": 29,
    "test_model_cache.py": 28,
    # `--durations=0` of each module alone under the simulator lock, 2026-12-06, AMD EPYC, 2 cores
    "test_vla_eval_study.py": 192,
    "test_vla_eval_conformance.py": 170,
    # the fast tier's longest (test_report_html.py also has slow tests: 19 s)
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


# The warm simulators a run of the slow tests keeps (rescue.env.warm): each of the 2 workers' studies runs up to 2
# simulators at once. A test that needs simulators of its study's own (it counts, kills or measures them) sets
# RESCUE_WARM_SIMULATORS=off for its commands.
WARM_ENV = "RESCUE_WARM_SIMULATORS"
WARM_SIZE = 4
WARM_START_S = 300


def pytest_configure(config: pytest.Config) -> None:
    """One cache of each kind in RUN_CACHES for the whole run: every simulator the tests start builds the same few
    LIBERO envs, and every embedded policy embeds the same few instructions; what was computed once is loaded
    byte for byte after. The pytest-xdist workers and every process they start inherit them; the process that
    made them removes them at the end. A cache the caller names (`off` included) is used as it is. A run that
    may hold simulator tests also keeps a warm pool of simulators that the studies of its commands lease
    (`_start_warm_pool`)."""
    if hasattr(config, "workerinput"):
        return
    import tempfile

    config._rescue_caches = []
    for variable in RUN_CACHES:
        if os.environ.get(variable) is None:
            os.environ[variable] = made = tempfile.mkdtemp(prefix=f"{variable.lower().replace('_', '-')}-")
            config._rescue_caches.append((variable, made))
    _start_warm_pool(config)


def _start_warm_pool(config: pytest.Config) -> None:
    """`rescue serve-simulators` for the whole run, its folder in RESCUE_WARM_SIMULATORS, unless the caller set
    that variable (`off`: none) or the run selects no simulator test (the fast tier). One that does not start
    stops the run: it fails, it does not go on without."""
    import subprocess
    import tempfile
    import time

    markexpr = config.getoption("markexpr") or ""
    if os.environ.get(WARM_ENV) is not None or markexpr.startswith("not sim") or markexpr == "interop":
        return
    folder = tempfile.mkdtemp(prefix="rescue-warm-simulators-")
    log = open(os.path.join(folder, "server.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", "serve-simulators", folder, "--size", str(WARM_SIZE)],
                            stdout=log, stderr=log, start_new_session=True)
    log.close()
    config._rescue_warm = (proc, folder)
    deadline = time.monotonic() + WARM_START_S
    while not os.path.exists(os.path.join(folder, "ready")):
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(os.path.join(folder, "server.log"), errors="replace") as f:
                why = f.read().strip().splitlines()[-1:] or ["no output"]
            _stop_warm_pool(config)
            raise pytest.UsageError(f"the warm simulators did not start (rescue.env.warm): {why[0]}")
        time.sleep(0.1)
    os.environ[WARM_ENV] = folder


def _stop_warm_pool(config: pytest.Config) -> None:
    import shutil
    import signal

    proc, folder = getattr(config, "_rescue_warm", (None, None))
    if proc is None:
        return
    config._rescue_warm = (None, None)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    shutil.rmtree(folder, ignore_errors=True)
    os.environ.pop(WARM_ENV, None)


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    _stop_warm_pool(config)
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


# What each test module took, summed over its tests' setup, call and teardown as the reports reach the process
# that prints (the controller under pytest-xdist): the longest are printed at the end of every run, so a CI log
# says where a tier's time went (benchmarks/tier_time.py compares a tier's total with the last recorded one).
_MODULE_SECONDS: collections.Counter = collections.Counter()
LONGEST_SHOWN = 10


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _MODULE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The ten longest test modules of this run, by the time their tests took."""
    if hasattr(config, "workerinput") or not _MODULE_SECONDS:
        return
    terminalreporter.section(f"the {LONGEST_SHOWN} longest test modules (s, their tests' durations added)")
    for module, seconds in _MODULE_SECONDS.most_common(LONGEST_SHOWN):
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")
