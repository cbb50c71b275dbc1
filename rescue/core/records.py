"""The study's record types: what the journal stores and exports read.

Every durable fact about a study is one of these pydantic models. They carry
plain data only (digests as hex strings, no arrays), so the pure core
(classification, statistics, proofs) can be tested without a simulator.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from rescue.core.arms import ArmName, base_arm, continuation
from rescue.core.asking import TriggerConfig
from rescue.core.success_labels import HistoricalOutcome
from rescue.core.trace import TraceRow

# How an arm ended. `complete`: ran to success or to its horizon.
# `interrupted`: started but never finished (crash, kill, lost worker).
# `error`: the infrastructure failed under it (simulator, policy connection).
ArmStatus = Literal["complete", "interrupted", "error"]

# The seed's assistance statuses. `control` marks the control arm; the rest
# describe what happened to one VLM request of an arm that asks. DESIGN §18 adds
# `declined` (the advisor kept the instruction) and `not_asked` (a trigger that never fired).
AssistanceStatus = Literal[
    "control",
    "applied",
    "not_reached",
    "broker_error",
    "invalid_response",
    "timeout",
    "declined",
    "not_asked",
]
# The statuses of an arm that made no call: it ran as the control arm did.
NO_CALL = frozenset({"control", "not_reached", "not_asked"})


class ReceiptRef(BaseModel):
    """Where one receipt line lives and what its bytes hash to: the link from a record to its evidence."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

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

    model_config = ConfigDict(use_attribute_docstrings=True)

    status: AssistanceStatus
    """`control` on the control arm; `applied`; `declined` (the advisor answered "keep the instruction"); `not_reached`
    (the arm ended before q); `not_asked` (its trigger never fired); otherwise why its request failed."""
    query_step: int | None = None
    """Env step at which the arm asked (q); None when it never asked (control arm, not reached)."""
    subgoal: str | None = None
    """The subgoal as answered (the VLM's, or the sham source's); None unless applied."""
    instruction: str | None = None
    """The applied instruction, verbatim (the original with the subgoal injected); None unless applied."""
    instruction_digest: str | None = None
    """sha256 of `instruction`'s UTF-8 bytes, as the trace rows from q on carry it; None unless applied."""
    call_id: str | None = None
    """The receipt's call id (a permuted sham arm: its donor's call); None when the arm made no call
    (control, not reached, a fixed sham text, no VLM configured, a donor without an answer)."""
    source: Literal["vlm", "fixed", "permuted"] | None = None
    """Where the subgoal came from: the VLM on this case, or (sham arm) a fixed text or a donor case's answer;
    None when the arm never asked (control, not reached) or had no VLM configured."""
    source_sha256: str | None = None
    """sha256 of a fixed sham text; None for every other source."""
    donor_case_id: str | None = None
    """A permuted sham arm's donor case; None otherwise."""
    receipt_ref: ReceiptRef | None = Field(default=None, validation_alias=AliasChoices("receipt_ref", "receipt"))
    """The outcome line of that call (file, line, sha256 of its bytes); None when there is no call. Records
    written before it was named for what it holds call it `receipt`; both names read."""
    request_id: str | None = None
    """Our request id within that call (a call may batch several cases); None when there is no call."""
    error_kind: str | None = None
    """Short name of the failure (`timeout`, `invalid_response`, `no_advisor`, `donor_failed`...); None unless it failed."""
    error: str | None = None
    """The failure in one line; None unless it failed."""


AnswerStatus = Literal["ok", "broker_error", "invalid_response", "timeout", "declined"]


class Answer(BaseModel):
    """What an arm's advisor answered it at q: a VLM's answer to this case, or a sham source's subgoal (a fixed
    text, a donor case's VLM answer). The arm runner applies it the same way whoever gave it."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    status: AnswerStatus
    """`ok` (a subgoal to apply), `declined` (keep the instruction: an advisor that may decline, DESIGN §18), else
    why there is none: `broker_error`, `invalid_response`, `timeout`."""
    subgoal: str | None = None
    """The subgoal; None unless the status is `ok`."""
    source: Literal["vlm", "fixed", "permuted"] = "vlm"
    """Where it came from: the VLM looking at this case, or (sham) a fixed text or a donor case's answer."""
    source_sha256: str | None = None
    """sha256 of a fixed sham text; None for every other source."""
    donor_case_id: str | None = None
    """A permuted sham's donor case; None otherwise."""
    call_id: str | None = None
    """The VLM call the subgoal came from (a permuted sham: its donor's); None: no call (a fixed text, a donor
    without an answer)."""
    request_id: str | None = None
    """Our request id within that call; None without a call."""
    receipt_ref: ReceiptRef | None = None
    """Where that call's outcome line was written (file, line, sha256 of its bytes); None without a call."""
    error_kind: str | None = None
    """Short name of the failure (`timeout`, `invalid_response`, `no_donor`, `donor_failed`...); None when ok."""
    error: str | None = None
    """The failure in one line; None when ok."""


