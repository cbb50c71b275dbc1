"""Build LeRobot policies with random weights and save them as LeRobot saves a trained one (run in LeRobot's venv).

    python tests/lerobot_policies.py OUT_DIR        # writes OUT_DIR/act, OUT_DIR/diffusion and the variants below

Each is built from its config class with LIBERO's features (two 256x256 cameras,
the 8-float state, 7-dim actions), nothing from a hub (`pretrained_backbone_weights
= None`), and saved with `save_pretrained` together with its pre/post processors
(normalisation statistics included), so `rescue-serve lerobot OUT_DIR/act` loads it
the way it loads a user's checkpoint. Kept small so the interop tier takes minutes:
ACT with chunks of 10, Diffusion with a short horizon, a small U-Net and 4 denoising
steps (n_obs_steps = 2: an observation history, served at C = 1). Besides, ACT variants a user may
bring: `act_ensemble` (LeRobot's documented temporal ensembling: `temporal_ensemble_coeff = 0.01`,
`n_action_steps = 1`), `act_3cam` (a third camera the LIBERO profile does not send) and `act_6dim`
(6-dimensional actions, another robot's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
from lerobot.policies.act.configuration_act import ACTConfig
from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
from lerobot.policies.factory import get_policy_class, make_pre_post_processors

IMAGE = (3, 256, 256)
INPUTS = {
    "observation.images.image": PolicyFeature(type=FeatureType.VISUAL, shape=IMAGE),
    "observation.images.image2": PolicyFeature(type=FeatureType.VISUAL, shape=IMAGE),
    "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(8,)),
}
OUTPUTS = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(7,))}


def _stats() -> dict[str, dict[str, torch.Tensor]]:
    """Normalisation statistics of the kind a LIBERO dataset has (every kind, for every feature)."""
    stats = {}
    for key, feature in {**INPUTS, "observation.images.image3": INPUTS["observation.images.image"], **OUTPUTS}.items():
        shape = (feature.shape[0], 1, 1) if feature.type is FeatureType.VISUAL else feature.shape
        stats[key] = {
            "mean": torch.full(shape, 0.4),
            "std": torch.full(shape, 0.25),
            "min": torch.full(shape, -1.0),
            "max": torch.full(shape, 1.0),
        }
    return stats


def _act(inputs: dict = INPUTS, outputs: dict = OUTPUTS, **fields) -> ACTConfig:
    return ACTConfig(chunk_size=10, pretrained_backbone_weights=None, dim_model=128, dim_feedforward=256,
                     n_encoder_layers=2, input_features=dict(inputs), output_features=dict(outputs), device="cpu",
                     **fields)


def configs() -> dict[str, object]:
    """The policies' configs."""
    common = {"input_features": dict(INPUTS), "output_features": dict(OUTPUTS), "device": "cpu"}
    return {
        "act": _act(n_action_steps=10),
        "diffusion": DiffusionConfig(n_obs_steps=2, horizon=16, n_action_steps=8, num_inference_steps=4,
                                     down_dims=(32, 64, 128), crop_shape=(84, 84), pretrained_backbone_weights=None,
                                     normalization_mapping={"VISUAL": NormalizationMode.MEAN_STD,
                                                            "STATE": NormalizationMode.MIN_MAX,
                                                            "ACTION": NormalizationMode.MIN_MAX},
                                     **common),
        "act_ensemble": _act(n_action_steps=1, temporal_ensemble_coeff=0.01),
        "act_3cam": _act({**INPUTS, "observation.images.image3": PolicyFeature(type=FeatureType.VISUAL, shape=IMAGE)},
                         n_action_steps=10),
        "act_6dim": _act(outputs={"action": PolicyFeature(type=FeatureType.ACTION, shape=(6,))}, n_action_steps=10),
    }


def main(out: Path) -> int:
    torch.manual_seed(0)
    for name, config in configs().items():
        policy = get_policy_class(config.type)(config)
        stats = _stats()
        stats["action"] = {k: v[: config.output_features["action"].shape[0]] for k, v in stats["action"].items()}
        preprocessor, postprocessor = make_pre_post_processors(config, dataset_stats=stats)
        folder = out / name
        policy.save_pretrained(folder)
        preprocessor.save_pretrained(folder)
        postprocessor.save_pretrained(folder)
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
