"""scripts/setup.sh on a machine already set up: it skips what is in place (the Python packages, when
nothing they come from changed since the last complete install here and pip finds them consistent), and
installs again when something did. Run on a copy of the checkout whose `.venv/bin/python` and `dpkg`
only record how they are called, so no package is touched."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import HANG_S, ROOT

pytestmark = pytest.mark.fast

# A stand-in interpreter: it records its arguments; `pip check` fails while BROKEN exists.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../../calls.log"
case "$*" in
  -VV) echo "Python 3.11.7 (fake)";;
  "-m pip check") [ ! -e "$(dirname "$0")/../../BROKEN" ];;
esac
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "serve").mkdir()
    shutil.copy(ROOT / "serve" / "pyproject.toml", tmp_path / "serve" / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "dpkg").write_text("#!/bin/sh\nexit 0\n")  # every system package is installed
    (shims / "dpkg").chmod(0o755)
    return tmp_path


def _setup(checkout: Path, **env: str) -> list[str]:
    """Run the script; the pip installs it ran."""
    log = checkout / "calls.log"
    log.write_text("")
    path = f"{checkout / 'shims'}{os.pathsep}{os.environ['PATH']}"
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=checkout, env={**os.environ, "PATH": path, **env},
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    return [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]


def test_a_rerun_on_a_set_up_checkout_installs_nothing(checkout):
    assert len(_setup(checkout)) == 2  # torch, then the serving distribution and the project with its extras
    assert _setup(checkout) == []
    assert _setup(checkout) == []


def test_a_change_to_what_the_packages_come_from_installs_again(checkout):
    _setup(checkout)
    with open(checkout / "pyproject.toml", "a") as f:
        f.write("\n# a new pin\n")
    assert len(_setup(checkout)) == 2
    assert _setup(checkout) == []
    assert len(_setup(checkout, SETUP_FORCE="1")) == 2  # asked for
    with open(checkout / "serve" / "pyproject.toml", "a") as f:
        f.write("\n# a new pin of the serving distribution\n")
    assert len(_setup(checkout)) == 2
    assert _setup(checkout) == []


def test_inconsistent_packages_or_a_failed_install_install_again(checkout):
    _setup(checkout)
    (checkout / "BROKEN").touch()  # pip check finds a broken requirement
    assert len(_setup(checkout)) == 2
    (checkout / "BROKEN").unlink()
    # An install that did not finish leaves no stamp: the next run installs.
    (checkout / ".venv" / ".setup-stamp").unlink()
    assert len(_setup(checkout)) == 2
