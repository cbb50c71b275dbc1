"""What a job may choose from: the service's own configuration (its named endpoints, policies and limits).

A submitted job must not be able to point the worker at a host, a file or code:
it would then send the worker's own keys to the submitter's endpoint, read the
worker's files, or run any importable callable. So the operator names what jobs
may use in a TOML file of the service (`rescue serve`, RESCUE_SERVICE_CONFIG):

    [defaults]
    vlm = "openai"                # the endpoint of a job that names none
    policy = "pi05"

    [vlm.openai]
    base_url = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"
    models = ["gpt-4.1-mini", "gpt-4.1"]   # a job may ask for these; the first is its default

    [policy.pi05]
    url = "ws://gpu-box:8000"
    api_key_env = "PI05_KEY"

    [limits]
    simulators = 4

A job names its choices (`vlm.endpoint`, `policy.name`) and may set only the
keys of JOB_KEYS: rescue/service/job_request.py.

Without a service file the embedded defaults are the only choices: the local VLM
endpoint and the embedded policies.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rescue.core.configuration.config_files import ConfigError, read_toml
from rescue.core.configuration.work_limit import MAX_ARM_STEPS, MAX_ARMS_PER_CASE

# The environment variable naming the service's configuration file (what `rescue serve` reads).
SERVICE_CONFIG_ENV = "RESCUE_SERVICE_CONFIG"
# The key variable of an endpoint that takes no key: the worker never passes it to a job,
# so the VLM client sends its placeholder, never another variable's key.
NO_KEY_ENV = "RESCUE_NO_VLM_KEY"
LOCAL = "local"

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# A prompt template is a file name in the endpoint's prompt folder, never a path.
TEMPLATE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


class Endpoint(BaseModel):
    """One VLM endpoint a job may name (`[vlm.<name>]`): where it is, which key goes with it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    base_url: str
    """Base URL of the OpenAI-compatible API (http:// or https://); `local`: the bundled endpoint."""
    api_key_env: str | None = None
    """The worker's environment variable holding this endpoint's key; None: no key is sent."""
    models: list[str] = Field(default_factory=list)
    """The models a job may ask for, the first its default (`model = "x"` gives one); empty: any model."""
    api: Literal["chat", "responses"] | None = None
    """The API every job uses on this endpoint; None: the job's `vlm.api` (default chat)."""
    server: Literal["openai", "vllm", "ollama", "sglang"] | None = None
    """What serves it, so each generation setting goes as the field that server reads (`[vlm] server`);
    None: the OpenAI wire."""
    prompt_root: str | None = None
    """The folder of prompt templates on the worker's host; None: the shipped prompts."""
    max_concurrent_calls: int | None = Field(default=None, gt=0)
    """The most requests in flight a job may ask for (and its default); None: as the job says."""
    requests_per_minute: float | None = Field(default=None, gt=0)
    """The highest request rate a job may ask for (and its default); None: as the job says."""

    @model_validator(mode="before")
    @classmethod
    def _one_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" in data:
            data = dict(data)
            if "models" in data:
                raise ValueError("give model or models, not both")
            data["models"] = [data.pop("model")]
        return data

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if value != LOCAL and not re.match(r"https?://[^/\s]+", value):
            raise ValueError(f"{value!r}: an http:// or https:// URL, or 'local'")
        return value


class NamedPolicy(BaseModel):
    """One policy a job may name (`[policy.<name>]`): a server's URL or an in-process factory."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str | None = None
    """The policy server's websocket URL (ws:// or wss://; vla-eval+ws:// or vla-eval+wss:// for a vla-eval model server)."""
    factory: str | None = None
    """`module:attr` of an in-process policy served on loopback (when there is no url)."""
    api_key_env: str | None = None
    """The worker's environment variable holding the policy server's key; None: no key is sent."""
    observation: str | None = None
    """The observation profile every job uses with it; None: the job's `policy.observation`, else what the server announces."""
    replan_interval: int | None = Field(default=None, gt=0)
    """C for every job; None: the job's `policy.replan_interval`, else the server's `action_horizon`."""

    @model_validator(mode="after")
    def _one_source(self) -> NamedPolicy:
        if (self.url is None) == (self.factory is None):
            raise ValueError("give exactly one of url and factory")
        if self.url is not None and not re.match(r"(vla-eval\+)?wss?://[^/\s]+", self.url):
            raise ValueError(f"url {self.url!r}: a ws:// or wss:// URL (vla-eval+ws:// for a vla-eval model server)")
        if self.factory is not None and self.api_key_env is not None:
            raise ValueError("api_key_env goes with a url (an in-process policy takes no key)")
        return self


