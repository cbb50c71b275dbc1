"""The object locator: the agentview image and the instruction in, where the named object and the target are.

A small convolutional network (torch, CPU) whose features are modulated by the
instruction's sentence embedding (FiLM) and read out by a spatial softmax, so
the text decides which object's keypoints it attends to. Trained on rendered
openpi-libero agentviews labelled with the simulator's positions
(`training/make_scenes.py`, `training/train_locator.py` under this folder); at run time it sees
pixels and text only.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

INPUT_SIZE = 112  # the 224x224 openpi-libero image, box-downsampled by two


def shrink(image: np.ndarray) -> np.ndarray:
    """A 224x224 openpi-libero image as uint8 INPUT_SIZE x INPUT_SIZE x 3 (box filter), at training and serving."""
    img = Image.fromarray(np.asarray(image, dtype=np.uint8))
    return np.array(img.convert("RGB").resize((INPUT_SIZE, INPUT_SIZE), Image.BOX), dtype=np.uint8)


def build_network(text_dim: int, keypoints: int = 32, width: int = 32, hidden: int = 256):
    """Conv trunk with FiLM from the text, a spatial softmax, and an MLP to the object's and target's positions."""
    import torch
    from torch import nn

    def block(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.GroupNorm(8, cout), nn.GELU())

    class LocatorNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, width // 2, 5, 2, 2), nn.GELU(), block(width // 2, width, 2))
            self.film_blocks = nn.ModuleList([block(width, width, 1), block(width, width, 1)])
            self.text = nn.Sequential(nn.Linear(text_dim, 128), nn.GELU())
            self.film = nn.Linear(128, 2 * 2 * width)  # a scale and a shift per channel for each FiLM block
            self.points = nn.Conv2d(width, keypoints, 1)
            self.head = nn.Sequential(
                nn.Linear(2 * keypoints + 128, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 6)
            )

        def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
            # image: (B, H, W, 3) uint8; text: (B, text_dim)
            x = image.permute(0, 3, 1, 2).float() / 127.5 - 1.0
            x = self.stem(x)
            t = self.text(text)
            gammas = self.film(t).view(-1, len(self.film_blocks), 2, x.shape[1], 1, 1)
            for i, blk in enumerate(self.film_blocks):
                x = blk(x) * (1.0 + gammas[:, i, 0]) + gammas[:, i, 1]
            maps = self.points(x)
            b, k, h, w = maps.shape
            attn = torch.softmax(maps.view(b, k, h * w), dim=-1).view(b, k, h, w)
            ys = torch.linspace(-1.0, 1.0, h, device=x.device)
            xs = torch.linspace(-1.0, 1.0, w, device=x.device)
            kp = torch.cat([(attn.sum(3) * ys).sum(2), (attn.sum(2) * xs).sum(2)], dim=1)
            return self.head(torch.cat([kp, t], dim=1))

    return LocatorNet()
