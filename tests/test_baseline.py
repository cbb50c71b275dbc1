"""Where a study's failures came from: the provenance `rescue manifest from-eval` writes, read back from the cases.

The evaluation study is real records written by the library's own writers (create_study, the journal's claim
and finish, the one classification dispatch); no simulator runs.
"""

from __future__ import annotations

import json

import pytest
from conftest import resolved_config
from helpers.evaluation_study import evaluation_study

from rescue.core.figures.baseline import Baseline, BaselineSource, baseline_of
from rescue.core.catalog import format_ids, parse_ids
from rescue.core.manifest import Case, load_manifest
from rescue.study.folder import create_study
from rescue.study.journal import Journal

pytestmark = pytest.mark.fast


def test_from_eval_names_its_evaluation_policy_success_protocol_and_split(tmp_path):
    from rescue.run.commands import manifest_from_eval

    study = evaluation_study(tmp_path / "eval", {"object-3-ep0", "object-4-ep2", "object-4-ep3"})
    out = tmp_path / "failures.jsonl"
    manifest_from_eval(study, out, inits=parse_ids("1-4"), limit=5)
    cases = load_manifest(out).cases
    assert [c.case_id for c in cases] == ["object-3-ep1", "object-3-ep2", "object-3-ep3", "object-3-ep4", "object-4-ep1"]
    with Journal.open(study, readonly=True) as journal:
        meta = journal.meta()
    baseline = baseline_of(cases)
    assert baseline == Baseline(by_hand=0, sources=[BaselineSource(
        kind="evaluation", cases=5, eval_study="eval", eval_config_sha256=meta["config_sha256"],
        eval_manifest_sha256=meta["manifest_sha256"], policy="my_lab.policies:pi05_libero", episodes=10, successes=3,
        failures=7, episode_protocol="rescue", suites="libero_object", tasks="3-4", inits="0-4", taken_inits="1-4",
        taken_limit=5, created=meta["created_at"],
    )])
    assert baseline.sources[0].success_rate == 0.3 and not baseline.written_by_hand
    # Every field the record documents comes from a tag the manifest carries on each line.
    assert all(json.loads(line)["tags"]["eval_policy"] == "my_lab.policies:pi05_libero" for line in out.read_text().splitlines())


def _case(i: int, **tags) -> Case:
    return Case(case_id=f"c{i}", suite="libero_object", task_id=3, init_state_index=i, env_seed=i, horizon=280,
                tags=tags)


def test_a_manifest_written_by_hand_says_so_and_a_mixed_one_names_each_source():
    assert baseline_of([_case(0), _case(1, note="by me")]) == Baseline(sources=[], by_hand=2)
    assert baseline_of([_case(0)]).written_by_hand
    lerobot = {"results_file": "eval_info.json", "results_sha256": "ab" * 32, "episode_protocol": "lerobot",
               "eval_episodes": 50, "eval_successes": 41, "eval_failures": 9}
    mixed = baseline_of([_case(0, **lerobot), _case(1, **lerobot), _case(2), _case(3, eval_study="e1")])
    assert [(s.kind, s.cases) for s in mixed.sources] == [("lerobot", 2), ("evaluation", 1)] and mixed.by_hand == 1
    assert mixed.sources[0].success_rate == 41 / 50 and mixed.sources[0].results_file == "eval_info.json"
    # A tag edited by hand into another type is not recorded rather than refused.
    odd = baseline_of([_case(0, eval_study="e1", eval_episodes="many", eval_policy=True)]).sources[0]
    assert (odd.episodes, odd.policy, odd.success_rate) == (None, None, None)


def test_ids_print_as_ranges_the_parser_reads():
    for ids in ([0, 1, 2, 5], [7], [3, 4, 9, 10, 11, 20], []):
        text = format_ids(ids)
        assert (parse_ids(text) if text else []) == ids
    assert format_ids([5, 1, 0, 2, 2]) == "0-2,5"


def test_the_report_names_the_baseline_and_says_when_there_is_none(tmp_path):
    from rescue.read.html.provenance import baseline_sentences
    from rescue.read.html.report import write_report
    from rescue.run.commands import manifest_from_eval

    study = evaluation_study(tmp_path / "eval", {"object-3-ep0", "object-4-ep2", "object-4-ep3"})
    manifest_from_eval(study, tmp_path / "failures.jsonl", inits=[1, 2, 3, 4])
    rescue = tmp_path / "rescue"
    create_study(rescue, load_manifest(tmp_path / "failures.jsonl"), resolved_config(8))
    page = write_report(rescue).read_text()
    said = ("The failures come from evaluation study eval (config sha256 {sha}…): policy my_lab.policies:pi05_libero; "
            "3 of 10 episodes succeeded (30.0%), 7 failed; episode protocol rescue; libero_object, tasks 3-4, initial "
            "states 0-4; failures of initial states 1-4 only.")
    with Journal.open(study, readonly=True) as journal:
        sha = journal.meta()["config_sha256"][:12]
    assert said.format(sha=sha) in page and 'data-baseline="evaluation"' in page
    # The export carries it (rescue-export/5, `study.baseline`), read back whole; an evaluation has none.
    from rescue.read.export import export_study, read_export, write_export

    export = export_study(rescue)
    assert export.study.baseline == baseline_of(load_manifest(tmp_path / "failures.jsonl").cases)
    write_export(export, tmp_path / "export.json", tmp_path / "export.csv")
    assert read_export(tmp_path / "export.json").study.baseline.sources[0].policy == "my_lab.policies:pi05_libero"
    assert json.loads((tmp_path / "export.json").read_text())["study"]["baseline"]["sources"][0]["successes"] == 3
    assert export_study(study).study.baseline is None
    by_hand = baseline_sentences(baseline_of([_case(0), _case(1)]), 2)
    assert by_hand == ["The manifest names no baseline evaluation: written by hand (no case carries an eval_study or "
                       "results_sha256 tag, as `rescue manifest from-eval`, `from-lerobot` and `from-openpi` write them)."]
