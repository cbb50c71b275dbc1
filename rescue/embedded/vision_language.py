"""The embedded vision-language policy: it reads only the openpi-libero contract (DESIGN §7).

Inputs, read as openpi's LIBERO policy reads them: `observation/image` (the
agentview, 224x224), `observation/wrist_image` (checked, not used),
`observation/state` (eef position, axis-angle, finger joints: 8 floats) and
`prompt`. No simulator state reaches it.

Two learned parts, both frozen:
- the object locator (`rescue.embedded.locator`): from the agentview and the
  prompt's sentence embedding, where the object the prompt names is and where
  the target is. An injected subgoal that names an object names the one to
  act on (the newest instruction wins);
- the chunk network of `rescue.embedded.learned`: from the gripper's state, the
  located object and target, and the prompt, a chunk of actions.
So the language selects the behaviour: the object the prompt names is the one
the gripper goes to.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from rescue.embedded.learned import DEFAULT_CHECKPOINT as CONTROLLER_CHECKPOINT
from rescue.embedded.learned import LearnedPolicy, text_features
from rescue.embedded.locator import build_network, shrink

DEFAULT_LOCATOR = Path(str(resources.files("rescue") / "assets" / "models" / "locator_libero_object.pt"))
IMAGE_KEY, WRIST_KEY, STATE_KEY, PROMPT_KEY = "observation/image", "observation/wrist_image", "observation/state", "prompt"
IMAGE_SHAPE = (224, 224, 3)


def parse_image(image) -> np.ndarray:
    """An image as uint8 HxWx3: float images in [0, 1] are scaled and CHW is transposed, as openpi's LIBERO policy does."""
    img = np.asarray(image)
    if np.issubdtype(img.dtype, np.floating):
        # A NaN would cast to some byte and the policy would answer it: an image it cannot read is refused.
        if not np.all(np.isfinite(img)) or img.min(initial=0.0) < 0.0 or img.max(initial=0.0) > 1.0:
            raise ValueError("a float image must hold finite values in [0, 1]")
        img = (255 * img).astype(np.uint8)
    if img.shape[0] == 3:
        img = np.transpose(img, (1, 2, 0))
    return img


class VisionLanguagePolicy:
    """Locator plus chunk network behind the policy interface: `infer(obs) -> {"actions": (C, 7)}`."""

    # The observation profile it reads (DESIGN §7), announced in the server's metadata.
    observation = "openpi-libero"
    # Neither network keeps state between calls: a fork may continue it on a fresh connection (DESIGN §13).
    stateless = True

    def __init__(
        self,
        locator: str | Path = DEFAULT_LOCATOR,
        controller: str | Path = CONTROLLER_CHECKPOINT,
        action_noise: float | None = None,
        seed: int = 0,
    ):
        import torch

        torch.set_num_threads(1)
        ckpt = torch.load(Path(locator), map_location="cpu", weights_only=False)
        self.locator_meta = ckpt["meta"]
        self.locator = build_network(int(self.locator_meta["text_dim"]))
        self.locator.load_state_dict(ckpt["state_dict"])
        self.locator.eval()
        self._mean = np.asarray(self.locator_meta["label_mean"], np.float32)
        self._std = np.asarray(self.locator_meta["label_std"], np.float32)
        self.controller = LearnedPolicy(controller, action_noise=action_noise, seed=seed)
        self.action_horizon = self.controller.action_horizon

    # -- RNG extension (the controller's sampling noise) -----------------
    def reset_rng(self, seed: int) -> None:
        """Restart the sampling noise from a seed."""
        self.controller.reset_rng(seed)

    def rng_state(self) -> str:
        """A digest of the sampling RNG's state; reading it does not advance it."""
        return self.controller.rng_state()

    # -- Policy ----------------------------------------------------------
    def reset(self) -> None:
        """Neither network keeps per-episode state."""

    def locate(self, image: np.ndarray, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """Where the prompt's object and the target are, from the agentview alone (world metres)."""
        import torch

        with torch.no_grad():
            out = self.locator(
                torch.from_numpy(shrink(image)[None]), torch.from_numpy(np.array(text_features(prompt)[None]))
            )[0].numpy()
        return out[:3] * self._std + self._mean, out[3:] * self._std + self._mean

    def read(self, obs: dict) -> tuple[np.ndarray, np.ndarray, str]:
        """The contract's inputs, checked: agentview (uint8 224x224x3), state (8,), prompt."""
        missing = [k for k in (IMAGE_KEY, WRIST_KEY, STATE_KEY, PROMPT_KEY) if k not in obs]
        if missing:
            raise KeyError(f"openpi-libero observation lacks {', '.join(missing)}")
        image, wrist = parse_image(obs[IMAGE_KEY]), parse_image(obs[WRIST_KEY])
        for key, img in ((IMAGE_KEY, image), (WRIST_KEY, wrist)):
            if img.shape != IMAGE_SHAPE:
                raise ValueError(f"{key} has shape {img.shape}, expected {IMAGE_SHAPE}")
        state = np.asarray(obs[STATE_KEY], dtype=np.float32).reshape(-1)
        if state.shape != (8,):
            raise ValueError(f"{STATE_KEY} has shape {state.shape}, expected (8,)")
        if not np.all(np.isfinite(state)):
            raise ValueError(f"{STATE_KEY} holds a value that is not finite")
        return image, state, str(obs[PROMPT_KEY])

    def infer(self, obs: dict) -> dict:
        """Locate, then predict a chunk with the controller's seeded sampling noise."""
        image, state, prompt = self.read(obs)
        obj, target = self.locate(image, prompt)
        controller_obs = {
            "robot0_eef_pos": state[:3],
            "robot0_gripper_qpos": state[6:8],
            "task/object_pos": obj,
            "task/target_pos": target,
            "prompt": prompt,
        }
        out = self.controller.infer(controller_obs)
        return {**out, "object_pos": obj, "target_pos": target}


def make_policy() -> VisionLanguagePolicy:
    """Factory for the bundled server: the committed libero_object checkpoints."""
    return VisionLanguagePolicy()
