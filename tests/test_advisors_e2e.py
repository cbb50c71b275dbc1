"""Three advisors and a sham arm in one study, through the CLI on real LIBERO (DESIGN §11): killed with SIGKILL
mid-run, resumed, verified, exported and reported with the pairwise table; a forged advisor arm fails verify.

The advisors: the bundled endpoint in process (`local`), and two loopback `rescue serve-vlm` processes, one
answering a subgoal about another object of the scene (`--answer wrong-object`), one a content-free text
(`--answer fixed:...`).
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT, arm_rows, case_states, cli_env, ensure_stopped, export_of, kill_mid_study, rescue_cli, write_cases

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

CONTINUE = "Continue with the task."
ADVISORS = ("local", "wrong", "continue")


def serve_vlm(answer: str, model: str) -> tuple[subprocess.Popen, str]:
    """A loopback `rescue serve-vlm` on a free port, answering as `answer` says and as `model`; its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "serve-vlm", "--port", "0", "--answer", answer, "--model", model],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    line = proc.stdout.readline()
    found = re.search(r"(http://\S+/v1)", line)
    if found is None:
        ensure_stopped(proc)
        raise AssertionError(f"serve-vlm did not start: {line!r}")
    return proc, found.group(1)


def test_the_wrong_object_answer_names_the_scenes_first_other_object_as_the_positive_control_declared():
    from rescue.core.catalog import libero_catalog
    from rescue.embedded.scene import wrong_object_subgoal

    declared = tomllib.loads((ROOT / "models" / "positive_control" / "mismatched.toml").read_text())["sham"]["by_task"]
    for task_id, task in enumerate(libero_catalog().suite("libero_object").tasks):
        assert wrong_object_subgoal(task.instruction) == declared[f"libero_object/{task_id}"], task.instruction


def test_three_advisors_and_a_sham_killed_resumed_verified_exported_and_reported(tmp_path):
    wrong, wrong_url = serve_vlm("wrong-object", "wrong-object")
    cont, cont_url = serve_vlm(f"fixed:{CONTINUE}", "content-free")
    try:
        _study(tmp_path, wrong_url, cont_url)
    finally:
        ensure_stopped(wrong)
        ensure_stopped(cont)


