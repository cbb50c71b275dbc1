"""The running peers of a study: policy server, VLM client, simulator pool.

A study's identity (C, observation profile, what the policy server announced)
is resolved here once, before the study folder exists, and checked against
the live server on every later start: a mismatch is refused before anything
is claimed or written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import aiohttp
import structlog
from rescue_serve.wire import RNG_EXTENSION

from rescue.core.configuration.config import POLICY_CONNECT_S, PolicyConfig, StudyConfig
from rescue.core.configuration.config_files import ConfigError
from rescue.core.configuration.vlm_config import VLMConfig
from rescue.core.episode_protocol import BUNDLED_DEFAULT as BUNDLED_DEFAULT_PROTOCOL
from rescue.core.episode_protocol import EXTERNAL_DEFAULT as EXTERNAL_DEFAULT_PROTOCOL
from rescue.core.episode_protocol import EpisodeProtocol, get_protocol
from rescue.core.failfast import PeerUnreachable, fix_for, one_line
from rescue.core.configuration.identity import (
    IdentityError,
    announced_identity,
    identity_changes,
    resolve_fork,
    resolve_interval,
    resolve_observation,
    resolve_stateless,
)
from rescue.core.observation import ObservationProfile, get_profile, needs_torch
from rescue.core.configuration.vla_eval_study import study_with_server
from rescue.core.vla_eval_settings import is_vla_eval
from rescue.core.reported_model import mismatch, model_matches
from rescue.env.backend import LOCAL, Backend
from rescue.env.memory import simulator_budget
from rescue.env.pool import SimPool
from rescue.policy.client import PolicyServerError, WebsocketPolicyClient
from rescue.policy.wires import connect
from rescue.study.layout import RECEIPTS, StudyLayout
from rescue.study.ledger import LabBudget
from rescue.study.receipts import ReceiptLog
from rescue.vlm.client import VLMClient
from wrappers.async_rules import LIBERO_LAYOUT, RulesConfig

log = structlog.get_logger()

# How long the policy server may take to answer with its metadata at a start.
POLICY_ANSWER_S = 5.0
# How long the VLM endpoint may take to answer the start's check.
VLM_ANSWER_S = 15.0


# The observation profile of a policy that announces none (DESIGN §7).
EXTERNAL_DEFAULT_OBSERVATION = "openpi-libero"
BUNDLED_DEFAULT_OBSERVATION = "privileged"


def policy_api_key(policy: PolicyConfig) -> str | None:
    """The policy server's API key, from the environment variable the config names."""
    return os.environ.get(policy.api_key_env) if policy.api_key_env else None


async def probe_policy(policy: PolicyConfig) -> dict[str, Any]:
    """The metadata frame of the configured policy server (the bundled one is asked in process)."""
    if policy.url is None:
        from rescue_serve.server import policy_metadata

        from rescue.policy.bundled import load_factory

        try:
            factory = load_factory(policy.factory)
        except (ImportError, AttributeError, ValueError, TypeError) as exc:
            # A factory that names nothing is bad input, refused before the study exists (exit 2).
            raise ConfigError(f"policy.factory {policy.factory!r} cannot be loaded: {type(exc).__name__}: "
                              f"{one_line(str(exc))}") from None
        return policy_metadata(factory, policy.factory, served=True)
    try:
        client = await asyncio.wait_for(
            connect(policy.url, api_key=policy_api_key(policy), connect_timeout_s=POLICY_ANSWER_S),
            POLICY_ANSWER_S,
        )
    except (OSError, asyncio.TimeoutError, aiohttp.ClientError, PolicyServerError) as exc:
        why = "did not answer" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {one_line(str(exc))}"
        raise PeerUnreachable(
            f"the policy server at {policy.url} did not send its metadata within {POLICY_ANSWER_S:g} s ({why}); "
            "start it (or fix policy.url / --policy-url), then run the command again; nothing was claimed"
        ) from None
    try:
        return dict(client.metadata)
    finally:
        await client.close()


async def check_vlm(config: StudyConfig) -> None:
    """Before the first claim: every advisor's VLM endpoint answers and takes its key (the cheapest
    authenticated request, `GET /models`, or one minimal call, as its `startup_check` says).

    Nothing is checked when no arm asks the VLM, nor for the bundled endpoint (started by the run)."""
    for name, _, vlm in config.advisor_configs():
        await _check_one_vlm(vlm, name)


