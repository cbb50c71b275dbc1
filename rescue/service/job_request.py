"""What a job may set, and how its request becomes a study's configuration.

A job names its choices (`vlm.endpoint`, `policy.name`) and may set only the
keys of JOB_KEYS (generation settings, arms, rules, counts...); anything else is
refused naming the key. The worker resolves the names into the study's
configuration when the job starts (`resolve_job`), and checks a stored study's
configuration against the same choices before resuming it (`study_problems`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
)

from rescue.core.configuration.config import EnvConfig, PolicyConfig, StudyConfig
from rescue.core.configuration.config_files import ConfigError, validate_config
from rescue.core.prompts import DEFAULT_ROOT
from rescue.core.configuration.schema import mixed_keys_problem
from rescue.core.configuration.vlm_config import AdvisorConfig, VLMConfig
from rescue.service.settings import (
    LOCAL,
    NAME_PATTERN,
    NO_KEY_ENV,
    TEMPLATE_PATTERN,
    Endpoint,
    ServiceConfig,
)

# The keys a job may set, dotted; a section listed whole (rules, sham) may be set in every key below it.
# Everything else is refused: it points the worker at a host, a file or code, or it is resolved when the
# study is created. `vlm.endpoint` and `policy.name` name the service's choices.
JOB_KEYS: frozenset[str] = frozenset({
    "cases_in_flight", "release_simulator_while_waiting", "fork_at_q", "continuations", "keyframes", "keepalive_s",
    "fail_fast_arms", "arms", "allow_idle_rules", "query_rule", "rules", "sham",
    "env.simulators", "env.image_size", "env.episode_protocol", "env.instruction", "env.max_simulator_rss_gb",
    "policy.replan_interval", "policy.observation", "policy.stateless", "policy.processes", "policy.connect_timeout_s",
    "vlm.model", "vlm.api", "vlm.structured", "vlm.deadline_s", "vlm.request_timeout_s", "vlm.max_attempts",
    "vlm.backoff_initial_s", "vlm.backoff_max_s", "vlm.backoff_jitter_s", "vlm.max_subgoal_chars",
    "vlm.prompt_template", "vlm.max_concurrent_calls", "vlm.requests_per_minute", "vlm.batch_size",
    "vlm.batch_window_s", "vlm.image_format", "vlm.image_detail", "vlm.max_output_tokens", "vlm.temperature",
    "vlm.seed", "vlm.reasoning_effort", "vlm.store", "vlm.startup_check", "vlm.price", "vlm.require_model_match",
    # Each entry's keys are checked on their own (ADVISOR_JOB_KEYS): an advisor names a service endpoint.
    "advisors", "query_points", "triggers", "asking", "vlm.may_decline",
})


# The keys of one `[[advisor]]` a job may set: its name, the service endpoint it names, and every
# job-settable `[vlm]` key; its URL, key and prompt folder come from the endpoint.
ADVISOR_JOB_KEYS: frozenset[str] = frozenset(
    {"name", "endpoint"} | {k.split(".", 1)[1] for k in JOB_KEYS if k.startswith("vlm.")}
)


CHOICE_KEYS = ("vlm.endpoint", "policy.name")


_ENDPOINT_HINT = "the service's endpoints carry their URLs and keys: name one with vlm.endpoint"


_POLICY_HINT = "the service's policies carry their servers and code: name one with policy.name"


# Why a key of StudyConfig is not job-settable (the rest: "resolved when the job starts").
_REFUSED_WHY: dict[str, str] = {
    "vlm.base_url": _ENDPOINT_HINT,
    "vlm.api_key_env": _ENDPOINT_HINT,
    "vlm.api_key": _ENDPOINT_HINT,
    "vlm.server": _ENDPOINT_HINT,
    "vlm.api_key_from_config": _ENDPOINT_HINT,
    "vlm.prompt_root": "a folder of the worker's host: the service's endpoint sets it",
    "policy.url": _POLICY_HINT,
    "policy.factory": _POLICY_HINT,
    "policy.api_key_env": _POLICY_HINT,
    "env.adapter": "code: the service runs its own simulator adapter",
    "vlm.lab_budget": "the lab's budget and its ledger are the lab's, not one job's",
    "vlm.lab_ledger": "the lab's budget and its ledger are the lab's, not one job's",
}


@dataclass(frozen=True)
class JobRequest:
    """A job as submitted: its study settings (job-settable keys only) and its choices by name."""

    config: StudyConfig
    """The settings the job gave; every other key is the default until the worker resolves the choices."""
    endpoint: str | None = None
    """`vlm.endpoint`: the service's VLM endpoint; None: its default."""
    policy: str | None = None
    """`policy.name`: the service's policy; None: its default."""
    given: frozenset[str] = field(default_factory=frozenset)
    """The dotted keys the job gave (what `resolve_job` must not overwrite)."""

    def settings(self) -> dict[str, Any]:
        """The job's settings as given (the job-settable keys it set), as a configuration object."""
        out: dict[str, Any] = {}
        for dotted, value in _leaves(self.config.model_dump(mode="json")):
            if dotted in self.given:
                section, _, key = dotted.partition(".")
                if key:
                    out.setdefault(section, {})[key] = value
                else:
                    out[section] = value
        return out


