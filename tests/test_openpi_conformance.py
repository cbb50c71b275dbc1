"""What an openpi LIBERO policy receives from our adapter: bit for bit what openpi's own client sends.

The reference is built the openpi way in a fresh process (`OffScreenRenderEnv` at
256, seeded, the official initial state, 10 settle steps of [0]*6 + [-1], each
camera image `[::-1, ::-1]` through `openpi_client.image_tools.resize_with_pad`,
state = eef_pos + quat2axisangle(eef_quat) + gripper_qpos); our side is the
adapter in a simulator process under the `openpi-libero` profile. Then a policy
checking exactly openpi's LIBERO inputs, behind the real `openpi_server` in its
own process, answers our client's queries with those observations, and a whole
`rescue eval` study runs against it through the CLI.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import rescue_cli
from openpi_libero_policy import load_received, openpi_server, received_sha256

from rescue.core.digest import digest_array, digest_obs, digest_text
from rescue.core.manifest import Case
from rescue.core.observation import get_profile
from rescue.env.pool import SimProcess
from rescue.policy.client import PolicyServerError, WebsocketPolicyClient
from rescue.study.folder import load_study_config
from rescue.study.journal import Journal

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

CASE = Case.model_validate(
    {"case_id": "spatial-0-ep0", "suite": "libero_spatial", "task_id": 0, "init_state_index": 0, "env_seed": 7, "horizon": 220}
)
# One openpi replan (5 actions) after the settle steps, so run_chunk's observation is checked too.
ACTIONS = np.array([[0.3, -0.2, 0.1, 0.0, 0.05, -0.05, -1.0]] * 5)

REFERENCE = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv
    from openpi_client import image_tools
    from robosuite.utils.transform_utils import quat2axisangle

    suite_name, task_id, init_idx, seed, actions_json, out = sys.argv[1:]
    suite = benchmark.get_benchmark_dict()[suite_name]()
    task = suite.get_task(int(task_id))
    bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
    env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=256, camera_widths=256)
    env.seed(int(seed))
    env.reset()
    obs = env.set_init_state(suite.get_task_init_states(int(task_id))[int(init_idx)])
    for _ in range(10):
        obs, _, _, _ = env.step([0.0] * 6 + [-1.0])

    def element(obs):
        img = np.ascontiguousarray(obs["agentview_image"][::-1, ::-1])
        wrist = np.ascontiguousarray(obs["robot0_eye_in_hand_image"][::-1, ::-1])
        return {
            "image": image_tools.convert_to_uint8(image_tools.resize_with_pad(img, 224, 224)),
            "wrist": image_tools.convert_to_uint8(image_tools.resize_with_pad(wrist, 224, 224)),
            "state": np.concatenate((obs["robot0_eef_pos"], quat2axisangle(obs["robot0_eef_quat"]), obs["robot0_gripper_qpos"])),
        }

    first = element(obs)
    for action in json.loads(actions_json):
        obs, _, _, _ = env.step(action)
    after = element(obs)
    np.savez(out, **{f"reset_{k}": v for k, v in first.items()}, **{f"chunk_{k}": v for k, v in after.items()},
             prompt=np.array(task.language))
    """
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.npz"
    args = [CASE.suite, str(CASE.task_id), str(CASE.init_state_index), str(CASE.env_seed), json.dumps(ACTIONS.tolist()), str(out)]
    proc = subprocess.run([sys.executable, "-c", REFERENCE, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out))


@pytest.fixture(scope="module")
def ours():
    """Reset and one chunk through the typed proxy of a simulator process, under openpi-libero."""
    sim = SimProcess("rescue.env.libero:LiberoAdapter", name="sim-openpi-conformance")

    async def go():
        reset = await sim.reset(CASE, "openpi-libero")
        chunk = await sim.run_chunk(ACTIONS, len(ACTIONS))
        return reset, chunk

    try:
        yield asyncio.run(go())
    finally:
        sim.stop()


def test_observation_keys_and_types_are_openpis(ours):
    reset, chunk = ours
    for obs in (reset.obs, chunk.obs):
        assert set(obs) == {"observation/image", "observation/wrist_image", "observation/state"}
        for key in ("observation/image", "observation/wrist_image"):
            assert obs[key].dtype == np.uint8 and obs[key].shape == (224, 224, 3)
        assert obs["observation/state"].shape == (8,)
    assert chunk.steps == len(ACTIONS)


