"""The study configuration: one pydantic model, loadable from TOML, overridable by flags.

It holds how the VLM is asked too (`VLMConfig`), with no SDK import, so the read side
can load a study's configuration without the runtime.
"""

from __future__ import annotations

import difflib
import os
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from rescue.core.digest import canonical_json, digest_text
from rescue.core.episode_protocol import PROTOCOLS, EpisodeProtocol, InstructionChoice, get_protocol
from rescue.core.inputs import MAX_CONFIG_BYTES, InputFileError, read_input
from rescue.core.names import EMBEDDED_POLICY
from rescue.core.prompts import DEFAULT_ROOT
from rescue.core.querypoint import query_point
from rescue.core.schema import MAX_ARM_STEPS, MAX_ARMS_PER_CASE, arms_problem, request_problem, work_problem
from rescue.core.arms import (
    ADVISOR_NAME,
    QUERY_POINT_NAME,
    advisor_arm,
    arm_advisor,
    continuation_arm,
    is_assisted,
    query_point_arm,
    query_point_of,
)
from rescue.core.sham import ShamConfig
from wrappers.async_rules import RulesConfig

# What a masked SecretStr dumps as; older study folders stored it in config.json.
_MASK = "**********"
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class MissingAPIKey(ValueError):
    """The study's key came from its config file, which is never stored, and none was supplied again."""


class TokenPrice(BaseModel):
    """A declared price per million tokens of each kind, in whatever unit it is declared in (USD, say)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    input: float = Field(ge=0)
    """The price of a million input tokens (images included); cached input tokens too unless `cached_input` is set."""
    output: float = Field(ge=0)
    """The price of a million output tokens; reasoning tokens are output tokens (as OpenAI counts and bills them)."""
    cached_input: float | None = Field(default=None, ge=0)
    """The price of a million input tokens served from the provider's prompt cache; None: the `input` price."""

    def cost(self, input_tokens: int | None, cached_input_tokens: int | None, output_tokens: int | None) -> float | None:
        """The cost of these totals; None when a count the price needs is unknown (never guessed)."""
        if input_tokens is None or output_tokens is None:
            return None
        if self.cached_input is None or self.cached_input == self.input:
            return (input_tokens * self.input + output_tokens * self.output) / 1e6
        if cached_input_tokens is None:
            return None
        fresh = input_tokens - cached_input_tokens
        return (fresh * self.input + cached_input_tokens * self.cached_input + output_tokens * self.output) / 1e6


