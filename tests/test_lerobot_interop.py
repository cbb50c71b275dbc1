"""Real LeRobot policies, as a user installs and serves them, rescued by real studies (`bash scripts/test.sh interop`).

scripts/interop_venv.sh builds (once, outside the checkout) a Python 3.12 venv with
`lerobot[diffusion]==0.6.1` from the package index and this repository's serving
distribution; a venv that cannot be built fails the tier, it never skips. In it,
tests/lerobot_policies.py builds ACT and Diffusion from their configs with random weights
(nothing from a hub) and saves them with their processors; `rescue-serve lerobot DIR`
serves each from that venv. From this project's venv, each gets preflight and a
3-case study, verified and exported (ACT forked at q; Diffusion replayed, seeded,
C = 1), and a seeded replay of its cases that must agree with the study query by query.
Every policy, ACT with LeRobot's temporal ensembling among them, answers bit for bit what
LeRobot's own `select_action` answers over whole episodes (tests/lerobot_select_action.py),
on connections interleaved; and every bad checkpoint or observation is one line that names
a fix that can work. SmolVLA and LeRobot's pi0/pi05 need hub tokenizers even with random
weights, so they are not built here.

No wait here has a fixed wall-clock cut: a study runs until it ends, and a server's start is
bounded by a patience that grows with the machine's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import HANG_S, ROOT, arm_rows, cli_env, ensure_stopped, rescue_cli, wait_healthy, write_cases
from lerobot_select_action import observation
from openpi_libero_policy import free_port

from rescue.policy.client import PolicyServerError, WebsocketPolicyClient

pytestmark = pytest.mark.interop

CASES = 3


@pytest.fixture(scope="module")
def lerobot_python() -> str:
    """The LeRobot venv's python (built on first use, then reused); the tier fails when it cannot be built."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "interop_venv.sh")], cwd=ROOT, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.fail(f"the LeRobot venv could not be built (scripts/interop_venv.sh exited {proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def saved(lerobot_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ACT and Diffusion with random weights, saved as LeRobot saves a trained policy."""
    out = tmp_path_factory.mktemp("lerobot-policies")
    subprocess.run([lerobot_python, str(ROOT / "tests" / "lerobot_policies.py"), str(out)], cwd=out, check=True,
                   capture_output=True, text=True)
    return out


def _patience() -> float:
    """How long a wait that could hang is given: HANG_S, times the machine's load per core when above one."""
    return HANG_S * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