async def _check_one_vlm(vlm: VLMConfig, advisor: str | None) -> None:
    check = vlm.startup_check or "models"
    if vlm.base_url == "local" or check == "none":
        return
    import openai

    client = openai.AsyncOpenAI(base_url=vlm.base_url, api_key=vlm.resolved_api_key(), max_retries=0, timeout=VLM_ANSWER_S)
    try:
        if check == "models":
            listed = [m.id for m in (await client.models.list()).data]
            if listed and not any(model_matches(vlm.model, m) for m in listed):
                # Said, not refused: a list is not an answer (answers are refused, by require_model_match).
                log.warning("vlm.model_not_listed", advisor=advisor, base_url=vlm.base_url, model=vlm.model,
                            listed=listed[:10], detail="another server on that port? its answers will be refused"
                            if vlm.refuses_other_models else "another server on that port?")
        else:
            from rescue.vlm.exchange import probe_kwargs

            reply = await client.chat.completions.create(**probe_kwargs(vlm))
            other = mismatch(vlm.model, reply.model)
            if other is not None and vlm.refuses_other_models:
                raise PeerUnreachable(f"the VLM endpoint{_of(advisor)} at {vlm.base_url}: {other}; {fix_for('model_mismatch')}; "
                                      "nothing was claimed")
            if other is not None:
                log.warning("vlm.model_mismatch", advisor=advisor, requested=vlm.model, reported=reply.model,
                            detail=f"{other}; its answers will be applied ([vlm] require_model_match = false)")
    except openai.APIStatusError as exc:
        if exc.status_code == 404 and check == "models":
            return  # a server without /models: it answered, and did not refuse the key
        fix = (f"check the key in ${vlm.api_key_env}" if exc.status_code in (401, 403)
               else "check vlm.base_url and vlm.model")
        raise PeerUnreachable(f"the VLM endpoint{_of(advisor)} at {vlm.base_url} refused the start's check with HTTP "
                              f"{exc.status_code} ({one_line(exc.message)}); {fix}; nothing was claimed") from None
    except (openai.APIConnectionError, openai.APITimeoutError) as exc:
        raise PeerUnreachable(f"the VLM endpoint{_of(advisor)} at {vlm.base_url} is not reachable ({type(exc).__name__}: "
                              f"{one_line(str(exc.__cause__ or exc))}); start it or fix vlm.base_url / --vlm-url; "
                              "nothing was claimed") from None
    finally:
        await client.close()


def _of(advisor: str | None) -> str:
    return f" of advisor {advisor!r}" if advisor is not None else ""


def config_with_identity(config: StudyConfig, metadata: dict[str, Any]) -> StudyConfig:
    """The study's configuration with its identity fixed: C, observation profile, announced identity."""
    if is_vla_eval(metadata):
        config = study_with_server(config, metadata)
    default = BUNDLED_DEFAULT_OBSERVATION if config.policy.url is None else EXTERNAL_DEFAULT_OBSERVATION
    observation = resolve_observation(config.policy.observation, metadata, default)
    try:
        profile = get_profile(observation)
    except ValueError as exc:
        raise IdentityError(f"policy.observation: {exc}") from None
    if needs_torch(profile) and importlib.util.find_spec("torch") is None:
        raise IdentityError(f"policy.observation: the {profile.name} profile computes the state's axis-angle with torch's "
                            "float32 kernels, as LeRobot does, and torch is not installed here (pip install torch==2.13.0)")
    rng_control = bool(metadata.get(RNG_EXTENSION))
    stateless = resolve_stateless(config.policy.stateless, metadata, rng_control)
    policy = config.policy.model_copy(
        update={
            "replan_interval": resolve_interval(config.policy.replan_interval, metadata),
            "observation": observation,
            "observation_sha256": profile.sha256(),
            "announced": announced_identity(metadata),
            "stateless": stateless,
            "rng_control": rng_control,
        }
    )
    episode = study_protocol(config)
    env = config.env.model_copy(update={"episode_protocol": episode.name, "episode_protocol_sha256": episode.sha256(),
                                        "instruction": episode.instruction})
    fork = resolve_fork(config.fork_at_q, rng_control, config.continuations,
                        bool(config.query_points or config.triggers))
    return config.model_copy(update={"policy": policy, "env": env, "rules": _rules_for(config.rules, profile),
                                     "fork_at_q": fork})