class QueryRecord(BaseModel):
    """One policy query of an arm, as the diagnostics read it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

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
    object_pos: tuple[float, float, float] | None = Field(default=None, exclude_if=lambda v: v is None)
    """In a study with triggers (DESIGN §18): the world position of the task's object at the query, metres, where
    the suite's goal names one; absent otherwise."""
    gripper: float | None = Field(default=None, exclude_if=lambda v: v is None)
    """In a study with triggers: the gripper command of the last action the chunk ran (LIBERO: -1 open, +1 closed);
    absent otherwise."""
    dispersion: float | None = Field(default=None, exclude_if=lambda v: v is None)
    """With an uncertainty trigger: how much the chunks drawn for this observation from a probe connection
    disagreed (rescue.core.triggers.dispersion), measured before the query; absent otherwise."""

    @property
    def rewritten(self) -> bool:
        """Whether a rule changed the predicted chunk."""
        return self.chunk_before is not None and self.chunk_after is not None and self.chunk_before != self.chunk_after


class ArmResult(BaseModel):
    """One finished (or failed) replay of a case under one arm spec."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    case_id: str
    """The case replayed."""
    arm: ArmName
    """Which arm this replay was."""
    status: ArmStatus
    """How the arm ended: `complete` (ran to success or its horizon) or `error` (the infrastructure failed under it);
    `interrupted` is declared, but no arm record carries it (an interrupted case has none)."""
    error: str | None = None
    """One line: the exception and its message; None unless the status is `error`."""
    error_detail: str | None = None
    """The whole text (a server's traceback), kept apart from the line; None unless the status is `error`."""
    success: bool | None = None
    """Whether the task succeeded within the horizon; None when the arm did not complete."""
    steps: int = 0
    """Env steps the arm ran (at most the case's horizon)."""
    fingerprint: str | None = None
    """The initial-state fingerprint, taken right after reset (LIBERO: sha256 of `fingerprint_parts` as canonical
    JSON); None when the arm never reset."""
    fingerprint_parts: dict[str, str] = Field(default_factory=dict)
    """The digest of each part of the initial state (physics, proprioception, instruction, layout,
    model XML...), by part name, so that a deviation names what differed; empty when the arm never reset."""
    python_hash_seed: str | None = None
    """PYTHONHASHSEED of the simulator process that reset the case (pinned by the pool); None when not reported."""
    trace: list[TraceRow] = Field(default_factory=list)
    """One row per policy query, in step order (the prefix proof compares the rows before q)."""
    assistance: Assistance
    """What the arm did at q (the control arm: status `control`): its first call."""
    again: list[Assistance] = Field(default_factory=list, exclude_if=lambda v: not v)
    """Its later calls in order (`[asking] max_calls` above 1, DESIGN §18), each with its own receipt; an applied
    subgoal replaces the one before from its step on. Absent: one call at most."""
    trigger_steps: dict[str, int | None] = Field(default_factory=dict, exclude_if=lambda v: not v)
    """A fork's leader in a study with triggers (DESIGN §18): the query step each trigger first fired at on its
    queries, by trigger name (None: it never fired); `rescue verify` derives it again from `queries`. Absent
    otherwise."""
    rule_firings: list[dict] = Field(default_factory=list)
    """Every rule firing, in order: `step`, `rule`, and the chunk's sha256 `before` and `after`; empty without rules."""
    idle_rules: list[str] = Field(default_factory=list)
    """Enabled rules the policy's replies could never trigger, one problem line each (only with allow_idle_rules)."""
    policy_rng_control: bool | None = None
    """Whether the policy server reset and reported its sampling RNG for this arm;
    False: prefix equality with the other arm is not guaranteed by the server. None: the arm never reached the policy."""
    mode: Literal["independent", "fork"] = "independent"
    """`fork`: the prefix ran once and the arms continued from one snapshot at q; `independent`: each arm ran whole."""
    prefix_replayed: bool | None = None
    """A fork's follower: whether its policy connection replayed the prefix's queries (a server with RNG control:
    the answers had to equal the leader's) or it continued from the snapshot at q on a fresh connection (a
    stateless policy whose server gives no RNG control, DESIGN §13). None: the leader, an independent arm, or a
    record made before it was noted."""
    fork_states: dict[int, str | None] = Field(default_factory=dict, exclude_if=lambda v: not v)
    """A fork's leader in a study with extra query points (DESIGN §14): the digest of its full simulator state at
    each of them, by env step (the pre-registered q's is `q_state`); absent otherwise."""
    fork_renders: dict[int, dict[str, str]] = Field(default_factory=dict, exclude_if=lambda v: not v)
    """The same leader's render of the VLM views at each of them, camera -> digest, by env step; absent otherwise."""
    continuation_seed: int | None = None
    """The seed the policy's RNG was reset to at q: a continuation after the first under RNG control (the same for
    every arm's k-th continuation, `rescue.core.arms.continuation_seed`); None otherwise."""
    episode_protocol: str | None = None
    """The episode protocol the arm's episode started under (`rescue`, `openpi`, `lerobot`); None: a record
    made before protocols (`rescue`)."""
    episode_markers: bool | None = None
    """Whether openpi's `episode_start`/`episode_end` frames were sent to the policy server (only to a server
    announcing them, and never under the openpi or lerobot protocol); None: a record made before it was noted."""
    q_state: str | None = None
    """Digest of the simulator's full state when the arm reached q; None when the arm ended before q or the
    adapter gives no state digest."""
    q_render: dict[str, str] | None = None
    """Camera -> digest (shape, dtype, pixels) of the VLM views rendered at q: in a fork, the control arm's are
    the leader's render of the state at q and every follower's are its first render after restoring it (they
    must be equal); an assisted or sham arm's are the views its answer came from. None: nothing rendered at q
    (an independent control arm, an arm that ended before q, or a study made before it was recorded)."""
    restored_render: dict[str, str] | None = None
    """The same views rendered again after the VLM wait when the arm continued on another simulator
    (restored from its snapshot); equal to q_render, or the arm failed. None: no restore happened."""
    keyframes: dict[str, str] = Field(default_factory=dict)
    """Keyframe name (`q112`, `end`) -> sha256 of the PNG stored in the study's frames folder; empty when keyframes are off."""
    queries: list[QueryRecord] = Field(default_factory=list)
    """Per policy query: the stage the policy reported, the end effector's world position, rule
    firings and chunk digests (DESIGN §6; `rescue diagnose` reads them)."""
    started_at: float | None = None
    """When the arm started, Unix time in seconds; None when it never got a simulator or policy connection."""
    finished_at: float | None = None
    """When the arm's record was made, Unix time in seconds; None when it never got a simulator or policy connection."""

    def calls(self) -> list[Assistance]:
        """Every call the arm made, in order (none for an arm that never asked)."""
        return [a for a in (self.assistance, *self.again) if a.status not in NO_CALL]


class Usage(BaseModel):
    """Token counts of one call; each is None when the provider did not report it."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    input_tokens: int | None = None
    """Input (prompt) tokens, images included, as the provider counts them."""
    cached_input_tokens: int | None = None
    """Of the input tokens, those the provider served from its prompt cache."""
    output_tokens: int | None = None
    """Output (completion) tokens, reasoning tokens included where the provider counts them there."""
    reasoning_tokens: int | None = None
    """Of the output tokens, those spent on hidden reasoning."""


class Receipt(BaseModel):
    """The durable record of one VLM call attempt or outcome (DESIGN §2)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    kind: ReceiptKind
    """`attempt_started` (written before an HTTP attempt is sent), `attempt` (how it ended) or `outcome` (the call's result)."""
    call_id: str
    """Our id of the call, shared by its attempt lines and its outcome line."""
    attempt: int
    """Attempts made so far (on an outcome: how many the call took)."""
    request_ids: list[str]
    """Our id of each request the call carries, one per case, in the order of `case_ids`."""
    tokens: dict[str, str] = Field(default_factory=dict)
    """Request id -> the per-request token its answer must echo (binds each answer to its request)."""
    case_ids: list[str]
    """The cases the call asks for (more than one only when batched), in request order."""
    provider_request_id: str | None = None
    """The provider's id of the HTTP request (its `x-request-id` header); None when none came back."""
    model_requested: str
    """The model the call asked for (`vlm.model`)."""
    model_reported: str | None = None
    """The model the response names; None when no response arrived or it named none."""
    endpoint_kind: Literal["chat", "responses"]
    """Which API the call used: chat completions or responses."""
    prompt_template: str
    """Name of the prompt template (`vlm.prompt_template`)."""
    prompt_template_sha256: str
    """sha256 of the template file's bytes."""
    prompt_sha256: str
    """sha256 of the rendered prompt's UTF-8 bytes (the prompt is kept as `<sha256>.txt`)."""
    image_sha256: dict[str, list[str]] = Field(default_factory=dict)
    """Request id -> sha256 of each view's PNG, in view order (before any contact sheet)."""
    started_at: float
    """When the attempt (on an outcome line: the call) started, Unix time in seconds."""
    finished_at: float | None = None
    """When it ended, Unix time in seconds; None only on an `attempt_started` line."""
    latency_s: float | None = None
    """Seconds from `started_at` to `finished_at` (an outcome's include retries and backoff); None only on an
    `attempt_started` line."""
    status: ReceiptStatus
    """`started` on an `attempt_started` line; otherwise how the attempt or call ended."""
    error_kind: str | None = None
    """Short name of the failure (`timeout`, `rate_limit`, `server`, `invalid_response`, `refusal`, `cancelled`...);
    None when nothing failed."""
    error: str | None = None
    """The failure's message, any API key redacted; None when nothing failed."""
    usage: Usage = Field(default_factory=Usage)
    """Token counts of the response; all None when no response arrived."""
    response_sha256: str | None = None
    """sha256 of the raw response body (kept as `<sha256>.txt`)."""
    subgoals: dict[str, str | None] = Field(default_factory=dict)
    """Request id -> the subgoal parsed from the answer (None: that request got none); empty on attempt lines and
    on calls that got no answer."""
    # A batched call can succeed for some of its requests and not for others.
    request_status: dict[str, str] = Field(default_factory=dict)
    """Request id -> that request's answer status (`ok`, `invalid_response`, `timeout`, `broker_error`; `declined`:
    the advisor kept the instruction, DESIGN §18); empty on attempt lines."""
    request_errors: dict[str, str] = Field(default_factory=dict)
    """Request id -> why its answer was rejected; only rejected requests appear."""
    sent_image_sha256: list[str] = Field(default_factory=list)
    """sha256 of each PNG as sent: a single request's views, or one contact sheet for a batch."""
    generation: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    """The generation settings of the call as configured (max_output_tokens, temperature, seed,
    reasoning_effort, store); None: unset. What went on the wire is `sent_generation`."""
    sent_generation: dict[str, Any] | None = None
    """The generation fields exactly as the request carried them, by their wire names (`max_tokens` to
    Ollama's chat, `max_completion_tokens` on OpenAI's, `reasoning: {effort}` on Responses); a setting
    unset or not read by the server (`vlm.server`) is absent, so its default applied. None on receipts
    written before this was recorded."""
    attempt_refs: list[ReceiptRef] = Field(default_factory=list)
    """On an outcome: the call's `attempt_started` and `attempt` lines, in order, so that editing
    or deleting one is detectable from the outcome line's own sha256."""
    advisor: str | None = None
    """The advisor (a named VLM configuration, DESIGN §11) the call was made for; None: a study of one `[vlm]`
    (and every receipt written before studies had several)."""
    arms: dict[str, str] = Field(default_factory=dict)
    """Case id -> the arm that asked for it (its base: `assisted`, `assisted@early`), so that a call counts for its
    query point even when its case never finished; empty: not said (a receipt written before it was recorded)."""


class CaseRecord(BaseModel):
    """Everything the classification of one case needs, gathered from the journal."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    case_id: str
    """The case classified."""
    group: str
    """The case's group (the manifest's `group`; by default its suite)."""
    task: str
    """The case's task, as `suite/task_id`."""
    horizon: int
    """H: the most env steps an arm may run."""
    query_step: int
    """q: the env step of the query point (DESIGN §2)."""
    historical_fingerprint: str | None = None
    """The manifest's initial-state fingerprint; None: it gives none (the arms are then compared with each other)."""
    pilot: bool = False
    """Whether the manifest declared the case a pilot (reported apart, never counted in N)."""
    historical_outcome: HistoricalOutcome = "failure"
    """How the episode ended in the evaluation: a `failure` (rescue labels) or a `success` (harm labels, DESIGN §17)."""
    interrupted: bool = False
    """Whether the case was claimed and never finished (its state is `interrupted`)."""
    primary: str = "assisted"
    """The arm whose verdict against control is the case's label: `assisted`, or the first advisor's
    `assisted:<name>` (DESIGN §11)."""
    query_steps: dict[str, int] = Field(default_factory=dict)
    """The env step each arm of a declared extra query point asks at (DESIGN §14), by arm (its continuations
    ask where it does); a trigger's arm (DESIGN §18): the step its trigger first fires at on the control arm's
    queries, as derived again from them (the horizon when it never fires); every other arm asks at `query_step`."""
    unasked: list[str] = Field(default_factory=list)
    """The trigger arms whose trigger never fires on the control arm's queries (derived again): not asked."""
    again_steps: dict[str, list[int]] = Field(default_factory=dict)
    """With `[asking] max_calls` above 1: the steps of each arm's later calls, derived again from its own queries
    by the study's rule, by arm; absent: the arm asks once."""
    again_receipts: dict[str, Receipt] = Field(default_factory=dict)
    """The outcome receipts of the arms' later calls, by call id."""
    declining: bool = False
    """Whether an advisor of the study may decline (DESIGN §18): its figures count the `declined` label."""
    triggers: dict[str, TriggerConfig] = Field(default_factory=dict)
    """The trigger each trigger's arm asks by, by arm (DESIGN §18); empty: a study without triggers."""
    max_calls: int = 1
    """How many calls an arm that asks a VLM may make (`[asking] max_calls`)."""
    arms: dict[str, ArmResult | None] = Field(default_factory=dict)
    """Every arm the study runs for the case, by name in the study's order (`control` first); None: not recorded."""
    receipts: dict[str, Receipt | None] = Field(default_factory=dict)
    """The outcome receipt of the call each arm's subgoal came from, by arm (a permuted sham: its donor's call);
    None or absent: the arm made no call, or its receipt was not found."""
    sham_source: Literal["fixed", "permuted"] | None = None
    """The sham source the study declared; None: the study has no sham arm."""
    sham_text: str | None = None
    """The declared fixed sham text for this case's task; None unless the source is `fixed`."""
    sham_donor: str | None = None
    """The case's declared donor; None unless the source is `permuted`."""
    sham_advisor: str | None = None
    """A permuted sham's declared donor advisor: the donor's receipt must be that advisor's; None: a study of
    one `[vlm]` (or a fixed sham)."""

    @property
    def control(self) -> ArmResult | None:
        """The control arm's record."""
        return self.arms.get("control")

    @control.setter
    def control(self, arm: ArmResult | None) -> None:
        self.arms["control"] = arm

    @property
    def assisted(self) -> ArmResult | None:
        """The primary arm's record."""
        return self.arms.get(self.primary)

    @assisted.setter
    def assisted(self, arm: ArmResult | None) -> None:
        self.arms[self.primary] = arm

    @property
    def receipt(self) -> Receipt | None:
        """The outcome receipt of the primary arm's call."""
        return self.receipts.get(self.primary)

    @receipt.setter
    def receipt(self, receipt: Receipt | None) -> None:
        self.receipts[self.primary] = receipt

    def judged(self) -> list[str]:
        """The arms judged against control, the primary first, then the others in the study's order (each arm's
        first continuation: its later ones are counted, not judged)."""
        return [self.primary] + [a for a in self.arms if a not in ("control", self.primary) and continuation(a) == 1]

    def q_of(self, arm: str) -> int:
        """The env step an arm asks at (and, in a fork, forks at): its query point's, else the case's q."""
        return self.query_steps.get(base_arm(arm), self.query_step)

    @property
    def continuations(self) -> int:
        """K: how many times each arm continued from the snapshot at q (1 without continuations)."""
        return max((continuation(a) for a in self.arms), default=1)


