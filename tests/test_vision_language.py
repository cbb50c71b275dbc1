"""The embedded vision-language policy: only the openpi-libero contract in, the named object chosen.

Observations come from the real LIBERO adapter under the `openpi-libero`
profile (the images a VLA client sends); distances are measured in the
simulator, never read from the policy's reply.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from rescue.core.observation import OPENPI_LIBERO
from rescue.embedded.phases import parse_pick_place
from rescue.embedded.training.make_scenes import object_body
from rescue.embedded.vision_language import DEFAULT_LOCATOR, VisionLanguagePolicy
from rescue.env.libero import LiberoAdapter
from wrappers.injection import inject

pytestmark = pytest.mark.sim

CONTRACT = {"observation/image", "observation/wrist_image", "observation/state", "prompt"}
# libero_object task 0 (alphabet soup); butter and milk are in its scene too. Initial states 0-9 are held out.
TASK = 0
A, B = "alphabet soup", "butter"


def _case(init: int, task: int = TASK) -> dict:
    return {"suite": "libero_object", "task_id": task, "init_state_index": init, "env_seed": init}


def _body(adapter: LiberoAdapter, name: str) -> np.ndarray:
    return adapter._body_pos(object_body(name))


@pytest.fixture(scope="module")
def adapter():
    sim = LiberoAdapter(cameras=("agentview", "robot0_eye_in_hand"))
    yield sim
    sim.close()


@pytest.fixture(scope="module")
def policy():
    assert DEFAULT_LOCATOR.is_file(), "the locator checkpoint is committed under models/"
    assert DEFAULT_LOCATOR.stat().st_size < 20 * 2**20
    return VisionLanguagePolicy()


class _Recording(Mapping):
    """A read-only observation that records every key the policy reads."""

    def __init__(self, data: dict) -> None:
        self._data, self.read = data, set()

    def __getitem__(self, key):
        self.read.add(key)
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key) -> bool:
        return key in self._data


def _rollout(adapter, policy, init: int, prompt: str, queries: int, seed: int = 0):
    """Run the policy from a reset under openpi-libero; the simulator's gripper positions after each chunk."""
    obs = adapter.reset(_case(init), OPENPI_LIBERO).obs
    policy.reset_rng(seed)
    eefs = []
    for _ in range(queries):
        chunk = policy.infer({**obs, "prompt": prompt})["actions"]
        obs = adapter.run_chunk(chunk, len(chunk)).obs
        eefs.append(np.array(adapter._env.env.sim.data.site_xpos[adapter._env.env.robots[0].eef_site_id]))
    return np.asarray(eefs)


def test_policy_reads_only_the_contract(adapter, policy):
    reset = adapter.reset(_case(1), OPENPI_LIBERO)
    assert set(reset.obs) == CONTRACT - {"prompt"}  # the profile sends nothing else
    recorded = _Recording({**reset.obs, "prompt": reset.instruction})
    out = policy.infer(recorded)
    assert recorded.read == CONTRACT
    assert out["actions"].shape == (policy.action_horizon, 7)
    # Privileged keys alone are not enough: the error names what is missing.
    with pytest.raises(KeyError, match="observation/image"):
        policy.infer({"robot0_eef_pos": np.zeros(3), "task/object_pos": np.zeros(3), "prompt": reset.instruction})
    # openpi's conventions are accepted: float images in [0, 1], channels first.
    image = reset.obs["observation/image"]
    as_float = {**reset.obs, "observation/image": np.transpose(image / 255.0, (2, 0, 1)), "prompt": reset.instruction}
    np.testing.assert_allclose(policy.locate(image, reset.instruction)[0],
                               policy.locate(np.asarray(policy.read(as_float)[0]), reset.instruction)[0], atol=0.01)


