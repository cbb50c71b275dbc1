"""The study's record types: what the journal stores and exports read.

Every durable fact about a study is one of these pydantic models. They carry
plain data only (digests as hex strings, no arrays), so the pure core
(classification, statistics, proofs) can be tested without a simulator.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# `sham`: a placebo arm (DESIGN §8): same q, same pause, same injection, a subgoal not from
# the VLM looking at this case.
ArmName = Literal["control", "assisted", "sham"]

# How an arm ended. `complete`: ran to success or to its horizon.
# `interrupted`: started but never finished (crash, kill, lost worker).
# `error`: the infrastructure failed under it (simulator, policy connection).
ArmStatus = Literal["complete", "interrupted", "error"]

# The seed's assistance statuses. `control` marks the control arm; the rest
# describe what happened to the assisted arm's single VLM request.
AssistanceStatus = Literal[
    "control",
    "applied",
    "not_reached",
    "broker_error",
    "invalid_response",
    "timeout",
]

Label = Literal["rescued", "not_rescued", "unknown", "initial_state_deviation"]
# An evaluation study (control arm only) labels episodes instead.
EpisodeLabel = Literal["success", "failure", "unknown"]


class TraceRow(BaseModel):
    """One policy query: what the policy saw and what it answered, as digests."""

    model_config = ConfigDict(frozen=True)

    step: int
    state: str
    images: dict[str, str] = Field(default_factory=dict)
    instruction: str
    actions: str


class ReceiptRef(BaseModel):
    """Where one receipt line lives and what its bytes hash to: the link from a record to its evidence."""

    model_config = ConfigDict(frozen=True)

    path: str
    """The receipts file, relative to the study folder (as the receipt log was told)."""
    lineno: int
    """1-based line number in that file."""
    sha256: str
    """sha256 of the exact bytes written, without the trailing newline."""


# `attempt_started`: written (and fsynced) before an HTTP attempt is sent, so a kill
# during the attempt leaves evidence. `attempt`: how that attempt ended. `outcome`: the
# call's result; the FIRST outcome line of a call is its outcome (see rescue.study.receipts).
ReceiptKind = Literal["attempt_started", "attempt", "outcome"]
ReceiptStatus = Literal["started", "ok", "error", "invalid_response", "timeout", "refusal"]


class Assistance(BaseModel):
    """What the assisted arm did at the query point (the control arm: status `control`)."""

    status: AssistanceStatus
    query_step: int | None = None
    subgoal: str | None = None
    instruction: str | None = None  # the applied instruction, verbatim
    instruction_digest: str | None = None
    call_id: str | None = None  # the receipt's call id
    # Where the subgoal came from: the VLM on this case, or (sham arm) a fixed text or a donor case's answer.
    source: Literal["vlm", "fixed", "permuted"] | None = None
    source_sha256: str | None = None  # a fixed sham text's sha256
    donor_case_id: str | None = None  # a permuted sham arm's donor
    receipt: ReceiptRef | None = None  # the outcome line of that call (file, line, sha256 of its bytes)
    request_id: str | None = None  # our request id within that call
    error_kind: str | None = None
    error: str | None = None


class QueryRecord(BaseModel):
    """One policy query of an arm, as the diagnostics read it."""

    model_config = ConfigDict(extra="forbid")

    step: int
    """Env step of the query."""
    stage: int | None = None
    """Stage the policy reported in its reply (under the configured stage key); None: not reported."""
    wrapper_stage: int | None = None
    """The rule wrapper's voted stage the rules saw at this query; None: no wrapper or no vote yet."""
    ee_pos: tuple[float, float, float] | None = None
    """End-effector position in the world frame at the query, metres."""
    fired: list[str] = Field(default_factory=list)
    """Names of the rules that fired on this query, in order."""
    chunk_before: str | None = None
    """sha256 of the chunk the policy predicted."""
    chunk_after: str | None = None
    """sha256 of the chunk after the rules (equal to chunk_before when no rule changed it)."""

    @property
    def rewritten(self) -> bool:
        """Whether a rule changed the predicted chunk."""
        return self.chunk_before is not None and self.chunk_after is not None and self.chunk_before != self.chunk_after


