"""A built wheel works on its own: package data ships, and is found from any directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e

# What a wheel is built from (pyproject's readme and the package data links' targets included). The serving
# distribution (serve/, package rescue_serve) is a wheel of its own, which this one depends on.
SOURCES = ("pyproject.toml", "README.md", "rescue", "wrappers", "prompts", "models")


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def copy_project(dest: Path) -> Path:
    """A copy of what the project's distribution is built from (links stay links), so a build leaves nothing here."""
    dest.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, dest / name)
    return dest


def copy_serving(dest: Path) -> Path:
    """A copy of the serving distribution (serve/), without what an earlier build left there."""
    return Path(shutil.copytree(ROOT / "serve", dest, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build")))


def test_wheel_installed_elsewhere_finds_its_prompt_and_models(tmp_path):
    src = copy_project(tmp_path / "src")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)])
    (wheel,) = (tmp_path / "dist").glob("vlm_rescue-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in ("prompts/subgoal_v1.txt", "models/policy_libero_object.pt", "models/subgoal_vision.pt",
                 "models/locator_libero_object.pt"):
        assert f"rescue/assets/{data}" in names
        assert zipfile.ZipFile(wheel).read(f"rescue/assets/{data}") == (ROOT / data).read_bytes()
    assert {"rescue/env/libero.py", "rescue/embedded/endpoint.py", "rescue/embedded/learned.py",
            "rescue/embedded/vision_language.py", "wrappers/injection.py"} <= names
    # The serving package is the serving distribution's alone: this wheel asks for it.
    assert not [n for n in names if n.startswith("rescue_serve/")]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "Requires-Dist: rescue-serve>=0.1.0" in metadata.splitlines()
    # The report's templates, style sheet and script ship with the package.
    templates = {f"rescue/read/html/templates/{p.name}" for p in (ROOT / "rescue/read/html/templates").iterdir()}
    assert "rescue/read/html/templates/study.html" in templates and templates <= names

    serve = copy_serving(tmp_path / "serve")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(serve)])
    (serving,) = (tmp_path / "dist").glob("rescue_serve-*.whl")
    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target", str(site), str(wheel), str(serving)])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Only the installed copy on the path; the checkout's editable install comes after it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    where = run([sys.executable, "-c", "import rescue, rescue_serve, wrappers; print(rescue.__file__); "
                 "print(rescue_serve.__file__); print(wrappers.__file__)"],
                cwd=elsewhere, env=env).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where
    assert "usage: rescue" in run([sys.executable, "-m", "rescue.cli", "--help"], cwd=elsewhere, env=env).stdout

    out = run([sys.executable, str(ROOT / "scripts" / "check_install.py")], cwd=elsewhere, env=env).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert found["failed"] == []
    assert Path(found["rescue"]).is_relative_to(site)
    assert Path(found["prompts"]).is_relative_to(site) and Path(found["policy_checkpoint"]).is_relative_to(site)
    assert found["template_sha256"] == found["receipt_template_sha256"]
    assert found["status"] == "ok" and "bbq sauce" in found["subgoal"]
    # The installed copy writes a report from its own templates, from any directory.
    study = shutil.copytree(ROOT / "tests" / "data" / "study_v4_plain", tmp_path / "study")
    run([sys.executable, "-m", "rescue.cli", "report", str(study)], cwd=elsewhere, env=env)
    assert "Summary (main cohort)" in (study / "report.html").read_text(encoding="utf-8")
    assert found["policy_actions_shape"] == [8, 7]
    assert found["vision_language_actions_shape"] == [8, 7] and Path(found["locator_checkpoint"]).is_relative_to(site)


def test_the_serving_distribution_builds_alone_and_asks_for_three_packages(tmp_path):
    # serve/ as a user installs it into a policy's venv: a wheel of rescue_serve alone, numpy, msgpack, websockets.
    src = copy_serving(tmp_path / "serve")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)])
    (wheel,) = (tmp_path / "dist").glob("rescue_serve-*.whl")
    archive = zipfile.ZipFile(wheel)
    assert {n.split("/")[0] for n in archive.namelist() if not n.startswith("rescue_serve-")} == {"rescue_serve"}
    metadata = archive.read(next(n for n in archive.namelist() if n.endswith("/METADATA"))).decode()
    requires = sorted(line.split(":", 1)[1].strip().split(">")[0].split("<")[0] for line in metadata.splitlines()
                      if line.startswith("Requires-Dist:"))
    assert requires == ["msgpack", "numpy", "websockets"]
    assert "Requires-Python: <3.14,>=3.10" in metadata or "Requires-Python: >=3.10,<3.14" in metadata
    entry = archive.read(next(n for n in archive.namelist() if n.endswith("/entry_points.txt"))).decode()
    assert "rescue-serve = rescue_serve.cli:main" in entry


def test_each_distribution_uninstalls_without_taking_the_others_files(tmp_path):
    # Real pip in a fresh venv, nothing downloaded: the dependencies are the project venv's, seen through a .pth line
    # (as CI's install check does), its own editable installs unseen (a .pth in a folder a .pth adds is not read).
    python = tmp_path / "venv" / "bin" / "python"
    run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")])
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(run([str(python), "-c", purelib]).stdout.strip())
    (site / "project_dependencies.pth").write_text(run([sys.executable, "-c", purelib]).stdout.strip() + "\n")
    project, serving = copy_project(tmp_path / "project"), copy_serving(tmp_path / "serve")
    pip = [sys.executable, "-m", "pip", "--python", str(python)]

    def install(source: Path) -> None:
        run([*pip, "install", "-q", "--no-deps", "--no-build-isolation", "--ignore-installed", str(source)])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bin_dir = python.parent

    def works(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)

    study = shutil.copytree(ROOT / "tests" / "data" / "study_v4_plain", tmp_path / "study")
    install(serving)
    install(project)
    assert works(str(bin_dir / "rescue"), "--help").returncode == 0
    assert works(str(bin_dir / "rescue-serve"), "--help").returncode == 0
    where = works(str(python), "-c", "import rescue, rescue_serve; print(rescue.__file__); print(rescue_serve.__file__)")
    assert all(Path(p).is_relative_to(site) for p in where.stdout.split()), where

    # The project goes: the serving distribution keeps every file and its command.
    run([*pip, "uninstall", "-q", "-y", "vlm-rescue"])
    assert works(str(python), "-c", "import rescue").returncode != 0 and not (bin_dir / "rescue").exists()
    assert works(str(bin_dir / "rescue-serve"), "--help").returncode == 0
    served = works(str(python), "-c", "import rescue_serve.server, rescue_serve.cli, rescue_serve.msgpack_numpy")
    assert served.returncode == 0, served.stderr

    # The serving distribution goes: the project keeps every file and its command (what needs a server aside).
    install(project)
    run([*pip, "uninstall", "-q", "-y", "rescue-serve"])
    assert works(str(python), "-c", "import rescue_serve").returncode != 0 and not (bin_dir / "rescue-serve").exists()
    assert works(str(bin_dir / "rescue"), "--help").returncode == 0
    report = works(str(bin_dir / "rescue"), "report", str(study))
    assert report.returncode == 0, report.stderr
    assert "Summary (main cohort)" in (study / "report.html").read_text(encoding="utf-8")