@contextlib.contextmanager
def served(python: str, folder: Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`rescue-serve lerobot FOLDER` in LeRobot's venv (the installed distribution, run from outside the checkout)."""
    port = free_port()
    proc = subprocess.Popen([python, "-m", "rescue_serve.cli", "lerobot", str(folder), "--port", str(port), *flags],
                            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_healthy(port, f"rescue-serve lerobot {folder.name}", proc, timeout_s=_patience())
        yield f"ws://127.0.0.1:{port}/", proc
    finally:
        ensure_stopped(proc)


def _rescue(*args: str) -> subprocess.CompletedProcess:
    """`rescue ARGS`, run until it ends (no wall-clock cut: a busy machine makes a study slow, not wrong)."""
    return rescue_cli(*args, timeout=None)


def _study(tmp: Path, url: str, name: str, horizon: int, fork: bool, arms: str = "") -> Path:
    config = tmp / f"{name}.toml"
    config.write_text(f"fork_at_q = {str(fork).lower()}\n{arms}\n[policy]\nurl = \"{url}\"\n\n"
                      "[env]\nepisode_protocol = \"lerobot\"\n")
    manifest = write_cases(tmp / f"{name}.jsonl", CASES, horizon=horizon)
    study = tmp / name
    _rescue("run", str(manifest), "--config", str(config), "--study", str(study))
    return study


def _traces(study: Path, arm: str) -> dict[str, list[dict]]:
    return {case: json.loads(data)["trace"] for (case, a), data in arm_rows(study).items() if a == arm}


def _check(tmp: Path, url: str, name: str, horizon: int, fork: bool) -> dict:
    """preflight, a verified and exported study, and a seeded replay of its control arms; returns the export."""
    config = tmp / "preflight.toml"
    config.write_text(f"fork_at_q = {str(fork).lower()}\n[policy]\nurl = \"{url}\"\n\n[env]\nepisode_protocol = \"lerobot\"\n")
    manifest = write_cases(tmp / "preflight.jsonl", CASES, horizon=horizon)
    pre = _rescue("preflight", str(manifest), "--config", str(config), "--cases", "1")
    assert "FAIL" not in pre.stdout, pre.stdout
    study = _study(tmp, url, name, horizon, fork)
    verify = _rescue("verify", str(study))
    assert verify.returncode == 0, verify.stdout
    _rescue("export", str(study))
    export = json.loads((study / "export.json").read_text())
    # The seeded replay: the same cases again, control arms only, on fresh connections.
    replay = _study(tmp, url, f"{name}-replay", horizon, fork, arms='arms = ["control"]')
    first, again = _traces(study, "control"), _traces(replay, "control")
    assert set(first) == set(again) and len(first) == CASES
    for case in first:
        assert len(first[case]) == len(again[case]) > 0
        for step, (a, b) in enumerate(zip(first[case], again[case])):
            assert (a["step"], a["images"], a["state"], a["actions"]) == (b["step"], b["images"], b["state"], b["actions"]), (case, step)
    return export


def _announced(study: Path) -> dict:
    return json.loads((study / "config.json").read_text())["policy"]["announced"]


def test_act_served_as_saved_forks_at_q(lerobot_python, saved, tmp_path):
    with served(lerobot_python, saved / "act") as (url, proc):
        export = _check(tmp_path, url, "act", horizon=40, fork=True)
    study = export["study"]
    assert (study["mode"], study["replan_interval"], study["observation"]) == ("fork", 10, "lerobot-libero")
    assert study["policy_stateless"] is True and study["policy_rng_control"] is True
    assert _announced(tmp_path / "act") == {"policy": "lerobot:act", "action_horizon": 10,
                                            "observation": "lerobot-libero", "torch_threads": 1}
    assert len(export["cases"]) == CASES and all(case["label"] not in (None, "unknown") for case in export["cases"])


def test_diffusion_served_as_saved_is_replayed_seeded_at_c1(lerobot_python, saved, tmp_path):
    with served(lerobot_python, saved / "diffusion") as (url, proc):
        export = _check(tmp_path, url, "diffusion", horizon=16, fork=False)
    study = export["study"]
    assert (study["mode"], study["replan_interval"], study["observation"]) == ("independent", 1, "lerobot-libero")
    assert study["policy_stateless"] is False and study["policy_rng_control"] is True
    assert _announced(tmp_path / "diffusion") == {"policy": "lerobot:diffusion", "action_horizon": 1,
                                                  "observation": "lerobot-libero", "torch_threads": 1}
    assert len(export["cases"]) == CASES and all(case["label"] not in (None, "unknown") for case in export["cases"])


def test_the_profile_equals_lerobots_own_pipeline_byte_for_byte(lerobot_python, saved, tmp_path):
    # Raw observations from our simulator (a lerobot-protocol episode of libero_object): LeRobot's pipeline
    # (preprocess_observation, LiberoProcessorStep, the policy's preprocessor) against the lerobot-libero profile
    # through the adapter and the same preprocessor, every tensor by dtype, shape and bytes.
    captured = tmp_path / "captured.npz"
    subprocess.run([sys.executable, str(ROOT / "tests" / "lerobot_capture.py"), str(captured)], cwd=ROOT,
                   env=cli_env(), check=True, capture_output=True, text=True)
    for name in ("act", "diffusion"):
        proc = subprocess.run([lerobot_python, str(ROOT / "tests" / "lerobot_conformance.py"), str(captured),
                               str(saved / name)], cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert set(report) == {"reset", "chunk", "render", "axisangle"}
        for stage in ("reset", "chunk"):
            for where in ("env", "policy"):
                got = report[stage][where]
                assert {"observation.images.image", "observation.images.image2", "observation.state", "task"} <= set(got)
                # Every tensor by dtype, shape and bytes: images, instruction and the state (whose axis-angle the
                # profile computes with torch's float32 kernels, as LeRobot does).
                assert all(v["equal"] for v in got.values()), (name, stage, where, got)
        # The lerobot protocol renders at the size lerobot-eval's LIBERO config builds its env with (360).
        size = report["render"]["lerobot_eval"]
        assert report["render"]["ours"] and all(shape == [*size, 3] for shape in report["render"]["ours"].values()), report
        # LeRobot's own axis-angle function gives the profile's bytes on 4,004 quaternions.
        assert report["axisangle"] == {"n": 4004, "dtype": ["float32", "float32"], "differ": 0}, report["axisangle"]


def _lerobot_obs(step: int) -> dict:
    return observation(0, step)


def test_connections_interleaved_keep_their_own_stream_and_history(lerobot_python, saved):
    # Diffusion keeps an observation history and samples: two connections seeded alike, their calls interleaved
    # with a third's, answer alike step by step; a connection seeded otherwise does not.
    async def main(url: str) -> tuple[list, list, list]:
        clients = [await WebsocketPolicyClient.connect(url, connect_timeout_s=_patience()) for _ in range(3)]
        for client, seed in zip(clients, (5, 5, 6)):
            await client.reset_rng(seed)
        answers: list[list] = [[], [], []]
        for step in range(10):
            for i in (2, 0, 1) if step % 2 else (0, 2, 1):
                answers[i].append((await clients[i].infer(_lerobot_obs(step)))["actions"])
        states = {(await c.rng_state()).digest for c in clients[:2]}
        for client in clients:
            await client.close()
        assert len(states) == 1
        return answers

    with served(lerobot_python, saved / "diffusion") as (url, proc):
        a, b, c = asyncio.run(main(url))
    assert all(x.shape == (1, 7) for x in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, z) for x, z in zip(a, c))


def test_a_missing_camera_key_names_the_rename_map_that_fixes_it(lerobot_python, saved):
    async def main(url: str) -> str:
        obs = _lerobot_obs(0)
        obs["observation.images.top"] = obs.pop("observation.images.image")
        async with await WebsocketPolicyClient.connect(url, connect_timeout_s=_patience()) as client:
            with pytest.raises(PolicyServerError) as info:
                await client.infer(obs)
        return str(info.value).strip().splitlines()[-1]

    with served(lerobot_python, saved / "act") as (url, proc):
        line = asyncio.run(main(url))
    assert ("the policy reads 'observation.images.image', which the observation lacks" in line
            and """--rename-map '{"observation.images.top": "observation.images.image"}'""" in line), line


def test_the_server_names_its_mode_and_threads(lerobot_python, saved):
    for name, line in (("act", "chunk mode: predict_action_chunk, C = 10, stateless"),
                       ("diffusion", "step mode: select_action at C = 1, stateful (n_obs_steps = 2"),
                       ("act_ensemble", "step mode: select_action at C = 1, stateful (select_action keeps "
                                        "temporal_ensembler between calls)")):
        with served(lerobot_python, saved / name) as (url, proc):
            pass
        said = proc.stderr.read().decode()
        assert line in said and "torch threads 1" in said, said


# --- served as LeRobot's own select_action runs, over whole episodes ------------------------------------------
SEED, STEPS, EPISODES = 7, 14, 2  # 14 steps: past ACT's chunk of 10 and Diffusion's 8 actions per chunk


def _select_action(python: str, folder: Path, out: Path) -> dict[str, np.ndarray]:
    """LeRobot's own select_action over the episodes, in process (tests/lerobot_select_action.py)."""
    subprocess.run([python, str(ROOT / "tests" / "lerobot_select_action.py"), str(folder), str(out), str(SEED),
                    str(STEPS), str(EPISODES)], cwd=out.parent, check=True, capture_output=True, text=True)
    return dict(np.load(out))


async def _episodes(url: str) -> tuple[dict, list[dict[str, np.ndarray]]]:
    """Two connections seeded alike, their calls interleaved, each running the episodes as a client does: at
    every query the observation of that step, C actions executed. The first starts an episode with the control
    `reset`, the second with openpi's episode_start frame only. Returns the metadata and each one's actions."""
    clients = [await WebsocketPolicyClient.connect(url, connect_timeout_s=_patience()) for _ in range(2)]
    try:
        interval = int(clients[0].metadata["action_horizon"])
        for client in clients:
            await client.reset_rng(SEED)
        runs: list[dict[str, list]] = [{}, {}]
        for episode in range(EPISODES):
            await clients[0].reset()
            assert await clients[1].episode_start("interop", "task", f"ep{episode}") is not None
            for step in range(0, STEPS, interval):
                for i in ((0, 1) if step % 2 else (1, 0)):
                    chunk = (await clients[i].infer(observation(episode, step)))["actions"]
                    runs[i].setdefault(f"episode{episode}", []).extend(chunk[:interval])
        metadata = dict(clients[0].metadata)
    finally:
        for client in clients:
            await client.close()
    return metadata, [{k: np.stack(v)[:STEPS] for k, v in run.items()} for run in runs]


@pytest.mark.parametrize("name,mode,interval", [
    ("act_ensemble", "step", 1),  # LeRobot's documented temporal ensembling: state inside select_action
    ("diffusion", "step", 1),  # an observation history, and noise from the connection's seed
    ("act", "chunk", 10),  # a chunk is what select_action pops, one action at a time
])
def test_each_policy_answers_what_lerobots_own_select_action_answers(lerobot_python, saved, tmp_path, name, mode,
                                                                     interval):
    expected = _select_action(lerobot_python, saved / name, tmp_path / f"{name}.npz")
    with served(lerobot_python, saved / name) as (url, proc):
        metadata, runs = asyncio.run(_episodes(url))
    assert (metadata["lerobot_mode"], metadata["action_horizon"], metadata["stateless"]) == (
        mode, interval, mode == "chunk")
    assert set(expected) == {f"episode{k}" for k in range(EPISODES)}
    for i, run in enumerate(runs):  # each connection, its own state per episode, bit for bit
        for episode, actions in expected.items():
            assert actions.shape == (STEPS, 7) and run[episode].dtype == np.float32
            differ = [step for step in range(STEPS) if run[episode][step].tobytes() != actions[step].tobytes()]
            assert differ == [], (name, f"connection {i}", episode, differ)


# --- bad input: one line, and only fixes that can work -------------------------------------------------------


def _refused_at_load(python: str, folder: Path, *flags: str) -> str:
    proc = subprocess.run([python, "-m", "rescue_serve.cli", "lerobot", str(folder), "--port", "0", *flags],
                          cwd=folder.parent, capture_output=True, text=True, timeout=_patience())
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip()


def test_a_checkpoint_saved_before_lerobots_processor_files_names_lerobots_migration(lerobot_python, saved, tmp_path):
    old = tmp_path / "old_act"
    shutil.copytree(saved / "act", old)
    for processor_file in old.glob("policy_*"):
        processor_file.unlink()
    line = _refused_at_load(lerobot_python, old)
    assert "was saved before LeRobot's processor files" in line, line
    assert f"python -m lerobot.processor.migrate_policy_normalization --pretrained-path {old}" in line, line


def test_a_corrupt_config_is_one_line(lerobot_python, saved, tmp_path):
    broken = tmp_path / "broken_act"
    shutil.copytree(saved / "act", broken)
    (broken / "config.json").write_text('{"type": "act", "chunk_size": ')
    line = _refused_at_load(lerobot_python, broken)
    assert line.startswith(f"rescue-serve lerobot: {broken / 'config.json'} is not a LeRobot policy configuration: "
                           "JSONDecodeError"), line


def test_chunk_mode_is_refused_for_a_policy_whose_select_action_keeps_state(lerobot_python, saved):
    line = _refused_at_load(lerobot_python, saved / "act_ensemble", "--mode", "chunk")
    assert "select_action keeps temporal_ensembler between calls" in line and "--mode step" in line, line


def test_a_cuda_device_seeds_the_devices_generator_or_is_refused(lerobot_python, saved):
    has_cuda = subprocess.run([lerobot_python, "-c", "import torch; print(torch.cuda.is_available())"],
                              capture_output=True, text=True, check=True).stdout.strip() == "True"
    if not has_cuda:
        line = _refused_at_load(lerobot_python, saved / "diffusion", "--device", "cuda")
        assert "--device cuda: torch finds no CUDA device here" in line, line
        return

    async def main(url: str) -> tuple[list, list, list]:
        clients = [await WebsocketPolicyClient.connect(url, connect_timeout_s=_patience()) for _ in range(3)]
        for client, seed in zip(clients, (5, 5, 6)):
            await client.reset_rng(seed)
        answers = [[(await c.infer(_lerobot_obs(step)))["actions"] for step in range(4)] for c in clients]
        for client in clients:
            await client.close()
        return answers

    # Diffusion draws its noise on the device: two connections seeded alike answer alike only when the
    # device's generator follows the seed.
    with served(lerobot_python, saved / "diffusion", "--device", "cuda") as (url, proc):
        a, b, c = asyncio.run(main(url))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, z) for x, z in zip(a, c))


