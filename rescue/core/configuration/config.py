"""The study configuration: one pydantic model (`StudyConfig`) and the rules of its identity.

How the VLM is asked lives in rescue/core/configuration/vlm_config.py; reading TOML and flags into a StudyConfig, with
one-line errors, in rescue/core/configuration/config_files.py; the strict schema every request passes, in schema.py.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from rescue.core.digest import canonical_json, digest_text
from rescue.core.episode_protocol import PROTOCOLS, EpisodeProtocol, InstructionChoice, get_protocol
from rescue.core.configuration.names import EMBEDDED_POLICY
from rescue.core.querypoint import query_point
from rescue.core.arms import (
    QUERY_POINT_NAME,
    advisor_arm,
    arm_advisor,
    continuation_arm,
    is_assisted,
    query_point_arm,
    query_point_of,
)
from rescue.core.asking import AskingConfig, TriggerConfig, trigger_named
from rescue.core.sham import ShamConfig
from rescue.core.configuration.stopping import StoppingConfig
from wrappers.async_rules import RulesConfig
from rescue.core.configuration.vlm_config import AdvisorConfig, VLMConfig, url_without_secrets


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
# How long a connection to the policy server is tried again while its port refuses, unless `[policy]
# connect_timeout_s` says otherwise.
POLICY_CONNECT_S = 30.0


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

    connect_timeout_s: float | None = None
    """How long a connection to the policy server is tried again while its port refuses (a server still starting,
    or starting again after it died), in seconds; None: 30 (POLICY_CONNECT_S). A server that is still down then
    stops the study, with the cases never claimed left to `rescue resume`. Raise it for a server that a supervisor
    restarts and that takes longer to load its weights (a new study still asks the server to answer within 5 s).
    A resource setting: results do not depend on it."""

    def connect_timeout(self) -> float:
        """`connect_timeout_s`, or its default."""
        return self.connect_timeout_s if self.connect_timeout_s is not None else POLICY_CONNECT_S

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
    triggers: list[TriggerConfig] | None = None
    """Triggers (`[[trigger]]` tables, DESIGN §18), in declared order: each adds the primary advisor's arm
    `assisted@<name>`, asking where its trigger first fires on the shared prefix (never, when it never fires),
    after the query points' arms. None: none."""
    asking: AskingConfig | None = None
    """How many calls an arm that asks a VLM may make and when it asks again (`[asking]`, DESIGN §18); None: once."""

    stopping: StoppingConfig | None = Field(default=None, exclude_if=lambda v: v is None)
    """A rule that stops the study once its answer is decided (`[stopping]`, DESIGN §20): what is tested, the
    error rate, the bounds; the cases then run in an order fixed at creation. None: every case runs."""

    @model_validator(mode="before")
    @classmethod
    def _advisor_tables(cls, data: Any) -> Any:
        # TOML's `[[advisor]]`, `[[query_point]]` and `[[trigger]]` tables arrive under their singular names.
        for table, key in (("advisor", "advisors"), ("query_point", "query_points"), ("trigger", "triggers")):
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
        # Each declared query point, then each trigger, is an arm of the primary advisor's, after the arms asking at
        # the pre-registered q.
        declared = [*(self.query_points or []), *(self.triggers or [])]
        if not declared:
            if any(query_point_of(a) for a in self.arms):
                raise ValueError("arms lists a query point's arm (assisted@<name>) but no [[query_point]] is declared")
            return self
        names = [p.name for p in declared]
        if (self.query_points is not None and not self.query_points) or len(set(names)) != len(names):
            if not self.triggers:
                raise ValueError("query_points: declare each [[query_point]] once, by a name of its own")
            raise ValueError("query_points, triggers: declare each [[query_point]] and [[trigger]] once, by a name of "
                             "its own")
        taken = [n for n in names if n in ("assisted", "control", "sham")]
        if taken:
            raise ValueError(f"query_points, triggers: {taken[0]!r} names an arm; give it a name of its own")
        fractions: dict[float, str] = {}
        for point in self.query_points or []:
            if point.fraction == 0.5:
                raise ValueError(f"query_points: {point.name!r} asks at fraction 0.5, the pre-registered q's (1/2 of H): "
                                 "that arm is the primary's already")
            if point.fraction in fractions:
                raise ValueError(f"query_points: {fractions[point.fraction]!r} and {point.name!r} both ask at fraction "
                                 f"{point.fraction:g}")
            fractions[point.fraction] = point.name
        if self.is_evaluation or not any(is_assisted(a) for a in self.arms):
            raise ValueError("query_points, triggers: an evaluation asks nothing; a query point is an arm that asks")
        if self.fork_at_q is False:
            raise ValueError("query points and triggers fork from the one prefix at their own q: they need fork_at_q "
                             "(leave it unset, or set it true)")
        for t in self.triggers or []:
            if t.kind == "random" and (trigger_named(self.triggers, t.matches) is None or t.matches == t.name
                                       or trigger_named(self.triggers, t.matches).kind == "random"):
                raise ValueError(f"trigger {t.name!r}: matches names {t.matches!r}, which is no other [[trigger]] "
                                 "of the study that reads the episode (stall, gripper, uncertainty)")
        wanted = [query_point_arm(self.primary_arm, n) for n in names]
        given = [a for a in self.arms if query_point_of(a)]
        if given and given != wanted:
            raise ValueError(f"arms: {', '.join(given)} are not the declared query points' arms ({', '.join(wanted)})")
        if not given:
            at = max(i for i, a in enumerate(self.arms) if is_assisted(a)) + 1
            self.arms = (*self.arms[:at], *wanted, *self.arms[at:])
        return self

    def query_step(self, arm: str, horizon: int) -> int:
        """The env step an arm asks at: its declared query point's, else the pre-registered q (DESIGN §2, §14).
        A trigger's arm asks where its trigger fires (`trigger_of`): ValueError."""
        point = query_point_of(arm)
        if point is None:
            return query_point(horizon, self.interval)
        if trigger_named(self.triggers, point) is not None:
            raise ValueError(f"{arm} asks where its trigger fires, decided while the episode runs")
        fraction = next(p.fraction for p in self.query_points or [] if p.name == point)
        return query_point(horizon, self.interval, fraction)

    def trigger_of(self, arm: str) -> TriggerConfig | None:
        """The trigger an arm asks by (`assisted@<trigger>`, DESIGN §18); None: it asks at a fixed step."""
        return trigger_named(self.triggers, query_point_of(arm))

    @property
    def max_calls(self) -> int:
        """How many calls an arm that asks a VLM may make (`[asking] max_calls`; 1 without it)."""
        return self.asking.max_calls if self.asking is not None else 1

    @property
    def may_decline(self) -> bool:
        """Whether an advisor of the study may answer "keep the instruction" (DESIGN §18)."""
        return any(vlm.may_decline for _, _, vlm in self.advisor_configs())

    @model_validator(mode="after")
    def _stopping_arms(self) -> "StudyConfig":
        if self.stopping is None:
            return self
        if self.is_evaluation:
            raise ValueError("stopping: an evaluation compares no arms; a rule stops a rescue study")
        first, second = self.stopping.arms(self.primary_arm)
        missing = [a for a in (first, second) if a not in self.arms]
        if missing:
            raise ValueError(f"stopping: the study has no arm {missing[0]!r} to test (its arms: {', '.join(self.arms)})")
        return self

    @model_validator(mode="after")
    def _continuations_fork(self) -> "StudyConfig":
        if self.continuations > 1 and self.fork_at_q is False:
            raise ValueError("continuations above 1 continue every arm from one snapshot at q: they need fork_at_q "
                             "(leave it unset, or set it true)")
        if self.continuations > 1 and self.max_calls > 1:
            raise ValueError("asking.max_calls above 1 with continuations above 1: an arm's continuations share its "
                             "one call at q, and would each ask again from states of their own; choose one")
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
# A new key touches: this tuple; JOB_KEYS (rescue/service/settings.py, then `python -m rescue.service.keydocs`);
# RANGES (rescue/core/configuration/schema.py) for a number; a flag in rescue/cli/, if any; `python -m rescue.read.schemas`.
# tests/test_config_keys.py names a key that is in none of them.
HASHED_WHEN_SET = (("vlm", "max_concurrent_calls"), ("vlm", "requests_per_minute"), ("sham", "by_task"),
                   ("vlm", "startup_check"), ("vlm", "server"), ("env", "episode_protocol"), ("env", "episode_protocol_sha256"),
                   ("env", "max_simulator_rss_gb"), ("vlm", "price"), ("sham", "advisor"), (None, "advisors"),
                   ("vlm", "lab_budget"), ("vlm", "lab_ledger"), ("env", "instruction"), ("vlm", "require_model_match"),
                   ("policy", "stateless"), ("policy", "rng_control"), (None, "query_points"),
                   ("policy", "processes"), ("policy", "connect_timeout_s"), (None, "triggers"), (None, "asking"),
                   ("vlm", "may_decline"), (None, "stopping"))
# The same for the keys of each `[[advisor]]` table added after advisors existed.
ADVISOR_HASHED_WHEN_SET = ("lab_budget", "lab_ledger", "require_model_match", "may_decline")
# (section, key, value) of settings added after studies existed whose absence meant that value: in the digest only
# when they differ from it.
HASHED_UNLESS_DEFAULT = ((None, "continuations", 1),)
# The [vlm] keys of the lab budget: one for a study's calls, also when its advisors are [[advisor]] tables.
LAB_KEYS = ("lab_budget", "lab_ledger")


def _built_in(value: str | None, names: Any, what: str) -> str | None:
    """`value` when it is None or one of `names`; else ValueError saying what is built in (and the close one)."""
    if value is None or value in names:
        return value
    close = difflib.get_close_matches(value, list(names), n=1, cutoff=0.6)
    raise ValueError(f"no {what} {value!r}{f'; did you mean {close[0]}?' if close else ''} (built in: "
                     f"{', '.join(names)})")


