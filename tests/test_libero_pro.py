"""LIBERO-PRO's perturbation suites, which the installed benchmark ships: one of each kind end to end.

For libero_object's language, object, swap, task and distractor perturbations: the reset's
fingerprint does not depend on the simulator process's hash seed, the policy is told the instruction
the suite's env gives (the perturbed wording for `_lan` and `_task`), the openpi-libero profile keeps
its cameras and state layout, a distractor's new object appears in the privileged profile only in the
suite that adds it; then a manifest mixing a standard suite and perturbation suites is checked, made
from evaluations (`rescue eval`, `manifest from-eval`), run with a sham arm, verified, and reported by
perturbation kind (the case's group).
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


def test_each_perturbation_kind_resets_alike_in_any_process_with_its_own_instruction_and_the_profiles_layout():
    catalog = libero_catalog()
    a = SimProcess("rescue.env.libero:LiberoAdapter", name="pro-a", hash_seed=0)
    b = SimProcess("rescue.env.libero:LiberoAdapter", name="pro-b", hash_seed=1)
    try:
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
    finally:
        a.stop()
        b.stop()


def test_a_manifest_mixing_standard_and_perturbation_suites_runs_verifies_and_reports_by_kind(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('keyframes = false\n[policy]\nfactory = "rescue.embedded.scripted:make_policy"\n'
                      '[sham]\nsource = "permuted"\n')
    lines = []
    for suite in ("libero_object", "libero_object_lan", "libero_object_swap"):
        study = tmp_path / f"eval-{suite}"
        rescue_cli("eval", "--suite", suite, "--tasks", "0", "--episodes", "1", "--horizon", "24", "--study", str(study),
                   "--config", str(config), "--simulators", "1")
        out = tmp_path / f"{suite}.jsonl"
        rescue_cli("manifest", "from-eval", str(study), "--out", str(out))
        lines += out.read_text().splitlines()
    manifest = tmp_path / "mixed.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    assert "3 cases" in " ".join(rescue_cli("manifest", "check", str(manifest)).stdout.split())
    study = tmp_path / "rescue"
    rescue_cli("run", str(manifest), "--study", str(study), "--config", str(config))
    assert rescue_cli("verify", str(study)).returncode == 0
    export = export_of(study)
    by_id = {c["case_id"]: c for c in export["cases"]}
    assert {c["group"] for c in export["cases"]} == {"object", "language", "swap"}
    assert set(export["summary"]["per_group"]) == {"object", "language", "swap"}
    assert all(c["label"] in ("rescued", "not_rescued") and c["sham_label"] is not None for c in export["cases"])
    # The language perturbation's assisted arm was injected into the words its policy was told.
    lan = next(c for c in by_id.values() if c["group"] == "language")
    assert lan["task"] == "libero_object_lan/0"
    assisted = json.loads(arm_rows(study)[(lan["case_id"], "assisted")])["assistance"]
    told = libero_catalog().task("libero_object_lan", 0).instruction
    assert assisted["status"] == "applied" and assisted["instruction"] == inject(told, assisted["subgoal"])
    # Each kind has its own placebo comparison: the sham's rescues and assisted against sham over its K.
    for kind, b in export["summary"]["per_group"].items():
        mine = [c for c in export["cases"] if c["group"] == kind]
        assert b["n"] == len(mine) and b["sham"]["r"] == sum(c["sham_label"] == "rescued" for c in mine)
        pairs = b["sham"]["pairs"]
        assert b["sham"]["k"] == sum(pairs.values()) <= len(mine)
    rescue_cli("report", str(study))
    page = (study / "report.html").read_text()
    for kind, b in export["summary"]["per_group"].items():
        assert f'data-figure="main.group.{kind}.sham_r" data-value="{b["sham"]["r"]}"' in page
        assert f'data-figure="main.group.{kind}.sham_k" data-value="{b["sham"]["k"]}"' in page
    index = (study / "report_files" / "cases.js").read_text()
    assert all(case_id in index for case_id in by_id)
    np.testing.assert_equal(sorted(by_id), sorted(json.loads(line)["case_id"] for line in lines))
