"""Real LeRobot policies, as a user installs and serves them, rescued by real studies (`bash scripts/test.sh interop`).

scripts/interop_venv.sh builds (once, outside the checkout) a Python 3.12 venv with
`lerobot[diffusion]==0.6.1` from the package index and this repository's serving
distribution; a venv that cannot be built fails the tier, it never skips. In it,
tests/lerobot_policies.py builds ACT and Diffusion from their configs with random weights
(nothing from a hub) and saves them with their processors; `rescue-serve lerobot DIR`
serves each from that venv. From this project's venv, each gets preflight and a
3-case study, verified and exported (ACT forked at q; Diffusion replayed, seeded,
C = 1), and a seeded replay of its cases that must agree with the study query by query.
SmolVLA and LeRobot's pi0/pi05 need hub tokenizers even with random weights, so they
are not built here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import HANG_S, ROOT, arm_rows, cli_env, ensure_stopped, export_of, rescue_cli, wait_healthy, write_cases
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


@contextlib.contextmanager
def served(python: str, folder: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`rescue-serve lerobot FOLDER` in LeRobot's venv (the installed distribution, run from outside the checkout)."""
    port = free_port()
    proc = subprocess.Popen([python, "-m", "rescue_serve.cli", "lerobot", str(folder), "--port", str(port)],
                            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_healthy(port, f"rescue-serve lerobot {folder.name}", proc)
        yield f"ws://127.0.0.1:{port}/", proc
    finally:
        ensure_stopped(proc)


def _study(tmp: Path, url: str, name: str, horizon: int, fork: bool, arms: str = "") -> Path:
    config = tmp / f"{name}.toml"
    config.write_text(f"fork_at_q = {str(fork).lower()}\n{arms}\n[policy]\nurl = \"{url}\"\n\n"
                      "[env]\nepisode_protocol = \"lerobot\"\n")
    manifest = write_cases(tmp / f"{name}.jsonl", CASES, horizon=horizon)
    study = tmp / name
    rescue_cli("run", str(manifest), "--config", str(config), "--study", str(study))
    return study


def _traces(study: Path, arm: str) -> dict[str, list[dict]]:
    return {case: json.loads(data)["trace"] for (case, a), data in arm_rows(study).items() if a == arm}


def _check(tmp: Path, url: str, name: str, horizon: int, fork: bool) -> dict:
    """preflight, a verified and exported study, and a seeded replay of its control arms; returns the export."""
    config = tmp / "preflight.toml"
    config.write_text(f"fork_at_q = {str(fork).lower()}\n[policy]\nurl = \"{url}\"\n\n[env]\nepisode_protocol = \"lerobot\"\n")
    manifest = write_cases(tmp / "preflight.jsonl", CASES, horizon=horizon)
    pre = rescue_cli("preflight", str(manifest), "--config", str(config), "--cases", "1")
    assert "FAIL" not in pre.stdout, pre.stdout
    study = _study(tmp, url, name, horizon, fork)
    verify = rescue_cli("verify", str(study))
    assert verify.returncode == 0, verify.stdout
    export = export_of(study)
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
    rng = np.random.default_rng(step)
    return {"observation.images.image": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
            "observation.images.image2": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
            "observation.state": rng.standard_normal(8).astype(np.float32), "task": "put the bowl on the plate"}


def test_connections_interleaved_keep_their_own_stream_and_history(lerobot_python, saved):
    # Diffusion keeps an observation history and samples: two connections seeded alike, their calls interleaved
    # with a third's, answer alike step by step; a connection seeded otherwise does not.
    async def main(url: str) -> tuple[list, list, list]:
        clients = [await WebsocketPolicyClient.connect(url, connect_timeout_s=HANG_S) for _ in range(3)]
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
        async with await WebsocketPolicyClient.connect(url, connect_timeout_s=HANG_S) as client:
            with pytest.raises(PolicyServerError) as info:
                await client.infer(obs)
        return str(info.value).strip().splitlines()[-1]

    with served(lerobot_python, saved / "act") as (url, proc):
        line = asyncio.run(main(url))
    assert ("the policy reads 'observation.images.image', which the observation lacks" in line
            and """--rename-map '{"observation.images.top": "observation.images.image"}'""" in line), line


def test_the_server_names_its_mode_and_threads(lerobot_python, saved):
    for name, line in (("act", "chunk mode: predict_action_chunk, C = 10, stateless"),
                       ("diffusion", "step mode: select_action at C = 1, stateful (n_obs_steps = 2")):
        with served(lerobot_python, saved / name) as (url, proc):
            pass
        said = proc.stderr.read().decode()
        assert line in said and "torch threads 1" in said, said
