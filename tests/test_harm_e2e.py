"""A small study of a failure and a historical success on real LIBERO through the CLI (DESIGN §17), with every
part the config accepts together: two advisors, a query point, a sham and K = 2 continuations (a study of advisors
and query points was refused after its folder was created). Verified, exported and reported: the success has its
own label, the export its harm section, the report opens with the net change."""

from __future__ import annotations

import json

import pytest
from conftest import export_of, rescue_cli, write_cases

from rescue.core.success_labels import SUCCESS_LABELS

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

CONFIG = """
continuations = 2

[[advisor]]
name = "a"

[[advisor]]
name = "b"

[[query_point]]
name = "early"
fraction = 0.25

[sham]
source = "fixed"
"""


def test_a_failure_and_a_success_with_advisors_a_query_point_a_sham_and_k(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=64)
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    lines[1]["outcome"] = "success"  # declared by hand: no evaluation to contradict
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = tmp_path / "study.toml"
    config.write_text(CONFIG)
    study = tmp_path / "study"
    rescue_cli("run", str(manifest), "--study", str(study), "--config", str(config))
    assert rescue_cli("verify", str(study)).returncode == 0
    stored = json.loads((study / "config.json").read_text())
    assert stored["arms"] == ["control", "assisted:a", "assisted:b", "assisted:a@early", "sham"]
    export = export_of(study)
    cases = {c["case_id"]: c for c in export["cases"]}
    assert cases["object-3-ep1"]["outcome"] == "success" and cases["object-3-ep1"]["label"] in SUCCESS_LABELS
    assert cases["object-3-ep0"]["label"] in ("rescued", "not_rescued", "unknown", "initial_state_deviation")
    # Every arm ran twice, and counts the continuations that ran.
    assert {v["continuations"] for v in cases["object-3-ep0"]["continuations"].values()} == {2}
    harm = export["summary"]["harm"]
    assert [f["arm"] for f in harm["arms"]] == ["assisted:a", "assisted:b", "assisted:a@early", "sham"]
    assert export["summary"]["n"] == 1 and harm["successes"] == 1
    assert all(f["net"]["episodes"] == 2 for f in harm["arms"])
    rescue_cli("report", str(study))
    page = (study / "report.html").read_text()
    assert page.index('data-answer="net"') < page.index('data-answer="main"')
