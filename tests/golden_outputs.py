"""The files a study's reading commands write (export JSON and CSV, the HTML report and its files, status), as
sha256 digests, so that a test can hold a study's outputs byte for byte across versions.

The export's `schema_version` is the one line allowed to change: it is read as `rescue-export/N` whatever N.

Regenerate (only when a change of the outputs is meant): .venv/bin/python tests/golden_outputs.py
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = DATA / "golden_outputs.json"
# Failures-only studies without triggers, made by earlier versions (tests/test_old_formats.py says how).
STUDIES = ("study_v4_plain", "study_v4_advisors")
_VERSION = re.compile(rb'"schema_version": "rescue-export/\d+"')


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def outputs(study: str, work: Path) -> dict[str, str]:
    """Export, report and status of a copy of `tests/data/<study>` through the `rescue` command, by file name."""
    folder = Path(shutil.copytree(DATA / study, work / study))
    rescue = [sys.executable, "-m", "rescue.cli"]
    env = {**os.environ, "COLUMNS": "120"}  # the terminal's width decides where rich wraps a line
    out = work / f"{study}-out"
    subprocess.run([*rescue, "export", str(folder), "--out", str(out / "export.json")], check=True, capture_output=True,
                   env=env)
    subprocess.run([*rescue, "report", str(folder), "--out", str(out / "report" / "report.html")], check=True,
                   capture_output=True, env=env)
    status = subprocess.run([*rescue, "status", str(folder)], check=True, capture_output=True, env=env).stdout
    found = {"status.txt": _sha(status)}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == "export.json":
            data = _VERSION.sub(b'"schema_version": "rescue-export/N"', data)
        found[path.relative_to(out).as_posix()] = _sha(data)
    return found


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        golden = {study: outputs(study, Path(tmp)) for study in STUDIES}
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