# Sections of StudyConfig whose keys are walked one by one (the others are leaves, or allowed whole).
_SECTIONS: dict[str, type[BaseModel]] = {"policy": PolicyConfig, "env": EnvConfig, "vlm": VLMConfig}


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of the keys of a configuration object, down to a section's keys (not into values)."""
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if not prefix and key in _SECTIONS and isinstance(value, Mapping):
            yield from _leaves(value, f"{key}.")
        else:
            yield dotted, value


def _known(dotted: str) -> bool:
    section, _, key = dotted.partition(".")
    if key:
        return section in _SECTIONS and (key in _SECTIONS[section].model_fields or key == "api_key")
    return section in StudyConfig.model_fields


def _settable(dotted: str) -> bool:
    return dotted in JOB_KEYS or dotted.split(".", 1)[0] in JOB_KEYS


def key_problem(dotted: str) -> str | None:
    """Why a job may not set this key, in one line; None: it may."""
    if _settable(dotted) or dotted in CHOICE_KEYS:
        return None
    if not _known(dotted):
        return f"{dotted}: unknown key"
    why = _REFUSED_WHY.get(dotted, "resolved when the job starts")
    return f"{dotted}: not settable by a job ({why})"


def advisor_problems(entries: Any, given_only: bool = True) -> list[str]:
    """Why a job's `[[advisor]]` tables may not be used as given, one line each (empty: they may).

    `given_only` False: the entries are a configuration's full dumps, and only keys that differ from an
    advisor's defaults count as set (a default URL or key variable points nowhere new)."""
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        return ["advisors: a list of [[advisor]] tables"]
    problems = []
    defaults = AdvisorConfig.model_construct().model_dump(mode="json") if not given_only else {}
    for i, entry in enumerate(entries):
        where = f"advisors[{i}]" + (f" ({entry['name']})" if isinstance(entry.get("name"), str) else "")
        for key, value in entry.items():
            if key in ADVISOR_JOB_KEYS or (not given_only and (key not in defaults or value == defaults[key])):
                if key == "endpoint" and value is not None and (not isinstance(value, str) or not NAME_PATTERN.fullmatch(value)):
                    problems.append(f"{where}.endpoint: a name of the service's configuration")
                continue
            if key == "prompt":
                problems.append(f"{where}.prompt: a file of the worker's host: name the endpoint's template with prompt_template")
            elif key in VLMConfig.model_fields or key == "api_key":
                why = _REFUSED_WHY.get(f"vlm.{key}", "resolved when the job starts").replace("vlm.endpoint", "endpoint")
                problems.append(f"{where}.{key}: not settable by a job ({why})")
            else:
                problems.append(f"{where}.{key}: unknown key")
    return problems


def job_request(data: Any) -> JobRequest:
    """A job request from a configuration object (the API's `config`); ConfigError naming every refused key."""
    if not isinstance(data, Mapping):
        raise ConfigError("config: a JSON object of settings")
    mixed = mixed_keys_problem(data)
    if mixed is not None:
        raise ConfigError(f"config: {mixed}")
    # TOML's [[advisor]], [[query_point]] and [[trigger]] tables
    tables = {"advisor": "advisors", "query_point": "query_points", "trigger": "triggers"}
    for table, key in tables.items():
        if table in data and key in data:
            raise ConfigError(f"config: give [[{table}]] tables or {key}, not both")
    data = {tables.get(k, k): v for k, v in data.items()}
    problems: list[str] = []
    choices: dict[str, str | None] = dict.fromkeys(CHOICE_KEYS)
    settings: dict[str, Any] = {}
    for dotted, value in _leaves(data):
        if dotted in _SECTIONS:
            problems.append(f"{dotted}: a table of settings")
            continue
        if dotted in CHOICE_KEYS:
            if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
                problems.append(f"{dotted}: a name of the service's configuration")
            else:
                choices[dotted] = value
            continue
        problem = key_problem(dotted)
        if problem:
            problems.append(problem)
            continue
        if dotted == "advisors" and value is not None:
            found = advisor_problems(value)
            if found:
                problems.extend(found)
                continue
        node = settings
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if not isinstance(node, dict) or (leaf in node and isinstance(node[leaf], dict) != isinstance(value, dict)):
            # `{"rules": 5, "rules.x": 1}`: a key given whole and again by one of its keys.
            problems.append(f"{dotted}: given both whole and key by key ({parents[0] if parents else dotted})")
            continue
        node[leaf] = value
    if problems:
        raise ConfigError("config: " + "; ".join(problems))
    config = validate_config(settings, "config")
    return JobRequest(config, choices["vlm.endpoint"], choices["policy.name"], frozenset(d for d, _ in _leaves(settings)))


