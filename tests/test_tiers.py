"""The test tiers hold: every module declares one, and a test outside `sim` cannot start MuJoCo."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import HANG_S, ROOT
from tiers_plugin import TIERS, module_tiers

pytestmark = pytest.mark.fast

LOADS_MUJOCO = "def test_loads():\n    import mujoco\n    assert mujoco.MjModel\n"


def pytest_in(folder: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """Run pytest on `files` next to a copy of this suite's conftest.py and its tier plugin."""
    folder.mkdir()
    for name in ("conftest.py", "tiers_plugin.py"):
        shutil.copy(ROOT / "tests" / name, folder / name)
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("import pytest\n\n" + textwrap.dedent(text))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning", *args],
        cwd=folder, capture_output=True, text=True, timeout=HANG_S,
    )


def test_every_test_module_here_declares_a_tier():
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        # The module-level line itself, so a file never collected (or failing to import) is checked too.
        lines = [line for line in path.read_text().splitlines() if line.startswith("pytestmark = ")]
        assert len(lines) == 1, f"{path.name}: one module-level `pytestmark = pytest.mark.<tier>` line"
        assert any(f"pytest.mark.{tier}" in lines[0] for tier in TIERS), f"{path.name}: {lines[0]}"


def test_module_tiers_reads_single_marks_and_lists():
    single = type("M", (), {"pytestmark": pytest.mark.sim})
    both = type("M", (), {"pytestmark": [pytest.mark.sim, pytest.mark.e2e, pytest.mark.skip]})
    assert module_tiers(single) == {"sim"} and module_tiers(both) == {"sim", "e2e"}
    assert module_tiers(type("M", (), {})) == set()


def test_a_module_without_a_tier_fails_collection_even_when_deselected(tmp_path):
    files = {
        "test_a.py": "pytestmark = pytest.mark.fast\ndef test_a():\n    pass\n",
        "test_b.py": "def test_b():\n    pass\n",
        "test_c.py": "pytestmark = [pytest.mark.fast, pytest.mark.sim]\ndef test_c():\n    pass\n",
    }
    # `-m "sim or e2e"` would deselect all three: the check must come first.
    proc = pytest_in(tmp_path / "t", files, "-m", "sim or e2e")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "test_b.py: declares no tier" in proc.stderr
    assert "test_c.py: declares fast together with ['sim']" in proc.stderr
    assert "test_a.py" not in proc.stderr


def test_a_helper_module_needs_no_tier_and_a_test_module_importing_it_still_does(tmp_path):
    files = {
        "helpers/__init__.py": "",
        "helpers/cases.py": "def a_case():\n    return 'case-1'\n",
        "test_h.py": "from helpers.cases import a_case\npytestmark = pytest.mark.fast\ndef test_h():\n    assert a_case() == 'case-1'\n",
    }
    proc = pytest_in(tmp_path / "t", files, "-q")
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout + proc.stderr
    untiered = {**files, "test_i.py": "from helpers.cases import a_case\ndef test_i():\n    assert a_case()\n"}
    proc = pytest_in(tmp_path / "u", untiered, "-q")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "test_i.py: declares no tier" in proc.stderr and "cases.py" not in proc.stderr


def test_a_fast_test_or_fixture_that_loads_mujoco_fails(tmp_path):
    files = {
        "test_d.py": "pytestmark = pytest.mark.fast\n" + LOADS_MUJOCO,
        "test_e.py": "pytestmark = pytest.mark.e2e\n@pytest.fixture\ndef sim():\n    import mujoco\n    return mujoco\n"
        "def test_e(sim):\n    pass\n",
    }
    # Each in its own process: the guard only sees MuJoCo arrive, not MuJoCo already there.
    for name, marker in (("test_d.py", "test_d.py::test_loads"), ("test_e.py", "test_e.py::test_e")):
        proc = pytest_in(tmp_path / name, {name: files[name]}, "-q")
        assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout
        assert f"{marker} loaded ['mujoco'] but its module is not marked sim" in proc.stdout


def test_sim_tests_may_load_mujoco_and_leave_the_fast_tier(tmp_path):
    files = {
        "test_f.py": "pytestmark = pytest.mark.sim\n" + LOADS_MUJOCO,
        # A slow test inside a fast module carries its own mark.
        "test_g.py": "pytestmark = pytest.mark.fast\n@pytest.mark.sim\n" + LOADS_MUJOCO + "def test_quick():\n    pass\n",
    }
    everything = pytest_in(tmp_path / "all", files, "-q")
    assert everything.returncode == 0 and "3 passed" in everything.stdout, everything.stdout
    fast = pytest_in(tmp_path / "fast", files, "-q", "-m", "not sim and not e2e")
    assert fast.returncode == 0 and "1 passed, 2 deselected" in fast.stdout, fast.stdout
