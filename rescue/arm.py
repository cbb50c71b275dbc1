"""The arm runner: one full replay of a case under one arm spec.

Both arms reset the case identically, query the policy every C steps and
record a query trace. The assisted arm, at the query point q, renders the
three views, asks the VLM once while the simulator waits, and from q on sends
the injected instruction. Keepalive probes hold the policy connection open
during the wait without inference and without touching the policy's RNG.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

import numpy as np
import structlog

from rescue.digest import digest_array, digest_obs, digest_text
from rescue.env.pool import as_float_chunk
from rescue.env.protocol import VLM_VIEWS
from rescue.querypoint import query_point
from rescue.records import ArmName, ArmResult, Assistance, TraceRow
from wrappers.injection import inject

log = structlog.get_logger()

# The assisted arm's answer statuses that leave the original instruction in force.
_FAILED_ASSISTANCE = {"broker_error": "broker_error", "invalid_response": "invalid_response", "timeout": "timeout"}


class Simulator(Protocol):
    """An env adapter reached asynchronously (a simulator process)."""

    async def call(self, method: str, *args: Any) -> Any: ...


class PolicyConnection(Protocol):
    """The policy client calls an arm needs."""

    @property
    def supports_rng(self) -> bool: ...

    async def infer(self, obs: dict) -> dict: ...

    async def reset(self) -> None: ...

    async def reset_rng(self, seed: int) -> None: ...

    async def rng_state(self) -> Any: ...

    async def keepalive(self) -> Any: ...


# ask(case_id, instruction, remaining_steps, views) -> an answer with status, subgoal, call_id, request_id, error...
Advisor = Callable[[str, str, int, dict[str, np.ndarray]], Awaitable[Any]]


class KeepaliveError(RuntimeError):
    """The policy connection or its RNG changed while the arm waited for the VLM."""


@dataclass
class ArmSpec:
    """How to run an arm: its name, the replan interval C and the query-point options."""

    arm: ArmName
    interval: int
    image_size: int = 256
    keepalive_s: float = 120.0


async def _query(policy: PolicyConnection, obs: dict, step: int, firings: list | None) -> dict:
    """One policy query; a rule wrapper (it keeps `firings`) is told the step so each firing names it."""
    if firings is not None:
        return await policy.infer(obs, step=step)  # type: ignore[call-arg]
    return await policy.infer(obs)


def policy_seed(case: dict) -> int:
    """The policy RNG seed of a case: explicit, else the env seed."""
    seed = case.get("policy_seed")
    return int(case["env_seed"] if seed is None else seed)


async def wait_with_keepalive(policy: PolicyConnection, answer: Awaitable[Any], every_s: float, case_id: str) -> Any:
    """Await the VLM answer while probing the policy connection; assert its RNG is untouched."""
    before = await policy.keepalive()
    task = asyncio.ensure_future(answer)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                break
            probe = await policy.keepalive()
            _check_same(before, probe, case_id)
        after = await policy.keepalive()
        _check_same(before, after, case_id)
        return task.result()
    finally:
        if not task.done():
            task.cancel()


def _check_same(before: Any, after: Any, case_id: str) -> None:
    if before is None or after is None:
        return
    fields = ("digest", "requests", "connection_id", "server_instance")
    changed = [f for f in fields if getattr(before, f) != getattr(after, f)]
    if changed:
        raise KeepaliveError(f"case {case_id}: policy {', '.join(changed)} changed during the VLM wait")


async def run_arm(
    case: dict,
    spec: ArmSpec,
    sim: Simulator,
    policy: PolicyConnection,
    advisor: Advisor | None = None,
) -> ArmResult:
    """Replay one case under one arm; infrastructure failures become an `error` result, never an exception."""
    case_id, horizon, interval = case["case_id"], int(case["horizon"]), spec.interval
    q = query_point(horizon, interval)
    bound = log.bind(case_id=case_id, arm=spec.arm)
    started = time.time()
    trace: list[TraceRow] = []
    assistance = Assistance(status="control" if spec.arm == "control" else "not_reached")
    fingerprint, step, success = None, 0, False
    # Rules between policy and simulator (wrappers/async_rules.py) log their firings here.
    firings: list[dict] | None = getattr(policy, "firings", None)
    rng_control = bool(policy.supports_rng)
    bound.info("arm.started", horizon=horizon, query_step=q)
    try:
        reset = await sim.call("reset", case)
        fingerprint = reset.fingerprint
        original = instruction = reset.instruction
        if case.get("instruction") not in (None, original):
            raise ValueError(f"manifest instruction {case['instruction']!r} differs from the task's {original!r}")
        await policy.reset()
        if rng_control:
            await policy.reset_rng(policy_seed(case))
        else:
            # Recorded on the arm (policy_rng_control) so the study shows it.
            bound.warning("arm.no_rng_control", reason="no RNG extension: prefix equality not guaranteed by the server")
        obs = reset.obs
        while step < horizon:
            if spec.arm == "assisted" and step >= q and assistance.status == "not_reached":
                assistance = await _assist(case, spec, sim, policy, advisor, original, horizon - step, step)
                if assistance.status == "applied":
                    instruction = assistance.instruction
            reply = await _query(policy, {**obs, "prompt": instruction}, step, firings)
            # Only the first C actions run; the rest of a longer chunk is dropped,
            # so nothing planned under an old instruction survives the next query.
            # The chunk is the one after any rules: the trace digests what runs.
            chunk = as_float_chunk(reply["actions"])[:interval]
            due = min(interval, horizon - step)
            if len(chunk) < due:
                # A short chunk would move the next query off the 0, C, 2C, ... grid.
                raise ValueError(f"step {step}: action chunk has {len(chunk)} actions, fewer than the {due} steps to the next query")
            trace.append(
                TraceRow(
                    step=step,
                    state=digest_obs(obs),
                    images={},
                    instruction=digest_text(instruction),
                    actions=digest_array(chunk),
                )
            )
            result = await sim.call("run_chunk", chunk, due)
            step += result.steps
            obs = result.obs
            if result.success:
                success = True
                break
    except Exception as exc:  # the arm's record carries the failure; the case stays in the denominator
        bound.warning("arm.error", error=f"{type(exc).__name__}: {exc}", step=step)
        return ArmResult(
            case_id=case_id,
            arm=spec.arm,
            status="error",
            error=f"{type(exc).__name__}: {exc}",
            steps=step,
            fingerprint=fingerprint,
            trace=trace,
            assistance=assistance,
            rule_firings=list(firings or []),
            policy_rng_control=rng_control,
            started_at=started,
            finished_at=time.time(),
        )
    bound.info("arm.finished", success=success, steps=step, assistance=assistance.status)
    return ArmResult(
        case_id=case_id,
        arm=spec.arm,
        status="complete",
        success=success,
        steps=step,
        fingerprint=fingerprint,
        trace=trace,
        assistance=assistance,
        rule_firings=list(firings or []),
        policy_rng_control=rng_control,
        started_at=started,
        finished_at=time.time(),
    )


async def _assist(
    case: dict,
    spec: ArmSpec,
    sim: Simulator,
    policy: PolicyConnection,
    advisor: Advisor | None,
    original: str,
    remaining: int,
    step: int,
) -> Assistance:
    """Render the views, ask once (the simulator waits), and build the injected instruction."""
    if advisor is None:
        return Assistance(status="broker_error", query_step=step, error_kind="no_advisor", error="no VLM configured")
    views = await sim.call("render", list(VLM_VIEWS), spec.image_size)
    answer = await wait_with_keepalive(
        policy, advisor(case["case_id"], original, remaining, views), spec.keepalive_s, case["case_id"]
    )
    common = dict(query_step=step, call_id=answer.call_id, request_id=answer.request_id)
    if answer.status != "ok":
        status = _FAILED_ASSISTANCE.get(answer.status, "broker_error")
        return Assistance(status=status, error_kind=answer.error_kind, error=answer.error, **common)
    applied = inject(original, answer.subgoal)
    return Assistance(
        status="applied",
        subgoal=answer.subgoal,
        instruction=applied,
        instruction_digest=digest_text(applied),
        **common,
    )
