"""Rule wrappers: correction rules applied to every predicted action chunk.

Modelled on the inference-wrapper rules diagnosed in seed 000: a stage
rollback, a gripper recovery that overwrites the whole chunk, and a chunk
compression gated by the predicted gripper span. Every rule is off unless
switched on, each can be switched alone (so an ablation changes one rule),
and each firing is logged with the step and the chunk digests before/after.

The stage the rules see, against the seed's description
-------------------------------------------------------
The seed says (in paraphrase): the inference stage is an internal condition
variable of the wrapper, updated from the model's predictions by voting, not
advanced by elapsed time; on reaching stage 4 the wrapper unconditionally sets
its internal stage back to 2 and clears the stage-vote history, and the next
inference runs under the modified stage. Here:

* every reply votes with the stage it reports under `stage_key` (the embedded
  learned and scripted policies report their phase index under "phase", which
  is the default key);
* the wrapper keeps the last `vote_window` votes; its stage is the first vote
  of an episode, and afterwards changes only when at least `votes_to_change`
  of the kept votes name one other stage (a strict majority, so no ties);
* a rollback sets the stage and clears the votes, so it persists until
  `votes_to_change` new votes agree on another stage (a policy stuck in stage
  4 is rolled back every `votes_to_change` queries, as the seed's counts of
  repeated rollbacks per episode suggest); with `stage_obs_key` set the
  policy is handed the wrapper's stage on its next query, as in the seed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


def chunk_digest(chunk: Any) -> str:
    """Hex sha256 over a chunk's dtype, shape and C-order bytes: the digest the trace gives an array
    (`rescue.core.digest.digest_array`, byte for byte), spelled here so the wrappers import nothing of rescue."""
    a = np.asarray(chunk)
    if a.dtype.hasobject:
        raise TypeError("cannot digest an object array")
    a = np.ascontiguousarray(a)
    header = json.dumps([a.dtype.str, list(a.shape)], separators=(",", ":"))
    return hashlib.sha256(header.encode("utf-8") + b"\n" + a.tobytes(order="C")).hexdigest()


@dataclass(frozen=True)
class ActionLayout:
    """Which action dims are grippers and how they are commanded. Default: LIBERO 7-D OSC."""

    action_dim: int = 7
    """Number of dims of one action."""
    gripper_dims: tuple[int, ...] = (6,)
    """The action dim of each gripper, one entry per gripper."""
    open_value: float = -1.0
    """The gripper command that opens it."""
    close_value: float = 1.0
    """The gripper command that closes it."""
    relative: bool = True
    """Relative layouts command deltas (holding still is 0); absolute layouts
    command targets (holding still is the current state at hold_state_dims)."""
    hold_state_dims: tuple[int, ...] | None = None
    """Absolute layouts: the state index holding each action dim still; None: the state's first entries, one per dim."""
    state_key: str = "observation/state"
    """The observation key of the state vector the gripper openings are read from."""
    gripper_state_dims: tuple[int, ...] = (6,)
    """Per gripper, the state index of its opening (LIBERO: a finger joint, ~0.04 m open)."""


@dataclass
class RuleContext:
    """What a rule may read (and, for the stage, write) at one policy query."""

    step: int
    obs: dict
    reply: dict
    layout: ActionLayout
    stage: int | None
    votes: list[int]
    chunk: np.ndarray  # the chunk as it stands before the rule being asked


@dataclass
class Rule:
    """A correction rule: when trigger(ctx) holds, effect(chunk, ctx) replaces the chunk."""

    name: ClassVar[str] = "rule"
    enabled: bool = False

    def trigger(self, ctx: RuleContext) -> bool:
        """Whether the rule fires on ctx.chunk."""
        raise NotImplementedError

    def effect(self, chunk: np.ndarray, ctx: RuleContext) -> np.ndarray:
        """The chunk after the rule; must not modify its input."""
        raise NotImplementedError


@dataclass
class StageRollback(Rule):
    """On reaching from_stage, set the wrapper's stage back to to_stage and clear the votes."""

    name: ClassVar[str] = "stage_rollback"
    from_stage: int = 4
    to_stage: int = 2

    def trigger(self, ctx: RuleContext) -> bool:
        return ctx.stage is not None and ctx.stage >= self.from_stage

    def effect(self, chunk: np.ndarray, ctx: RuleContext) -> np.ndarray:
        # The chunk is untouched; the next query runs under the rolled-back stage.
        ctx.stage = self.to_stage
        ctx.votes.clear()
        return chunk