def request_of(config: StudyConfig, endpoint: str | None = None, policy: str | None = None) -> JobRequest:
    """A job request from a study configuration (`rescue submit`'s, or a queued job's config.json).

    A key counts as given when it was set or differs from the default, so a
    full dump of an older job holds only what differs; ConfigError names every refused key."""
    given = set(dict(_leaves(config.model_dump(mode="json", exclude_unset=True)))) - {"vlm.api_key_from_config"}
    default = dict(_leaves(StudyConfig().model_dump(mode="json")))
    changed = {k for k, v in _leaves(config.model_dump(mode="json")) if v != default.get(k)} - {"vlm.api_key_from_config"}
    if config.vlm.api_key is not None or config.vlm.api_key_from_config:
        changed.add("vlm.api_key")
    # A refused key written with its default value (every key of an older job's full dump) points nowhere new.
    refused = [p for k in sorted(given | changed) if (p := key_problem(k)) and k in changed]
    if config.advisors:
        refused += advisor_problems(config.model_dump(mode="json")["advisors"], given_only=False)
        if any(a.api_key is not None or a.api_key_from_config for a in config.advisors):
            refused.append("advisors: api_key: not settable by a job (the service's endpoints carry their keys)")
    if refused:
        raise ConfigError("config: " + "; ".join(refused))
    keep = {k for k in given | changed if _settable(k)}
    return JobRequest(config, endpoint, policy, frozenset(keep))


def resolve_job(request: JobRequest, service: ServiceConfig) -> StudyConfig:
    """The study configuration of a job: its settings, with the service's endpoint and policy it named.

    ConfigError names every problem: a name the service does not offer, a
    model it does not allow, a setting the endpoint or policy fixes otherwise,
    a limit exceeded, a prompt template that is not a template's name."""
    problems: list[str] = []
    data = request.config.model_dump(mode="json")
    given = request.given
    try:
        _, endpoint = service.endpoint(request.endpoint)
    except ConfigError as exc:
        problems.append(str(exc))
        endpoint = None
    try:
        _, policy = service.named_policy(request.policy)
    except ConfigError as exc:
        problems.append(str(exc))
        policy = None
    vlm, pol = data["vlm"], data["policy"]
    if data.get("advisors"):
        # Each advisor names its own endpoint; the study's `[vlm]` stays unset (DESIGN §11).
        endpoint = None
        if request.endpoint is not None:
            problems.append("vlm.endpoint: a job with [[advisor]] tables names each advisor's endpoint")
        defaults = AdvisorConfig.model_construct().model_dump(mode="json")
        for i, entry in enumerate(data["advisors"]):
            where = f"advisors[{i}] ({entry['name']})"
            try:
                entry["endpoint"], chosen = service.endpoint(entry.get("endpoint"))
            except ConfigError as exc:
                problems.append(f"{where}: {exc}")
                continue
            entry_given = {k for k, v in entry.items() if v != defaults.get(k)}
            _apply_endpoint(entry, chosen, entry_given, where, problems)
    if endpoint is not None:
        _apply_endpoint(vlm, endpoint, {k.split(".", 1)[1] for k in given if k.startswith("vlm.")}, "vlm", problems)
    if policy is not None:
        pol.update(url=policy.url, api_key_env=policy.api_key_env,
                   factory=policy.factory or PolicyConfig.model_fields["factory"].default)
        for key in ("observation", "replan_interval"):
            fixed = getattr(policy, key)
            if fixed is None:
                continue
            if f"policy.{key}" in given and pol[key] != fixed:
                problems.append(f"policy.{key}: this policy fixes it to {fixed!r}")
            pol[key] = fixed
    if not data.get("advisors"):
        _template_problem(vlm, endpoint, "vlm", problems)
    limits = service.limits
    # More policy processes than simulators serve nothing: the simulators' limit bounds them too.
    for key, value, most in (("env.simulators", data["env"]["simulators"], limits.simulators),
                             ("policy.processes", pol["processes"] or 0, limits.simulators),
                             ("cases_in_flight", data["cases_in_flight"], limits.cases_in_flight),
                             ("env.image_size", data["env"]["image_size"], limits.image_size)):
        if value > most:
            problems.append(f"{key}: at most {most} on this service")
    if problems:
        raise ConfigError("config: " + "; ".join(problems))
    return validate_config(data, "config", limits.arms_per_case)