def _study(tmp_path: Path, wrong_url: str, cont_url: str) -> None:
    manifest = write_cases(tmp_path / "m.jsonl", 3, horizon=64)
    config = tmp_path / "advisors.toml"
    config.write_text(
        "fork_at_q = true\n\n"
        '[[advisor]]\nname = "local"\n\n'
        f'[[advisor]]\nname = "wrong"\nbase_url = "{wrong_url}"\nmodel = "wrong-object"\n\n'
        f'[[advisor]]\nname = "continue"\nbase_url = "{cont_url}"\nmodel = "content-free"\n'
        "price = { input = 1.0, output = 4.0 }\n\n"
        '[sham]\nsource = "permuted"\nseed = 3\n'
    )
    study = tmp_path / "study"
    kill_mid_study(["run", str(manifest), "--study", str(study), "--config", str(config), "--cases-in-flight", "1"], study)
    before, states = arm_rows(study), case_states(study)
    assert "finished" in states.values() and "claimed" in states.values()
    rescue_cli("resume", str(study))
    after = arm_rows(study)
    assert all(after[k] == v for k, v in before.items())  # nothing that ran before the kill ran again
    verify = rescue_cli("verify", str(study))
    assert "OK" in verify.stdout.splitlines()[0]

    export = export_of(study)
    assert export["schema_version"] == "rescue-export/8"
    assert [a["name"] for a in export["study"]["advisors"]] == list(ADVISORS)
    cases = {c["case_id"]: c for c in export["cases"]}
    finished = [c for cid, c in cases.items() if states.get(cid) != "claimed"]
    interrupted = [c for cid, c in cases.items() if states.get(cid) == "claimed"]
    assert interrupted and all(c["state"] == "interrupted" for c in interrupted)
    def verdict(c: dict, arm: str) -> dict:  # the primary's verdict is the case's own
        return {k: c[k] for k in ("label", "rule", "in_e")} if arm == c["primary"] else c["verdicts"][arm]

    for c in interrupted:
        assert all(verdict(c, f"assisted:{n}")["label"] == "unknown" for n in ADVISORS)
        assert c["verdicts"]["sham"]["label"] == "unknown"
    rows = {(cid, arm): json.loads(data) for (cid, arm), data in after.items()}
    for c in finished:
        # The primary advisor's verdict is the case's label; each advisor applied its own answer.
        assert c["primary"] == "assisted:local" and "assisted:local" not in c["verdicts"]
        assert c["arms"]["assisted:wrong"]["subgoal"] == "grasp the alphabet soup"  # task 3 (bbq sauce)'s scene
        assert c["arms"]["assisted:continue"]["subgoal"] == CONTINUE
        assert all(verdict(c, f"assisted:{n}")["in_e"] for n in ADVISORS), c["case_id"]
        # Forked: every arm continued from the one snapshot at q.
        q_states = {rows[(c["case_id"], arm)]["q_state"] for arm in ("control", "sham", *(f"assisted:{n}" for n in ADVISORS))}
        assert len(q_states) == 1 and None not in q_states
        assert {rows[(c["case_id"], arm)]["mode"] for arm in (f"assisted:{n}" for n in ADVISORS)} == {"fork"}
    # Every receipt names its advisor; each advisor's arm points at a call of its own.
    receipts = [json.loads(line) for line in (study / "receipts" / "receipts.jsonl").read_text().splitlines()]
    outcome = {r["call_id"]: r for r in receipts if r["kind"] == "outcome"}
    assert {r["advisor"] for r in receipts} == set(ADVISORS)
    for c in finished:
        for n in ADVISORS:
            assert outcome[c["arms"][f"assisted:{n}"]["call_id"]]["advisor"] == n

    summary = export["summary"]
    by = {a["arm"].removeprefix("assisted:"): a for a in [summary, *summary["arms"]] if a["arm"] != "sham"}
    assert summary["arm"] == "assisted:local" and list(by) == list(ADVISORS)
    against_sham = {c["first"].removeprefix("assisted:") for c in summary["comparisons"] if c["second"] == "sham"}
    assert against_sham == set(ADVISORS)
    pairs = {(p["first"].removeprefix("assisted:"), p["second"].removeprefix("assisted:")): p
             for p in summary["comparisons"] if p.get("holm_p") is not None}
    assert list(pairs) == [("local", "wrong"), ("local", "continue"), ("wrong", "continue")]
    for p in pairs.values():
        assert p["k"] == len(finished) == sum(p["pairs"].values())
        assert p["holm_p"] >= p["mcnemar_p"]
    use = export["usage_by_advisor"]
    assert all(use[n]["calls"] >= len(finished) for n in ADVISORS)
    assert use["local"]["cost"] is None and use["continue"]["cost"] is not None  # declared price only

    rescue_cli("report", str(study))
    page = (study / "report.html").read_text()
    assert 'id="sec-advisors"' in page and "pairwise matrix" in page
    for (first, second), p in pairs.items():
        assert f'data-figure="main.pair.{first}.{second}.k" data-value="{p["k"]}"' in page
        assert f'data-figure="main.matrix.{first}.{second}" data-value="{json.dumps(p["holm_p"])}"' in page
    for n in ADVISORS:
        assert f'data-figure="main.advisor.{n}.r" data-value="{by[n]["r"]}"' in page
    from rescue.read.html.app import read_index_script, read_panel_script

    panel = read_panel_script((study / "report_files" / "case" / f"{finished[0]['case_id']}.js").read_text())[1]
    for n in ADVISORS:
        assert f'data-advisor="{n}"' in panel
    assert "grasp the alphabet soup" in panel and CONTINUE in panel
    index = read_index_script((study / "report_files" / "cases.js").read_text())
    assert "subgoal@wrong" in index["fields"]
    terminal = rescue_cli("status", str(study)).stdout
    assert "assisted:wrong vs control" in terminal and "advisor continue:" in terminal

    # A consistent forgery of one advisor's arm (its digest recomputed) is caught by re-deriving it.
    from rescue.core.records import ArmResult
    from rescue.study.journal import arm_digest

    copy = shutil.copytree(study, tmp_path / "forged")
    case_id = finished[0]["case_id"]
    con = sqlite3.connect(copy / "journal.sqlite")
    data = json.loads(con.execute("SELECT data FROM arms WHERE case_id = ? AND arm = 'assisted:wrong'", (case_id,)).fetchone()[0])
    data["success"] = not data["success"]
    forged = ArmResult.model_validate(data)
    con.execute("UPDATE arms SET data = ?, digest = ? WHERE case_id = ? AND arm = 'assisted:wrong'",
                (forged.model_dump_json(), arm_digest(forged), case_id))
    con.commit()
    con.close()
    out = rescue_cli("verify", str(copy), check=False)
    assert out.returncode == 1 and "stored verdict of the assisted:wrong arm" in out.stdout, out.stdout
