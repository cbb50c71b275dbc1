"""The image-only subgoal model: three camera views in, the task phase and object out.

A small convolutional network (torch, CPU) with one trunk shared by the
views, trained on rendered LIBERO frames labelled by the expert
(`training/make_frames.py`, `training/train_vision.py` under this folder). It sees pixels only:
no poses, no simulator state.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import numpy as np
from PIL import Image

# Package data (a link to the top-level models/ in a checkout), so any install finds it.
DEFAULT_CHECKPOINT = Path(str(resources.files("rescue") / "assets" / "models" / "subgoal_vision.pt"))
VIEWS = ("agentview", "frontview", "robot0_eye_in_hand")
INPUT_SIZE = 64
# The objects of libero_object's ten tasks, in task order.
OBJECTS = (
    "alphabet soup", "cream cheese", "salad dressing", "bbq sauce", "ketchup",
    "tomato sauce", "butter", "milk", "chocolate pudding", "orange juice",
)


def downsample(view: np.ndarray | Image.Image) -> np.ndarray:
    """One view as uint8 INPUT_SIZE x INPUT_SIZE x 3 (box filter), the same at training and serving."""
    image = view if isinstance(view, Image.Image) else Image.fromarray(np.asarray(view, dtype=np.uint8))
    return np.asarray(image.convert("RGB").resize((INPUT_SIZE, INPUT_SIZE), Image.BOX), dtype=np.uint8)


def build_network(n_phases: int = 7, n_objects: int = len(OBJECTS)):
    """Shared per-view conv trunk, concatenated view features, a phase head and an object head."""
    import torch
    from torch import nn

    class SubgoalNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = nn.Sequential(
                nn.Conv2d(3, 24, 5, stride=2, padding=2), nn.GroupNorm(4, 24), nn.GELU(),
                nn.Conv2d(24, 48, 3, stride=2, padding=1), nn.GroupNorm(8, 48), nn.GELU(),
                nn.Conv2d(48, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.GELU(),
                nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.GELU(),
                nn.Flatten(),  # 64 x 4 x 4: keep where things are, not only what
                nn.Linear(64 * 16, 128), nn.GELU(),
            )
            self.head = nn.Sequential(nn.Linear(128 * len(VIEWS), 256), nn.GELU())
            self.phase = nn.Linear(256, n_phases)
            self.object = nn.Linear(256, n_objects)

        def forward(self, views: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # views: (B, V, 3, H, W) floats in [-0.5, 0.5]
            b, v = views.shape[:2]
            feats = self.trunk(views.flatten(0, 1)).view(b, v * 128)
            h = self.head(feats)
            return self.phase(h), self.object(h)

    return SubgoalNet()


def to_tensor(frames: np.ndarray):
    """uint8 (B, V, H, W, 3) -> float tensor (B, V, 3, H, W) in [-0.5, 0.5]."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(frames.transpose(0, 1, 4, 2, 3))).float() / 255.0 - 0.5


class SubgoalModel:
    """The frozen network: `predict(views)` gives phase and object probabilities."""

    def __init__(self, checkpoint: str | Path = DEFAULT_CHECKPOINT):
        import torch

        torch.set_num_threads(1)
        ckpt = torch.load(Path(checkpoint), map_location="cpu", weights_only=False)
        self.meta = ckpt["meta"]
        self.net = build_network()
        self.net.load_state_dict(ckpt["state_dict"])
        self.net.eval()

    def predict(self, views: list[Image.Image | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Phase and object probabilities from the three views, in VIEWS order."""
        import torch

        if len(views) != len(VIEWS):
            raise ValueError(f"expected {len(VIEWS)} views, got {len(views)}")
        frames = np.stack([downsample(v) for v in views])[None]
        with torch.no_grad():
            phase, obj = self.net(to_tensor(frames))
        return torch.softmax(phase[0], -1).numpy(), torch.softmax(obj[0], -1).numpy()


@functools.lru_cache(maxsize=2)
def load_model(checkpoint: str | Path = DEFAULT_CHECKPOINT) -> SubgoalModel | None:
    """The committed model, or None when its file is missing."""
    return SubgoalModel(checkpoint) if Path(checkpoint).is_file() else None
