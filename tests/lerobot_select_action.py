"""LeRobot's own `select_action` over episodes, as lerobot-eval runs a policy (run in LeRobot's venv).

    python tests/lerobot_select_action.py POLICY_DIR OUT.npz SEED STEPS EPISODES

The policy and its processors load as LeRobot loads them (`from_pretrained`, `make_pre_post_processors`),
torch on one thread (what `rescue-serve lerobot` pins by default). `torch.manual_seed(SEED)` once, then each
episode: `policy.reset()`, and STEPS observations (`observation(episode, step)`: what a test sends the served
policy) through `preprocess_observation`, the policy's preprocessor, `select_action` and its postprocessor,
as lerobot-eval's rollout does. OUT.npz holds `episode<k>`: (STEPS, action_dim) float32.

`observation` needs numpy only: the test imports it in this project's venv.
"""

from __future__ import annotations

import sys

import numpy as np

TASK = "put the bowl on the plate"


def observation(episode: int, step: int) -> dict:
    """The lerobot-libero observation of a step of an episode: two 256x256 cameras, the 8-float state, the task."""
    rng = np.random.default_rng([episode, step])
    return {"observation.images.image": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
            "observation.images.image2": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
            "observation.state": rng.standard_normal(8).astype(np.float32), "task": TASK}


def main(policy_dir: str, out: str, seed: int, steps: int, episodes: int) -> int:
    import torch
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.envs.utils import preprocess_observation
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    torch.set_num_threads(1)
    config = PreTrainedConfig.from_pretrained(policy_dir)
    policy = get_policy_class(config.type).from_pretrained(policy_dir, config=config)
    policy.eval()
    preprocessor, postprocessor = make_pre_post_processors(config, pretrained_path=policy_dir)
    torch.manual_seed(seed)
    result = {}
    for episode in range(episodes):
        policy.reset()
        actions = []
        for step in range(steps):
            obs = observation(episode, step)
            batch = preprocess_observation({
                "pixels": {"image": obs["observation.images.image"][None],
                           "image2": obs["observation.images.image2"][None]},
                "agent_pos": obs["observation.state"][None],
            })
            batch["task"] = [obs["task"]]
            with torch.inference_mode():
                action = postprocessor(policy.select_action(preprocessor(batch)))
            actions.append(action.detach().cpu().numpy().astype(np.float32).reshape(-1))
        result[f"episode{episode}"] = np.stack(actions)
    np.savez(out, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
