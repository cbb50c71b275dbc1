"""Preflight: check the peers, determinism and keepalive before a study is run (DESIGN §4).

First two real calls with the study's settings, so a systematic failure shows
before any case is claimed: one policy query with the chosen observation
profile (a policy reading other keys fails here, naming the key), and, when
the study has an assisted arm, one VLM call (auth, model, structured output)
with the three views of a reset simulator. If either fails, nothing else runs.
Then three checks, each with a verdict:
- the policy server's RNG extension (without it the server does not make the
  two arms' prefixes equal; any equality is observed, not enforced);
- determinism: the first k cases' control arms, each run at once on n
  clients (own policy connection, own simulator), agree to the last trace row;
- idle hold: one policy connection held idle as long as the longest VLM wait,
  with the study's keepalive probes, keeps its connection and RNG state, and
  its next inference equals a fresh connection's.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import numpy as np
import structlog

from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.vlm_config import MissingAPIKey, VLMConfig
from rescue.core.episode_protocol import get_protocol
from rescue.core.failfast import fix_for
from rescue.core.configuration.identity import resolve_fork
from rescue.core.images import VLM_VIEWS
from rescue.core.manifest import Case, load_manifest
from rescue.core.observation import get_profile
from rescue.core.records import ArmResult
from rescue.core.reported_model import mismatch
from rescue.policy.client import PolicyServerError, WebsocketPolicyClient
from rescue.run.arm import ArmSpec, run_arm
from rescue.run.peers import Peers, resolved_config, start_peers
from rescue.study.layout import StudyLayout
from rescue.study.receipts import ReceiptLog
from rescue.vlm.answers import SubgoalRequest
from rescue.vlm.client import VLMClient
from wrappers.async_rules import AsyncRuleWrapper, rule_inputs_problems
from rescue.run.idle_hold import first_obs, idle_length_check, check_idle_hold
from rescue.run.preflight_report import Check, PreflightReport
from rescue.policy.wires import VLA_EVAL, wire_of
from rescue.run.preflight_vla_eval import check_chunk_boundary, check_server

log = structlog.get_logger()

_TRACE_FIELDS = ("state", "images", "instruction", "actions")


def agreement(results: list[ArmResult]) -> str | None:
    """None if every arm equals the first (fingerprint, trace, outcome, rule firings); else the first difference."""
    ref = results[0]
    for i, r in enumerate(results[1:], start=1):
        if r.fingerprint != ref.fingerprint:
            return f"client {i}: initial-state fingerprint differs from client 0"
        for row_ref, row in zip(ref.trace, r.trace):
            if row_ref.step != row.step:
                return f"client {i}: trace row at step {row.step}, client 0 at step {row_ref.step}"
            diff = [f for f in _TRACE_FIELDS if getattr(row, f) != getattr(row_ref, f)]
            if diff:
                return f"client {i}: trace differs from client 0 at step {row.step} ({', '.join(diff)})"
        if len(r.trace) != len(ref.trace):
            return f"client {i}: {len(r.trace)} trace rows, client 0 has {len(ref.trace)}"
        if (r.steps, r.success) != (ref.steps, ref.success):
            return f"client {i}: ended at step {r.steps} (success {r.success}), client 0 at {ref.steps} ({ref.success})"
        if r.rule_firings != ref.rule_firings:
            return f"client {i}: rule firings differ from client 0"
    return None


async def _connect(peers: Peers) -> WebsocketPolicyClient:
    return await peers.connect_policy()


async def _one_arm(case: Case, config: StudyConfig, peers: Peers) -> ArmResult:
    """A control arm as the engine runs it: own simulator, own connection, the configured rules."""
    spec = ArmSpec(
        arm="control", interval=peers.interval, query_step=config.query_step("control", case.horizon),
        image_size=config.env.image_size, keepalive_s=config.keepalive_s,
        profile=get_profile(config.policy.observation or "privileged"), protocol=config.env.protocol(),
    )
    sim = await peers.pool.acquire()
    try:
        policy = AsyncRuleWrapper(await _connect(peers), config.rules)
        try:
            return await run_arm(case, spec, sim, policy)
        finally:
            await policy.close()
    finally:
        peers.pool.release(sim)


async def check_determinism(case: Case, config: StudyConfig, peers: Peers, clients: int) -> Check:
    """Run the case's control arm on `clients` clients at once; their traces must agree to the last row."""
    name = f"determinism {case.case_id}"
    # Every arm finishes (and frees its simulator) before the verdict, even when one fails.
    results = await asyncio.gather(*(_one_arm(case, config, peers) for _ in range(clients)), return_exceptions=True)
    for i, r in enumerate(results):
        if isinstance(r, BaseException):  # the simulator or the connection failed before the arm could record it
            return Check(name=name, verdict="fail", detail=f"client {i}: {type(r).__name__}: {r}")
        if r.status != "complete":
            return Check(name=name, verdict="fail", detail=f"client {i}: arm {r.status}: {r.error}")
    problem = agreement(list(results))
    sampler = problem is not None and _samples(list(results))
    if sampler and config.forked:
        return Check(name=name, verdict="pass", detail=(
            f"{clients} clients reset to one initial state and the policy answered it differently ({problem}): it "
            "samples, and its server gives no RNG control. The study forks at q: the prefix runs once, so every arm "
            "shares it, and each continues from the snapshot at q on a fresh connection (a new draw of the policy)"))
    if sampler:
        return Check(name=name, verdict="fail", detail=(
            f"{clients} clients disagree: {problem}; the policy samples and its server gives no RNG control, so with "
            "fork_at_q = false a case's arms never share a prefix: unset fork_at_q (forked at q is the default for "
            "such a server) or serve the policy with RNG control (`rescue serve-policy`, docs/own-vla.md)"))
    if problem is not None:
        return Check(name=name, verdict="fail", detail=f"{clients} clients disagree: {problem}")
    ref = results[0]
    last = ref.trace[-1].step if ref.trace else None
    return Check(
        name=name,
        verdict="pass",
        detail=f"{clients} clients agree: fingerprint and all {len(ref.trace)} trace rows (last at step {last}), "
        f"{ref.steps} steps, success {ref.success}",
    )