def _rules_for(rules: RulesConfig, profile: ObservationProfile) -> RulesConfig:
    """The rules with the default layout's gripper opening read where the profile sends it (the state
    vector's gripper entry for openpi-libero and lerobot-libero); a layout the config sets is kept."""
    opening = profile.gripper_opening()
    if rules.layout != LIBERO_LAYOUT or opening is None:
        return rules
    key, index = opening
    layout = dataclasses.replace(LIBERO_LAYOUT, state_key=key, gripper_state_dims=(index,))
    return rules.model_copy(update={"layout": layout})


def study_protocol(config: StudyConfig) -> EpisodeProtocol:
    """The study's episode protocol: the configured one, else `openpi` for an external server and `rescue`
    for the bundled policies, telling what `[env] instruction` says (IdentityError for an unknown name)."""
    name = config.env.episode_protocol or (EXTERNAL_DEFAULT_PROTOCOL if config.policy.url else BUNDLED_DEFAULT_PROTOCOL)
    try:
        return get_protocol(name, config.env.instruction)
    except ValueError as exc:
        raise IdentityError(f"env.episode_protocol: {exc}") from None


async def resolved_config(config: StudyConfig) -> StudyConfig:
    """Probe the configured policy server and fix the study's identity (IdentityError when it cannot);
    check the VLM endpoint too (PeerUnreachable when either does not answer)."""
    await check_vlm(config)  # the cheap check first: building a bundled policy to ask it takes seconds
    return config_with_identity(config, await probe_policy(config.policy))


def check_identity(config: StudyConfig, metadata: dict[str, Any]) -> None:
    """Refuse a server that announces itself otherwise than when the study was created, or a changed profile."""
    changes = identity_changes(config.policy.announced or {}, metadata)
    profile = get_profile(config.policy.observation or BUNDLED_DEFAULT_OBSERVATION)
    if config.policy.observation_sha256 not in (None, profile.sha256()):
        changes.append(
            f"observation profile {profile.name!r}: the study was created with definition "
            f"{config.policy.observation_sha256[:12]}…, this version defines {profile.sha256()[:12]}…"
        )
    rng_control = bool(metadata.get(RNG_EXTENSION))
    if config.policy.rng_control is not None and config.policy.rng_control != rng_control:
        had = "announced" if config.policy.rng_control else "did not announce"
        now = "announces" if rng_control else "does not announce"
        changes.append(f"RNG extension: the server {had} it when the study was created and {now} it now")
    if changes:
        raise IdentityError("the policy server is not the one this study was created with: " + "; ".join(changes))
    episode = config.env.protocol()
    if config.env.episode_protocol_sha256 not in (None, episode.sha256()):
        raise IdentityError(f"episode protocol {episode.name!r}: the study was created with definition "
                            f"{config.env.episode_protocol_sha256[:12]}…, this version defines {episode.sha256()[:12]}…")


async def check_live_identity(config: StudyConfig) -> None:
    """Probe the configured policy server and check it against the study's identity; check the VLM endpoint."""
    await check_vlm(config)
    check_identity(config, await probe_policy(config.policy))


@dataclass
class Peers:
    """The running peers of a study: policy URLs, VLM clients (one per advisor), simulator pool."""

    # One URL per policy process, else the one server's (in the command process, or external).
    policy_urls: list[str]
    policy_api_key: str | None
    interval: int
    pool: SimPool
    vlm: VLMClient | None
    closers: list[Callable[[], Any]] = field(default_factory=list)
    # Every advisor's client by its arm (`assisted`, or `assisted:<name>`); `vlm` is the primary's.
    advisors: dict[str, VLMClient] = field(default_factory=dict)
    # The lab budget a case's calls are held against before it is claimed; None: the study declares none.
    budget: LabBudget | None = None
    # How long a connection is tried again while the policy server's port refuses (`[policy] connect_timeout_s`).
    policy_connect_s: float = POLICY_CONNECT_S
    _next_policy: int = field(default=0, init=False, repr=False)

    @property
    def policy_url(self) -> str:
        """The first policy URL (the only one unless the policy is served from processes of its own)."""
        return self.policy_urls[0]

    async def connect_policy(self, url: str | None = None) -> WebsocketPolicyClient:
        """A new connection to `url` (None: the first policy URL), tried again while its port refuses for
        `policy_connect_s`."""
        return await connect(url or self.policy_url, api_key=self.policy_api_key, connect_timeout_s=self.policy_connect_s)

    def next_policy_url(self) -> str:
        """The policy URL the next connection goes to: each in turn."""
        url = self.policy_urls[self._next_policy % len(self.policy_urls)]
        self._next_policy += 1
        return url