class Defaults(BaseModel):
    """What a job that names nothing gets."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    vlm: str | None = None
    """The endpoint of a job without `vlm.endpoint`; None: `local` if offered, else the first listed."""
    policy: str | None = None
    """The policy of a job without `policy.name`; None: `vision_language` if offered, else the first listed."""


class Limits(BaseModel):
    """The most a job may ask of the worker's machine."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    simulators: int = Field(default=8, gt=0)
    """Simulator processes of one job (`env.simulators`) at most."""
    cases_in_flight: int = Field(default=64, gt=0)
    """Cases one job runs at once (`cases_in_flight`) at most."""
    image_size: int = Field(default=1024, gt=0)
    """Side of the views rendered for the VLM (`env.image_size`) at most, in pixels."""
    arms_per_case: int = Field(default=MAX_ARMS_PER_CASE, gt=0, le=MAX_ARMS_PER_CASE)
    """Arms one case of a job runs (its arms × its continuations) at most; at most the study's own bound."""
    arm_steps: int = Field(default=MAX_ARM_STEPS, gt=0, le=MAX_ARM_STEPS)
    """Arm-steps one job asks for (each case's horizon × its arms, summed) at most; at most the study's own bound."""


def _embedded_endpoints() -> dict[str, Endpoint]:
    return {LOCAL: Endpoint(base_url=LOCAL)}


def _embedded_policies() -> dict[str, NamedPolicy]:
    # Named by string: the service imports no policy; the job's child loads the one a study uses.
    return {name: NamedPolicy(factory=f"rescue.embedded.{module}:make_policy")
            for name, module in (("learned", "learned"), ("scripted", "scripted"), ("vision_language", "vision_language"))}


class ServiceConfig(BaseModel):
    """The operator's choices: named VLM endpoints and policies, the defaults and the limits of a job."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    vlm: dict[str, Endpoint] = Field(default_factory=_embedded_endpoints)
    """The endpoints a job may name; not given: the local endpoint only."""
    policy: dict[str, NamedPolicy] = Field(default_factory=_embedded_policies)
    """The policies a job may name; not given: the embedded policies (learned, scripted, vision_language)."""
    defaults: Defaults = Field(default_factory=Defaults)
    """What a job that names nothing gets."""
    limits: Limits = Field(default_factory=Limits)
    """The most a job may ask of the machine."""

    @model_validator(mode="after")
    def _names(self) -> ServiceConfig:
        for section, named in (("vlm", self.vlm), ("policy", self.policy)):
            if not named:
                raise ValueError(f"[{section}] offers nothing: name at least one")
            for name in named:
                if not NAME_PATTERN.fullmatch(name):
                    raise ValueError(f"[{section}.{name}]: a name is letters, digits, '_', '.' or '-'")
        for section, name, named in (("vlm", self.defaults.vlm, self.vlm), ("policy", self.defaults.policy, self.policy)):
            if name is not None and name not in named:
                raise ValueError(f"defaults.{section} = {name!r}: no [{section}.{name}]")
        return self

    def endpoint(self, name: str | None) -> tuple[str, Endpoint]:
        """The named endpoint (None: the default); ConfigError naming the offered ones."""
        return _choose("vlm.endpoint", name, self.defaults.vlm, LOCAL, self.vlm)

    def named_policy(self, name: str | None) -> tuple[str, NamedPolicy]:
        """The named policy (None: the default); ConfigError naming the offered ones."""
        return _choose("policy.name", name, self.defaults.policy, "vision_language", self.policy)


def _choose(key: str, name: str | None, default: str | None, fallback: str, named: dict[str, Any]) -> tuple[str, Any]:
    if name is None:
        name = default or (fallback if fallback in named else next(iter(named)))
    if name not in named:
        raise ConfigError(f"{key}: the service offers no {name!r} (it offers: {', '.join(sorted(named))})")
    return name, named[name]


def load_service_config(path: str | os.PathLike[str] | None) -> ServiceConfig:
    """The service's configuration from a TOML file; None: the embedded defaults. ConfigError names what is wrong."""
    if path is None:
        return ServiceConfig()
    data = read_toml(path, "service configuration file")
    try:
        return ServiceConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"]) or "(top level)"
            problems.append(f"{key}: {'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}")
        raise ConfigError(f"{path}: " + "; ".join(problems)) from None


def service_config_from_env() -> ServiceConfig:
    """The service configuration named by RESCUE_SERVICE_CONFIG, else the embedded defaults."""
    return load_service_config(os.environ.get(SERVICE_CONFIG_ENV) or None)


