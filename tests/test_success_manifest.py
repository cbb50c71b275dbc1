"""Historical successes in the manifest (DESIGN §17): `rescue manifest from-eval --successes`, the frame and seed
each case carries, and rows whose outcome contradicts the evaluation they name.

The evaluation is real records written by the library's own writers (test_baseline's); no simulator runs.
"""

from __future__ import annotations

import json
import pytest
from conftest import rescue_cli
from helpers.evaluation_study import evaluation_study

from rescue.core.manifest import ManifestError, load_manifest, read_manifest_bytes
from rescue.core.figures.success_sample import SamplingFrame, frame_of

pytestmark = pytest.mark.fast

WON = {"object-3-ep0", "object-3-ep1", "object-3-ep4", "object-4-ep0", "object-4-ep2", "object-4-ep3"}


def test_all_successes_or_a_seeded_stratified_sample_with_its_frame(tmp_path):
    from rescue.run.commands import manifest_from_eval

    study = evaluation_study(tmp_path / "eval", WON)
    everything = manifest_from_eval(study, tmp_path / "all.jsonl", successes="all")
    assert [c.historical_outcome for c in everything].count("success") == 6
    assert frame_of(load_manifest(tmp_path / "all.jsonl").cases) == SamplingFrame(failures=4, successes=6)
    first = manifest_from_eval(study, tmp_path / "a.jsonl", successes=4, seed=11)
    again = manifest_from_eval(study, tmp_path / "b.jsonl", successes=4, seed=11)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    won = [c for c in first if c.outcome == "success"]
    assert len(won) == 4 and {c.task for c in won} == {"libero_object/3", "libero_object/4"}
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert all(r["outcome"] in ("failure", "success") for r in rows)  # every case says how it ended
    assert frame_of(load_manifest(tmp_path / "a.jsonl").cases) == SamplingFrame(failures=4, successes=6, sampled=4, seed=11)
    assert {r["tags"]["frame_task_successes"] for r in rows if r["task_id"] == 3} == {3}
    assert again == first
    # A held-out split: the frame is the split's episodes.
    held = manifest_from_eval(study, tmp_path / "held.jsonl", inits=[2, 3, 4], successes="all")
    assert frame_of(held) == SamplingFrame(failures=3, successes=3)


def test_failures_only_manifests_are_written_as_before(tmp_path):
    from rescue.run.commands import manifest_from_eval

    study = evaluation_study(tmp_path / "eval", WON)
    manifest_from_eval(study, tmp_path / "f.jsonl")
    assert all("outcome" not in json.loads(line) and "frame_failures" not in json.loads(line)["tags"]
               for line in (tmp_path / "f.jsonl").read_text().splitlines())


def test_a_row_that_contradicts_its_evaluation_is_refused_with_line_and_field(tmp_path):
    from rescue.run.commands import check_outcomes

    study = evaluation_study(tmp_path / "eval", WON)
    from rescue.run.commands import manifest_from_eval

    manifest_from_eval(study, tmp_path / "m.jsonl", successes="all")
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    row = json.loads(lines[1])
    row["outcome"] = "success"  # a failure of the evaluation, called a success
    lines[1] = json.dumps(row)
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    manifest = load_manifest(tmp_path / "bad.jsonl")
    with pytest.raises(ManifestError) as err:
        check_outcomes(manifest, read_manifest_bytes(tmp_path / "bad.jsonl"), study)
    assert err.value.problems == [f"{tmp_path / 'bad.jsonl'}:2: outcome: 'success', but evaluation eval recorded "
                                  f"'failure' for {row['case_id']}"]
    check_outcomes(load_manifest(tmp_path / "m.jsonl"), read_manifest_bytes(tmp_path / "m.jsonl"), study)
    # The command line says it in one line, exit 2, no traceback.
    run = rescue_cli("manifest", "check", str(tmp_path / "bad.jsonl"), "--eval", str(study), check=False)
    assert run.returncode == 2 and ":2: outcome:" in run.stdout + run.stderr and "Traceback" not in run.stderr


def test_a_bad_sample_size_is_bad_input_with_nothing_written(tmp_path):
    study = evaluation_study(tmp_path / "eval", WON)
    run = rescue_cli("manifest", "from-eval", str(study), "--out", str(tmp_path / "m.jsonl"), "--successes", "some",
                     check=False)
    assert run.returncode == 2 and "--successes 'some'" in run.stdout + run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "m.jsonl").exists()
