"""Observation profiles: what a policy sees, as data (DESIGN §7).

A profile names the cameras (rendered at what size, rotated how, resized how,
under which keys), how the state is built and which key carries the
instruction. The simulator adapter renders the profile's cameras and hands the
raw arrays to `shape_observation`, a pure function, so the same code shapes the
observation whichever simulator process produced the pixels.

Pure: numpy and PIL only; no simulator import.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from rescue.core import vla_eval_observation as vla_eval
from rescue.core.digest import digest_array, digest_json

# Render convention of the raw frames the adapter passes in: robosuite's "opengl"
# image convention (what `sim.render` returns and what LIBERO's camera observables
# hold, i.e. upside down). Rotations below are applied to frames in this convention.
RAW_IMAGE_CONVENTION = "opengl"


class CameraSpec(BaseModel):
    """One camera the policy sees, and how its pixels are prepared."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    camera: str = Field(description="Simulator camera name (robosuite), e.g. agentview.")
    key: str = Field(description="Observation key the image is sent under.")
    size: int | None = Field(
        default=256, gt=0,
        description="Render height and width in pixels; None: the episode protocol's `camera_size`, the render size the "
                    "evaluation built its env with.")
    rotate_180: bool = Field(default=False, description="Flip rows and columns (img[::-1, ::-1]) of the raw render.")
    resize_with_pad: tuple[int, int] | None = Field(
        default=None, description="Target (height, width) for an aspect-keeping, zero-padded resize; None keeps the render size."
    )


# State parts a "concat" state can be built from: part name -> (raw observable, length).
# Raw observables are robosuite's names; derived parts say how they are derived.
STATE_PARTS: dict[str, tuple[str, int]] = {
    "eef_pos": ("robot0_eef_pos", 3),
    "eef_quat": ("robot0_eef_quat", 4),
    "eef_axisangle": ("robot0_eef_quat", 3),  # quat2axisangle of the quaternion
    "eef_axisangle_float32": ("robot0_eef_quat", 3),  # the same in float32 arithmetic, as LeRobot computes it
    "gripper_qpos": ("robot0_gripper_qpos", 2),
    "gripper_qvel": ("robot0_gripper_qvel", 2),
    "joint_pos": ("robot0_joint_pos", 7),
    "joint_vel": ("robot0_joint_vel", 7),
    **vla_eval.STATE_PARTS,  # the harness's own axis-angles, and its controller's pose (vla-eval-libero)
}

# Groups a "spread" state copies under their own keys (the embedded policies' view).
SPREAD_PARTS = {
    "proprio": "every robot0_* observable, float64, under its robosuite name",
    "object_positions": "object/<name>: each object's position from the simulator",
    "task_goal": "task/object_pos, task/target_pos, task/relation_in: the goal predicate's bodies",
}


class StateSpec(BaseModel):
    """How the state is built from the simulator's observables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    composition: Literal["concat", "spread"] = Field(
        description="concat: one vector of `parts` under `key`; spread: each part's arrays under their own keys."
    )
    parts: tuple[str, ...] = Field(description="Named parts, in order (STATE_PARTS for concat, SPREAD_PARTS for spread).")
    key: str | None = Field(default=None, description="Observation key of the concatenated vector (concat only).")
    dtype: Literal["float64", "float32"] = Field(default="float64", description="dtype of the state arrays sent.")


class ObservationProfile(BaseModel):
    """What a policy receives at each query; part of a study's identity."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Profile name (openpi-libero, lerobot-libero, privileged, or a custom one).")
    cameras: tuple[CameraSpec, ...] = Field(default=(), description="Cameras rendered at each policy query.")
    state: StateSpec = Field(description="How the state is built.")
    instruction_key: str = Field(default="prompt", description="Key that carries the instruction.")
    extra: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Constant extra keys sent with every observation."
    )
    extra_states: tuple[StateSpec, ...] = Field(
        default=(), description="Further concatenated state vectors, each under its own key (vla-eval's "
        "controller_states).")

    def gripper_opening(self) -> tuple[str, int] | None:
        """Where the policy input holds the gripper's first finger joint (the key and its index in that
        array): what the rule wrappers read; None when the profile does not send it."""
        if self.state.composition == "spread":
            return ("robot0_gripper_qpos", 0) if "proprio" in self.state.parts else None
        offset = 0
        for part in self.state.parts:
            if part == "gripper_qpos":
                return self.state.key, offset
            offset += STATE_PARTS[part][1]
        return None

    def sha256(self) -> str:
        """Stable digest of the profile (canonical JSON), for a study's identity."""
        # A profile without extra states digests as before the field existed (studies recorded those digests).
        return digest_json(self.model_dump(mode="json", exclude={"extra_states"} if not self.extra_states else None))

    def rendered_at(self, size: int) -> ObservationProfile:
        """The profile with every camera that leaves its size to the episode protocol rendered at `size`."""
        if all(c.size is not None for c in self.cameras):
            return self
        cameras = tuple(c if c.size is not None else c.model_copy(update={"size": size}) for c in self.cameras)
        return self.model_copy(update={"cameras": cameras})

    def camera_names(self) -> list[str]:
        """Simulator cameras this profile needs, in profile order."""
        return [c.camera for c in self.cameras]

    def policy_input(self, obs: dict, instruction: str) -> dict:
        """The full request: the shaped observation plus the instruction under its key."""
        return {**obs, self.instruction_key: instruction}

    def image_digests(self, obs: dict) -> dict[str, str]:
        """sha256 of each image the policy receives, by observation key (for trace rows)."""
        return {c.key: digest_array(obs[c.key]) for c in self.cameras if c.key in obs}


