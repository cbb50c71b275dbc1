"""`rescue usage`: a lab's VLM calls over every study under its folders, equal to the sum of the studies' exports.

The studies are real records written by the library's own writers (tests/report_studies.py): a priced study
under `studies/`, an unpriced one on another model and endpoint inside a service job folder, an evaluation
(no calls), a study still being created (a dot folder) and a folder whose configuration is not a study's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from report_studies import build_report_study

from rich.console import Console

from rescue.read.export import export_study
from rescue.read.lab_usage import lab_usage, quantile
from rescue.read.terminal import render_lab_usage
from rescue.study.folder import StudyError

pytestmark = pytest.mark.fast

DAY = 86400.0


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lab")
    build_report_study(root / "studies" / "priced", 40, seed=1, vlm={"price": {"input": 2.0, "output": 8.0}},
                       call_every_s=DAY / 10)
    build_report_study(root / "queue" / "jobs" / "job-1" / "study-x", 25, sham="fixed", seed=2,
                       vlm={"model": "gpt-4.1-mini", "base_url": "https://api.example.com/v1"}, call_every_s=DAY / 4)
    build_report_study(root / "studies" / ".study-y.creating-1", 5, seed=3)  # being created: not a study yet
    broken = root / "studies" / "broken"
    build_report_study(broken, 5, seed=4)
    (broken / "config.json").write_text("{not json")
    return root


def _snapshot(root: Path) -> dict[str, str]:
    # SQLite's shared-memory and write-ahead files appear beside a WAL journal whoever opens it, readers too.
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.endswith(("-shm", "-wal"))}


def _usage(folders: list, optional: list = ()) -> dict:
    # As `rescue usage --json` prints it.
    return json.loads(lab_usage(folders, optional).model_dump_json())


def test_usage_equals_the_sum_of_the_exports_and_writes_nothing(lab, monkeypatch):
    before = _snapshot(lab)
    monkeypatch.chdir(lab)  # the command's defaults: studies/ and the service's queue/, searched when they exist
    out = _usage([], ["studies", "queue"])
    assert _snapshot(lab) == before
    assert out["schema_version"] == "rescue-usage/1" and out["folders"] == ["studies", "queue"]
    paths = [s["path"] for s in out["studies"]]
    assert paths == ["studies/priced", "queue/jobs/job-1/study-x"]
    assert len(out["skipped"]) == 1 and out["skipped"][0].startswith("studies/broken: ")

    exports = {p: export_study(lab / p).usage for p in paths}
    total = out["total"]
    assert total["calls"] == sum(u.calls for u in exports.values()) > 40
    for kind in ("input", "cached_input", "output", "reasoning"):
        assert total["tokens"][kind]["known_sum"] == sum(u.tokens[kind].known_sum for u in exports.values())
        assert total["tokens"][kind]["calls_without"] == sum(u.tokens[kind].calls_without for u in exports.values())
    assert total["latency"]["sum_s"] == pytest.approx(sum(u.latency.sum_s for u in exports.values()))
    # The priced study's cost is its export's; the other declared none, so the total's is unknown.
    by_study = {g["key"]: g for g in out["by_study"]}
    priced, unpriced = exports["studies/priced"], exports["queue/jobs/job-1/study-x"]
    assert priced.cost is not None and by_study["studies/priced"]["cost"] == pytest.approx(priced.cost)
    assert unpriced.cost is None and by_study["queue/jobs/job-1/study-x"]["cost"] is None
    assert total["cost"] is None and total["cost_known"] == pytest.approx(priced.cost)
    assert total["calls_without_cost"] == unpriced.calls
    for path, u in exports.items():
        g = by_study[path]
        assert (g["calls"], g["by_status"], g["latency"]["max_s"]) == (u.calls, u.by_status, u.latency.max_s)
        assert {k: t["total"] for k, t in g["tokens"].items()} == {k: t.total for k, t in u.tokens.items()}

    # Every grouping partitions the same calls.
    for key in ("by_model", "by_endpoint", "by_study", "by_day"):
        assert sum(g["calls"] for g in out[key]) == total["calls"], key
        assert sum(g["tokens"]["input"]["known_sum"] for g in out[key]) == total["tokens"]["input"]["known_sum"], key
        assert sum(g["cost_known"] for g in out[key]) == pytest.approx(total["cost_known"]), key
    assert [g["key"] for g in out["by_model"]] == ["gpt-4.1-mini", "qwen2.5-vl-7b"]
    assert [g["key"] for g in out["by_endpoint"]] == ["api.example.com", "vlm.example.org:8443"]
    days = [g["key"] for g in out["by_day"]]
    assert days == sorted(days) and days[0] == "1970-01-01" and len(days) >= 5


def test_latency_quantiles_and_named_folders(lab):
    out = _usage([str(lab / "queue")])
    assert [s["path"] for s in out["studies"]] == [str(lab / "queue/jobs/job-1/study-x")]
    lat = out["total"]["latency"]
    # The builder's latencies: 1.2 + (g % 7) * 0.3 s for call g.
    values = [1.2 + (g % 7) * 0.3 for g in range(out["total"]["calls"])]
    assert lat["p50_s"] == pytest.approx(quantile(values, 50)) and lat["max_s"] == pytest.approx(max(values))
    assert quantile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and quantile([5.0], 99) == 5.0
    assert quantile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_a_named_folder_must_exist(tmp_path):
    with pytest.raises(StudyError, match=f"^{tmp_path / 'nowhere'}: no such folder$"):
        lab_usage([tmp_path / "nowhere"])
    assert lab_usage([], [tmp_path / "nowhere"]).studies == []  # a default that is not there: nothing to read


def test_the_table_names_each_grouping(lab, monkeypatch):
    monkeypatch.chdir(lab)
    console = Console(width=200, record=True)
    console.print(render_lab_usage(lab_usage(["studies", "queue"])))
    text = console.export_text()
    for title in ("per model", "per endpoint", "per study", "per day (UTC)", "all calls", "gpt-4.1-mini",
                  "not read: studies/broken"):
        assert title in text


def test_usage_counts_a_copied_study_once_and_skips_naming_what_it_cannot_read(tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    from conftest import ROOT

    lab = tmp_path / "lab"
    garbage = lab / "bad-ledger"
    garbage.mkdir(parents=True)
    (garbage / "ledger.sqlite").write_bytes(b"not a database" * 100)
    build_report_study(lab / "studies" / "a", 6, sham="off", seed=5, vlm={"price": {"input": 2.0, "output": 8.0}})
    shutil.copytree(lab / "studies" / "a", lab / "studies" / "a-backup")  # the same calls, the same ids
    build_report_study(lab / "studies" / "budgeted", 4, sham="off", seed=6,
                       vlm={"price": {"input": 2.0, "output": 8.0}, "lab_budget": 5.0, "lab_ledger": str(garbage)})
    # A ledger that is a FIFO is named as a corrupt one is, never left out silently.
    piped = lab / "piped-ledger"
    piped.mkdir()
    os.mkfifo(piped / "ledger.sqlite")
    build_report_study(lab / "studies" / "piped", 2, sham="off", seed=8,
                       vlm={"price": {"input": 2.0, "output": 8.0}, "lab_budget": 5.0, "lab_ledger": str(piped)})
    fifo = lab / "studies" / "fifo"
    build_report_study(fifo, 4, sham="off", seed=7)
    (fifo / "receipts" / "receipts.jsonl").unlink()
    os.mkfifo(fifo / "receipts" / "receipts.jsonl")
    out = subprocess.run([sys.executable, "-m", "rescue.cli", "usage", "--json"], cwd=lab, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    usage = json.loads(out.stdout)
    own = export_study(lab / "studies" / "a").usage.calls
    seen = {s["path"]: s for s in usage["studies"]}
    assert seen["studies/a"]["counted_elsewhere"] == 0 and seen["studies/a-backup"]["counted_elsewhere"] == own
    budgeted = export_study(lab / "studies" / "budgeted").usage.calls
    piped_calls = export_study(lab / "studies" / "piped").usage.calls
    assert usage["total"]["calls"] == own + budgeted + piped_calls  # the copy's calls once
    skipped = usage["skipped"]
    assert any(s.startswith(f"studies/fifo: {fifo / 'receipts' / 'receipts.jsonl'}: not a regular file") or
               s.startswith("studies/fifo: studies/fifo/receipts/receipts.jsonl: not a regular file") for s in skipped), skipped
    assert any(s.startswith(f"{garbage / 'ledger.sqlite'}: the lab's ledger cannot be used") for s in skipped), skipped
    assert any(s == f"{piped / 'ledger.sqlite'}: the lab budget's ledger is not a regular file" for s in skipped), skipped
