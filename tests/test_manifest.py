"""Manifest loading against real files: every problem reported at once, by line and field."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ROOT, cli_env, rescue_cli, write_cases

from rescue.core.catalog import CATALOG_FILE, OFFICIAL_HORIZON, libero_catalog, render
from rescue.env.catalog_build import build_libero_catalog
from rescue.core.manifest import (
    MAX_LINE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_PROBLEMS,
    Case,
    Manifest,
    ManifestError,
    case_id_problem,
    derive_policy_seed,
    load_manifest,
    parse_manifest,
)
from rescue.study.files import write_manifest

pytestmark = pytest.mark.fast

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
    assert Case.model_validate(case_dict(0, fingerprint="ABcd01" * 10 + "ABCD")).fingerprint == "abcd01" * 10 + "abcd"
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(case_dict(0, fingerprint="xyz"))])
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:1: fingerprint: ")


def test_a_fingerprint_of_the_wrong_length_is_refused(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(case_dict(0, fingerprint="ab" * 31)),
                                              json.dumps(case_dict(1, fingerprint="ab" * 33))])
    assert problems_of(path) == [f"{path}:1: fingerprint: a fingerprint is a sha256: 64 hex digits, not 62",
                                 f"{path}:2: fingerprint: a fingerprint is a sha256: 64 hex digits, not 66"]


def test_one_episode_under_two_ids_or_as_pilot_and_main_is_refused(tmp_path):
    twice = dict(case_dict(0), case_id="again")
    as_pilot = dict(case_dict(0), case_id="pilot-too", pilot=True)
    other_seed = dict(case_dict(0), case_id="other-seed", env_seed=8)  # another episode: accepted
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(case_dict(0)), json.dumps(twice), json.dumps(as_pilot),
                                              json.dumps(other_seed)])
    assert problems_of(path) == [
        f"{path}:2: (case): the same episode (suite, task, initial state, env seed) as line 1",
        f"{path}:3: (case): the same episode (suite, task, initial state, env seed) as line 1",
    ]


def test_a_lone_surrogate_is_refused_with_line_and_field(tmp_path):
    # \ud800 is valid JSON and decodes to a string that no UTF-8 writer accepts.
    in_tag = json.dumps(case_dict(0, tags={"note": "x"})).replace('"x"', '"\\ud800"')
    in_id = json.dumps([dict(case_dict(1), case_id="a")]).replace('"a"', '"a\\udfffb"')
    lines = write_lines(tmp_path / "m.jsonl", [in_tag])
    assert problems_of(lines) == [f"{lines}:1: tags.note: holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                                  "without its pair), which is not text"]
    listed = tmp_path / "m.json"
    listed.write_text(in_id)
    assert problems_of(listed) == [f"{listed}[0]: case_id: holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                                   "without its pair), which is not text"]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder"])
def test_anything_but_a_regular_file_is_refused_at_once(tmp_path, kind):
    import os

    path = {"fifo": tmp_path / "m.fifo", "dev_zero": Path("/dev/zero"), "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes to it: a reader that opened it blocking would hang here
    (problem,) = problems_of(path)
    what = {"fifo": "a FIFO (named pipe)", "dev_zero": "a character device", "folder": "a folder"}[kind]
    assert problem == f"{path}: is {what}, not a file; give the manifest as a regular file"


def test_a_manifest_of_pilot_cases_only_needs_to_be_a_pilot_run(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(case_dict(0, pilot=True))])
    manifest = load_manifest(path)
    with pytest.raises(ManifestError, match="main cohort is empty"):
        manifest.require_main_cohort()
    load_manifest(write_lines(tmp_path / "n.jsonl", [json.dumps(case_dict(0, pilot=True)), json.dumps(case_dict(1))])
                  ).require_main_cohort()


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


# --- the benchmark catalog ---------------------------------------------------

CORPUS = Path(__file__).parent / "manifests"
OBJECT_3 = "pick up the bbq sauce and place it in the basket"


def object_case(i: int = 0, **changes) -> dict:
    d = {"case_id": f"object-3-ep{i}", "suite": "libero_object", "task_id": 3, "init_state_index": i,
         "env_seed": i, "horizon": 64}
    d.update(changes)
    return d


def test_catalog_has_the_official_suites():
    catalog = libero_catalog()
    sizes = {name: len(catalog.suites[name].tasks) for name in OFFICIAL_HORIZON}
    assert sizes == {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10, "libero_90": 90}
    assert {name: catalog.suites[name].horizon for name in OFFICIAL_HORIZON} == OFFICIAL_HORIZON
    assert OFFICIAL_HORIZON == {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
                                "libero_90": 400}
    assert all(task.init_states == 50 for name in OFFICIAL_HORIZON for task in catalog.suites[name].tasks)
    assert catalog.task("libero_object", 3).instruction == OBJECT_3
    assert catalog.task("libero_object", 10) is None and catalog.task("libero_nonexistent", 0) is None
    assert libero_catalog() is catalog  # read once per process


@pytest.mark.sim
def test_shipped_catalog_equals_the_installed_libero():
    pytest.importorskip("libero.libero.benchmark")
    built = build_libero_catalog()
    assert built.suites == libero_catalog().suites
    assert built.unavailable == libero_catalog().unavailable
    shipped = (ROOT / "rescue" / "core" / CATALOG_FILE).read_text(encoding="utf-8")
    assert render(built) == shipped, "regenerate with `python -m rescue.env.catalog_build`"


def test_checking_a_manifest_starts_no_simulator(tmp_path):
    # What keeps the check fast is that it loads nothing heavy; its speed is measured in
    # benchmarks/journal_scale.py (a 100,000-case manifest), not asserted here.
    rows = [object_case(i, task_id=i % 10, init_state_index=i % 50) for i in range(200)]
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(r) for r in rows])
    code = (
        "import sys\n"
        "from rescue.core.manifest import load_manifest\n"
        f"m = load_manifest({str(path)!r})\n"
        "heavy = sorted({n.split('.')[0] for n in sys.modules} & {'libero', 'robosuite', 'mujoco', 'torch', 'openai'})\n"
        "print(len(m.cases), heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, check=True)
    n, heavy = out.stdout.split(" ", 1)
    assert n == "200" and heavy.strip() == "[]"


# --- checks against the catalog ----------------------------------------------


def test_every_suites_last_task_and_initial_state_are_accepted_and_one_more_refused(tmp_path):
    catalog = libero_catalog()
    good, bad = [], []
    for name, suite in catalog.suites.items():
        last = len(suite.tasks) - 1
        own = suite.tasks[last].instruction
        good.append(dict(case_id=f"{name}-last", suite=name, task_id=last, init_state_index=suite.tasks[last].init_states - 1,
                         env_seed=1, horizon=10 * suite.horizon, instruction=own))
        bad.append(dict(case_id=f"{name}-task", suite=name, task_id=last + 1, init_state_index=0, env_seed=1, horizon=1))
        bad.append(dict(case_id=f"{name}-init", suite=name, task_id=0, init_state_index=suite.tasks[0].init_states,
                        env_seed=1, horizon=1))
        bad.append(dict(case_id=f"{name}-long", suite=name, task_id=0, init_state_index=0, env_seed=1,
                        horizon=10 * suite.horizon + 1))
    assert len(load_manifest(write_lines(tmp_path / "good.jsonl", [json.dumps(r) for r in good])).cases) == len(good)
    for i in range(0, len(bad), 3):  # one file per suite: all of them in one would pass MAX_PROBLEMS
        path = write_lines(tmp_path / "bad.jsonl", [json.dumps(r) for r in bad[i:i + 3]])
        assert [p.split(": ")[1] for p in problems_of(path)] == ["task_id", "init_state_index", "horizon"]


def test_every_problem_of_a_line_is_reported_together(tmp_path):
    row = object_case(task_id=999, init_state_index=5000, horizon=10**30, instruction="x", colour="red")
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(row)])
    problems = problems_of(path)
    assert f"{path}:1: colour: Extra inputs are not permitted" in problems
    assert f"{path}:1: task_id: libero_object has no task 999 (task ids 0..9)" in problems
    assert any(p.startswith(f"{path}:1: horizon: ") and "280" in p for p in problems)
    assert len(problems) == 3  # init and instruction cannot be judged without a task


def test_horizon_bound_can_be_raised_or_lifted_but_not_past_the_hard_limit(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(object_case(horizon=2801))])
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:1: horizon: 2801 steps is over 10 x libero_object's official horizon 280")
    assert load_manifest(path, max_horizon_factor=11).cases[0].horizon == 2801
    assert load_manifest(path, max_horizon_factor=None).cases[0].horizon == 2801
    huge = write_lines(tmp_path / "huge.jsonl", [json.dumps(object_case(horizon=10**30))])
    with pytest.raises(ManifestError) as info:
        load_manifest(huge, max_horizon_factor=None)
    assert info.value.problems == [f"{huge}:1: horizon: Input should be less than or equal to 1000000"]


def test_the_tasks_own_instruction_is_accepted_and_any_other_refused(tmp_path):
    ok = write_lines(tmp_path / "ok.jsonl", [json.dumps(object_case(instruction=OBJECT_3))])
    assert load_manifest(ok).cases[0].instruction == OBJECT_3
    bad = write_lines(tmp_path / "bad.jsonl", [json.dumps(object_case(instruction=OBJECT_3 + " "))])
    (problem,) = problems_of(bad)
    assert problem.startswith(f"{bad}:1: instruction: ") and repr(OBJECT_3) in problem


def test_catalog_none_skips_benchmark_checks_but_not_the_case_model(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(object_case(suite="kitchen", task_id=999))])
    assert load_manifest(path, catalog=None).cases[0].suite == "kitchen"
    assert problems_of(path)[0].startswith(f"{path}:1: suite: unknown suite 'kitchen'")
    bad_id = write_lines(tmp_path / "id.jsonl", [json.dumps(object_case(case_id="../x"))])
    with pytest.raises(ManifestError):
        load_manifest(bad_id, catalog=None)


def test_code_built_manifests_are_checked_the_same_way():
    body = (json.dumps(object_case(init_state_index=50)) + "\n").encode()
    with pytest.raises(ManifestError) as info:
        parse_manifest(body, "episodes")
    assert info.value.problems == ["episodes:1: init_state_index: libero_object task 3 has no initial state 50 (indices 0..49)"]


# --- case ids ------------------------------------------------------------------


@pytest.mark.parametrize("case_id", ["object-3-ep0", "case-00001", "a:b.c_d-e", "A", "9", "x" * 128, "v1.2"])
def test_safe_case_ids_are_accepted(case_id):
    assert case_id_problem(case_id) is None
    assert Case.model_validate(object_case(case_id=case_id)).case_id == case_id


@pytest.mark.parametrize(
    "case_id",
    ["../../x", "/abs/path", "a/b", "a\\b", "a\x00b", "a\nb", "a\rb", "a\u202eb", "a\u2066b", ".hidden", "..",
     "a..b", "-flag", ":x", "x" * 129, " a", "a ", "ｆｕｌｌ", "é", ""],
)
def test_unsafe_case_ids_are_refused_everywhere(case_id):
    assert case_id_problem(case_id)
    with pytest.raises(ValueError):  # also for cases built in code, not only from files
        Case.model_validate(object_case(case_id=case_id))


def test_ids_that_differ_only_in_letter_case_are_refused(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(object_case(0, case_id="Ep-1")),
                                              json.dumps(object_case(1, case_id="ep-1"))])
    assert problems_of(path) == [f"{path}:2: case_id: case id 'ep-1' differs from 'Ep-1' (line 1) only in letter case"]


# --- encodings, line ends, sizes -----------------------------------------------


def test_bom_and_crlf_are_accepted_and_read_the_same_cases(tmp_path):
    rows = [json.dumps(object_case(i)) for i in range(3)]
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes("".join(r + "\n" for r in rows).encode())
    windows = tmp_path / "windows.jsonl"
    windows.write_bytes(b"\xef\xbb\xbf" + "".join(r + "\r\n" for r in rows).encode())
    a, b = load_manifest(plain), load_manifest(windows)
    assert a.cases == b.cases
    assert b.sha256 == hashlib.sha256(windows.read_bytes()).hexdigest() != a.sha256  # the file as it is
    as_list = tmp_path / "list.json"
    as_list.write_bytes(b"\xef\xbb\xbf[" + ",\r\n".join(rows).encode() + b"]\r\n")
    assert load_manifest(as_list).cases == a.cases


def test_line_separators_inside_strings_do_not_split_a_line(tmp_path):
    # U+2028 and U+0085 are line breaks to str.splitlines, not to JSON.
    row = object_case(tags={"note": "a\u2028b\u0085c"})
    path = tmp_path / "m.jsonl"
    path.write_bytes((json.dumps(row, ensure_ascii=False) + "\n").encode())
    assert load_manifest(path).cases[0].tags == {"note": "a\u2028b\u0085c"}


def test_a_50_mb_line_is_refused_without_being_parsed(tmp_path):
    path = tmp_path / "big.jsonl"
    size = 50 * 1024 * 1024
    with path.open("wb") as f:
        f.write((json.dumps(object_case(0)) + "\n").encode())
        f.write(json.dumps(object_case(1, tags={"blob": "x" * size})).encode() + b"\n")
    tracemalloc.start()
    try:
        problems = problems_of(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    line_bytes = path.stat().st_size - len(json.dumps(object_case(0))) - 2
    assert problems == [f"{path}:2: line is {line_bytes} bytes long, at most {MAX_LINE_BYTES}"]
    # The file is read once; parsing the line would take several times its size.
    assert peak < path.stat().st_size + 8 * 1024 * 1024


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: costs no disk
    tracemalloc.start()
    try:
        problems = problems_of(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert problems == [f"{path}: the file is {MAX_MANIFEST_BYTES + 1} bytes long, at most {MAX_MANIFEST_BYTES}"]
    assert peak < 1024 * 1024


def test_a_json_list_item_over_the_line_limit_is_refused(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps([object_case(0), object_case(1, tags={"blob": "x" * MAX_LINE_BYTES})]))
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}[1]: case is ") and problem.endswith(f"at most {MAX_LINE_BYTES}")


def test_a_file_of_many_bad_lines_reports_a_screenful(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", ["{bad"] * 5000)
    problems = problems_of(path)
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[-1] == f"{path}: stopped after {MAX_PROBLEMS} problems"


# --- the corpus of malformed manifests -----------------------------------------

# Each file in tests/manifests and what its problems must say: `{path}` followed by
# each fragment (line, then field) must begin one of the problems.
EXPECTED = {
    "empty.jsonl": [": no cases"],
    "blank_lines_only.jsonl": [": no cases"],
    "not_json.jsonl": [":1:1: invalid JSON: "],
    "truncated_line.jsonl": [":2:38: invalid JSON: "],
    "list_then_lines.jsonl": [":2:1: invalid JSON: Extra data (a JSON list must be the whole file"],
    "lines_then_list.jsonl": [":2: expected a JSON object, got list"],
    "list_of_non_objects.json": ["[0]: expected a JSON object", "[1]: expected a JSON object", "[2]: expected"],
    "pretty_object.json": [": expected a JSON list of cases or one case per line"],
    "scalar_line.jsonl": [":2: expected a JSON object, got int"],
    "duplicate_ids.jsonl": [":3: case_id: duplicate case id 'object-3-ep0' (first at line 1)"],
    "ids_differ_in_case.jsonl": [":2: case_id: case id 'case-a' differs from 'Case-A' (line 1) only in letter case"],
    "missing_fields.jsonl": [f":1: {f}: Field required" for f in ("suite", "task_id", "init_state_index", "env_seed", "horizon")],
    "task_id_string.jsonl": [":1: task_id: Input should be a valid integer"],
    "horizon_float.jsonl": [":1: horizon: Input should be a valid integer"],
    "bool_for_int.jsonl": [":1: init_state_index: Input should be a valid integer"],
    "pilot_not_bool.jsonl": [":1: pilot: Input should be a valid boolean"],
    "suite_null.jsonl": [":1: suite: Input should be a valid string"],
    "unknown_field.jsonl": [":1: colour: Extra inputs are not permitted"],
    "tag_not_scalar.jsonl": [":1: tags.seen: tag values must be a string, number or boolean"],
    "id_path_traversal.jsonl": [":1: case_id: case id '../../x' has the character '/'"],
    "id_absolute_path.jsonl": [":1: case_id: case id '/etc/passwd' has the character '/'"],
    "id_nul.jsonl": [":1: case_id: case id 'a\\x00b' has the character '\\x00'"],
    "id_newline.jsonl": [":1: case_id: case id 'a\\nb' has the character '\\n'"],
    "id_bidi.jsonl": [":1: case_id: case id 'case\\u202egnp.exe' has the character '\\u202e'"],
    "id_leading_dot.jsonl": [":1: case_id: case id '.hidden' must start with a letter or digit"],
    "id_too_long.jsonl": [":1: case_id: case id is 200 characters long, at most 128"],
    "id_space.jsonl": [":1: case_id: case id 'object 3' has the character ' '"],
    "id_empty.jsonl": [":1: case_id: String should have at least 1 character"],
    "id_not_string.jsonl": [":1: case_id: Input should be a valid string"],
    "fingerprint_not_hex.jsonl": [":1: fingerprint: String should match pattern"],
    "duplicate_key.jsonl": [":1: horizon: the key appears twice in one object"],
    "unknown_suite.jsonl": [":1: suite: unknown suite 'libero_nonexistent'"],
    "task_999.jsonl": [":1: task_id: libero_object has no task 999"],
    "task_negative.jsonl": [":1: task_id: Input should be greater than or equal to 0"],
    "init_5000.jsonl": [":1: init_state_index: libero_object task 3 has no initial state 5000"],
    "wrong_instruction.jsonl": [":1: instruction: 'pick up the ketchup and place it in the basket' is not"],
    "horizon_negative.jsonl": [":1: horizon: Input should be greater than 0"],
    "horizon_zero.jsonl": [":1: horizon: Input should be greater than 0"],
    "horizon_1e30.jsonl": [":1: horizon: 100000000000000000000... steps is over 10 x libero_object's"],
    "horizon_over_10x.jsonl": [":1: horizon: 2801 steps is over 10 x libero_object's official horizon 280"],
    "env_seed_negative.jsonl": [":1: env_seed: Input should be greater than or equal to 0"],
    "nan_tag.jsonl": [":1: invalid JSON: NaN is not a JSON number"],
    "huge_integer.jsonl": [":1: invalid JSON: a number with more than 4300 digits"],
    "deep_nesting.jsonl": [":1: invalid JSON: nested too deeply"],
    "utf16.jsonl": [": not UTF-8 text (a UTF-16 byte-order mark)"],
    "latin1.jsonl": [":2: not UTF-8 text"],
    "crlf_bad_second_line.jsonl": [":2: task_id: libero_object has no task 999"],
    "bom_unknown_suite.jsonl": [":1: suite: unknown suite 'libero_nonexistent'"],
    "list_with_bad_items.json": ["[1]: horizon: Input should be greater than 0",
                                 "[2]: case_id: duplicate case id 'object-3-ep0' (first at index 0)",
                                 "[3]: init_state_index: libero_object task 3 has no initial state 5000"],
    "many_problems.jsonl": [":2: horizon: ", ":3:2: invalid JSON: ", ":4: case_id: duplicate", ":4: colour: ",
                            ":6: suite: Field required", ":7: expected a JSON object", ":8: suite: unknown suite"],
}


def _generated(tmp_path) -> dict[str, tuple[Path, list[str]]]:
    """Corpus entries too large to commit, written on the fly."""
    line = tmp_path / "line_50mb.jsonl"
    with line.open("wb") as f:
        f.write((json.dumps(object_case(0)) + "\n").encode())
        f.write(json.dumps(object_case(1, tags={"blob": "x" * (50 * 1024 * 1024)})).encode() + b"\n")
    huge = tmp_path / "file_over_limit.jsonl"
    with huge.open("wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    return {"line_50mb": (line, [":2: line is "]), "file_over_limit": (huge, [": the file is "])}


def _corpus_files() -> list[str]:
    return sorted(p.name for p in CORPUS.iterdir())


def test_every_corpus_file_has_expectations():
    assert _corpus_files() == sorted(EXPECTED)
    assert len(EXPECTED) >= 30


def _assert_clear(problems: list[str], path: Path, fragments: list[str]) -> None:
    for fragment in fragments:
        assert any(p.startswith(f"{path}{fragment}") for p in problems), (fragment, problems)
    for p in problems:
        # One line each, no control or bidi characters reaching the terminal.
        assert p.isprintable() and len(p) < 400, p


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_file_is_refused_line_by_line(name):
    path = CORPUS / name
    _assert_clear(problems_of(path), path, EXPECTED[name])


def _refused_by_the_cli(path: Path, fragments: list[str], study: Path) -> None:

    def run(args: list[str]) -> tuple[list[str], object]:
        return args, rescue_cli(*args, timeout=60, check=False)

    commands = [["manifest", "check", str(path)], ["run", str(path), "--study", str(study)]]
    with ThreadPoolExecutor(len(commands)) as pool:  # the two processes are independent
        results = list(pool.map(run, commands))
    for args, proc in results:
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, (args, out)
        assert "Traceback" not in out, out
        problems = [line for line in proc.stderr.splitlines() if line.startswith(str(path))]
        assert problems, out
        _assert_clear(problems, path, fragments)
    assert not study.exists(), f"rescue run wrote {study}"


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_cli_refuses_corpus_file_and_writes_nothing(name, tmp_path):
    _refused_by_the_cli(CORPUS / name, EXPECTED[name], tmp_path / "study")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_cli_refuses_generated_corpus_and_writes_nothing(tmp_path):
    for name, (path, fragments) in _generated(tmp_path).items():
        _assert_clear(problems_of(path), path, fragments)
        _refused_by_the_cli(path, fragments, tmp_path / f"study-{name}")


@pytest.mark.e2e
def test_run_on_a_bad_manifest_imports_no_simulator(tmp_path):
    study = tmp_path / "study"
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "rescue.cli", "run", str(CORPUS / "task_999.jsonl"), "--study", str(study)],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0 and not study.exists()
    modules = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    imported = {name.split(".")[0] for name in modules}
    assert "rescue" in imported
    assert not imported & {"libero", "robosuite", "mujoco"}, imported & {"libero", "robosuite", "mujoco"}
    # Nor the VLM's SDK, nor torch, nor scipy.stats: a refusal costs what `rescue manifest check` costs.
    assert not imported & {"openai", "torch"}, imported & {"openai", "torch"}
    assert "scipy.stats" not in modules


@pytest.mark.e2e
def test_a_valid_manifest_passes_the_cli_check(tmp_path):
    path = write_cases(tmp_path / "m.jsonl", 3)
    proc = rescue_cli("manifest", "check", str(path), timeout=60)
    assert "3 cases (0 pilot)" in " ".join(proc.stdout.split())  # the terminal may wrap it