def quat2axisangle(quat: np.ndarray) -> np.ndarray:
    """Axis-angle (3) of an (x, y, z, w) quaternion, by robosuite's formula (its input is not modified)."""
    q = np.array(quat, copy=True)  # robosuite clips in place; the caller's array stays as it was
    q[3] = min(max(q[3], -1.0), 1.0)
    w = q[3]
    den = np.sqrt(1.0 - w * w)
    if math.isclose(den, 0.0):
        return np.zeros(3)
    return (q[:3] * 2.0 * math.acos(w)) / den


def quat2axisangle_float32(quat: np.ndarray) -> np.ndarray:
    """Axis-angle (3, float32) of an (x, y, z, w) quaternion as LeRobot's `LiberoProcessorStep` computes it, with
    torch's float32 CPU kernels: the quaternion cast to float32, w clamped to [-1, 1], axis = xyz / sqrt(1 - w^2),
    times 2 acos(w). Those kernels are not numpy's: torch's sqrt is not correctly rounded and its acos is another
    approximation, so numpy's float32 arithmetic differs in the last bits for about half of all quaternions
    (and robosuite's float64 formula differs too). torch is imported here, only when a profile asks for it."""
    import torch

    q = torch.from_numpy(np.array(quat, dtype=np.float32).reshape(1, 4))
    w = q[:, 3].clamp(-1.0, 1.0)
    den = torch.sqrt(torch.clamp(1.0 - w * w, min=0.0))
    if not bool(den[0] > 1e-10):
        return np.zeros(3, dtype=np.float32)
    angle = 2.0 * torch.acos(w)
    return ((q[:, :3] / den.unsqueeze(1)) * angle.unsqueeze(1))[0].numpy()


def needs_torch(profile: ObservationProfile) -> bool:
    """Whether shaping this profile's observations needs torch (its state's axis-angle uses torch's kernels)."""
    return "eef_axisangle_float32" in profile.state.parts


