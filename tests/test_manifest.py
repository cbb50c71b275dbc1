"""Manifest loading against real files: every problem reported at once, by line and field."""

from __future__ import annotations

import hashlib
import json

import pytest

from rescue.manifest import (
    Case,
    Manifest,
    ManifestError,
    check_instructions,
    derive_policy_seed,
    load_manifest,
    write_manifest,
)

EXAMPLE = {
    "case_id": "spatial-0-ep3",
    "suite": "libero_spatial",
    "task_id": 0,
    "init_state_index": 3,
    "env_seed": 7,
    "horizon": 220,
    "group": "spatial",
}


def case_dict(i: int, **changes) -> dict:
    d = {
        "case_id": f"spatial-{i}-ep0",
        "suite": "libero_spatial",
        "task_id": i,
        "init_state_index": 0,
        "env_seed": i,
        "horizon": 220,
    }
    d.update(changes)
    return d


def write_lines(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def problems_of(path) -> list[str]:
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    return info.value.problems


# --- valid manifests ---------------------------------------------------------


def test_example_line_loads_with_defaults(tmp_path):
    path = write_lines(tmp_path / "manifest.jsonl", [json.dumps(EXAMPLE)])
    manifest = load_manifest(path)
    (case,) = manifest.cases
    assert case.case_id == "spatial-0-ep3"
    assert case.task == "libero_spatial/0"
    assert case.group == "spatial"
    assert case.pilot is False and case.tags == {} and case.instruction is None
    assert case.policy_seed == derive_policy_seed(7)
    assert manifest.source == str(path)


def test_group_defaults_to_suite_and_policy_seed_is_deterministic():
    a = Case.model_validate(case_dict(1))
    b = Case.model_validate(case_dict(1))
    assert a.group == "libero_spatial"
    assert a.policy_seed == b.policy_seed
    assert Case.model_validate(case_dict(1, env_seed=2)).policy_seed != a.policy_seed
    assert Case.model_validate(case_dict(1, policy_seed=5)).policy_seed == 5


def test_jsonl_with_blank_lines_and_json_list_load_the_same_cases(tmp_path):
    rows = [case_dict(i, pilot=(i == 0), tags={"seen": True, "n": i}) for i in range(3)]
    jsonl = tmp_path / "m.jsonl"
    a_line, b_line, c_line = (json.dumps(r) for r in rows)
    jsonl.write_text(f"\n{a_line}\n\n   \n{b_line}\n{c_line}\n")
    as_list = tmp_path / "m.json"
    as_list.write_text(json.dumps(rows, indent=2))

    a, b = load_manifest(jsonl), load_manifest(as_list)
    assert a.cases == b.cases
    assert a.case_ids == ["spatial-0-ep0", "spatial-1-ep0", "spatial-2-ep0"]
    assert [c.case_id for c in a.pilot_cases] == ["spatial-0-ep0"]
    assert [c.case_id for c in a.main_cases] == ["spatial-1-ep0", "spatial-2-ep0"]


def test_json_list_is_recognised_by_content_whatever_the_extension(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("  [" + json.dumps(case_dict(0)) + "]")
    assert load_manifest(path).case_ids == ["spatial-0-ep0"]


def test_sha256_is_of_the_file_bytes_and_stable(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(case_dict(i)) for i in range(4)])
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    assert load_manifest(path).sha256 == expected
    assert load_manifest(path).sha256 == expected
    path.write_text(path.read_text() + "\n")  # same cases, different bytes
    assert load_manifest(path).sha256 != expected


def test_fingerprint_is_hex_and_lowercased(tmp_path):
    assert Case.model_validate(case_dict(0, fingerprint="ABcd01")).fingerprint == "abcd01"
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(case_dict(0, fingerprint="xyz"))])
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:1: fingerprint: ")


def test_adapter_subclass_accepts_its_own_fields(tmp_path):
    class KitchenCase(Case):
        layout_id: int

    path = write_lines(tmp_path / "m.jsonl", [json.dumps(case_dict(0, layout_id=4))])
    assert load_manifest(path, case_type=KitchenCase).cases[0].layout_id == 4
    (problem,) = problems_of(path)  # the base case does not know the field
    assert problem == f"{path}:1: layout_id: Extra inputs are not permitted"


# --- malformed manifests -----------------------------------------------------


def test_bad_json_on_line_3_names_line_and_column(tmp_path):
    path = write_lines(
        tmp_path / "m.jsonl",
        [json.dumps(case_dict(0)), json.dumps(case_dict(1)), '{"case_id": "x", "suite": }'],
    )
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:3:27: invalid JSON: ")


def test_missing_field(tmp_path):
    row = case_dict(0)
    del row["horizon"]
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(row)])
    assert problems_of(path) == [f"{path}:1: horizon: Field required"]


def test_horizon_zero(tmp_path):
    rows = [case_dict(0), case_dict(1), case_dict(2, horizon=0)]
    path = write_lines(tmp_path / "manifest.jsonl", [json.dumps(r) for r in rows])
    assert problems_of(path) == [f"{path}:3: horizon: Input should be greater than 0"]


def test_duplicate_ids_name_both_lines(tmp_path):
    path = write_lines(
        tmp_path / "m.jsonl",
        [json.dumps(case_dict(0)), json.dumps(case_dict(1)), json.dumps(case_dict(0, env_seed=9))],
    )
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:3: case_id: duplicate case id 'spatial-0-ep0'")
    assert "line 1" in problem