def test_images_equal_openpis_client_bit_for_bit(ours, reference):
    reset, chunk = ours
    for stage, obs in (("reset", reset.obs), ("chunk", chunk.obs)):
        ref_img, ref_wrist = reference[f"{stage}_image"], reference[f"{stage}_wrist"]
        assert ref_img.dtype == np.uint8 and ref_img.shape == (224, 224, 3)
        assert np.array_equal(obs["observation/image"], ref_img), stage
        assert np.array_equal(obs["observation/wrist_image"], ref_wrist), stage
        # Not a blank frame: the check would be vacuous on one.
        assert ref_img.std() > 10 and ref_wrist.std() > 5


def test_state_equals_openpis_within_1e_6(ours, reference):
    reset, chunk = ours
    for stage, obs in (("reset", reset.obs), ("chunk", chunk.obs)):
        assert np.max(np.abs(obs["observation/state"] - reference[f"{stage}_state"])) <= 1e-6, stage
    assert reset.instruction == str(reference["prompt"])


def test_a_wrong_rotation_would_be_caught(ours, reference):
    # The equality above is not luck of a symmetric scene: upright or unrotated pixels differ.
    reset, _ = ours
    assert not np.array_equal(reset.obs["observation/image"][::-1, ::-1], reference["reset_image"])


def test_real_openpi_server_accepts_our_observations(ours):
    reset, chunk = ours
    profile = get_profile("openpi-libero")

    async def go(url: str):
        client = await WebsocketPolicyClient.connect(url, connect_timeout_s=20)
        try:
            assert client.metadata == {}  # openpi's server announces nothing: C comes from config
            # openpi's server does not know the episode frames: the client must not send them
            # (the policy would get one as an observation and fail; `requests` below would count it).
            assert not client.supports_episode_control
            assert await client.episode_start("conformance", reset.instruction, CASE.case_id) is None
            replies = []
            for obs in (reset.obs, chunk.obs):
                request = profile.policy_input(obs, reset.instruction)
                reply = await client.infer(request)
                replies.append((request, reply))
            # The privileged observation the embedded policies use is refused with the missing key.
            with pytest.raises(PolicyServerError, match="observation/image"):
                await client.infer({"robot0_eef_pos": np.zeros(3), "prompt": reset.instruction})
            return replies
        finally:
            await client.close()

    with openpi_server() as url:
        replies = asyncio.run(go(url))
    for i, (request, reply) in enumerate(replies, start=1):
        assert np.asarray(reply["actions"]).shape == (10, 7)
        assert reply["requests"] == i
        assert reply["received_sha256"] == received_sha256(request)


FULL_ARM_HORIZON = 40
FULL_ARM_C = 5


def _eval_against_openpi(tmp_path, name: str, policy_toml: str):
    """`rescue eval` of one libero_object episode against the real openpi server; (process, study, received)."""
    config = tmp_path / f"{name}.toml"
    config.write_text(f"[policy]\n{policy_toml}\n")
    study, received = tmp_path / name, tmp_path / f"{name}-received"
    received.mkdir()
    with openpi_server(received_dir=received) as url:
        proc = rescue_cli(
            "eval", "--suite", "libero_object", "--tasks", "0", "--episodes", "1",
            "--horizon", str(FULL_ARM_HORIZON), "--simulators", "1", "--cases-in-flight", "1",
            "--policy-url", url, "--config", str(config), "--study", str(study), check=False,
        )
    with Journal.open(study) as journal:
        arms = journal.all_arms()
    return proc, study, arms, load_received(received)


