"""Preflight against a vla-eval model server: what it is, which fork mode is valid for it, and whether the study's
q falls on its chunk boundary (DESIGN §19).

Such a server is stateful and chunked on its side (a buffer per session, played one action per observation)
and gives no RNG control. Two modes are valid: fork at q with every follower on a fresh session (its buffer is
empty there only if q is on a chunk boundary: C, the study's replanning interval, must be the server's
`chunk_size` or a multiple of it), or independent replays of a deterministic server. Whether q is on a
boundary is checked, not assumed, when the server is deterministic: the control arm of the first case runs whole
twice and once with a fresh session from q on; all three must agree.
"""

from __future__ import annotations

import asyncio

from rescue.core.configuration.config import StudyConfig
from rescue.core.manifest import Case
from rescue.core.observation import get_profile
from rescue.core.querypoint import query_point
from rescue.core.records import ArmResult
from rescue.core.vla_eval_settings import env_seed, horizon, merged_params, refusal
from rescue.policy.vla_eval_client import health
from rescue.run.arm import ArmRun, ArmSpec
from rescue.run.peers import Peers
from rescue.run.preflight_report import Check


def _spec(config: StudyConfig, peers: Peers) -> ArmSpec:
    return ArmSpec(arm="control", interval=peers.interval, image_size=config.env.image_size,
                   keepalive_s=config.keepalive_s, profile=get_profile(config.policy.observation or "privileged"),
                   protocol=config.env.protocol())


async def check_server(cases: list[Case], config: StudyConfig, peers: Peers) -> Check:
    """The server's HELLO and health, its observation params as honoured, and the fork mode named."""
    client = await peers.connect_policy()
    try:
        hello = client.metadata.get("vla_eval_hello", {})
    finally:
        await client.close()
    try:
        status = (await health(peers.policy_url)).get("status", "?")
    except Exception as exc:
        status = f"unanswered ({type(exc).__name__})"
    params = merged_params({}, dict(hello.get("observation_params") or {}))
    problem = refusal(params)
    if problem is not None:
        return Check(name="vla-eval server", verdict="fail", detail=f"the server asks for {problem}")
    c = peers.interval
    example = cases[0].horizon
    mode = ("forks at q, each follower on a fresh session" if config.forked
            else "runs every arm whole (independent replays: the server must be deterministic)")
    detail = (f"{hello.get('model_server', '?')} (harness {hello.get('harness_version', '?')}, /health {status}) is "
              f"stateful and chunked on its side with no RNG control: its buffer plays each chunk of C = {c} actions "
              f"one per observation, so every arm sends an observation at every step. Valid: fork at q on a chunk "
              f"boundary (q = ceil(H/2/C)*C, {query_point(example, c)} for H = {example}) with each follower on a "
              f"fresh session, or independent replays of a deterministic server; this study {mode}; profile "
              f"{config.policy.observation} for observation_params {dict(hello.get('observation_params') or {})}")
    notes = []
    seed = env_seed(params)
    other = [case.case_id for case in cases if seed is not None and case.env_seed != seed]
    if other and "env_seed" in params:
        notes.append(f"the server asks env_seed {seed}; {len(other)} case(s) are seeded otherwise (e.g. {other[0]}): "
                     "the harness seeds as its run's config says, else as the server asks (import the run's recording "
                     "with `rescue manifest from-vla-eval` to take each episode's own)")
    if "max_steps" in params:
        limit = [case.case_id for case in cases if case.horizon != horizon(None, params, case.suite)]
        if limit:
            notes.append(f"the server asks max_steps {params['max_steps']}; {len(limit)} case(s) have another horizon")
    if notes:
        return Check(name="vla-eval server", verdict="warn", detail=detail + "; " + "; ".join(notes))
    return Check(name="vla-eval server", verdict="pass", detail=detail)


async def _arm(case: Case, config: StudyConfig, peers: Peers, fresh_at_q: bool) -> ArmResult:
    """The case's control arm, whole on one session, or with a fresh session from q on."""
    arm = ArmRun(case, _spec(config, peers), None, await peers.connect_policy())
    sim = arm.sim = await peers.pool.acquire()
    try:
        await arm.start()
        if fresh_at_q:
            await arm.run_until(arm.q)
            await arm.policy.close()
            arm.attach(await peers.connect_policy())
            await arm.start_policy()
        await arm.run_until(arm.horizon)
        return arm.result()
    finally:
        await arm.policy.close()
        peers.pool.release(sim)


def _first_difference(a: ArmResult, b: ArmResult) -> str | None:
    for row_a, row_b in zip(a.trace, b.trace):
        if (row_a.step, row_a.state, row_a.images, row_a.actions) != (row_b.step, row_b.state, row_b.images, row_b.actions):
            return f"step {row_a.step}"
    if (len(a.trace), a.steps, a.success) != (len(b.trace), b.steps, b.success):
        return f"the end ({a.steps} vs {b.steps} steps)"
    return None


async def check_chunk_boundary(case: Case, config: StudyConfig, peers: Peers) -> Check:
    """Whether a fresh session at q answers as the running one: q is on the server's chunk boundary."""
    name = f"chunk boundary {case.case_id}"
    whole, again, fresh = await asyncio.gather(*(_arm(case, config, peers, at_q) for at_q in (False, False, True)),
                                               return_exceptions=True)
    for got in (whole, again, fresh):
        if isinstance(got, BaseException):
            return Check(name=name, verdict="fail", detail=f"{type(got).__name__}: {got}")
    q = query_point(case.horizon, peers.interval)
    if _first_difference(whole, again) is not None:
        return Check(name=name, verdict="warn", detail=(
            f"two whole runs differ ({_first_difference(whole, again)}): the server samples, so whether q = {q} is on "
            f"its chunk boundary cannot be checked; C = {peers.interval} must be its chunk_size"))
    if whole.steps <= q:
        return Check(name=name, verdict="warn", detail=f"the episode ended at step {whole.steps}, before q = {q}: "
                     "nothing to compare (check on a case that runs past q)")
    where = _first_difference(whole, fresh)
    if where is not None:
        return Check(name=name, verdict="fail", detail=(
            f"q = {q} is not on a chunk boundary of the server: a fresh session from q answers otherwise than the "
            f"running one (first at {where}); set [policy] replan_interval to the server's chunk_size (now "
            f"C = {peers.interval}), or the server keeps state across its chunks and cannot fork"))
    return Check(name=name, verdict="pass", detail=(
        f"a fresh session from q = {q} answers as the running one to the end ({whole.steps} steps): q is on the "
        f"server's chunk boundary"))
