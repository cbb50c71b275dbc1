"""Preflight's idle hold: a policy connection held idle as long as the longest VLM wait must come back
with its connection, its RNG state and its next chunk unchanged (DESIGN §4: keepalive consumes no randomness)."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from rescue.core.configuration.config import StudyConfig
from rescue.core.manifest import Case
from rescue.core.observation import get_profile
from rescue.policy.client import PolicyConnectionClosed, PolicyServerError
from rescue.run.arm import KeepaliveError, wait_with_keepalive
from rescue.run.peers import Peers
from rescue.run.preflight_report import Check


async def first_obs(case: Case, config: StudyConfig, peers: Peers) -> dict:
    profile = get_profile(config.policy.observation or "privileged")
    sim = await peers.pool.acquire()
    try:
        reset = await sim.reset(case, profile, config.env.protocol())
    finally:
        peers.pool.release(sim)
    return profile.policy_input(reset.obs, reset.instruction)


async def _fresh_second_chunk(peers: Peers, obs: dict, seed: int) -> np.ndarray:
    """What a new connection answers to its second query after reset_rng(seed)."""
    ref = await peers.connect_policy()
    try:
        await ref.reset()
        await ref.reset_rng(seed)
        await ref.infer(obs)
        return np.asarray((await ref.infer(obs))["actions"])
    finally:
        await ref.close()


async def check_idle_hold(case: Case, config: StudyConfig, peers: Peers, idle_s: float) -> Check:
    """Hold a connection idle for idle_s with the study's keepalive; its connection and RNG must survive."""
    try:
        return await _idle_hold(case, config, peers, idle_s)
    except Exception as exc:  # the simulator or the connection failed outside the hold itself
        return Check(name="idle hold", verdict="fail", detail=f"{type(exc).__name__}: {exc}")


async def _idle_hold(case: Case, config: StudyConfig, peers: Peers, idle_s: float) -> Check:
    name = "idle hold"
    every = config.keepalive_s
    obs = await first_obs(case, config, peers)
    seed = case.policy_seed
    client = await peers.connect_policy()
    try:
        await client.reset()
        if client.supports_rng:
            await client.reset_rng(seed)
        await client.infer(obs)
        before = await client.rng_state()
        start = time.monotonic()
        try:
            await wait_with_keepalive(client, asyncio.sleep(idle_s), every, case.case_id)
        except KeepaliveError as exc:
            return Check(name=name, verdict="fail", detail=f"the policy's RNG state changed while idle: {exc}")
        except (PolicyConnectionClosed, PolicyServerError, ConnectionError, asyncio.TimeoutError) as exc:
            held = time.monotonic() - start
            return Check(
                name=name,
                verdict="fail",
                detail=f"the policy connection was lost {held:.1f} s into a {idle_s:g} s idle hold with keepalive "
                f"every {every:g} s ({type(exc).__name__}: {exc}); the server or a proxy drops idle connections: "
                "lower keepalive_s below its idle limit or raise that limit",
            )
        after = await client.rng_state()
        if before != after:
            return Check(name=name, verdict="fail", detail=f"RNG state changed across the idle hold: {before} -> {after}")
        try:
            chunk = np.asarray((await client.infer(obs))["actions"])
        except (PolicyConnectionClosed, PolicyServerError, ConnectionError) as exc:
            return Check(name=name, verdict="fail", detail=f"inference after the idle hold failed: {type(exc).__name__}: {exc}")
    finally:
        await client.close()
    if before is None:
        return Check(
            name=name,
            verdict="pass",
            detail=f"connection held idle {idle_s:g} s with ping keepalive every {every:g} s and answered afterwards; "
            "its RNG state cannot be read (no RNG extension)",
        )
    reference = await _fresh_second_chunk(peers, obs, seed)
    if reference.shape != chunk.shape or not np.array_equal(reference, chunk):
        return Check(
            name=name,
            verdict="fail",
            detail="after the idle hold the next inference differs from a fresh connection's second inference: "
            "keepalive consumed randomness or the policy is not deterministic",
        )
    return Check(
        name=name,
        verdict="pass",
        detail=f"connection held idle {idle_s:g} s with keepalive every {every:g} s: RNG digest, request counter "
        f"({after.requests}), connection id and server instance unchanged; the next inference equals a fresh connection's",
    )


def idle_length_check(config: StudyConfig, idle_s: float) -> Check | None:
    deadlines = [vlm.deadline_s for _, _, vlm in config.advisor_configs()]
    if not deadlines or idle_s >= max(deadlines):
        return None
    longest = max(deadlines)
    return Check(
        name="idle length",
        verdict="warn",
        detail=f"held {idle_s:g} s, shorter than the longest VLM wait (vlm.deadline_s = {longest:g} s); "
        f"run with --idle-s {longest:g} before a real study",
    )