def _samples(results: list[ArmResult]) -> bool:
    """Whether runs without RNG control reset alike and saw the same first observation, yet got different first
    chunks: the policy samples (DESIGN §13)."""
    if any(r.policy_rng_control is not False for r in results) or len({r.fingerprint for r in results}) != 1:
        return False
    firsts = [r.trace[0] for r in results if r.trace]
    return (len(firsts) == len(results) and len({(f.state, tuple(sorted(f.images.items()))) for f in firsts}) == 1
            and len({f.actions for f in firsts}) > 1)


def mode_check(config: StudyConfig) -> Check:
    """How the study's arms will run (DESIGN §13): forked at q, with or without a replay of the prefix, and how many
    continuations; or each arm whole."""
    if config.forked:
        how = ("each follower replays the prefix through its own connection (the server gives RNG control)"
               if config.policy.rng_control else
               "each follower continues from the snapshot on a fresh connection without a replay (the server gives no "
               "RNG control; the policy is declared stateless)")
        k = f"; {config.continuations} continuations per arm" if config.continuations > 1 else ""
        return Check(name="mode", verdict="pass", detail=f"forked at q: the prefix runs once; {how}{k}")
    return Check(name="mode", verdict="pass", detail="independent: every arm runs whole from the initial state "
                 "(prefix equality needs a deterministic policy or RNG control)")


def _last_line(text: str) -> str:
    """The last non-empty line of an error (a server traceback ends with the exception)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[-1] if lines else str(text)


async def check_policy_query(case: Case, config: StudyConfig, peers: Peers) -> Check:
    """One policy query with the study's observation profile; the chunk must cover C steps."""
    name = "policy query"
    profile = config.policy.observation or "privileged"
    obs: dict = {}
    try:
        obs = await first_obs(case, config, peers)
        client = await _connect(peers)
        try:
            await client.reset()
            reply = await client.infer(obs)
        finally:
            await client.close()
        actions = np.asarray(reply["actions"])
    except PolicyServerError as exc:
        line = _last_line(exc)
        # Another profile is a fix only for a key the observation lacks (a KeyError, or one of its kind, as
        # openpi's servers and rescue-serve raise it); a server's other refusals (the action dimensions, a camera
        # no profile sends) carry their own fix.
        lacks_key = line.split(":", 1)[0].endswith("KeyError")
        fix = (f"; it sent keys {sorted(obs)}: set [policy] observation to the profile the policy reads "
               "(openpi-libero, lerobot-libero, privileged)") if lacks_key else ""
        return Check(name=name, verdict="fail",
                     detail=f"the policy server refused an observation of profile {profile!r} ({line}){fix}")
    except Exception as exc:
        return Check(name=name, verdict="fail", detail=f"{type(exc).__name__}: {_last_line(exc)}")
    interval = peers.interval
    if wire_of(config.policy.url) == VLA_EVAL:  # one action per observation; the chunk stays on the server
        return Check(name=name, verdict="pass" if actions.ndim == 2 and actions.shape[0] == 1 else "fail",
                     detail=f"profile {profile!r}: the vla-eval server answered one action of shape {actions.shape[1:]} "
                     f"to the observation (its chunk of C = {interval} stays on its side)")
    if actions.ndim != 2 or actions.shape[0] < interval:
        return Check(
            name=name,
            verdict="fail",
            detail=f"the policy answered actions of shape {actions.shape}: a chunk needs at least C = {interval} rows "
            "(set [policy] replan_interval to at most the policy's chunk length)",
        )
    # The study's rules must have their inputs in such a reply, or an ablation compares identical arms.
    idle = rule_inputs_problems(config.rules, reply, interval, obs_sample=obs)
    if idle:
        return Check(name=name, verdict="fail", detail="an enabled rule cannot fire: " + "; ".join(idle))
    return Check(
        name=name, verdict="pass",
        detail=f"profile {profile!r}: the policy answered a ({actions.shape[0]}, {actions.shape[1]}) chunk; C = {interval}",
    )


