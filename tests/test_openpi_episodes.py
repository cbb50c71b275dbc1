"""The user's own episodes, bit for bit: rescue's control arms against the peer's own evaluation loop.

openpi: a loop written the way openpi's LIBERO example runs (tests/openpi_client_loop.py: hard
resets, `env.seed(7)` once per task, episodes in order, `task.language` as the prompt, openpi-client
on the wire) queries the bundled vision-language policy server; `rescue eval` queries the same server
under the `openpi` protocol (the default for a policy server). Every query of every episode must carry
the same image, state and prompt digests, in three suites: episode indices 0, 1, 2 of two tasks of
libero_spatial (each task seeded once), which places its fixtures from the random stream, so episode
k > 0 depends on the k resets before it; episodes 0 and 1 of one task of libero_object and of
libero_object_lan (its BDDL says other words than its task.language, and openpi's loop sends the
latter, which the policy acts on). They are failures all: 10 steps is too short to succeed.

LeRobot: its LIBERO env seeds `1000 + j` before episode j's (hard) reset; a loop written that way
and rescue's simulator under the `lerobot` protocol and `lerobot-libero` profile, given the same
actions, must see the same images (`observation.images.*`) and state at every query step.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import ROOT, cli_env, ensure_stopped, export_of, rescue_cli

from rescue.core.catalog import libero_catalog
from rescue.core.digest import digest_array, digest_obs, digest_text
from rescue.core.episode_protocol import get_protocol
from rescue.core.figures.evaluation import episode_cases
from rescue.core.manifest import load_manifest
from rescue.env.pool import SimProcess
from rescue.study.journal import Journal

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

MAX_STEPS, C = 10, 5
# Per suite, (tasks, episodes of each): libero_spatial's episode 2 follows two resets that placed its fixtures
# from the random stream, and its second task shows the seed is per task; one task each of the others.
EPISODES = {"libero_object": ("0", 2), "libero_spatial": ("0,1", 3), "libero_object_lan": ("1", 2)}
SUITES = tuple(EPISODES)


@pytest.fixture(scope="module")
def vision_language_server():
    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "serve-policy", "--policy", "rescue.embedded.vision_language:make_policy",
         "--port", "0"],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        for line in proc.stdout:
            found = re.search(r"(ws://\S+)", line)
            if found:
                yield found.group(1).rstrip("/")
                break
        else:
            raise AssertionError("the policy server did not start")
    finally:
        ensure_stopped(proc)


@pytest.mark.parametrize("suite", SUITES)
def test_control_arms_under_the_openpi_protocol_are_openpis_episodes_query_by_query(tmp_path, suite, vision_language_server):
    url, (tasks, episodes) = vision_language_server, EPISODES[suite]
    loop_out = tmp_path / "loop.json"
    loop = subprocess.run([sys.executable, str(ROOT / "tests" / "openpi_client_loop.py"), url, suite, tasks,
                           str(episodes), str(MAX_STEPS), str(loop_out)], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=1200)
    assert loop.returncode == 0, loop.stderr[-3000:]
    theirs = json.loads(loop_out.read_text())

    config = tmp_path / "c.toml"
    config.write_text(f"[policy]\nreplan_interval = {C}\n")
    study = tmp_path / "eval"
    rescue_cli("eval", "--suite", suite, "--tasks", tasks, "--episodes", str(episodes), "--horizon", str(MAX_STEPS),
               "--policy-url", url, "--config", str(config), "--study", str(study), timeout=1200)
    with Journal.open(study, readonly=True) as journal:
        arms = {case_id: by_arm["control"] for case_id, by_arm in journal.all_arms().items()}
        cases = {c.case_id: c for c in journal.cases()}
    assert sorted(arms) == sorted(theirs) and len(arms) == len(tasks.split(",")) * episodes
    for case_id, arm in arms.items():
        assert arm.episode_protocol == "openpi" and arm.episode_markers is False  # openpi's client sends none
        assert cases[case_id].env_seed == 7  # openpi seeds each task once, with 7
        assert arm.status == "complete" and arm.success is False, (case_id, arm.error)
        ours = [{"step": r.step, "images": r.images, "state": r.state, "prompt": r.instruction} for r in arm.trace]
        assert len(ours) == MAX_STEPS // C
        assert ours == theirs[case_id], case_id
    # Not one episode repeated: the initial states differ, and so do the queries.
    assert len({arm.trace[0].images["observation/image"] for arm in arms.values()}) == len(arms)
    if suite == "libero_object_lan":
        # openpi's loop told task.language, the base suite's words, not the BDDL's rewritten ones.
        catalog = libero_catalog()
        for case_id, arm in arms.items():
            task = catalog.task(suite, cases[case_id].task_id)
            assert task.task_language != task.instruction
            assert {r.instruction for r in arm.trace} == {digest_text(task.task_language)}, case_id


def _lerobot_info(successes_by_task: dict[int, list[bool]]) -> bytes:
    """An eval_info.json in the shape lerobot-eval writes it (per_task, with each episode's success)."""
    per_task = [{"task_group": "libero_object", "task_id": t,
                 "metrics": {"sum_rewards": [0.0] * len(s), "max_rewards": [0.0] * len(s), "successes": s, "video_paths": []}}
                for t, s in successes_by_task.items()]
    return json.dumps({"per_task": per_task, "per_group": {}, "overall": {}}).encode()


LEROBOT_LOOP = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv
    from rescue.core.digest import digest_array, digest_obs

    import torch

    def lerobot_axisangle(quat):
        # LiberoProcessorStep._quat2axisangle (LeRobot 0.6.1), torch on a batch of one: the quaternion as float32,
        # w clamped, axis = xyz / sqrt(1 - w^2), times 2 acos(w) (the interop tier runs LeRobot's own).
        q = torch.from_numpy(np.asarray(quat, dtype=np.float64)[None]).to(torch.float32)
        w = q[:, 3].clamp(-1.0, 1.0)
        den = torch.sqrt(torch.clamp(1.0 - w * w, min=0.0))
        result = torch.zeros((1, 3))
        mask = den > 1e-10
        if mask.any():
            result[mask] = q[mask, :3] / den[mask].unsqueeze(1) * (2.0 * torch.acos(w[mask])).unsqueeze(1)
        return result[0].numpy()

    suite_name, tasks, episodes, actions_json, out = sys.argv[1:]
    actions = np.array(json.loads(actions_json))
    suite = benchmark.get_benchmark_dict()[suite_name]()
    result = {}
    for task_id in map(int, tasks.split(",")):
        task = suite.get_task(task_id)
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        # LeRobot's LiberoEnv: one env per task, hard resets, one unseeded reset when it is made; built at
        # lerobot-eval's LIBERO config size (observation_height = observation_width = 360).
        env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=360, camera_widths=360)
        env.reset()
        init_states = suite.get_task_init_states(task_id)
        for j in range(int(episodes)):
            env.seed(1000 + j)  # lerobot-eval's start seed plus the episode
            env.reset()
            obs = env.set_init_state(init_states[j % len(init_states)])
            for _ in range(10):
                obs, _, _, _ = env.step([0, 0, 0, 0, 0, 0, -1])
            rows = []
            for i in range(0, len(actions), 5):
                images = {
                    "observation.images.image": np.ascontiguousarray(obs["agentview_image"][::-1, ::-1]),
                    "observation.images.image2": np.ascontiguousarray(obs["robot0_eye_in_hand_image"][::-1, ::-1]),
                }
                state = np.concatenate((obs["robot0_eef_pos"], lerobot_axisangle(obs["robot0_eef_quat"]),
                                        obs["robot0_gripper_qpos"])).astype(np.float32)
                rows.append({"images": {k: digest_array(v) for k, v in images.items()},
                             "state": digest_obs({"observation.state": state})})
                for a in actions[i:i + 5]:
                    obs, _, _, _ = env.step(a.tolist())
            result[f"{task_id}-{j}"] = rows
    json.dump(result, open(out, "w"))
    """
)


def test_the_lerobot_protocol_starts_lerobots_episodes_and_its_profile_sends_its_keys(tmp_path):
    suite, tasks, episodes = "libero_spatial", "7", 2
    rng = np.random.default_rng(5)
    actions = np.zeros((20, 7))
    actions[:, :6] = rng.uniform(-0.4, 0.4, (20, 6))
    actions[:, 6] = np.where(np.arange(20) < 10, -1.0, 1.0)
    out = tmp_path / "lerobot.json"
    loop = subprocess.run([sys.executable, "-c", LEROBOT_LOOP, suite, tasks, str(episodes), json.dumps(actions.tolist()),
                           str(out)], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=1200)
    assert loop.returncode == 0, loop.stderr[-3000:]
    theirs = json.loads(out.read_text())
    protocol = get_protocol("lerobot")
    cases = episode_cases(suite, [int(t) for t in tasks.split(",")], episodes, protocol.horizon(suite), protocol=protocol)
    assert protocol.horizon(suite) == 280 and get_protocol("openpi").horizon(suite) == 220  # where they differ
    assert [c.env_seed for c in cases] == [1000, 1001]
    sim = SimProcess("rescue.env.libero:LiberoAdapter", name="sim-lerobot")
    try:
        for case in cases:
            obs = sim._call("reset", case, "lerobot-libero", "lerobot").obs
            assert set(obs) == {"observation.images.image", "observation.images.image2", "observation.state"}
            assert obs["observation.images.image"].shape == (360, 360, 3)
            rows = []
            for i in range(0, len(actions), 5):
                images = {k: obs[k] for k in ("observation.images.image", "observation.images.image2")}
                rows.append({"images": {k: digest_array(v) for k, v in images.items()},
                             "state": digest_obs({"observation.state": obs["observation.state"]})})
                obs = sim._call("run_chunk", actions[i:i + 5], 5, "always").obs
            assert rows == theirs[f"{case.task_id}-{case.init_state_index}"], case.case_id
    finally:
        sim.stop()
    assert len({r[0]["images"]["observation.images.image"] for r in theirs.values()}) == len(theirs)


def test_openpi_and_lerobot_results_become_manifests_whose_episodes_replay_their_fingerprints(tmp_path):
    openpi = tmp_path / "results.jsonl"
    openpi.write_text("".join(json.dumps({"suite": "libero_object", "task_id": 3, "episode": k, "success": k == 0}) + "\n"
                              for k in range(3)))
    lerobot = tmp_path / "eval_info.json"
    lerobot.write_bytes(_lerobot_info({3: [False, True]}))
    rescue_cli("manifest", "from-openpi", str(openpi), "--out", str(tmp_path / "o.jsonl"))
    rescue_cli("manifest", "from-lerobot", str(lerobot), "--out", str(tmp_path / "l.jsonl"))
    o, l = load_manifest(tmp_path / "o.jsonl").cases, load_manifest(tmp_path / "l.jsonl").cases
    assert [(c.case_id, c.env_seed, c.init_state_index, c.horizon, c.tags["episode_protocol"]) for c in o] == [
        ("object-3-ep1", 7, 1, 280, "openpi"), ("object-3-ep2", 7, 2, 280, "openpi")]
    assert [(c.case_id, c.env_seed, c.init_state_index, c.tags["episode_protocol"]) for c in l] == [
        ("object-3-ep0", 1000, 0, "lerobot")]
    assert all(c.fingerprint and len(c.fingerprint) == 64 for c in o + l)
    # Each names the results file it came from (rescue.core.figures.baseline): its name, sha256, episodes and successes.
    import hashlib

    from rescue.core.figures.baseline import baseline_of

    (src,) = baseline_of(o).sources
    assert (src.kind, src.cases, src.results_file, src.episodes, src.successes, src.failures, src.inits) == (
        "openpi", 2, "results.jsonl", 3, 1, 2, "0-2")
    assert src.results_sha256 == hashlib.sha256(openpi.read_bytes()).hexdigest()
    assert baseline_of(l).sources[0].kind == "lerobot" and baseline_of(l).sources[0].successes == 1
    # openpi's episode 1 and 2 of a task seeded once differ from each other and from LeRobot's episode 0.
    assert len({c.fingerprint for c in o + l}) == 3
    # A study of the openpi failures under that protocol starts from the fingerprinted states: no deviation.
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({**c.model_dump(mode="json", exclude_none=True), "horizon": 48}) + "\n" for c in o))
    rescue_cli("run", str(short), "--study", str(tmp_path / "s"), "--episode-protocol", "openpi",
               "--policy-factory", "rescue.embedded.scripted:make_policy", "--simulators", "1")
    labels = {c["case_id"]: c["label"] for c in export_of(tmp_path / "s")["cases"]}
    assert set(labels.values()) <= {"rescued", "not_rescued"}, labels