@dataclass
class GripperRecovery(Rule):
    """When a gripper is fully closed (and no other is half open), hold still with it opened.

    As in the seed, the whole chunk is overwritten: the hold row tiled over the
    chunk, then the closed grippers commanded open.
    """

    name: ClassVar[str] = "gripper_recovery"
    closed_at: float = 0.002  # an opening at or below this counts as fully closed
    middle: tuple[float, float] = (0.01, 0.03)  # an opening strictly inside is "half open"
    min_stage: int | None = 2  # the seed gates on stage >= 2; None: no stage gate

    def _openings(self, ctx: RuleContext) -> np.ndarray:
        state = np.asarray(ctx.obs[ctx.layout.state_key], dtype=np.float64)
        return np.abs(state[list(ctx.layout.gripper_state_dims)])

    def trigger(self, ctx: RuleContext) -> bool:
        if self.min_stage is not None and (ctx.stage is None or ctx.stage < self.min_stage):
            return False
        opening = self._openings(ctx)
        closed = opening <= self.closed_at
        half_open = (opening > self.middle[0]) & (opening < self.middle[1])
        # Seed: one gripper fully closed while the other is not half open.
        return any(closed[i] and not np.delete(half_open, i).any() for i in range(len(opening)))

    def effect(self, chunk: np.ndarray, ctx: RuleContext) -> np.ndarray:
        layout = ctx.layout
        if layout.relative:
            hold = np.zeros(chunk.shape[1], dtype=chunk.dtype)
            hold[list(layout.gripper_dims)] = chunk[0, list(layout.gripper_dims)]
        else:
            state = np.asarray(ctx.obs[layout.state_key])
            hold = state[list(layout.hold_state_dims or range(chunk.shape[1]))].astype(chunk.dtype)
        out = np.tile(hold, (chunk.shape[0], 1))
        closed = self._openings(ctx) <= self.closed_at
        for dim, is_closed in zip(layout.gripper_dims, closed):
            if is_closed:
                out[:, dim] = layout.open_value
        return out


@dataclass
class ChunkCompression(Rule):
    """Resample the first `of` steps of the chunk into `keep`, unless the gripper span is large.

    The span gate (max - min of a gripper dim over the chunk) keeps a grasp or
    release from being squeezed. Relative actions are integrated, resampled and
    differenced so the compressed chunk covers the same displacement.

    The seed compresses 26 of 30 predicted steps into 20 (and runs 20 per
    query). The defaults here keep its ratio (6/8 = 0.75, seed 20/26 = 0.77)
    for the 8-action chunks of the embedded policies; the compressed chunk
    has keep + (len - of) actions, so the replan interval must not exceed that
    (6 for 8-action chunks; `rule_inputs_problems` says so before a study).
    """

    name: ClassVar[str] = "chunk_compression"
    keep: int = 6
    of: int = 8
    span_threshold: float = 0.2

    def trigger(self, ctx: RuleContext) -> bool:
        if len(ctx.chunk) < self.of or self.keep >= self.of:
            return False
        grip = ctx.chunk[:, list(ctx.layout.gripper_dims)]
        return float((grip.max(axis=0) - grip.min(axis=0)).max(initial=0.0)) <= self.span_threshold

    def effect(self, chunk: np.ndarray, ctx: RuleContext) -> np.ndarray:
        head = chunk[: self.of].astype(np.float64)
        grippers = list(ctx.layout.gripper_dims)
        motion = [d for d in range(chunk.shape[1]) if d not in grippers]
        out = np.empty((self.keep, chunk.shape[1]), dtype=np.float64)
        if ctx.layout.relative:
            path = np.vstack([np.zeros((1, len(motion))), np.cumsum(head[:, motion], axis=0)])
            t = np.linspace(0.0, self.of, self.keep + 1)
            out[:, motion] = np.diff(_interp_rows(t, path), axis=0)
        else:
            out[:, motion] = _interp_rows(np.linspace(0.0, self.of - 1, self.keep), head[:, motion])
        # Gripper commands are discrete: take the nearest, never a blend.
        nearest = np.rint(np.linspace(0.0, self.of - 1, self.keep)).astype(int)
        out[:, grippers] = head[nearest][:, grippers]
        return np.concatenate([out.astype(chunk.dtype), chunk[self.of :]])


