"""Observation profiles as data, and the pure helpers against the libraries they must equal."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT
from openpi_client import image_tools

from rescue.core.observation import (
    LEROBOT_LIBERO,
    OPENPI_LIBERO,
    PRIVILEGED,
    PROFILES,
    CameraSpec,
    ObservationProfile,
    StateSpec,
    get_profile,
    quat2axisangle,
    resize_with_pad,
    shape_observation,
)

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("shape", [(256, 256, 3), (480, 640, 3), (100, 37, 3), (224, 224, 3), (3, 128, 200, 3)])
def test_resize_with_pad_is_openpis_bit_for_bit(shape):
    rng = np.random.default_rng(sum(shape))
    img = rng.integers(0, 256, shape, dtype=np.uint8)
    for h, w in ((224, 224), (120, 300)):
        ours, theirs = resize_with_pad(img, h, w), image_tools.resize_with_pad(img, h, w)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert np.array_equal(ours, theirs)


@pytest.mark.sim
def test_quat2axisangle_is_robosuites():
    from robosuite.utils.transform_utils import quat2axisangle as reference

    rng = np.random.default_rng(0)
    quats = [q / np.linalg.norm(q) for q in rng.normal(size=(200, 4))]
    quats += [np.array([0.0, 0.0, 0.0, 1.0]), np.array([0.0, 0.0, 0.0, -1.0]), np.array([1e-9, 0, 0, 1.0 + 1e-9]), np.array([0.1, 0.2, 0.3, 1.5])]
    for q in quats:
        before = q.copy()
        ours = quat2axisangle(q)
        assert np.array_equal(q, before)  # robosuite clips its argument in place; ours leaves it alone
        assert np.array_equal(ours, reference(q.copy()))


def test_builtin_profiles_and_lookup():
    assert set(PROFILES) == {"openpi-libero", "lerobot-libero", "privileged", "vla-eval-libero", "vla-eval-libero+wrist",
                             "vla-eval-libero+state", "vla-eval-libero+wrist+state", "vla-eval-libero+state+no-antipodal",
                             "vla-eval-libero+wrist+state+no-antipodal"}
    assert get_profile("openpi-libero") is OPENPI_LIBERO
    with pytest.raises(ValueError, match="unknown observation profile 'openpi'"):
        get_profile("openpi")
    assert OPENPI_LIBERO.camera_names() == ["agentview", "robot0_eye_in_hand"]
    assert PRIVILEGED.camera_names() == []


def test_profile_sha256_is_stable_and_covers_every_field():
    digests = {p.sha256() for p in PROFILES.values()}
    assert len(digests) == len(PROFILES)
    # The same data gives the same digest in a fresh interpreter (no hash-seed or id dependence).
    code = "from rescue.core.observation import PROFILES; import json; print(json.dumps({k: p.sha256() for k, p in PROFILES.items()}))"
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}, check=True)
        assert json.loads(out.stdout) == {k: p.sha256() for k, p in PROFILES.items()}
    base = OPENPI_LIBERO
    variants = [
        base.model_copy(update={"instruction_key": "task"}),
        base.model_copy(update={"cameras": base.cameras[:1]}),
        base.model_copy(update={"cameras": (base.cameras[0].model_copy(update={"rotate_180": False}), base.cameras[1])}),
        base.model_copy(update={"cameras": (base.cameras[0].model_copy(update={"resize_with_pad": (128, 128)}), base.cameras[1])}),
        base.model_copy(update={"state": base.state.model_copy(update={"dtype": "float32"})}),
        base.model_copy(update={"extra": {"k": 1}}),
    ]
    assert len({v.sha256() for v in variants} | {base.sha256()}) == len(variants) + 1
    # A profile is data: it round-trips through JSON.
    assert ObservationProfile.model_validate_json(base.model_dump_json()) == base


def _raw():
    rng = np.random.default_rng(3)
    raw = {
        "robot0_eef_pos": np.array([0.1, -0.2, 1.0]),
        "robot0_eef_quat": np.array([0.99, 0.05, 0.1, 0.02]) / np.linalg.norm([0.99, 0.05, 0.1, 0.02]),
        "robot0_gripper_qpos": np.array([0.039, -0.039]),
        "robot0_joint_pos": rng.normal(size=7),
        "bowl_1_pos": np.array([0.0, 0.1, 0.9]),
        "object/bowl_1": np.array([0.0, 0.1, 0.9]),
        "task/object_pos": np.array([0.0, 0.1, 0.9]),
    }
    frames = {cam: rng.integers(0, 256, (256, 256, 3), dtype=np.uint8) for cam in ("agentview", "robot0_eye_in_hand")}
    return raw, frames


def test_openpi_profile_shapes_like_openpis_client():
    raw, frames = _raw()
    obs = shape_observation(OPENPI_LIBERO, raw, frames)
    assert set(obs) == {"observation/image", "observation/wrist_image", "observation/state"}
    expect = image_tools.convert_to_uint8(image_tools.resize_with_pad(np.ascontiguousarray(frames["agentview"][::-1, ::-1]), 224, 224))
    assert np.array_equal(obs["observation/image"], expect)
    assert obs["observation/wrist_image"].shape == (224, 224, 3) and obs["observation/wrist_image"].dtype == np.uint8
    state = np.concatenate((raw["robot0_eef_pos"], quat2axisangle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]))
    assert obs["observation/state"].dtype == np.float64 and np.array_equal(obs["observation/state"], state)
    request = OPENPI_LIBERO.policy_input(obs, "put the bowl on the plate")
    assert request["prompt"] == "put the bowl on the plate"
    assert set(OPENPI_LIBERO.image_digests(obs)) == {"observation/image", "observation/wrist_image"}


def test_lerobot_profile_keys_and_orientation():
    raw, frames = _raw()
    obs = shape_observation(LEROBOT_LIBERO, raw, frames)
    assert set(obs) == {"observation.images.image", "observation.images.image2", "observation.state"}
    assert np.array_equal(obs["observation.images.image"], frames["agentview"][::-1, ::-1])  # 180 degrees, no resize
    assert obs["observation.state"].dtype == np.float32 and obs["observation.state"].shape == (8,)
    assert LEROBOT_LIBERO.instruction_key == "task"


def test_the_lerobot_profile_renders_at_the_protocols_size():
    from rescue.core.episode_protocol import get_protocol

    # lerobot-eval builds LIBERO's env at 360x360; openpi's client and the env class's default at 256.
    assert [get_protocol(p).camera_size for p in ("lerobot", "openpi", "rescue")] == [360, 256, 256]
    assert {c.size for c in LEROBOT_LIBERO.rendered_at(360).cameras} == {360}
    assert {c.size for c in LEROBOT_LIBERO.rendered_at(256).cameras} == {256}
    assert OPENPI_LIBERO.rendered_at(360) is OPENPI_LIBERO  # a profile that names its size keeps it
    assert LEROBOT_LIBERO.rendered_at(360).sha256() != LEROBOT_LIBERO.rendered_at(256).sha256()


def test_privileged_profile_spreads_what_the_embedded_policies_read():
    raw, frames = _raw()
    obs = shape_observation(PRIVILEGED, raw, {})
    assert {"robot0_eef_pos", "robot0_gripper_qpos", "task/object_pos", "object/bowl_1"} <= set(obs)
    assert "bowl_1_pos" not in obs and not any(k.startswith("observation") for k in obs)
    assert all(v.dtype == np.float64 for v in obs.values())


def test_custom_profile_and_bad_parts():
    raw, frames = _raw()
    custom = ObservationProfile(
        name="custom",
        cameras=(CameraSpec(camera="agentview", key="img", size=256, resize_with_pad=(64, 128)),),
        state=StateSpec(composition="concat", parts=("joint_pos", "gripper_qpos"), key="s", dtype="float32"),
        instruction_key="instruction",
        extra={"embodiment": "panda"},
    )
    obs = shape_observation(custom, raw, frames)
    assert obs["img"].shape == (64, 128, 3) and obs["s"].shape == (9,) and obs["embodiment"] == "panda"
    bad = custom.model_copy(update={"state": StateSpec(composition="concat", parts=("elbow",), key="s")})
    with pytest.raises(ValueError, match="unknown state part 'elbow'"):
        shape_observation(bad, raw, frames)
    with pytest.raises(Exception):
        CameraSpec(camera="agentview", key="img", colour="red")  # unknown fields are refused


def test_observation_module_needs_no_simulator():
    code = "import sys, rescue.core.observation; print(sorted(m for m in ('robosuite', 'mujoco', 'libero', 'torch', 'openpi_client') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout.strip() == "[]"


def test_the_lerobot_profile_computes_the_axis_angle_in_float32_as_lerobot_does():
    # The eef quaternion at the reset of object-3-ep0 under the lerobot protocol, and the bytes LeRobot 0.6.1's
    # LiberoProcessorStep._quat2axisangle gives for it (torch, float32); robosuite's float64 formula cast to float32
    # is one float32 step off in the second element.
    from rescue.core.observation import LEROBOT_LIBERO, compose_state, quat2axisangle, quat2axisangle_float32

    quat = np.array([0.9995646824193214, -0.00019292262238918, -0.02950264056701997, 5.138478755805677e-05])
    lerobot = bytes.fromhex("c4f748404de01eba31d0bdbd")
    assert quat2axisangle_float32(quat).tobytes() == lerobot
    assert quat2axisangle(quat).astype(np.float32).tobytes() != lerobot
    raw = {"robot0_eef_pos": np.array([0.1, 0.2, 0.3]), "robot0_eef_quat": quat,
           "robot0_gripper_qpos": np.array([0.04, -0.04])}
    state = compose_state(LEROBOT_LIBERO.state.parts, raw).astype(np.float32)
    assert state[3:6].tobytes() == lerobot
    assert not quat2axisangle_float32(np.array([0.0, 0.0, 0.0, 1.0])).any()  # no rotation: zeros, as LeRobot


def test_the_float32_axis_angle_is_torchs_kernels_not_numpys():
    # numpy's float32 sqrt and arccos give other last bits than torch's for about half of all quaternions; the
    # profile must give torch's (the interop tier checks it against LeRobot's own function on the same draws).
    import torch

    from rescue.core.observation import quat2axisangle_float32

    rng = np.random.default_rng(1)
    quats = rng.standard_normal((400, 4))
    quats /= np.linalg.norm(quats, axis=1, keepdims=True)
    q = quats.astype(np.float32)
    w = np.clip(q[:, 3], -1, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        numpy_way = q[:, :3] / np.sqrt(np.float32(1) - w * w)[:, None] * (np.float32(2) * np.arccos(w))[:, None]
    ours = np.stack([quat2axisangle_float32(x) for x in quats])
    assert ours.dtype == np.float32
    assert (ours != numpy_way).any(axis=1).mean() > 0.2
    t = torch.from_numpy(q)
    wt = t[:, 3].clamp(-1.0, 1.0)
    torch_way = t[:, :3] / torch.sqrt(torch.clamp(1.0 - wt * wt, min=0.0)).unsqueeze(1) * (2.0 * torch.acos(wt)).unsqueeze(1)
    assert ours.tobytes() == torch_way.numpy().tobytes()


def test_a_profile_that_needs_torch_without_torch_is_one_line(monkeypatch):
    import importlib.util

    from rescue.core.configuration.config import StudyConfig
    from rescue.core.configuration.identity import IdentityError
    from rescue.run.peers import config_with_identity

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    config = StudyConfig(policy={"url": "ws://x", "observation": "lerobot-libero"}, env={"episode_protocol": "lerobot"})
    with pytest.raises(IdentityError, match="lerobot-libero profile computes the state's axis-angle with torch's"):
        config_with_identity(config, {"action_horizon": 8})
    assert config_with_identity(config.model_copy(update={"policy": config.policy.model_copy(
        update={"observation": "openpi-libero"})}), {"action_horizon": 8}).policy.observation == "openpi-libero"