def test_a_full_arm_runs_against_the_real_openpi_server(tmp_path):
    # openpi's metadata is empty, so C comes from the config; the profile is left to the default.
    proc, study, arms, received = _eval_against_openpi(tmp_path, "openpi", f"replan_interval = {FULL_ARM_C}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = load_study_config(study)
    assert config.policy.observation == "openpi-libero"
    assert config.policy.replan_interval == FULL_ARM_C
    assert config.policy.announced == {}
    arm = arms["object-0-ep0"]["control"]
    assert arm.status == "complete", arm.error
    assert arm.steps == FULL_ARM_HORIZON and arm.success is False
    assert [row.step for row in arm.trace] == list(range(0, FULL_ARM_HORIZON, FULL_ARM_C))
    # Every query reached the server's policy, and what it received is what the trace proves.
    assert len(received) == len(arm.trace)
    for row, obs in zip(arm.trace, received):
        assert set(row.images) == {"observation/image", "observation/wrist_image"}
        for key, digest in row.images.items():
            assert obs[key].dtype == np.uint8 and obs[key].shape == (224, 224, 3)
            assert digest == digest_array(obs[key]), (row.step, key)
        assert row.state == digest_obs({"observation/state": obs["observation/state"]}), row.step
        assert row.instruction == digest_text(obs["prompt"]), row.step
    # The robot moved under the policy's actions: the frames are not one image repeated.
    assert len({row.images["observation/image"] for row in arm.trace}) == len(arm.trace)
    assert len({row.images["observation/wrist_image"] for row in arm.trace}) > 1


def test_the_privileged_profile_fails_with_the_missing_key_named(tmp_path):
    _, _, arms, received = _eval_against_openpi(
        tmp_path, "privileged", f'replan_interval = {FULL_ARM_C}\nobservation = "privileged"'
    )
    arm = arms["object-0-ep0"]["control"]
    assert arm.status == "error" and arm.success is None
    assert "PolicyServerError" in arm.error and "KeyError" in arm.error and "'observation/image'" in arm.error
    assert arm.trace == [] and received == []


def test_the_own_vla_walkthrough_against_the_real_openpi_server(tmp_path):
    # The README's "Rescue the failures of your own VLA", command by command: eval, manifest from-eval, preflight, run.
    config = tmp_path / "vla.toml"
    config.write_text(f"[policy]\nreplan_interval = {FULL_ARM_C}\n\n[env]\nsimulators = 2\n")
    base, rescue, failures = tmp_path / "eval", tmp_path / "rescue", tmp_path / "failures.jsonl"
    received = tmp_path / "received"
    received.mkdir()
    with openpi_server(received_dir=received) as url:
        # Without C in the config, openpi's empty metadata leaves it unknown: refused, nothing created.
        refused = rescue_cli("eval", "--suite", "libero_object", "--tasks", "0", "--episodes", "1",
                             "--policy-url", url, "--study", str(base), check=False)
        assert refused.returncode == 2 and not base.exists()
        assert "announces no action_horizon (openpi's servers usually don't); set [policy] replan_interval" in refused.stderr
        rescue_cli("eval", "--suite", "libero_object", "--tasks", "0", "--episodes", "1", "--horizon",
                   str(FULL_ARM_HORIZON), "--policy-url", url, "--config", str(config), "--study", str(base))
        made = rescue_cli("manifest", "from-eval", str(base), "--out", str(failures)).stdout
        assert "wrote 1 failure case(s)" in made
        pre = rescue_cli("preflight", str(failures), "--cases", "1", "--clients", "2", "--idle-s", "1",
                         "--policy-url", url, "--config", str(config)).stdout.splitlines()
        rescue_cli("run", str(failures), "--policy-url", url, "--config", str(config), "--study", str(rescue))
    assert pre[1].startswith("PASS  policy query: profile 'openpi-libero'")
    assert pre[2].startswith("PASS  vlm call:")
    assert any(line.startswith("WARN  rng extension: the server lacks the RNG extension") for line in pre)
    assert any(line.startswith("PASS  determinism object-0-ep0: 2 clients agree") for line in pre)
    assert pre[-1] == "preflight: ok"
    with Journal.open(rescue) as journal:
        arms = journal.all_arms()["object-0-ep0"]
    assert {a: r.status for a, r in arms.items()} == {"control": "complete", "assisted": "complete"}
    assert arms["assisted"].assistance.status == "applied"
    assert not arms["control"].policy_rng_control  # openpi's server has no RNG extension, and the record says so
    # The assisted arm's policy saw the injected instruction from q on.
    prompts = {str(obs["prompt"]) for obs in load_received(received)}
    assert arms["assisted"].assistance.instruction in prompts