def _interp_rows(t: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Linear interpolation of each column of rows (sampled at 0, 1, ...) at times t."""
    grid = np.arange(len(rows), dtype=np.float64)
    out = np.empty((len(t), rows.shape[1]), dtype=np.float64)
    for j in range(rows.shape[1]):
        out[:, j] = np.interp(t, grid, rows[:, j])
    return out


# The reply key the embedded policies report their stage (phase index) under.
STAGE_KEY = "phase"

RULES: dict[str, type[Rule]] = {r.name: r for r in (StageRollback, GripperRecovery, ChunkCompression)}


class RuleSet(BaseModel):
    """Which rules are on, by name, with optional parameters per rule."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: list[str] = Field(default_factory=list)
    """Names of the rules switched on (`stage_rollback`, `gripper_recovery`, `chunk_compression`)."""
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Rule name -> its parameters (the rule's fields, e.g. `chunk_compression.keep`); absent: the defaults."""

    def rules(self) -> list[Rule]:
        """All known rules in a fixed order, each switched on only if named in `enabled`."""
        unknown = (set(self.enabled) | set(self.params)) - set(RULES)
        if unknown:
            raise ValueError(f"unknown rules: {sorted(unknown)}; known: {sorted(RULES)}")
        return [
            cls(enabled=name in self.enabled, **self.params.get(name, {})) for name, cls in RULES.items()
        ]


class RuleWrapper:
    """Applies the enabled rules to every chunk the inner policy predicts and logs each firing."""

    def __init__(
        self,
        policy: Any,
        rules: list[Rule],
        log: list[dict] | None = None,
        layout: ActionLayout = ActionLayout(),
        stage_key: str = STAGE_KEY,
        stage_obs_key: str | None = None,
        vote_window: int = 3,
        votes_to_change: int = 2,
    ) -> None:
        check_votes(vote_window, votes_to_change)
        self._policy = policy
        self.rules = list(rules)
        self.firings: list[dict] = log if log is not None else []
        self.layout = layout
        self._stage_key = stage_key
        # Where to hand the wrapper's stage back to the policy, if it conditions on it.
        self._stage_obs_key = stage_obs_key
        self._window, self._quorum = vote_window, votes_to_change
        self.stage: int | None = None
        self.votes: list[int] = []
        self.queries = 0
        # The last query as the rules saw it (the arm's per-query record reads it).
        self.last_query: dict | None = None

    def _vote(self, vote: int) -> None:
        """Keep the vote; move the stage only when a quorum of the kept votes names another one."""
        self.votes.append(vote)
        del self.votes[: -self._window]
        if self.stage is None:
            self.stage = vote  # the episode's first reply sets the stage: there is none to keep
            return
        best = max(set(self.votes), key=self.votes.count)
        if best != self.stage and self.votes.count(best) >= self._quorum:
            self.stage = best

    def infer(self, obs: dict, step: int | None = None) -> dict:
        """Query the inner policy and return its reply with the rules applied to "actions".

        step is the env step of this query (for the firing log); default: the query index.
        """
        if self._stage_obs_key is not None and self.stage is not None:
            obs = {**obs, self._stage_obs_key: self.stage}
        reply = self._policy.infer(obs)
        vote = reply.get(self._stage_key)
        if vote is not None:
            self._vote(int(vote))
        chunk = np.asarray(reply["actions"])
        ctx = RuleContext(
            step=self.queries if step is None else step,
            obs=obs,
            reply=reply,
            layout=self.layout,
            stage=self.stage,
            votes=self.votes,
            chunk=chunk,
        )
        seen_stage = self.stage
        before_all = chunk_digest(chunk)
        fired: list[str] = []
        for rule in self.rules:
            ctx.chunk = chunk
            if not rule.enabled or not rule.trigger(ctx):
                continue
            before = chunk_digest(chunk)
            chunk = rule.effect(chunk, ctx)
            fired.append(rule.name)
            self.firings.append(
                {"step": ctx.step, "rule": rule.name, "before": before, "after": chunk_digest(chunk)}
            )
        self.stage, self.votes = ctx.stage, ctx.votes
        self.last_query = {
            "step": ctx.step,
            "vote": None if vote is None else int(vote),
            "stage": seen_stage,  # the aggregated stage the rules saw
            "stage_after": self.stage,  # the stage in force for the next query (after any rollback)
            "fired": fired,
            "before": before_all,
            "after": chunk_digest(chunk) if fired else before_all,
            "length": len(chunk),
        }
        self.queries += 1
        return {**reply, "actions": chunk}

    def reset(self) -> None:
        """Reset the inner policy and the wrapper's stage; the firing log is kept."""
        self._policy.reset()
        self.stage = None
        self.votes = []
        self.queries = 0
        self.last_query = None


def check_votes(vote_window: int, votes_to_change: int) -> None:
    """Refuse a vote window whose quorum could tie or never be reached."""
    if vote_window < 1 or not (vote_window // 2 < votes_to_change <= vote_window):
        raise ValueError(
            f"votes_to_change must be a strict majority of vote_window: got {votes_to_change} of {vote_window}"
        )
