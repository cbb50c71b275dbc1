"""Shared pieces of the benchmarks: manifests, timed studies, and a bare arm loop.

The bare loop runs the same arms with the same simulator processes, policy
server, VLM endpoint and concurrency as a study, but with no journal, no
trace, no receipts and no classification: what a study costs beyond it is the
project's overhead.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

from rescue.core.configuration.config import StudyConfig
from rescue.core.images import VLM_VIEWS
from rescue.core.manifest import Case, Manifest, parse_manifest
from rescue.core.observation import get_profile
from rescue.core.querypoint import query_point
from rescue.core.records import ReceiptRef
from rescue.env.pool import as_float_chunk
from rescue.policy.client import WebsocketPolicyClient
from rescue.run.engine import run_study
from rescue.run.peers import resolved_config, start_peers
from rescue.study import logs
from rescue.study.folder import create_study
from rescue.study.layout import StudyLayout
from rescue.vlm.answers import SubgoalRequest
from rescue.vlm.client import VLMClient
from wrappers.injection import inject

# Which embedded policy a benchmark runs: the vision-language one (the default: images rendered at
# every query, as a real VLA's study) or the privileged chunk policy (no rendering), by
# RESCUE_BENCH_POLICY=vision_language|privileged.
POLICIES = {"vision_language": "rescue.embedded.vision_language:make_policy", "privileged": "rescue.embedded.learned:make_policy"}
POLICY = os.environ.get("RESCUE_BENCH_POLICY", "vision_language")


def study_config(**fields) -> StudyConfig:
    """The benchmarks' study configuration: the chosen embedded policy, and `fields`."""
    return StudyConfig(**{"policy": {"factory": POLICIES[POLICY]}, **fields})


def cases(n: int, horizon: int, task_id: int = 0) -> list[Case]:
    """n libero_object cases of one task (different initial states)."""
    return [
        Case(case_id=f"bench-{i}", suite="libero_object", task_id=task_id, init_state_index=i % 50, env_seed=i,
             horizon=horizon, group="object")
        for i in range(n)
    ]


def manifest(items: list[Case]) -> Manifest:
    """A manifest object for cases made in code."""
    return parse_manifest("".join(c.model_dump_json() + "\n" for c in items).encode(), "bench.jsonl")


def timed_study(items: list[Case], config: StudyConfig) -> float:
    """Wall time of a full study (peers started inside, as `rescue run` does)."""
    logs.configure(None, verbose=False)
    root = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        create_study(root / "study", manifest(items), asyncio.run(resolved_config(config)))
        t0 = time.perf_counter()
        asyncio.run(run_study(root / "study"))
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _NoReceipts:
    """The bare loop keeps no receipts; the client still gets the reference a write returns."""

    def write(self, receipt) -> ReceiptRef:
        return ReceiptRef(path="none", lineno=1, sha256="0" * 64)


async def _bare(items: list[Case], config: StudyConfig, root: Path) -> None:
    config = await resolved_config(config)
    profile = get_profile(config.policy.observation)
    async with start_peers(config, StudyLayout.of(root)) as peers:
        vlm = VLMClient(peers.vlm.config, _NoReceipts()) if peers.vlm else None
        queue = list(items)

        async def arm(case: Case, name: str) -> None:
            sim = await peers.pool.acquire()
            client = await WebsocketPolicyClient.connect(peers.policy_url)
            try:
                await client.reset()
                await client.reset_rng(case.policy_seed)
                reset = await sim.reset(case, profile)
                obs, instruction, step = reset.obs, reset.instruction, 0
                q, c, h = query_point(case.horizon, peers.interval), peers.interval, case.horizon
                asked = False
                while step < h:
                    if name == "assisted" and step >= q and not asked:
                        asked = True
                        views = await sim.render(list(VLM_VIEWS), config.env.image_size)
                        answer = await vlm.ask(SubgoalRequest(case.case_id, instruction, h - step, views))
                        if answer.status == "ok":
                            instruction = inject(instruction, answer.subgoal)
                    reply = await client.infer(profile.policy_input(obs, instruction))
                    due = min(c, h - step)
                    observe = "never" if step + due >= h else "unless_success"
                    result = await sim.run_chunk(as_float_chunk(reply["actions"])[:c], due, observe)
                    step, obs = step + result.steps, result.obs
                    if result.success:
                        break
            finally:
                await client.close()
                peers.pool.release(sim)

        async def worker() -> None:
            while queue:
                case = queue.pop(0)
                await asyncio.gather(*(arm(case, a) for a in config.arms))

        await asyncio.gather(*(worker() for _ in range(config.cases_in_flight)))
        if vlm:
            await vlm.aclose()


def timed_bare(items: list[Case], config: StudyConfig) -> float:
    """Wall time of the bare loop over the same arms."""
    logs.configure(None, verbose=False)
    root = Path(tempfile.mkdtemp(prefix="bench-bare-"))
    try:
        t0 = time.perf_counter()
        asyncio.run(_bare(items, config, root))
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Endpoint:
    """`rescue serve-vlm` in its own process, with a fixed answer latency."""

    def __init__(self, latency_s: float):
        import re
        import subprocess
        import sys

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "rescue.cli", "serve-vlm", "--port", "0", "--latency", str(latency_s)],
            stdout=subprocess.PIPE, text=True,
        )
        self.url = re.search(r"(http://\S+/v1)", self._proc.stdout.readline()).group(1)

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)
