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
from rescue.core.figures.success_sample import DESIGN, SamplingFrame, frame_of, frame_refusal

pytestmark = pytest.mark.fast

WON = {"object-3-ep0", "object-3-ep1", "object-3-ep4", "object-4-ep0", "object-4-ep2", "object-4-ep3"}


def test_all_successes_or_a_seeded_stratified_sample_with_its_frame(tmp_path):
    from rescue.run.commands import manifest_from_eval

    study = evaluation_study(tmp_path / "eval", WON)
    everything = manifest_from_eval(study, tmp_path / "all.jsonl", successes="all")
    assert [c.historical_outcome for c in everything].count("success") == 6
    assert frame_of(load_manifest(tmp_path / "all.jsonl").cases) == SamplingFrame(failures=4, successes=6, design=DESIGN)
    first = manifest_from_eval(study, tmp_path / "a.jsonl", successes=4, seed=11)
    again = manifest_from_eval(study, tmp_path / "b.jsonl", successes=4, seed=11)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    won = [c for c in first if c.outcome == "success"]
    assert len(won) == 4 and {c.task for c in won} == {"libero_object/3", "libero_object/4"}
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert all(r["outcome"] in ("failure", "success") for r in rows)  # every case says how it ended
    assert frame_of(load_manifest(tmp_path / "a.jsonl").cases) == SamplingFrame(failures=4, successes=6, sampled=4, seed=11,
                                                                               design=DESIGN)
    assert {r["tags"]["frame_task_successes"] for r in rows if r["task_id"] == 3} == {3}
    assert again == first
    # A held-out split: the frame is the split's episodes.
    held = manifest_from_eval(study, tmp_path / "held.jsonl", inits=[2, 3, 4], successes="all")
    assert frame_of(held) == SamplingFrame(failures=3, successes=3, design=DESIGN)


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
    for value in ("some", "²", "-3"):  # a superscript is a digit to str.isdigit, not a count
        run = rescue_cli("manifest", "from-eval", str(study), "--out", str(tmp_path / "m.jsonl"), "--successes", value,
                         check=False)
        assert run.returncode == 2 and f"--successes {value!r}" in run.stdout + run.stderr, value
        assert "Traceback" not in run.stderr and "internal error" not in run.stdout + run.stderr
        assert not (tmp_path / "m.jsonl").exists()
    both = rescue_cli("manifest", "from-eval", str(study), "--out", str(tmp_path / "m.jsonl"), "--limit", "2",
                      "--failures", "2", check=False)
    assert both.returncode == 2 and "give one" in both.stdout + both.stderr and not (tmp_path / "m.jsonl").exists()


def test_what_was_asked_and_could_not_be_is_said_in_a_line(tmp_path):
    study = evaluation_study(tmp_path / "eval", WON)
    run = rescue_cli("manifest", "from-eval", str(study), "--out", str(tmp_path / "m.jsonl"), "--successes", "50")
    assert "notice: --successes 50: the evaluation has 6 successes; all are taken" in run.stdout
    run = rescue_cli("manifest", "from-eval", str(study), "--out", str(tmp_path / "n.jsonl"), "--seed", "3")
    assert "notice: --seed 3 draws nothing" in run.stdout


def test_a_seeded_sample_of_failures_after_the_pilot_and_a_limit_that_is_not_one(tmp_path):
    from rescue.run.commands import manifest_from_eval

    study = evaluation_study(tmp_path / "eval", WON)
    everything = manifest_from_eval(study, tmp_path / "all.jsonl", successes="all")
    failures = [c for c in everything if c.outcome != "success"]
    sampled = manifest_from_eval(study, tmp_path / "f.jsonl", pilot_tasks=1, failures=2, successes="all", seed=5)
    pilot = [c for c in sampled if c.pilot]
    main = [c for c in sampled if not c.pilot and c.outcome != "success"]
    assert len(pilot) == 1 and pilot[0].case_id == failures[0].case_id  # declared over every failure, first
    assert len(main) == 2 and pilot[0] not in main
    frame = frame_of(load_manifest(tmp_path / "f.jsonl").cases)
    assert (frame.failures, frame.failures_sampled, frame.failure_seed, frame.design) == (len(failures), 2, 5, DESIGN)
    main_frame = frame.model_copy(update={"failures": frame.failures - 1})
    assert frame_refusal(main_frame, 2, 6) is None  # an equal-probability sample of the failures outside the pilot
    again = manifest_from_eval(study, tmp_path / "g.jsonl", pilot_tasks=1, failures=2, successes="all", seed=5)
    assert again == sampled
    # `--limit`: the first failures, recorded, so that nothing is extrapolated from them.
    first = manifest_from_eval(study, tmp_path / "l.jsonl", limit=2, successes="all")
    limited = frame_of(load_manifest(tmp_path / "l.jsonl").cases)
    assert limited.limit == 2 and [c.case_id for c in first if c.outcome != "success"] == [c.case_id for c in failures[:2]]
    assert "first 2 of the evaluation's" in frame_refusal(limited, 2, 6)


def test_rows_that_disagree_on_the_frame_are_refused_and_an_unchecked_outcome_is_said(tmp_path):
    from rescue.run.commands import manifest_from_eval

    study = evaluation_study(tmp_path / "eval", WON)
    manifest_from_eval(study, tmp_path / "m.jsonl", successes=4, seed=2)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    rows[3]["tags"]["frame_successes"] = 60  # one row edited: the net change would silently lose its frame
    (tmp_path / "edited.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = rescue_cli("manifest", "check", str(tmp_path / "edited.jsonl"), "--eval", str(study), check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 2 and "disagree on the sampling frame's 'frame_successes'" in out and "Traceback" not in out
    # The evaluation the rows name is not here: checked for nothing, and said so.
    run = rescue_cli("manifest", "check", str(tmp_path / "m.jsonl"), "--eval", str(tmp_path / "elsewhere"))
    assert f"notice: evaluation {rows[0]['tags']['eval_study']} is not found here" in run.stdout