def resize_with_pad(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize keeping the aspect ratio and pad with zeros to (height, width), bilinear (PIL),
    like tf.image.resize_with_pad as openpi's client replicates it; a batch is accepted too."""
    if img.shape[-3:-1] == (height, width):
        return img
    lead = img.shape[:-3]
    flat = img.reshape(-1, *img.shape[-3:])
    out = np.stack([np.asarray(_resize_one(Image.fromarray(im), height, width)) for im in flat])
    return out.reshape(*lead, *out.shape[-3:])


def _resize_one(image: Image.Image, height: int, width: int) -> Image.Image:
    cur_w, cur_h = image.size
    if (cur_w, cur_h) == (width, height):
        return image
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    resized = image.resize((new_w, new_h), resample=Image.BILINEAR)
    canvas = Image.new(resized.mode, (width, height), 0)
    canvas.paste(resized, (max(0, int((width - new_w) / 2)), max(0, int((height - new_h) / 2))))
    return canvas


def to_uint8(img: np.ndarray) -> np.ndarray:
    """Float images in [0, 1] to uint8 (as openpi's client converts); uint8 passes through."""
    if np.issubdtype(img.dtype, np.floating):
        return (255 * img).astype(np.uint8)
    return img


def prepare_image(spec: CameraSpec, raw: np.ndarray) -> np.ndarray:
    """A raw render (RAW_IMAGE_CONVENTION, HxWx3) prepared as the camera spec says."""
    img = raw[::-1, ::-1] if spec.rotate_180 else raw
    img = np.ascontiguousarray(img)
    if spec.resize_with_pad is not None:
        img = resize_with_pad(img, *spec.resize_with_pad)
    return np.ascontiguousarray(to_uint8(img))


def compose_state(parts: tuple[str, ...], raw: dict[str, np.ndarray]) -> np.ndarray:
    """Concatenate named state parts from raw observables (in their own dtype, as openpi's client does)."""
    pieces = []
    for part in parts:
        if part not in STATE_PARTS:
            raise ValueError(f"unknown state part {part!r} (known: {', '.join(STATE_PARTS)})")
        source, length = STATE_PARTS[part]
        value = np.asarray(raw[source])
        if part == "eef_axisangle":
            value = quat2axisangle(value)
        elif part == "eef_axisangle_float32":
            value = quat2axisangle_float32(value)
        elif part in vla_eval.DERIVED_PARTS:
            value = vla_eval.DERIVED_PARTS[part](value)
        if value.shape != (length,):
            raise ValueError(f"state part {part!r} has shape {value.shape}, expected ({length},)")
        pieces.append(value)
    return np.concatenate(pieces) if pieces else np.zeros(0)


def _spread(part: str, raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if part == "proprio":
        return {k: v for k, v in raw.items() if k.startswith("robot0_") and not k.endswith("_image")}
    if part == "object_positions":
        return {k: v for k, v in raw.items() if k.startswith("object/")}
    if part == "task_goal":
        return {k: v for k, v in raw.items() if k.startswith("task/")}
    raise ValueError(f"unknown spread state part {part!r} (known: {', '.join(SPREAD_PARTS)})")


def shape_observation(profile: ObservationProfile, raw: dict[str, np.ndarray], frames: dict[str, np.ndarray]) -> dict:
    """The observation a policy receives (without the instruction), from raw observables and raw renders.

    `raw` holds robosuite observables by name (plus privileged `object/*` and `task/*`
    entries when a spread profile asks for them); `frames` holds one raw render per
    camera of the profile (empty when the profile has no cameras).
    """
    dtype = np.dtype(profile.state.dtype)
    obs: dict = {}
    for spec in profile.cameras:
        obs[spec.key] = prepare_image(spec, frames[spec.camera])
    if profile.state.composition == "concat":
        obs[profile.state.key] = compose_state(profile.state.parts, raw).astype(dtype)
    else:
        for part in profile.state.parts:
            obs.update({k: np.asarray(v, dtype=dtype) for k, v in _spread(part, raw).items()})
    for spec in profile.extra_states:
        obs[spec.key] = compose_state(spec.parts, raw).astype(np.dtype(spec.dtype))
    obs.update(profile.extra)
    return obs


OPENPI_LIBERO = ObservationProfile(
    # openpi examples/libero/main.py: 256x256 renders, rotated 180 degrees, resize_with_pad to
    # 224x224 uint8; state = eef_pos + quat2axisangle(eef_quat) + gripper_qpos (8 floats, float64
    # as the client concatenates them); the instruction under "prompt".
    name="openpi-libero",
    cameras=(
        CameraSpec(camera="agentview", key="observation/image", size=256, rotate_180=True, resize_with_pad=(224, 224)),
        CameraSpec(camera="robot0_eye_in_hand", key="observation/wrist_image", size=256, rotate_180=True, resize_with_pad=(224, 224)),
    ),
    state=StateSpec(composition="concat", parts=("eef_pos", "eef_axisangle", "gripper_qpos"), key="observation/state"),
    instruction_key="prompt",
)

LEROBOT_LIBERO = ObservationProfile(
    # LeRobot (huggingface/lerobot): src/lerobot/envs/libero.py renders agentview_image and
    # robot0_eye_in_hand_image at the size the env is built with (LiberoEnv's default 256; lerobot-eval's
    # `--env.type=libero` config builds it at 360: the episode protocol's camera_size says which) and maps them to
    # "image" and "image2", which preprocessing prefixes to observation.images.image and
    # observation.images.image2; src/lerobot/processor/env_processor.py (LiberoProcessorStep)
    # flips both H and W (a 180 degree rotation) and builds observation.state = eef pos (3) +
    # axis-angle of the eef quaternion (3, computed in float32) + gripper qpos (2) as float32; no resize. LeRobot's
    # policies read the instruction from "task". Images go over the wire as uint8 HxWx3 (the
    # server side converts to float CHW as LeRobot's own preprocessing does).
    name="lerobot-libero",
    cameras=(
        CameraSpec(camera="agentview", key="observation.images.image", size=None, rotate_180=True),
        CameraSpec(camera="robot0_eye_in_hand", key="observation.images.image2", size=None, rotate_180=True),
    ),
    state=StateSpec(
        composition="concat", parts=("eef_pos", "eef_axisangle_float32", "gripper_qpos"), key="observation.state",
        dtype="float32",
    ),
    instruction_key="task",
)

PRIVILEGED = ObservationProfile(
    # The embedded reference policies (rescue/embedded/scripted.py, learned.py, expert.py) read
    # robot0_eef_pos, robot0_gripper_qpos, task/object_pos, task/target_pos and "prompt"; the
    # rule wrappers read robot0_gripper_qpos. The profile keeps exactly the observation these
    # policies were built against (all robot0_* proprioception, object/* and task/*), no images.
    name="privileged",
    cameras=(),
    state=StateSpec(composition="spread", parts=("proprio", "object_positions", "task_goal")),
    instruction_key="prompt",
)

# vla-eval's LIBERO benchmark, one variant per set of observation params a server asks for (rescue.core.vla_eval_observation).
VLA_EVAL_LIBERO = tuple(ObservationProfile.model_validate(data) for data in vla_eval.profile_data())

PROFILES: dict[str, ObservationProfile] = {p.name: p for p in (OPENPI_LIBERO, LEROBOT_LIBERO, PRIVILEGED, *VLA_EVAL_LIBERO)}


def get_profile(name: str) -> ObservationProfile:
    """A built-in profile by name."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown observation profile {name!r} (built in: {', '.join(PROFILES)})") from None