def test_unknown_field(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(case_dict(0, colour="red"))])
    assert problems_of(path) == [f"{path}:1: colour: Extra inputs are not permitted"]


def test_types_are_not_coerced(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(case_dict(0, task_id="0", pilot="yes"))])
    problems = problems_of(path)
    assert any(p.startswith(f"{path}:1: task_id: ") for p in problems)
    assert any(p.startswith(f"{path}:1: pilot: ") for p in problems)


def test_json_list_errors_name_the_index(tmp_path):
    rows = [case_dict(0), case_dict(1, horizon=0), case_dict(0), {"suite": "s"}]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(rows))
    problems = problems_of(path)
    assert f"{path}[1]: horizon: Input should be greater than 0" in problems
    assert any(p.startswith(f"{path}[2]: case_id: duplicate") and "index 0" in p for p in problems)
    assert f"{path}[3]: case_id: Field required" in problems


def test_json_list_with_bad_json_names_line_and_column(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('[\n  {"case_id": "a"},\n  {"case_id": }\n]')
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:3:15: invalid JSON: ")


def test_all_problems_are_reported_at_once_in_file_order(tmp_path):
    bad_tag = case_dict(5, tags={"ok": 1, "bad": [1, 2]})
    path = write_lines(
        tmp_path / "m.jsonl",
        [
            json.dumps(case_dict(0)),                      # 1 fine
            json.dumps(case_dict(1, horizon=0)),           # 2 horizon
            "{not json",                                   # 3 invalid JSON
            json.dumps(case_dict(0, colour=1)),            # 4 duplicate + unknown field
            "",
            json.dumps({"case_id": "lonely"}),             # 6 several missing fields
            "[1, 2]",                                      # 7 not an object
            '{"case_id": "a", "case_id": "b"}',            # 8 repeated key
            json.dumps(bad_tag),                           # 9 tag value
        ],
    )
    problems = problems_of(path)
    lines = [int(p[len(str(path)) + 1 :].split(":")[0]) for p in problems]
    assert lines == sorted(lines)
    assert set(lines) == {2, 3, 4, 6, 7, 8, 9}
    assert f"{path}:2: horizon: Input should be greater than 0" in problems
    assert f"{path}:4: colour: Extra inputs are not permitted" in problems
    assert any(p.startswith(f"{path}:4: case_id: duplicate") for p in problems)
    for field in ("suite", "task_id", "init_state_index", "env_seed", "horizon"):
        assert f"{path}:6: {field}: Field required" in problems
    assert any(p.startswith(f"{path}:9: tags.bad: ") for p in problems)
    assert "problems in manifest" in str(ManifestError(problems))


def test_failure_writes_nothing(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(case_dict(0, horizon=0))])
    before = sorted(p.name for p in tmp_path.iterdir())
    problems_of(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_empty_and_unreadable_manifests(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    assert problems_of(empty) == [f"{empty}: no cases"]
    assert problems_of(tmp_path / "missing.jsonl")[0].startswith(f"{tmp_path / 'missing.jsonl'}: cannot read")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    assert "not UTF-8" in problems_of(binary)[0]


def test_pretty_printed_single_object_in_json_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(case_dict(0), indent=2))
    assert problems_of(path) == [f"{path}: expected a JSON list of cases or one case per line"]


def test_manifest_model_refuses_duplicate_ids():
    case = Case.model_validate(case_dict(0))
    with pytest.raises(ValueError):
        Manifest(cases=[case, case], source="x", sha256="0")


# --- instruction check -------------------------------------------------------


def test_check_instructions_uses_the_adapter_lookup(tmp_path):
    own = {0: "pick up the bowl", 1: "open the drawer"}
    path = write_lines(
        tmp_path / "m.jsonl",
        [
            json.dumps(case_dict(0, instruction="pick up the bowl")),
            json.dumps(case_dict(1, instruction="open the drawer ")),
            json.dumps(case_dict(2)),                          # no instruction: nothing to check
            json.dumps(case_dict(3, instruction="anything")),  # unknown task
        ],
    )
    problems = check_instructions(load_manifest(path, catalog=None), lambda case: own[case.task_id])
    assert len(problems) == 2
    assert problems[0].startswith("spatial-1-ep0: instruction 'open the drawer ' differs")
    assert problems[1].startswith("spatial-3-ep0: task libero_spatial/3 not found")


# --- writing -----------------------------------------------------------------


def test_write_manifest_round_trips_and_replaces_atomically(tmp_path):
    cases = [Case.model_validate(case_dict(i, pilot=i == 1, tags={"k": "v"})) for i in range(3)]
    path = tmp_path / "out.jsonl"
    path.write_text("old contents\n")
    write_manifest(cases, path)
    assert load_manifest(path).cases == cases
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary left behind
    assert "null" not in path.read_text()


def test_write_manifest_refuses_duplicates_and_keeps_the_old_file(tmp_path):
    case = Case.model_validate(case_dict(0))
    path = tmp_path / "out.jsonl"
    path.write_text("old contents\n")
    with pytest.raises(ManifestError):
        write_manifest([case, case], path)
    assert path.read_text() == "old contents\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