def _apply_endpoint(vlm: dict[str, Any], endpoint: Endpoint, given: set[str], where: str, problems: list[str]) -> None:
    """Fill a VLM table (`[vlm]`, or one advisor's) from the service endpoint it named, checking the keys the job gave."""
    vlm.update(base_url=endpoint.base_url, api_key_env=endpoint.api_key_env or NO_KEY_ENV,
               prompt_root=endpoint.prompt_root, server=endpoint.server)
    if endpoint.models:
        if "model" not in given:
            vlm["model"] = endpoint.models[0]
        elif vlm["model"] not in endpoint.models:
            problems.append(f"{where}.model: {vlm['model']!r} is not offered by this endpoint "
                            f"(it offers: {', '.join(endpoint.models)})")
    if endpoint.api is not None:
        if "api" in given and vlm["api"] != endpoint.api:
            problems.append(f"{where}.api: this endpoint takes {endpoint.api!r} only")
        vlm["api"] = endpoint.api
    for key in ("max_concurrent_calls", "requests_per_minute"):
        cap = getattr(endpoint, key)
        if cap is None:
            continue
        if key in given and vlm[key] is not None and vlm[key] <= cap:
            continue
        if key in given:
            problems.append(f"{where}.{key}: at most {cap:g} on this endpoint")
        vlm[key] = cap
    if where != "vlm":
        _template_problem(vlm, endpoint, where, problems)


def _template_problem(vlm: dict[str, Any], endpoint: Endpoint | None, where: str, problems: list[str]) -> None:
    if not TEMPLATE_PATTERN.fullmatch(vlm["prompt_template"]):
        problems.append(f"{where}.prompt_template: the name of a template (letters, digits, '_' or '-'), not a path")
    elif endpoint is not None:
        root = Path(endpoint.prompt_root) if endpoint.prompt_root else DEFAULT_ROOT
        if not (root / f"{vlm['prompt_template']}.txt").is_file():
            problems.append(f"{where}.prompt_template: this endpoint has no template {vlm['prompt_template']!r}")


def _vlm_problems(vlm: VLMConfig, service: ServiceConfig, where: str) -> list[str]:
    # The bundled endpoint runs in the job itself: whatever key variable an older study named stays on loopback.
    endpoints = [e for e in service.vlm.values()
                 if e.base_url == vlm.base_url and (vlm.base_url == LOCAL or (e.api_key_env or NO_KEY_ENV) == vlm.api_key_env)]
    problems = []
    if not endpoints:
        problems.append(f"{where}.base_url, {where}.api_key_env: not an endpoint of this service")
    elif not any(e.prompt_root == vlm.prompt_root for e in endpoints):
        problems.append(f"{where}.prompt_root: not this endpoint's prompt folder")
    elif not any(e.server == vlm.server for e in endpoints):
        problems.append(f"{where}.server: not this endpoint's server kind")
    if not TEMPLATE_PATTERN.fullmatch(vlm.prompt_template):
        problems.append(f"{where}.prompt_template: not a template's name")
    return problems


def study_problems(config: StudyConfig, service: ServiceConfig) -> list[str]:
    """Why a stored study may not go on under this service: a host, key, file or code the service does not offer."""
    if config.advisors:
        problems = [p for i, a in enumerate(config.advisors) for p in _vlm_problems(a, service, f"advisors[{i}] ({a.name})")]
    else:
        problems = _vlm_problems(config.vlm, service, "vlm")
    pol = config.policy
    # A policy with a url is that server; its factory is never loaded.
    if not any(p.url == pol.url and p.api_key_env == pol.api_key_env and (p.url is not None or p.factory == pol.factory)
               for p in service.policy.values()):
        problems.append("policy.url, policy.factory, policy.api_key_env: not a policy of this service")
    if config.env.adapter != EnvConfig.model_fields["adapter"].default:
        problems.append("env.adapter: not the service's simulator adapter")
    return problems
