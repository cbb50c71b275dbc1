"""An evaluation loop written the way openpi's LIBERO example runs it (examples/libero/main.py).

Per task: `OffScreenRenderEnv(bddl, camera_heights=256, camera_widths=256)` (robosuite's default
`hard_reset=True`: every reset rebuilds the model), `env.seed(7)` once, then the task's episodes
in order: `env.reset()`, `env.set_init_state(initial_states[k])`, 10 steps of `[0]*6 + [-1]`,
then a new chunk every 5 steps from the policy over openpi's websocket client, the first 5
actions executed, until success or `max_steps`. Observations as the example builds them: both
cameras rotated 180 degrees, `image_tools.resize_with_pad(224)` and `convert_to_uint8`, the
state eef pos + axis-angle + gripper qpos, the prompt the task's language.

Before each episode the loop resets the policy's RNG to the episode's seed through the bundled
server's control message (plain openpi has none; without it two runs of one episode sample
differently), so the comparison is of the episodes, not of the sampler.

`python tests/openpi_client_loop.py URL SUITE TASKS EPISODES MAX_STEPS OUT.json` writes, per
episode, every query's step and the digests of the images, the state and the prompt it sent, as a
study's trace rows digest them.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np


def _quat2axisangle(quat: np.ndarray) -> np.ndarray:
    # examples/libero/main.py's own copy of robosuite's formula.
    quat = quat.copy()
    if quat[3] > 1.0:
        quat[3] = 1.0
    elif quat[3] < -1.0:
        quat[3] = -1.0
    den = np.sqrt(1.0 - quat[3] * quat[3])
    if math.isclose(den, 0.0):
        return np.zeros(3)
    return (quat[:3] * 2.0 * math.acos(quat[3])) / den


def main() -> None:
    url, suite_name, tasks, episodes, max_steps, out = sys.argv[1:]
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv
    from openpi_client import image_tools
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from rescue.core.digest import digest_array, digest_obs, digest_text
    from rescue.core.figures.evaluation import case_id_of
    from rescue.core.manifest import derive_policy_seed

    host, port = url.removeprefix("ws://").rsplit(":", 1)
    client = WebsocketClientPolicy(host, int(port))
    suite = benchmark.get_benchmark_dict()[suite_name]()
    result: dict[str, list[dict]] = {}
    for task_id in (int(t) for t in tasks.split(",")):
        task = suite.get_task(task_id)
        initial_states = suite.get_task_init_states(task_id)
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=256, camera_widths=256)
        env.seed(7)
        for k in range(int(episodes)):
            client.infer({"__rescue__": "reset"})
            client.infer({"__rescue__": "reset_rng", "seed": derive_policy_seed(7)})
            env.reset()
            obs = env.set_init_state(initial_states[k])
            t, plan, rows = 0, [], []
            while t < int(max_steps) + 10:
                if t < 10:
                    obs, _, done, _ = env.step([0.0] * 6 + [-1.0])
                    t += 1
                    continue
                if not plan:
                    img = np.ascontiguousarray(obs["agentview_image"][::-1, ::-1])
                    wrist = np.ascontiguousarray(obs["robot0_eye_in_hand_image"][::-1, ::-1])
                    element = {
                        "observation/image": image_tools.convert_to_uint8(image_tools.resize_with_pad(img, 224, 224)),
                        "observation/wrist_image": image_tools.convert_to_uint8(image_tools.resize_with_pad(wrist, 224, 224)),
                        "observation/state": np.concatenate(
                            (obs["robot0_eef_pos"], _quat2axisangle(obs["robot0_eef_quat"]), obs["robot0_gripper_qpos"])
                        ),
                        "prompt": str(task.language),
                    }
                    rows.append({
                        "step": t - 10,
                        "images": {key: digest_array(element[key]) for key in ("observation/image", "observation/wrist_image")},
                        "state": digest_obs({"observation/state": element["observation/state"]}),
                        "prompt": digest_text(element["prompt"]),
                    })
                    plan = list(client.infer(element)["actions"][:5])
                obs, _, done, _ = env.step(plan.pop(0).tolist())
                t += 1
                if done:
                    break
            result[case_id_of(suite_name, task_id, k)] = rows
        env.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
