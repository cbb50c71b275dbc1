"""LIBERO-PRO's perturbation suites, which the installed benchmark ships: one of each kind end to end.

For libero_object's language, object, swap, task and distractor perturbations: the reset's
fingerprint does not depend on the simulator process's hash seed, the policy is told the instruction
the suite's env gives (the perturbed wording for `_lan` and `_task`), the openpi-libero profile keeps
its cameras and state layout, a distractor's new object appears in the privileged profile only in the
suite that adds it; then a manifest mixing a standard suite and perturbation suites is checked, made
from evaluations (`rescue eval`, `manifest from-eval`), run with a sham arm, verified, and reported by
perturbation kind (the case's group). `libero_object_lan@base-inits` starts libero_object's own episodes,
fingerprint for fingerprint but for the instruction, with the perturbed words told under any protocol.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import arm_rows, export_of, rescue_cli

from rescue.core.catalog import libero_catalog
from rescue.env.pool import SimProcess
from wrappers.injection import inject

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

SUITES = {"libero_object_lan": "language", "libero_object_object": "object", "libero_object_swap": "swap",
          "libero_object_task": "task", "libero_object_with_mug": "distractor"}


def _reset(sim: SimProcess, suite: str, profile: str):
    return sim._call("reset", {"suite": suite, "task_id": 0, "init_state_index": 0, "env_seed": 0}, profile)


@pytest.fixture(scope="module")
def simulators():
    """Two simulator processes with different hash seeds (0 and 1), started once for the module."""
    a = SimProcess("rescue.env.libero:LiberoAdapter", name="pro-a", hash_seed=0)
    b = SimProcess("rescue.env.libero:LiberoAdapter", name="pro-b", hash_seed=1)
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_each_perturbation_kind_resets_alike_in_any_process_with_its_own_instruction_and_the_profiles_layout(simulators):
    catalog = libero_catalog()
    a, b = simulators
    base_objects = {k for k in _reset(a, "libero_object", None).obs if k.startswith("object/")}
    for suite, kind in SUITES.items():
        assert catalog.suite(suite).perturbation == kind and catalog.suite(suite).base == "libero_object"
        first, second = _reset(a, suite, "openpi-libero"), _reset(b, suite, "openpi-libero")
        assert first.fingerprint == second.fingerprint, suite  # hash seeds 0 and 1
        assert first.instruction == catalog.task(suite, 0).instruction, suite
        assert set(first.obs) == {"observation/image", "observation/wrist_image", "observation/state"}
        assert first.obs["observation/image"].shape == (224, 224, 3) and first.obs["observation/state"].shape == (8,)
        objects = {k for k in _reset(a, suite, None).obs if k.startswith("object/")}
        if kind == "distractor":
            assert any("mug" in k for k in objects - base_objects), sorted(objects - base_objects)
        else:
            assert not any("mug" in k for k in objects), suite
    # The language perturbation tells the policy other words than the standard suite's task.
    assert catalog.task("libero_object_lan", 0).instruction != catalog.task("libero_object", 0).instruction


def test_base_inits_is_the_base_episode_told_the_perturbed_words_in_any_process_and_protocol(simulators):
    catalog = libero_catalog()
    a, b = simulators
    for protocol in ("rescue", "openpi"):
        for task_id, index in ((0, 30), (7, 3)):
            def reset(sim, suite):
                case = {"suite": suite, "task_id": task_id, "init_state_index": index,
                        "env_seed": 7 if protocol == "openpi" else index}
                return sim._call("reset", case, "openpi-libero", protocol)

            base, variant = reset(a, "libero_object"), reset(b, "libero_object_lan@base-inits")
            lan = reset(a, "libero_object_lan")
            where = (protocol, task_id, index)
            # Physics, proprioception, scene and compiled model are the base episode's: only the words differ.
            differ = {k for k, v in base.fingerprint_parts.items() if variant.fingerprint_parts[k] != v}
            assert differ == {"instruction"} and base.fingerprint != variant.fingerprint, where
            assert variant.instruction == catalog.task("libero_object_lan", task_id).instruction, where
            assert variant.instruction != base.instruction, where
            for key in ("observation/image", "observation/wrist_image", "observation/state"):
                assert np.array_equal(variant.obs[key], base.obs[key]), (where, key)
            # The suite as shipped starts elsewhere (its initial states are its own) ...
            assert lan.fingerprint_parts["physics"] != base.fingerprint_parts["physics"], where
            assert lan.fingerprint_parts["model"] == base.fingerprint_parts["model"], where  # the same model
            # ... and is told what the protocol's client sends: openpi's loop, task.language (the base's words).
            told = base.instruction if protocol == "openpi" else variant.instruction
            assert lan.instruction == told, where


def test_a_manifest_mixing_standard_and_perturbation_suites_runs_verifies_and_reports_by_kind(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('keyframes = false\n[policy]\nfactory = "rescue.embedded.scripted:make_policy"\n'
                      '[sham]\nsource = "permuted"\n')
    lines = []
    for suite in ("libero_object", "libero_object_lan", "libero_object_lan@base-inits", "libero_object_swap"):
        study = tmp_path / f"eval-{suite}"
        rescue_cli("eval", "--suite", suite, "--tasks", "0", "--episodes", "1", "--horizon", "24", "--study", str(study),
                   "--config", str(config), "--simulators", "1")
        out = tmp_path / f"{suite}.jsonl"
        made = rescue_cli("manifest", "from-eval", str(study), "--out", str(out))
        assert made.returncode == 0
        lines += out.read_text().splitlines()
    manifest = tmp_path / "mixed.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    checked = " ".join(rescue_cli("manifest", "check", str(manifest)).stdout.split())
    assert "4 cases" in checked
    # Each perturbed suite says how it pairs with its base: by identical episode only on base inits.
    assert "libero_object_lan pairs with libero_object only by (task, initial-state index), not by episode" in checked
    assert "libero_object_lan@base-inits pairs with libero_object by identical episode" in checked
    assert "libero_object_swap pairs with libero_object only by" in checked
    study = tmp_path / "rescue"
    rescue_cli("run", str(manifest), "--study", str(study), "--config", str(config))
    assert rescue_cli("verify", str(study)).returncode == 0
    export = export_of(study)
    by_id = {c["case_id"]: c for c in export["cases"]}
    groups = {"object", "language", "language@base-inits", "swap"}
    assert {c["group"] for c in export["cases"]} == groups and set(export["summary"]["per_group"]) == groups
    assert "object_lan.base-inits-0-ep0" in by_id
    assert all(c["label"] in ("rescued", "not_rescued") and "sham" in c["verdicts"] for c in export["cases"])
    # The language perturbation's assisted arm was injected into the words its policy was told.
    lan = next(c for c in by_id.values() if c["group"] == "language")
    assert lan["task"] == "libero_object_lan/0"
    assisted = json.loads(arm_rows(study)[(lan["case_id"], "assisted")])["assistance"]
    told = libero_catalog().task("libero_object_lan", 0).instruction
    assert assisted["status"] == "applied" and assisted["instruction"] == inject(told, assisted["subgoal"])
    # Each kind has its own placebo comparison: the sham's rescues and assisted against sham over its K.
    def sham_of(b: dict) -> tuple[dict, dict]:
        figures = next(a for a in b["arms"] if a["arm"] == "sham")
        return figures, next(c for c in b["comparisons"] if (c["first"], c["second"]) == ("assisted", "sham"))

    for kind, b in export["summary"]["per_group"].items():
        mine = [c for c in export["cases"] if c["group"] == kind]
        figures, versus = sham_of(b)
        assert b["n"] == len(mine) and figures["r"] == sum(c["verdicts"]["sham"]["label"] == "rescued" for c in mine)
        assert versus["k"] == sum(versus["pairs"].values()) <= len(mine)
    rescue_cli("report", str(study))
    page = (study / "report.html").read_text()
    for kind, b in export["summary"]["per_group"].items():
        figures, versus = sham_of(b)
        assert f'data-figure="main.group.{kind}.sham_r" data-value="{figures["r"]}"' in page
        assert f'data-figure="main.group.{kind}.sham_k" data-value="{versus["k"]}"' in page
    index = (study / "report_files" / "cases.js").read_text()
    assert all(case_id in index for case_id in by_id)
    np.testing.assert_equal(sorted(by_id), sorted(json.loads(line)["case_id"] for line in lines))