async def _vlm_views(case: Case, config: StudyConfig, peers: Peers) -> tuple[str, dict]:
    profile = get_profile(config.policy.observation or "privileged")
    sim = await peers.pool.acquire()
    try:
        reset = await sim.reset(case, profile, config.env.protocol())
        views = await sim.render(list(VLM_VIEWS), config.env.image_size)
    finally:
        peers.pool.release(sim)
    return reset.instruction, views


def _vlm_hint(kind: str | None, error: str, key_env: str) -> str:
    if kind == "model_mismatch":
        return fix_for(kind)
    text = error.lower()
    if "401" in text or "403" in text or "api key" in text or "api_key" in text:
        return f"the VLM refused the API key: put a valid key in ${key_env} (vlm.api_key_env)"
    if kind == "quota" or "quota" in text:
        return "the VLM account is out of quota"
    if "404" in text or ("model" in text and "not found" in text):
        return "the VLM does not serve this model: check vlm.model and vlm.base_url"
    if kind == "connection":
        return "the VLM endpoint is not reachable: check vlm.base_url"
    return "fix the VLM settings before running the study"


async def check_vlm_call(case: Case, config: StudyConfig, peers: Peers, workdir: Path,
                         advisor: str | None = None, settings: VLMConfig | None = None) -> Check:
    """One real VLM call with the study's settings (an advisor's: `settings`) on a reset simulator's views;
    any failure fails it."""
    name = "vlm call" if advisor is None else f"vlm call (advisor {advisor})"
    configured = settings if settings is not None else config.vlm
    vlm = configured.model_copy(update={"batch_size": 1})  # no batch window to wait for
    closers = []
    client = None
    key = ""
    try:
        if vlm.base_url == "local":
            from rescue.embedded.endpoint import start_endpoint

            runner, base_url = await start_endpoint()
            closers.append(runner.cleanup)
            vlm = vlm.model_copy(update={"base_url": base_url})
        key = vlm.resolved_api_key()
        instruction, views = await _vlm_views(case, config, peers)
        client = VLMClient(vlm, ReceiptLog(workdir / "preflight-receipts.jsonl"), artifacts_dir=workdir / "vlm")
        answer = await client.ask(SubgoalRequest(case.case_id, instruction, case.horizon // 2, views))
    except MissingAPIKey as exc:
        return Check(name=name, verdict="fail", detail=str(exc))
    except Exception as exc:
        return Check(name=name, verdict="fail", detail=f"{type(exc).__name__}: {_last_line(exc)}")
    finally:
        if client is not None:
            await client.aclose()
        for close in closers:
            await close()
    where = f"model {vlm.model!r} at {configured.base_url} ({vlm.api} API, structured output {'on' if vlm.structured else 'off'})"
    if answer.status != "ok":
        error = _last_line(answer.error or answer.status)
        if len(key) >= 4 and key != "none":
            error = error.replace(key, "[redacted]")  # some providers echo the key
        hint = _vlm_hint(answer.error_kind, error, vlm.api_key_env)
        return Check(name=name, verdict="fail", detail=f"{hint} ({where}: {answer.error_kind or answer.status}: {error})")
    answered = f"{where} answered a subgoal of {len(answer.subgoal or '')} characters"
    other = mismatch(vlm.model, answer.receipt.model_reported if answer.receipt is not None else None)
    if other is not None:  # applied only because [vlm] require_model_match = false
        return Check(name=name, verdict="warn", detail=f"{other}; its answers will be applied "
                     f"([vlm] require_model_match = false) ({answered})")
    return Check(name=name, verdict="pass", detail=answered)


async def check_rng_extension(peers: Peers) -> tuple[Check, bool]:
    """Whether the server resets and reports the policy RNG per connection."""
    client = await _connect(peers)
    try:
        supported = client.supports_rng
    finally:
        await client.close()
    if supported:
        return Check(name="rng extension", verdict="pass", detail="the server announces the RNG extension: the policy RNG is reset per arm and read by keepalive"), True
    detail = ("the server lacks the RNG extension: two independent replays of a policy that samples part at step 0, "
              "so a study against it forks at q unless told otherwise (arms record policy_rng_control = false; "
              "determinism below is observed, not enforced)")
    return Check(name="rng extension", verdict="warn", detail=detail), False


async def check_episode_markers(config: StudyConfig, peers: Peers) -> Check:
    """Whether arms will send openpi's episode_start/episode_end frames, and why (DESIGN §10).

    A server that does not know the frames passes them to its policy as an observation (openpi's own
    websocket server does: it answers every frame with `policy.infer`), so they go only to a server whose
    metadata announces them, and never under a protocol whose own client sends none."""
    protocol = get_protocol(config.env.episode_protocol)
    client = await _connect(peers)
    try:
        announced = client.supports_episode_control
    finally:
        await client.close()
    if protocol.episode_markers == "never":
        server = "announces them" if announced else "does not announce them"
        return Check(name="episode markers", verdict="pass",
                     detail=f"not sent: the {protocol.name} protocol's own client sends none (the server {server})")
    if announced:
        return Check(name="episode markers", verdict="pass",
                     detail="sent around every arm: the server announces episode_start/episode_end")
    return Check(name="episode markers", verdict="pass",
                 detail="not sent: the server does not announce episode_start/episode_end; a server that does "
                 "not know them (openpi's) would pass them to its policy as an observation")


async def run_preflight(
    cases: list[Case],
    config: StudyConfig,
    k: int = 2,
    clients: int = 3,
    idle_s: float = 30.0,
    workdir: Path | None = None,
) -> PreflightReport:
    """Start the study's peers with `clients` simulators and run every check; never raises for a failed check.

    k=0 skips the determinism check (the idle hold alone, e.g. for a long hold).
    """
    if not cases:
        raise ValueError("the manifest has no case to run")
    if k < 0 or (k > 0 and clients < 2):
        raise ValueError("the determinism check needs at least two clients")
    simulators = clients if k > 0 else 1
    run_config = config.model_copy(
        update={"arms": ("control",), "env": config.env.model_copy(update={"simulators": simulators})}
    )
    checks: list[Check] = []
    url, rng_control = None, None
    with tempfile.TemporaryDirectory(prefix="preflight-") as tmp:
        try:
            run_config = await resolved_config(run_config)
            # The checks run under the resolved identity (C, observation profile, mode) a study would get.
            fork = resolve_fork(config.fork_at_q, bool(run_config.policy.rng_control), config.continuations,
                                bool(config.query_points or config.triggers))
            config = config.model_copy(update={"policy": run_config.policy, "fork_at_q": fork})
            async with start_peers(run_config, StudyLayout.of(workdir or tmp)) as peers:
                url = peers.policy_url
                # The real calls first: a wrong profile or VLM key ends the preflight in one line.
                calls = [await check_policy_query(cases[0], config, peers)]
                for advisor, _, settings in config.advisor_configs():
                    calls.append(await check_vlm_call(cases[0], config, peers, Path(tmp), advisor, settings))
                checks.extend(calls)
                for check in calls:
                    log.info("preflight.check", **check.model_dump())
                if any(c.verdict == "fail" for c in calls):
                    return PreflightReport(checks=checks, policy_url=url, policy_rng_control=rng_control)
                rng_check, rng_control = await check_rng_extension(peers)
                checks.append(rng_check)
                checks.append(mode_check(config))
                checks.append(await check_episode_markers(run_config, peers))
                if wire_of(config.policy.url) == VLA_EVAL:
                    checks.append(await check_server(cases, config, peers))
                    if k > 0:
                        checks.append(await check_chunk_boundary(cases[0], config, peers))
                for case in cases[:k]:
                    checks.append(await check_determinism(case, config, peers, clients))
                    log.info("preflight.check", **checks[-1].model_dump())
                checks.append(await check_idle_hold(cases[0], config, peers, idle_s))
                log.info("preflight.check", **checks[-1].model_dump())
        except Exception as exc:  # a peer that does not start is a failed preflight, not a crash
            checks.append(Check(name="peers", verdict="fail", detail=f"{type(exc).__name__}: {exc}"))
    idle = idle_length_check(config, idle_s)
    if idle is not None:
        checks.append(idle)
    return PreflightReport(checks=checks, policy_url=url, policy_rng_control=rng_control)


def preflight(
    manifest_path: str | Path, config: StudyConfig, k: int = 2, clients: int = 3, idle_s: float = 30.0
) -> PreflightReport:
    """Load a manifest and run the preflight checks on its first k cases."""
    manifest = load_manifest(manifest_path)
    return asyncio.run(run_preflight(list(manifest.cases), config, k, clients, idle_s))