def _last_line_of_refusal(url: str, obs: dict) -> str:
    async def main() -> str:
        async with await WebsocketPolicyClient.connect(url, connect_timeout_s=_patience()) as client:
            with pytest.raises(PolicyServerError) as info:
                await client.infer(obs)
        return str(info.value).strip().splitlines()[-1]

    return asyncio.run(main())


def test_a_policy_with_a_camera_the_client_does_not_send_is_not_advised_a_rename(lerobot_python, saved):
    with served(lerobot_python, saved / "act_3cam") as (url, proc):
        line = _last_line_of_refusal(url, _lerobot_obs(0))
    assert "the policy reads 3 cameras" in line and "the observation has 2" in line, line
    assert "no rename adds a camera" in line and "--rename-map" not in line, line


def test_a_missing_state_is_never_advised_a_rename_of_the_instruction(lerobot_python, saved):
    without_state = {k: v for k, v in _lerobot_obs(0).items() if k != "observation.state"}
    other_name = {**without_state, "state": _lerobot_obs(0)["observation.state"]}
    with served(lerobot_python, saved / "act") as (url, proc):
        missing = _last_line_of_refusal(url, without_state)
        renamed = _last_line_of_refusal(url, other_name)
    assert missing.startswith("rescue_serve.lerobot.ObservationKeyError: the policy reads 'observation.state', "
                              "which the observation lacks"), missing
    assert "--rename-map" not in missing and "task" not in missing.split("(it sent")[0], missing
    # A state the client sends under another name is one rename away.
    assert """--rename-map '{"state": "observation.state"}'""" in renamed, renamed


def test_a_state_of_another_size_is_one_clear_line(lerobot_python, saved):
    seven = {**_lerobot_obs(0), "observation.state": np.zeros(7, dtype=np.float32)}
    with served(lerobot_python, saved / "act") as (url, proc):
        line = _last_line_of_refusal(url, seven)
    assert line == ("ValueError: observation.state has 7 floats; the policy reads 8 (its input_features): the client "
                    "sends another robot's state"), line


def test_preflight_names_the_action_dimensions_without_advising_another_profile(lerobot_python, saved, tmp_path):
    config = tmp_path / "preflight.toml"
    manifest = write_cases(tmp_path / "preflight.jsonl", 1, horizon=20)
    with served(lerobot_python, saved / "act_6dim") as (url, proc):
        config.write_text(f"[policy]\nurl = \"{url}\"\n\n[env]\nepisode_protocol = \"lerobot\"\n")
        out = rescue_cli("preflight", str(manifest), "--config", str(config), "--cases", "1", check=False,
                         timeout=None).stdout
    line = next(line for line in out.splitlines() if "policy query" in line)
    assert "FAIL" in line and "the policy's actions have 6 dimensions; the simulator takes 7" in line, line
    assert "set [policy] observation" not in line, line