@pytest.mark.parametrize("task, init", [(0, 2), (3, 5), (7, 8)])
def test_locator_finds_the_named_object_from_pixels(adapter, policy, task, init):
    """Held-out initial states: the located object is where the simulator has it, and moves when the scene does."""
    reset = adapter.reset(_case(init, task), OPENPI_LIBERO)
    obj = parse_pick_place(reset.instruction).obj
    located, target = policy.locate(reset.obs["observation/image"], reset.instruction)
    truth = _body(adapter, obj)
    assert np.linalg.norm(located[:2] - truth[:2]) < 0.03
    assert np.linalg.norm(target[:2] - adapter._body_pos("basket_1_contain_region")[:2]) < 0.03
    # A blank image locates nothing in particular: the answer came from the pixels.
    blank = np.zeros_like(reset.obs["observation/image"])
    assert np.linalg.norm(policy.locate(blank, reset.instruction)[0][:2] - truth[:2]) > 0.03


def test_the_object_named_is_the_object_approached(adapter, policy):
    """Same initial state and seed; naming A or B sends the gripper to A or to B (measured in the simulator)."""
    init = 3
    adapter.reset(_case(init), OPENPI_LIBERO)
    pos = {name: _body(adapter, name) for name in (A, B)}
    assert np.linalg.norm(pos[A][:2] - pos[B][:2]) > 0.08  # far enough apart to tell
    ends = {}
    for name in (A, B):
        eefs = _rollout(adapter, policy, init, f"pick up the {name} and place it in the basket", queries=6)
        ends[name] = eefs[-1]
    for name, other in ((A, B), (B, A)):
        near = np.linalg.norm(ends[name][:2] - pos[name][:2])
        far = np.linalg.norm(ends[name][:2] - pos[other][:2])
        assert near < 0.04 and far > near + 0.04, (name, near, far)


def test_a_subgoal_naming_another_object_redirects_the_gripper(adapter, policy):
    """The injected subgoal is the newest instruction: "grasp the butter" after the soup's task goes to the butter."""
    init = 3
    adapter.reset(_case(init), OPENPI_LIBERO)
    pos = {name: _body(adapter, name) for name in (A, B)}
    original = f"pick up the {A} and place it in the basket"
    to_b = _rollout(adapter, policy, init, inject(original, f"grasp the {B}"), queries=6)[-1]
    free = _rollout(adapter, policy, init, inject(original, "Continue with the task."), queries=6)[-1]
    assert np.linalg.norm(to_b[:2] - pos[B][:2]) < 0.04
    assert np.linalg.norm(free[:2] - pos[A][:2]) < 0.04


def test_bundled_server_announces_the_contract():
    from rescue.core.configuration.names import EMBEDDED_POLICY
    from rescue_serve.server import policy_metadata

    from rescue.policy.bundled import load_factory

    spec = EMBEDDED_POLICY
    meta = policy_metadata(load_factory(spec), spec)
    assert meta["observation"] == "openpi-libero"
    assert meta["action_horizon"] == 8


@pytest.mark.e2e
def test_served_by_the_bundled_server_like_an_external_vla(tmp_path):
    """`rescue eval` serves it from its factory; the study resolves openpi-libero from what the server announces."""
    import json

    from conftest import arm_rows, rescue_cli

    from rescue.core.records import ArmResult

    study = tmp_path / "eval"
    rescue_cli("eval", "--suite", "libero_object", "--tasks", "0", "--episodes", "1", "--horizon", "24",
               "--study", str(study), "--policy-factory", "rescue.embedded.vision_language:make_policy")
    policy = json.loads((study / "config.json").read_text())["policy"]
    assert policy["observation"] == "openpi-libero" and policy["announced"]["observation"] == "openpi-libero"
    (data,) = arm_rows(study).values()
    arm = ArmResult.model_validate_json(data)
    # Every query carried the two images of the contract (their digests are in the trace), and they changed.
    assert len(arm.trace) == 3 and all(set(row.images) == {"observation/image", "observation/wrist_image"} for row in arm.trace)
    assert len({row.images["observation/image"] for row in arm.trace}) == 3