class ArmResult(BaseModel):
    """One finished (or failed) replay of a case under one arm spec."""

    case_id: str
    arm: ArmName
    status: ArmStatus
    error: str | None = None  # one line: the exception and its message
    error_detail: str | None = None  # the whole text (a server's traceback), kept apart from the line
    success: bool | None = None
    steps: int = 0
    fingerprint: str | None = None
    # The digest of each part of the initial state (physics, proprioception, instruction, layout,
    # model XML...), so that a deviation names what differed.
    fingerprint_parts: dict[str, str] = Field(default_factory=dict)
    # PYTHONHASHSEED of the simulator process that reset the case (pinned by the pool).
    python_hash_seed: str | None = None
    trace: list[TraceRow] = Field(default_factory=list)
    assistance: Assistance
    rule_firings: list[dict] = Field(default_factory=list)  # step, rule, chunk digests before/after
    # Enabled rules the policy's replies could never trigger (only with allow_idle_rules).
    idle_rules: list[str] = Field(default_factory=list)
    # Whether the policy server reset and reported its sampling RNG for this arm;
    # False: prefix equality with the other arm is not guaranteed by the server.
    policy_rng_control: bool | None = None
    # "fork": the prefix ran once and both arms continued from one snapshot at q.
    mode: Literal["independent", "fork"] = "independent"
    q_state: str | None = None  # digest of the simulator's full state when the arm reached q
    keyframes: dict[str, str] = Field(default_factory=dict)
    # Per policy query: the stage the policy reported, the end effector's world position, rule
    # firings and chunk digests (DESIGN §6; `rescue diagnose` reads them).
    queries: list[QueryRecord] = Field(default_factory=list)  # name ("q112", "end") -> sha256 of the stored PNG
    started_at: float | None = None
    finished_at: float | None = None


class Usage(BaseModel):
    """Token counts of one call; each is None when the provider did not report it."""

    input_tokens: int | None = None
    cached_input_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None


class Receipt(BaseModel):
    """The durable record of one VLM call attempt or outcome (DESIGN §2)."""

    kind: ReceiptKind
    call_id: str
    attempt: int
    """Attempts made so far (on an outcome: how many the call took)."""
    request_ids: list[str]
    tokens: dict[str, str] = Field(default_factory=dict)  # request id -> per-request token
    case_ids: list[str]
    provider_request_id: str | None = None
    model_requested: str
    model_reported: str | None = None
    endpoint_kind: Literal["chat", "responses"]
    prompt_template: str
    prompt_template_sha256: str
    prompt_sha256: str
    """sha256 of the rendered prompt's UTF-8 bytes (the prompt is kept as `<sha256>.txt`)."""
    image_sha256: dict[str, list[str]] = Field(default_factory=dict)  # request id -> view digests
    started_at: float
    finished_at: float | None = None
    """None only on an `attempt_started` line."""
    latency_s: float | None = None
    """None only on an `attempt_started` line."""
    status: ReceiptStatus
    error_kind: str | None = None
    error: str | None = None
    usage: Usage = Field(default_factory=Usage)
    response_sha256: str | None = None
    """sha256 of the raw response body (kept as `<sha256>.txt`)."""
    subgoals: dict[str, str | None] = Field(default_factory=dict)  # request id -> subgoal
    # A batched call can succeed for some of its requests and not for others.
    request_status: dict[str, str] = Field(default_factory=dict)  # request id -> answer status
    request_errors: dict[str, str] = Field(default_factory=dict)  # request id -> why rejected
    sent_image_sha256: list[str] = Field(default_factory=list)  # images as sent (views or contact sheet)
    generation: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    """The generation settings of the call (max_output_tokens, temperature, seed, reasoning_effort,
    store); None: not sent, the provider's default applies."""
    attempt_refs: list[ReceiptRef] = Field(default_factory=list)
    """On an outcome: the call's `attempt_started` and `attempt` lines, in order, so that editing
    or deleting one is detectable from the outcome line's own sha256."""


class CaseRecord(BaseModel):
    """Everything the classification of one case needs, gathered from the journal."""

    case_id: str
    group: str
    task: str
    horizon: int
    query_step: int
    historical_fingerprint: str | None = None
    pilot: bool = False
    interrupted: bool = False
    control: ArmResult | None = None
    assisted: ArmResult | None = None
    receipt: Receipt | None = None  # the outcome receipt of the assisted arm's call
    # The sham arm (None: the study has none), what it was declared to use, and its donor's receipt.
    sham: ArmResult | None = None
    sham_source: Literal["fixed", "permuted"] | None = None
    sham_text: str | None = None
    sham_donor: str | None = None
    sham_receipt: Receipt | None = None


class ShamVerdict(BaseModel):
    """The sham arm against the control arm, by the same DESIGN §3 rules as the assisted arm."""

    label: Label
    rule: int
    reason: str
    in_m: bool = False
    in_e: bool = False


class Verdict(BaseModel):
    """A case's classification and the rule (DESIGN §3 number) that decided it."""

    case_id: str
    label: Label | EpisodeLabel
    rule: int
    reason: str
    in_m: bool = False
    in_e: bool = False
    sham: ShamVerdict | None = None  # when the study has a sham arm
