"""Each simulator's memory budget when none is configured: a share of the machine's available memory,
never under the floor (DESIGN §12); and a build's price measured as its own peak (MemoryBudget)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rescue.env.memory import (
    DEFAULT_MAX_RSS_GB,
    MACHINE_SHARE,
    MemoryBudget,
    _malloc_trim,
    available_bytes,
    default_budget_gb,
    simulator_budget,
)

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(("simulators", "available", "expected"), [
    (2, 24e9, 6.0),  # half of 24 GB over two
    (1, 24e9, 12.0),
    (8, 24e9, 2.5),  # 1.5 each would be under the floor
    (2, 3e9, 2.5),
])
def test_the_default_is_a_share_of_the_available_memory_with_the_floor_under_it(simulators, available, expected):
    assert default_budget_gb(simulators, available) == expected


def test_a_configured_budget_wins_and_other_machines_get_the_floor():
    assert simulator_budget(3.0, 2, on_this_machine=True) == (3.0, "[env] max_simulator_rss_gb")
    gb, source = simulator_budget(None, 2, on_this_machine=False)
    assert gb == DEFAULT_MAX_RSS_GB and "other machines" in source


def test_on_this_machine_the_default_reads_what_it_has():
    available = available_bytes()
    assert available is not None and available > 0  # Linux says MemAvailable
    gb, source = simulator_budget(None, 2, on_this_machine=True)
    assert gb >= DEFAULT_MAX_RSS_GB
    assert gb == DEFAULT_MAX_RSS_GB or abs(gb - MACHINE_SHARE * available / 2 / 1e9) < 0.5  # memory moves meanwhile
    assert "GB available when the run started" in source and "2 simulators" in source


def test_a_build_is_priced_by_its_own_peak_and_later_builds_by_what_they_add():
    budget = MemoryBudget(100.0)
    assert budget.price("libero_object") is None and not budget.fits("libero_object")  # never built: built alone
    budget.building("libero_object")
    scratch = b"x" * 200_000_000  # a build's peak: 200 MB written, then let go
    del scratch
    budget.settle()
    first = budget.first_cost["libero_object"]
    assert first > 190_000_000  # (pages the process held already served part of it)
    budget.building("libero_object")
    scratch = b"x" * 50_000_000
    del scratch
    budget.settle()
    # The second build's peak is its own (the first's 200 MB is forgotten), and it prices the suite from now on.
    assert 45_000_000 < budget.cost["libero_object"] < 190_000_000
    assert budget.price("libero_object") == budget.cost["libero_object"] and budget.fits("libero_object")


def test_a_machine_that_does_not_say_its_available_memory_gets_the_floor(monkeypatch):
    import rescue.env.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda: None)
    gb, source = simulator_budget(None, 2, on_this_machine=True)
    assert gb == DEFAULT_MAX_RSS_GB and "does not say" in source


def test_giving_memory_back_starts_no_process():
    # A simulator gives its free heap back after every env it builds or closes. Looking glibc's malloc_trim up with
    # ctypes.util.find_library ran `ldconfig -p` each time: a child of a process of gigabytes, which the memory test's
    # sampler, catching it before its exec, took for one simulator more. Python's audit hooks see every process start.
    code = textwrap.dedent("""
        import sys
        started = []
        sys.addaudithook(lambda event, args: event in ("subprocess.Popen", "os.fork", "os.posix_spawn", "os.exec",
                                                       "os.spawn", "os.system") and started.append(event))
        from rescue.env.memory import give_back_free_memory
        give_back_free_memory()
        give_back_free_memory()
        print(started)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    assert _malloc_trim() is not None  # and on this glibc it does give memory back