def url_without_secrets(url: str) -> str:
    """A URL as text: no user or password, no query string (either may carry a key)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else url


def endpoint_host(base_url: str) -> str:
    """A VLM endpoint as a report names it: `local`, else its host and port (a URL's user, password and query
    may carry a key)."""
    if base_url == "local":
        return "local"
    parts = urlsplit(base_url)
    if not parts.hostname:
        return base_url
    return f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname


class VLMConfig(BaseModel):
    """Everything that decides how the VLM is asked. It holds no secret in its dumps: `api_key` is excluded."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    base_url: str = "local"
    """Base URL of the OpenAI-compatible API; `local`: the bundled endpoint on loopback."""
    api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)
    """Used for calls, never written (not in dumps, receipts or logs); prefer `api_key_env`."""
    api_key_from_config: bool = False
    """Set when `api_key` was given: a resumed study must be given the key again (see `missing_key_message`)."""
    api_key_env: str = "OPENAI_API_KEY"
    """The environment variable the key is read from when `api_key` is not given."""
    model: str = "rescue-advisor-v0"
    """The model every call asks for."""
    api: Literal["chat", "responses"] = "chat"
    """Which API the calls use: chat completions or responses."""
    structured: bool = True
    """Whether calls ask for structured output (a strict JSON schema of the answers); False: free text, parsed."""
    deadline_s: float = 1200.0
    """Seconds from a request (a batch: its first) to its answer, retries and backoff included; then `timeout`."""
    request_timeout_s: float = 120.0
    """Seconds one HTTP attempt may take."""
    max_attempts: int = 5
    """HTTP attempts per call at most (infrastructure retries, recorded in the receipts)."""
    backoff_initial_s: float = 1.0
    """Seconds before the first retry; doubled before each further one."""
    backoff_max_s: float = 60.0
    """The longest wait between attempts, seconds; also the cap on a server's Retry-After."""
    backoff_jitter_s: float = 1.0
    """Up to this many random seconds added to each backoff."""
    max_subgoal_chars: int = 1500
    """Longest subgoal accepted, in characters; a longer answer is rejected (`invalid_response`)."""
    prompt_template: str = "subgoal_v1"
    """Name of the prompt template (a file in the prompts folder)."""
    prompt_root: str | None = None
    """Folder of the prompt templates; None: the shipped prompts folder."""
    # One limit for the whole study, however many simulators or cluster nodes feed it (None: none).
    max_concurrent_calls: int | None = Field(default=None, gt=0)
    """Requests in flight at once; None: no limit."""
    requests_per_minute: float | None = Field(default=None, gt=0)
    """Requests start at most this often, evenly spaced; retries count. None: no limit."""
    batch_size: int = 1
    """Cases per call at most; 1: every case gets its own call."""
    batch_window_s: float = 60.0
    """Seconds a partly filled batch waits for more cases before it is sent."""
    image_format: Literal["png"] = "png"
    """How the images are encoded (PNG only)."""
    image_detail: Literal["auto", "low", "high"] = "auto"
    """The `detail` hint sent with each image."""
    # Generation settings (DESIGN §9): part of the study's identity, recorded in every receipt.
    # None: not sent (the provider's default applies).
    max_output_tokens: int | None = Field(default=None, gt=0)
    """Sent as `max_completion_tokens` (chat; `max_tokens` to Ollama, see `server`) or `max_output_tokens`
    (responses); None: not sent."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    """Sampling temperature; None: not sent."""
    seed: int | None = None
    """Sampling seed; chat only: the Responses API has no seed. None: not sent."""
    reasoning_effort: ReasoningEffort | None = None
    """Sent as `reasoning_effort` (chat) or `reasoning.effort` (responses), only when set."""
    store: bool = False
    """Whether the provider may store the request and response (sent on both APIs wherever the server
    reads it; Ollama's endpoints and vLLM's and SGLang's chat have no such field)."""
    server: Literal["openai", "vllm", "ollama", "sglang"] | None = None
    """What serves `base_url`: it decides the field each generation setting is sent as, and drops the
    ones that server does not read (rescue/vlm/servers.py). None: the OpenAI wire (OpenAI, the bundled
    endpoint); `ollama`: the cap as `max_tokens` on chat, no `store`; `vllm`, `sglang`: no `store` on chat.
    Receipts record the fields as sent (`sent_generation`)."""
    startup_check: Literal["models", "call", "none"] | None = None
    """What a start asks the endpoint before the first claim: `models` (None: the default) lists its
    models (the cheapest request that needs the key; a server without `/models` passes), `call` sends
    one minimal chat call (1 output token), `none` asks nothing."""
    price: TokenPrice | None = None
    """The declared price per million tokens of each kind (`{input = 2.0, output = 8.0}`); usage then has a cost.
    None: the cost is unknown (never guessed)."""
    lab_budget: float | None = Field(default=None, gt=0)
    """The lab's cap on the declared cost of VLM calls, shared by every study whose calls go into the same ledger
    (rescue/study/ledger.py), in the unit of `price`: a case is claimed only when its calls' estimated cost fits
    under it, else the study stops claiming (exit 3). Needs a declared price. None: no cap, no ledger."""
    lab_ledger: str | None = None
    """The folder of the lab's ledger (`ledger.sqlite`), made absolute when the study is created; None: `receipts/`
    in the working directory then. Only with `lab_budget`."""
    require_model_match: bool | None = None
    """Whether an answer from an endpoint that reports another model than `model` is refused
    (`invalid_response`, error kind `model_mismatch`; rescue/core/reported_model.py says what matches).
    None: true, since an answer of another model is no evidence about the one the study names. False
    (e.g. a proxy that reports its deployment's own name): the answer is applied, and preflight, the
    terminal summary and the report warn."""

    @property
    def refuses_other_models(self) -> bool:
        """`require_model_match` resolved: True unless set false."""
        return self.require_model_match is not False

    @model_validator(mode="before")
    @classmethod
    def _key_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("api_key") is not None:
            data = dict(data)
            key = data["api_key"]
            if (key.get_secret_value() if isinstance(key, SecretStr) else key) == _MASK:
                data["api_key"] = None  # a mask written by an older version is not a key
            data["api_key_from_config"] = True
        return data

    @model_validator(mode="after")
    def _seed_needs_chat(self) -> "VLMConfig":
        if self.seed is not None and self.api == "responses":
            raise ValueError("the Responses API has no seed: unset vlm.seed or use vlm.api = 'chat'")
        return self

    def generation(self) -> dict[str, Any]:
        """The generation settings as recorded in receipts (None: not sent)."""
        return {
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "reasoning_effort": self.reasoning_effort,
            "store": self.store,
        }

    def missing_key_message(self) -> str | None:
        """Why no key can be sent, and how to supply it again (None: a key is at hand or none is needed)."""
        if self.api_key is not None or os.environ.get(self.api_key_env) or not self.api_key_from_config:
            return None
        return (
            "this study's VLM key was given as [vlm] api_key and is never stored in the study; "
            f"supply it again by setting the environment variable {self.api_key_env} "
            "(the study's vlm.api_key_env) before resuming"
        )

    def resolved_api_key(self) -> str:
        """The key to send: explicit, else from `api_key_env`, else a placeholder for local servers."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        message = self.missing_key_message()
        if message is not None:
            raise MissingAPIKey(message)
        return os.environ.get(self.api_key_env) or "none"


class AdvisorConfig(VLMConfig):
    """One advisor (DESIGN §11): a named VLM configuration (endpoint, model, API, prompt template, generation
    settings, batching). A study of several runs one assisted arm per advisor, `assisted:<name>`."""

    name: str = Field(pattern=rf"^{ADVISOR_NAME}$")
    """The advisor's name: letters, digits, `_`, `.` or `-`; its arm is `assisted:<name>` and every receipt of its
    calls names it."""
    endpoint: str | None = None
    """The service endpoint (`rescue serve`'s `[vlm.<name>]`) this advisor's URL and key came from; None: the
    configuration gave them (`base_url`, `api_key_env`)."""

    @model_validator(mode="after")
    def _lab_budget_in_vlm(self) -> "AdvisorConfig":
        if self.lab_budget is not None or self.lab_ledger is not None:
            raise ValueError("the lab budget is one for the study's calls: set lab_budget (and lab_ledger) in [vlm]")
        return self

    @model_validator(mode="before")
    @classmethod
    def _prompt_file(cls, data: Any) -> Any:
        # `prompt = "prompts/subgoal_v1.txt"`: a template file, stored as its name and folder.
        if not isinstance(data, dict) or "prompt" not in data:
            return data
        data = dict(data)
        prompt = data.pop("prompt")
        if "prompt_template" in data or "prompt_root" in data:
            raise ValueError("give prompt (a template file) or prompt_template and prompt_root, not both")
        path = Path(str(prompt))
        if path.suffix != ".txt" and len(path.parts) == 1:
            data["prompt_template"] = str(prompt)
            return data
        if path.suffix != ".txt" or not path.is_file():
            raise ValueError(f"prompt {prompt!r}: no such template file (a .txt file, relative to the working folder)")
        data["prompt_template"] = path.stem
        folder = path.parent.resolve()
        data["prompt_root"] = None if folder == DEFAULT_ROOT.resolve() else str(folder)
        return data


class QueryPointConfig(BaseModel):
    """A declared extra query point (DESIGN §14): the primary advisor's arm `assisted@<name>` asks at
    q_f = ceil(f * H / C) * C, forking from the one prefix run at its own q with its own three views and call."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=rf"^{QUERY_POINT_NAME}$")
    """The query point's name: letters, digits, `_` or `-`; its arm is `assisted@<name>`."""
    fraction: float = Field(gt=0.0, lt=1.0)
    """f, the fraction of the horizon it asks at (rounded up to the replan grid, like the pre-registered 1/2)."""


# Simulators one policy process serves when `[policy] processes` is not set: one process answers about this
# many before its core is the bound (benchmarks/policy_processes.py).
SIMULATORS_PER_POLICY_PROCESS = 8
# Below this many simulators the in-process policy stays in the command process.
POLICY_PROCESSES_FROM = 4


def auto_policy_processes(simulators: int) -> int:
    """The policy processes chosen for `simulators` simulators: none below POLICY_PROCESSES_FROM, else one for
    every SIMULATORS_PER_POLICY_PROCESS (rounded up)."""
    if simulators < POLICY_PROCESSES_FROM:
        return 0
    return -(-simulators // SIMULATORS_PER_POLICY_PROCESS)


class PolicyConfig(BaseModel):
    """Where the frozen policy is served, or which in-process policy to serve."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str | None = None
    """The policy server's websocket URL (ws://host:port); None serves `factory` on loopback."""
    factory: str = EMBEDDED_POLICY
    """`module:attr` of the policy served on loopback when `url` is None (default: the embedded vision-language policy,
    which reads the openpi-libero contract as a VLA does; studies made before it keep the factory they name)."""
    api_key_env: str | None = None
    """The environment variable holding the policy server's key; None: no key is sent."""
    replan_interval: int | None = Field(default=None, gt=0)
    """C, in env steps. None before a study is created: then the server's `action_horizon` decides it,
    and the study's configuration holds the resolved value from then on."""
    observation: str | None = None
    """The observation profile (DESIGN §7). None: what the server announces, else the
    default for its kind (`privileged` for the bundled policies, `openpi-libero` otherwise)."""

    @field_validator("observation")
    @classmethod
    def _a_profile(cls, value: str | None) -> str | None:
        from rescue.core.observation import PROFILES

        return _built_in(value, PROFILES, "observation profile")
    observation_sha256: str | None = None
    """The sha256 of that profile's definition, fixed at creation (a changed built-in is refused on resume);
    None before a study is created."""
    announced: dict[str, Any] | None = None
    """What the server announced about itself when the study was created (identity.IDENTITY_KEYS);
    a later start against a server announcing otherwise is refused. None before a study is created."""
    stateless: bool | None = None
    """Whether the policy keeps no state between calls (openpi's `Policy.infer` keeps none), so that a forked
    arm can continue from the snapshot at q on a fresh connection without replaying the prefix through the
    policy (DESIGN §13). None before a study is created: then what the server announces (`stateless` in its
    metadata), else true for a server without the RNG extension, else unset (under RNG control the prefix is
    replayed, whatever the policy keeps). A stateful policy whose server gives no RNG control is refused."""
    rng_control: bool | None = None
    """Whether the policy server announced the RNG extension (reset and read a connection's sampling RNG) when
    the study was created; a later start against a server that differs is refused. None: a study made before
    it was recorded."""
    processes: int | None = Field(default=None, ge=0)
    """How many processes of their own serve the in-process policy (`factory`), each arm's connection going to
    the next: 0 serves it in the command process; None chooses by the simulator count (`auto_policy_processes`).
    Ignored (0) when `url` is set. A resource setting, like `env.simulators`: each connection builds its own
    policy, so results do not depend on it."""

    def served_processes(self, simulators: int) -> int:
        """How many policy processes a run with `simulators` simulators starts (0: none, in process or external)."""
        if self.url is not None:
            return 0
        return self.processes if self.processes is not None else auto_policy_processes(simulators)

    def name(self) -> str:
        """The policy as a record names it: its server's URL without secrets, or the factory served on loopback."""
        return url_without_secrets(self.url) if self.url else self.factory


class EnvConfig(BaseModel):
    """Which simulator adapter to run and how many processes of it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    adapter: str = "rescue.env.libero:LiberoAdapter"
    """`module:attr` of the simulator adapter."""
    simulators: int = 2
    """Simulator processes the study runs."""
    image_size: int = 256
    """Side, in pixels, of the square views rendered for the VLM at q."""
    episode_protocol: str | None = None
    """How an episode starts (`rescue`, `openpi`, `lerobot`: rescue/core/episode_protocol.py). None before a
    study is created: then `openpi` for an external policy server, `rescue` for the bundled policies; a
    study made before protocols holds None, which is `rescue`."""
    episode_protocol_sha256: str | None = None
    """The sha256 of that protocol's definition, `instruction` applied, fixed at creation (a changed built-in is
    refused on resume)."""

    @field_validator("episode_protocol")
    @classmethod
    def _a_protocol(cls, value: str | None) -> str | None:
        return _built_in(value, PROTOCOLS, "episode protocol")
    instruction: InstructionChoice | None = None
    """What the policy is told, when not what the episode protocol's own client sends: `perturbed`, a LIBERO-PRO
    suite's rewritten words (`_lan`, `_task`), which openpi's and LeRobot's loops never send (they send
    `task.language`, for those suites their base's words); `task.language` under the `rescue` protocol. None
    before a study is created: the protocol's own (rescue: perturbed; openpi, lerobot: task.language); fixed then."""
    max_simulator_rss_gb: float | None = Field(default=None, gt=0)
    """Resident memory one simulator process (or Ray actor) may hold, in GB of 1e9 bytes: before it builds a
    task's env it closes the envs it used least recently (DESIGN §12). None: 2.5. A resource setting, like
    `simulators`: results do not depend on it (an env built again replays bit for bit)."""


    def protocol(self) -> EpisodeProtocol:
        """The episode protocol arms start by: `episode_protocol` (None: rescue), telling what `instruction` says."""
        return get_protocol(self.episode_protocol, self.instruction)


class StudyConfig(BaseModel):
    """Everything that decides how a study runs; its sha256 is written into the study folder."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """Where the frozen policy is served, and what it receives."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Which simulator adapter runs, and how many of it."""
    vlm: VLMConfig = Field(default_factory=lambda: VLMConfig(base_url="local"))
    """How the VLM is asked (base_url `local`: the bundled OpenAI-compatible endpoint on loopback)."""
    # More cases than simulators keep the simulators busy while assisted arms wait for the VLM.
    cases_in_flight: int = 4
    """Cases run at once."""
    release_simulator_while_waiting: bool = True
    """Whether an assisted arm waiting at q snapshots its simulator and gives it back to the pool."""
    fork_at_q: bool | None = None
    """Run the common prefix once and every arm from one snapshot at q (DESIGN §13; a disclosed mode). None before a
    study is created: then true against a policy server without the RNG extension (a policy that samples gives
    two independent replays different prefixes) or with `continuations` above 1, else false (each arm runs whole)."""
    continuations: int = Field(default=1, ge=1, le=100)
    """K: how many times every arm (control, each assisted arm, the sham) continues from the one snapshot at q with
    independent draws of the policy (DESIGN §13); the case's label comes from continuation 1. Above 1 needs
    `fork_at_q`."""
    keyframes: bool = True
    """Whether to render one view of each arm at q and at its end into the study's frames (for `rescue report`)."""
    keepalive_s: float = 120.0
    """Seconds between keepalive probes of the policy connection while an arm waits for the VLM."""
    fail_fast_arms: int = Field(default=3, ge=0)
    """Stop claiming when the first K arms (or the first K assisted arms' VLM calls) all fail with
    the same infrastructure error; 0 turns it off."""
    arms: tuple[str, ...] = ("control", "assisted")
    """The arms each case runs; `control` alone makes an evaluation study; a sham source adds `sham`."""
    rules: RulesConfig = Field(default_factory=RulesConfig)
    """Correction rules between the policy and the simulator; all off unless named in rules.enabled."""
    allow_idle_rules: bool = False
    """An enabled rule whose inputs the policy's replies lack stops the study at its first query,
    unless this is set (then the rule stays idle, and the arm records it in `idle_rules`)."""
    sham: ShamConfig = Field(default_factory=ShamConfig)
    """The sham (placebo) arm, off by default: DESIGN §8 and rescue/core/sham.py."""
    query_rule: Literal["ceil(H/2/C)*C"] = "ceil(H/2/C)*C"
    """The query point: the first regular policy query at or after half the horizon (DESIGN §2)."""
    query_points: list[QueryPointConfig] | None = None
    """Extra query points (`[[query_point]]` tables, DESIGN §14), in declared order: each adds the primary advisor's
    arm `assisted@<name>`, asking at its own q; the pre-registered q (1/2 of H) keeps the case's label. None: none."""
    advisors: list[AdvisorConfig] | None = None
    """The study's advisors (`[[advisor]]` tables, DESIGN §11), in declared order, the first the study's primary
    (its verdict is the case's label): one assisted arm each, `assisted:<name>`. None: the one advisor is
    `[vlm]`, whose arm is `assisted`."""

    @model_validator(mode="before")
    @classmethod
    def _advisor_tables(cls, data: Any) -> Any:
        # TOML's `[[advisor]]` and `[[query_point]]` tables arrive under `advisor` and `query_point`.
        for table, key in (("advisor", "advisors"), ("query_point", "query_points")):
            if isinstance(data, dict) and table in data:
                data = dict(data)
                if key in data:
                    raise ValueError(f"give [[{table}]] tables or {key}, not both")
                data[key] = data.pop(table)
        return data

    @model_validator(mode="after")
    def _advisor_arms(self) -> "StudyConfig":
        if self.advisors is not None:
            names = [a.name for a in self.advisors]
            if not names:
                raise ValueError("advisors: declare at least one [[advisor]] (or none, and a [vlm] table)")
            if len(set(names)) != len(names):
                raise ValueError(f"advisors: two advisors named {sorted(n for n in names if names.count(n) > 1)[0]!r}")
            mine, default = self.vlm.model_dump(exclude=set(LAB_KEYS)), VLMConfig().model_dump(exclude=set(LAB_KEYS))
            if mine != default or self.vlm.api_key is not None:
                raise ValueError("vlm: a study with [[advisor]] tables asks its advisors only; put every VLM setting "
                                 "in each [[advisor]] table (a [vlm] table is the one advisor of a study without them)")
            wanted = [advisor_arm(n) for n in names]
            # A query point's arms (`assisted:<name>@<point>`, DESIGN §14) are the query points' business.
            given = [a for a in self.arms if is_assisted(a) and query_point_of(a) is None]
            if given == ["assisted"]:
                at = self.arms.index("assisted")
                self.arms = (*self.arms[:at], *wanted, *self.arms[at + 1:])
            elif given and given != wanted:
                raise ValueError(f"arms: {', '.join(given)} are not the declared advisors' arms ({', '.join(wanted)})")
        elif any(arm_advisor(a) is not None for a in self.arms):
            raise ValueError("arms lists an advisor's arm (assisted:<name>) but no [[advisor]] is declared")
        if self.sham.advisor is not None:
            if self.sham.source != "permuted":
                raise ValueError("sham.advisor names the donors' advisor of a permuted sham; the source is not permuted")
            if self.sham.advisor not in [a.name for a in self.advisors or []]:
                raise ValueError(f"sham.advisor: no [[advisor]] is named {self.sham.advisor!r}")
        return self

    @model_validator(mode="after")
    def _lab_budget_priced(self) -> "StudyConfig":
        if self.vlm.lab_ledger is not None and self.vlm.lab_budget is None:
            raise ValueError("vlm.lab_ledger is the lab budget's ledger: set vlm.lab_budget too")
        if self.vlm.lab_budget is not None:
            unpriced = [name or "[vlm]" for name, _, vlm in self.advisor_configs() if vlm.price is None]
            if unpriced:
                raise ValueError(f"vlm.lab_budget needs a declared price for every call: {', '.join(unpriced)} "
                                 "declares none (price = {input = ..., output = ...})")
        return self

    @model_validator(mode="after")
    def _query_point_arms(self) -> "StudyConfig":
        # Each declared query point is an arm of the primary advisor's, after the arms asking at the pre-registered q.
        if self.query_points is None:
            if any(query_point_of(a) for a in self.arms):
                raise ValueError("arms lists a query point's arm (assisted@<name>) but no [[query_point]] is declared")
            return self
        names = [p.name for p in self.query_points]
        if not names or len(set(names)) != len(names):
            raise ValueError("query_points: declare each [[query_point]] once, by a name of its own")
        if self.is_evaluation or not any(is_assisted(a) for a in self.arms):
            raise ValueError("query_points: an evaluation asks nothing; a query point is an arm that asks")
        if self.fork_at_q is False:
            raise ValueError("query points fork from the one prefix at their own q: they need fork_at_q "
                             "(leave it unset, or set it true)")
        wanted = [query_point_arm(self.primary_arm, n) for n in names]
        given = [a for a in self.arms if query_point_of(a)]
        if given and given != wanted:
            raise ValueError(f"arms: {', '.join(given)} are not the declared query points' arms ({', '.join(wanted)})")
        if not given:
            at = max(i for i, a in enumerate(self.arms) if is_assisted(a)) + 1
            self.arms = (*self.arms[:at], *wanted, *self.arms[at:])
        return self

    def query_step(self, arm: str, horizon: int) -> int:
        """The env step an arm asks at: its declared query point's, else the pre-registered q (DESIGN §2, §14)."""
        point = query_point_of(arm)
        if point is None:
            return query_point(horizon, self.interval)
        fraction = next(p.fraction for p in self.query_points or [] if p.name == point)
        return query_point(horizon, self.interval, fraction)

    @model_validator(mode="after")
    def _continuations_fork(self) -> "StudyConfig":
        if self.continuations > 1 and self.fork_at_q is False:
            raise ValueError("continuations above 1 continue every arm from one snapshot at q: they need fork_at_q "
                             "(leave it unset, or set it true)")
        return self

    @model_validator(mode="after")
    def _sham_arm(self) -> "StudyConfig":
        # A rescue study with a sham source runs the sham arm as its last arm.
        if self.sham.on and any(is_assisted(a) for a in self.arms) and "sham" not in self.arms:
            self.arms = (*self.arms, "sham")
        if "sham" in self.arms and not self.sham.on:
            raise ValueError("arms lists 'sham' but [sham] source is off")
        return self

    def advisor_configs(self) -> list[tuple[str | None, str, VLMConfig]]:
        """(advisor name, arm, VLM configuration) of every advisor in declared order, the primary first;
        a study of one `[vlm]` has one, named None, arm `assisted`. Empty for an evaluation."""
        if not any(is_assisted(a) for a in self.arms):
            return []
        if self.advisors is None:
            return [(None, "assisted", self.vlm)]
        return [(a.name, advisor_arm(a.name), a) for a in self.advisors]

    def given_keys(self) -> dict[str, SecretStr]:
        """The API keys given in the configuration (never stored), by advisor arm; a run needs them again."""
        return {arm: vlm.api_key for _, arm, vlm in self.advisor_configs() if vlm.api_key is not None}

    def with_keys(self, keys: dict[str, Any]) -> "StudyConfig":
        """This configuration with API keys supplied again (by advisor arm, as `given_keys` gives them)."""
        if not keys:
            return self
        if self.advisors is None:
            key = keys.get("assisted")
            return self if key is None else self.model_copy(update={"vlm": self.vlm.model_copy(update={"api_key": key})})
        advisors = [a.model_copy(update={"api_key": keys[advisor_arm(a.name)]}) if advisor_arm(a.name) in keys else a
                    for a in self.advisors]
        return self.model_copy(update={"advisors": advisors})

    def missing_key_message(self) -> str | None:
        """Why an advisor's key cannot be sent (its config file gave it and it was not supplied again); None: all can."""
        for name, _, vlm in self.advisor_configs():
            message = vlm.missing_key_message()
            if message is not None:
                return message if name is None else f"advisor {name!r}: {message}"
        return None

    @property
    def case_arms(self) -> tuple[str, ...]:
        """Every arm a case runs: the study's arms, then (with `continuations` K above 1, in a rescue study) their
        continuations 2 to K (`control#2`, `assisted#2`, ...)."""
        k_max = 1 if self.is_evaluation else self.continuations
        return tuple(continuation_arm(arm, k) for k in range(1, k_max + 1) for arm in self.arms)

    @property
    def forked(self) -> bool:
        """Whether the arms continue from one snapshot at q (a created study's resolved `fork_at_q`)."""
        return bool(self.fork_at_q) and not self.is_evaluation

    @property
    def primary_arm(self) -> str:
        """The arm whose verdict is the case's label: `assisted`, or the first advisor's `assisted:<name>`."""
        return "assisted" if not self.advisors else advisor_arm(self.advisors[0].name)

    @property
    def sham_donor_advisor(self) -> str | None:
        """The advisor whose answers a permuted sham arm applies (declared, else the primary); None: a study of one `[vlm]`."""
        if not self.advisors:
            return None
        return self.sham.advisor or self.advisors[0].name

    @property
    def is_evaluation(self) -> bool:
        """An evaluation study runs the control arm only and labels episodes."""
        return tuple(self.arms) == ("control",)

    @property
    def interval(self) -> int:
        """C of a created study (its config always holds the resolved value)."""
        if self.policy.replan_interval is None:
            raise ValueError("the configuration has no resolved replan_interval (not a created study's)")
        return self.policy.replan_interval

    def sha256(self) -> str:
        """Digest of the resolved configuration.

        Settings added after studies already existed count only when set, so the
        digest of an older study's config.json (written without them) still holds."""
        data = self.model_dump(mode="json")
        for section, key in HASHED_WHEN_SET:
            node = data if section is None else data[section]
            if node.get(key) is None:
                node.pop(key, None)
        for advisor in data.get("advisors") or []:
            for key in ADVISOR_HASHED_WHEN_SET:
                if advisor.get(key) is None:
                    advisor.pop(key, None)
        for section, key, default in HASHED_UNLESS_DEFAULT:
            node = data if section is None else data[section]
            if node.get(key) == default:
                node.pop(key, None)
        return digest_text(canonical_json(data))


# (section, key) of settings added after studies existed: in the digest only when not None (section None: top level).
HASHED_WHEN_SET = (("vlm", "max_concurrent_calls"), ("vlm", "requests_per_minute"), ("sham", "by_task"),
                   ("vlm", "startup_check"), ("vlm", "server"), ("env", "episode_protocol"), ("env", "episode_protocol_sha256"),
                   ("env", "max_simulator_rss_gb"), ("vlm", "price"), ("sham", "advisor"), (None, "advisors"),
                   ("vlm", "lab_budget"), ("vlm", "lab_ledger"), ("env", "instruction"), ("vlm", "require_model_match"),
                   ("policy", "stateless"), ("policy", "rng_control"), (None, "query_points"),
                   ("policy", "processes"))
# The same for the keys of each `[[advisor]]` table added after advisors existed.
ADVISOR_HASHED_WHEN_SET = ("lab_budget", "lab_ledger", "require_model_match")
# (section, key, value) of settings added after studies existed whose absence meant that value: in the digest only
# when they differ from it.
HASHED_UNLESS_DEFAULT = ((None, "continuations", 1),)
# The [vlm] keys of the lab budget: one for a study's calls, also when its advisors are [[advisor]] tables.
LAB_KEYS = ("lab_budget", "lab_ledger")


class ConfigError(ValueError):
    """A configuration file or flag that cannot be used, named in one line."""


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> StudyConfig:
    """Read a TOML file (if any), apply dotted-key overrides, validate; ConfigError names what is wrong."""
    where = str(path) if path is not None else "the command line"
    return validate_config(config_data(path, overrides), where)


def config_data(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A TOML file's tables (if any) with dotted-key overrides applied (None values skipped), not yet validated."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_toml(path, "configuration file")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return data


def read_toml(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """A TOML file's tables, read with the input guard (rescue/core/inputs.py); ConfigError names what is wrong."""
    try:
        return tomllib.loads(read_input(path, MAX_CONFIG_BYTES, what).decode("utf-8"))
    except InputFileError as exc:
        raise ConfigError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None


def _built_in(value: str | None, names: Any, what: str) -> str | None:
    """`value` when it is None or one of `names`; else ValueError saying what is built in (and the close one)."""
    if value is None or value in names:
        return value
    close = difflib.get_close_matches(value, list(names), n=1, cutoff=0.6)
    raise ValueError(f"no {what} {value!r}{f'; did you mean {close[0]}?' if close else ''} (built in: "
                     f"{', '.join(names)})")


def _unknown_key(loc: tuple) -> str:
    """"unknown key", with the keys of its table it may mean (`contnuations`: did you mean continuations?)."""
    model: Any = StudyConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an entry of a list of tables ([[advisor]], [[query_point]])
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return "unknown key"
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        kinds += [inner for kind in kinds for inner in typing.get_args(kind)]
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if model is None:
            return "unknown key"
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=2, cutoff=0.75)
    return f"unknown key; did you mean {' or '.join(close)}?" if close else "unknown key"


def validate_config(data: dict[str, Any], where: str, max_arms_per_case: int = MAX_ARMS_PER_CASE) -> StudyConfig:
    """A StudyConfig from plain data, through the one strict schema (rescue/core/schema.py: types, finite numbers
    in their ranges, each key once, the arms of a case bounded by `max_arms_per_case`), or ConfigError naming
    every problem in one line (`where` first)."""
    problem = request_problem(data, StudyConfig)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    try:
        config = StudyConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"]) or "(top level)"
            what = (_unknown_key(err["loc"]) if err["type"] == "extra_forbidden"
                    else err["msg"].removeprefix("Value error, "))
            problems.append(f"{key}: {what}")
        raise ConfigError(f"{where}: " + "; ".join(problems)) from None
    problem = case_arms_problem(config, max_arms_per_case)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    return config


def work_problems(config: StudyConfig, horizons: list[int], max_arm_steps: int = MAX_ARM_STEPS) -> str | None:
    """Why a manifest's cases ask this configuration for too much work (arm-steps past `max_arm_steps`), or a
    declared query point can fire in none of them (its q at or past every case's horizon H; C must be known:
    `policy.replan_interval`), in one line; None: neither."""
    problem = work_problem(len(config.case_arms), horizons, max_arm_steps)
    if problem is not None or not config.query_points or config.policy.replan_interval is None or not horizons:
        return problem
    for point in config.query_points:
        steps = {h: config.query_step(query_point_arm(config.primary_arm, point.name), h) for h in horizons}
        never = sorted({h for h, q in steps.items() if q >= h})
        if never:
            h = never[0]
            return (f"query_points: {point.name!r} (fraction {point.fraction:g}) asks at step {steps[h]}, which a case "
                    f"of horizon {h} never reaches (C = {config.interval}): it cannot fire within H")
    return None


def case_arms_problem(config: StudyConfig, limit: int = MAX_ARMS_PER_CASE) -> str | None:
    """Why a case of this configuration runs too many arms, naming the product; None: at most `limit`."""
    k = 1 if config.is_evaluation else config.continuations
    advisors = len(config.advisor_configs())
    points = len(config.query_points or [])
    parts = ["control"] if "control" in config.arms else []
    parts += [f"{advisors} advisor{'s' * (advisors != 1)}"] if advisors else []
    parts += [f"{points} query point{'s' * (points != 1)}"] if points else []
    parts += ["sham"] if "sham" in config.arms else []
    text = f"{', '.join(parts)} = {len(config.arms)} arms × {k} continuation{'s' * (k != 1)}"
    return arms_problem(len(config.case_arms), text, limit)