@contextlib.asynccontextmanager
async def start_peers(
    config: StudyConfig, layout: StudyLayout, backend: Backend = LOCAL, lab_budget: float | None = None
) -> AsyncIterator[Peers]:
    """Start what a created study's config asks for, after checking the policy server's identity.

    The simulators come from `backend`: local processes, or actors on a Ray cluster. `lab_budget`: the lab
    budget's cap for this run instead of the study's `[vlm] lab_budget`."""
    closers: list[Callable[[], Any]] = []
    try:
        api_key = policy_api_key(config.policy)
        policy_urls = await _serve_policy(config, layout, closers)
        for url in policy_urls:  # every process serves the same policy: each is checked
            probe = await connect(url, api_key=api_key, connect_timeout_s=config.policy.connect_timeout())
            metadata = dict(probe.metadata)
            await probe.close()
            check_identity(config, metadata)
        advisors: dict[str, VLMClient] = {}
        budget = None
        if config.advisor_configs() and (lab_budget is not None or config.vlm.lab_budget is not None):
            budget = LabBudget(config, layout.root, lab_budget)
            closers.append(budget.close)
        local_url = None
        # One receipts log for every advisor: each receipt names its advisor (DESIGN §11).
        receipts = ReceiptLog(layout.receipts, name=RECEIPTS)
        for name, arm, vlm_config in config.advisor_configs():
            if vlm_config.base_url == "local":
                if local_url is None:
                    from rescue.embedded.endpoint import start_endpoint

                    runner, local_url = await start_endpoint()
                    closers.append(runner.cleanup)
                vlm_config = vlm_config.model_copy(update={"base_url": local_url})
            # Each advisor its own client: its settings, its prompt, its limiter and batches.
            advisors[arm] = VLMClient(vlm_config, receipts, artifacts_dir=layout.vlm_artifacts, advisor=name, budget=budget)
            closers.append(advisors[arm].aclose)
        max_rss_gb, source = simulator_budget(config.env.max_simulator_rss_gb, config.env.simulators,
                                              on_this_machine=backend.kind == "local" or backend.address is None)
        log.info("env.memory_budget", gb=max_rss_gb, source=source)
        pool = backend.pool(config.env.simulators, config.env.adapter, log_path=str(layout.simulator_log),
                            max_rss_gb=max_rss_gb)
        closers.append(pool.close)
        yield Peers(policy_urls, api_key, config.interval, pool, advisors.get(config.primary_arm), closers, advisors,
                    budget, config.policy.connect_timeout())
    finally:
        for close in reversed(closers):
            result = close()
            if asyncio.iscoroutine(result):
                await result


def policy_connections(config: StudyConfig) -> int:
    """The connections a study's own policy server takes at once: every arm (and continuation) of every case in
    flight may hold one (a fork's followers open theirs at q), and a few more for probes; never fewer than the
    serving distribution's default."""
    from rescue_serve.limits import DEFAULT_MAX_CONNECTIONS

    return max(DEFAULT_MAX_CONNECTIONS, config.cases_in_flight * len(config.case_arms) + 16)


async def _serve_policy(config: StudyConfig, layout: StudyLayout, closers: list[Callable[[], Any]]) -> list[str]:
    """The policy URLs of a run: the configured server's; else the in-process policy served from processes of
    its own (`[policy] processes`, by default one per 8 simulators from 4 on), or in this process."""
    if config.policy.url is not None:
        return [config.policy.url]
    processes = config.policy.served_processes(config.env.simulators)
    connections = policy_connections(config)
    if processes > 0:
        from rescue.run.policy_processes import serve_in_processes, stop_processes

        # Started and waited for here, in the main thread: a child dies with it (see env.pool.die_with).
        served = serve_in_processes(config.policy.factory, processes, str(layout.policy_log),
                                    max_connections=connections)
        closers.append(lambda: stop_processes(served))
        return [p.url for p in served]
    from rescue.policy.bundled import serve_factory

    server = await serve_factory(config.policy.factory, max_connections=connections)
    closers.append(server.stop)
    return [server.url]
