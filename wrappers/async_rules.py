"""The rule wrappers around a remote policy: rules applied to each reply before the arm runs it.

The frozen policy sits behind an async websocket client, so the synchronous
RuleWrapper cannot hold it. This wrapper awaits the remote reply and hands it
to a RuleWrapper whose inner "policy" just returns that reply: the rules,
their order, the stage bookkeeping and the firing log stay in one place.
Everything else (reset, RNG extension, keepalive) passes straight through.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field, model_validator

from wrappers.rules import RULES, STAGE_KEY, ActionLayout, ChunkCompression, GripperRecovery, RuleSet, RuleWrapper, check_votes

# The embedded LIBERO adapter reports the finger joints as `robot0_gripper_qpos`
# (about 0.04 each when open); there is no openpi-style `observation/state`.
LIBERO_LAYOUT = ActionLayout(state_key="robot0_gripper_qpos", gripper_state_dims=(0,))


class RulesConfig(RuleSet):
    """Which rules an arm's policy runs behind, with their parameters and the action layout."""

    layout: ActionLayout = Field(default_factory=lambda: LIBERO_LAYOUT)
    """Which action dims are grippers, how they are commanded, and where the state reports their opening."""
    stage_key: str = STAGE_KEY
    """Reply key carrying the policy's stage; the embedded learned and scripted policies report "phase"."""
    stage_obs_key: str | None = None
    """Obs key to hand the wrapper's stage back to the policy; None: the policy is not told."""
    # The stage is voted (wrappers/rules.py): the last vote_window votes are kept and
    # votes_to_change of them (a strict majority) must agree to move it.
    vote_window: int = 3
    """How many of the latest stage votes are kept."""
    votes_to_change: int = 2
    """How many kept votes must name another stage to move it."""

    @model_validator(mode="after")
    def _buildable(self) -> RulesConfig:
        # Unknown names or parameters fail when the configuration loads, not mid-study.
        try:
            self.rules()
        except TypeError as exc:
            raise ValueError(f"bad rule parameters: {exc}") from exc
        check_votes(self.vote_window, self.votes_to_change)
        return self


def rule_inputs_problems(rules: RulesConfig, reply_sample: dict, interval: int, obs_sample: dict | None = None) -> list[str]:
    """Why an enabled rule could never fire (or would break the arm) on replies like reply_sample.

    reply_sample is one reply of the policy (its first, before any rule);
    interval is the arm's replan interval; obs_sample, if given, is one policy
    input (what the wrapper sees). Empty list: every enabled rule has its inputs.
    A study should refuse to start on a non-empty list.
    """
    problems: list[str] = []
    by_name = {r.name: r for r in rules.rules() if r.enabled}
    keys = sorted(str(k) for k in reply_sample)
    needs_stage = [n for n, r in by_name.items() if n == "stage_rollback" or getattr(r, "min_stage", None) is not None]
    stage = reply_sample.get(rules.stage_key)
    if needs_stage and stage is None:
        problems.append(
            f"{', '.join(needs_stage)} need(s) the policy's stage under reply key {rules.stage_key!r}, "
            f"but the reply has only {keys}: set rules.stage_key"
        )
    elif needs_stage and not _is_int(stage):
        problems.append(f"the reply's stage {rules.stage_key!r} is {stage!r}, not an integer")
    actions = reply_sample.get("actions")
    chunk = None if actions is None else np.asarray(actions)
    if chunk is None or chunk.ndim != 2:
        problems.append(f"the reply has no 2-D 'actions' chunk (keys {keys})")
        return problems
    length, dim = chunk.shape
    grippers = list(rules.layout.gripper_dims)
    if by_name and any(d >= dim for d in grippers):
        problems.append(f"gripper dims {grippers} do not fit {dim}-D actions: set rules.layout")
    comp = by_name.get("chunk_compression")
    if isinstance(comp, ChunkCompression):
        if comp.keep >= comp.of:
            problems.append(f"chunk_compression keeps {comp.keep} of {comp.of}: it never shortens anything")
        elif length < comp.of:
            problems.append(
                f"chunk_compression compresses the first {comp.of} actions, but the policy's chunks have "
                f"{length}: it can never fire (set rules.params.chunk_compression.of <= {length})"
            )
        elif comp.keep + length - comp.of < interval:
            problems.append(
                f"chunk_compression leaves {comp.keep + length - comp.of} of {length} actions, fewer than the "
                f"replan interval {interval}: set policy.replan_interval <= {comp.keep + length - comp.of}"
            )
    rec = by_name.get("gripper_recovery")
    if isinstance(rec, GripperRecovery) and obs_sample is not None:
        state = obs_sample.get(rules.layout.state_key)
        if state is None:
            problems.append(
                f"gripper_recovery reads the gripper opening from {rules.layout.state_key!r}, "
                f"absent from the policy input (keys {sorted(obs_sample)}): set rules.layout"
            )
        elif max(rules.layout.gripper_state_dims) >= np.asarray(state).size:
            problems.append(f"gripper_recovery's gripper_state_dims do not fit {rules.layout.state_key!r}")
    return problems


def _is_int(value: Any) -> bool:
    try:
        return int(value) == float(value)
    except (TypeError, ValueError):
        return False


def ablation_configs(base: RulesConfig, rules: list[str]) -> dict[str, RulesConfig]:
    """Rule settings differing by one switch: all listed rules on, each off alone, all off.

    Names: "all_on", "no_<rule>" for each listed rule, "all_off" (only the
    listed rules change; any other rule keeps its state in `base`). Everything
    else (parameters, layout, stage key, votes) is base's.
    """
    unknown = set(rules) - set(RULES)
    if unknown or not rules or len(set(rules)) != len(rules):
        raise ValueError(f"ablation needs distinct known rules, got {rules}; known: {sorted(RULES)}")
    kept = [r for r in base.enabled if r not in rules]

    def with_on(on: list[str]) -> RulesConfig:
        enabled = [r for r in RULES if r in kept or r in on]
        return base.model_copy(update={"enabled": enabled})

    out = {"all_on": with_on(list(rules))}
    for rule in rules:
        out[f"no_{rule}"] = with_on([r for r in rules if r != rule])
    out["all_off"] = with_on([])
    return out


class _Reply:
    """A stand-in inner policy for RuleWrapper: returns the reply it was given."""

    def __init__(self) -> None:
        self.reply: dict | None = None

    def infer(self, obs: dict) -> dict:
        assert self.reply is not None
        reply, self.reply = self.reply, None
        return reply

    def reset(self) -> None:
        pass


class RulesCannotFire(RuntimeError):
    """An enabled rule whose inputs the policy's replies lack: an ablation of it would compare identical arms."""


class AsyncRuleWrapper:
    """An async policy connection whose replies pass through the enabled rules; firings are logged.

    With `interval` given, the first reply is checked by `rule_inputs_problems`: an enabled rule
    that could never fire raises RulesCannotFire (or, with strict=False, is noted in `idle_rules`).
    """

    def __init__(self, policy: Any, rules: RulesConfig, interval: int | None = None, strict: bool = True) -> None:
        self._policy = policy
        self._config, self._interval, self._strict = rules, interval, strict
        self.idle_rules: list[str] = []
        self._checked = interval is None or not any(r.enabled for r in rules.rules())
        self._given = _Reply()
        self._stage_obs_key = rules.stage_obs_key
        self._rules = RuleWrapper(
            self._given,
            rules.rules(),
            layout=rules.layout,
            stage_key=rules.stage_key,
            vote_window=rules.vote_window,
            votes_to_change=rules.votes_to_change,
        )

    @property
    def firings(self) -> list[dict]:
        """Every firing so far: step, rule, and the digests of the chunk before and after."""
        return self._rules.firings

    @property
    def stage(self) -> int | None:
        """The wrapper's (voted) stage now: the one in force for the next query."""
        return self._rules.stage

    @property
    def last_query(self) -> dict | None:
        """The last query as the rules saw it: step, vote, stage, stage_after, fired, before, after, length."""
        return self._rules.last_query

    @property
    def url(self) -> str | None:
        """The inner connection's URL (how an arm's error names the policy)."""
        return getattr(self._policy, "url", None)

    @property
    def metadata(self) -> dict[str, Any]:
        """The inner connection's metadata frame."""
        return self._policy.metadata

    @property
    def supports_rng(self) -> bool:
        """Whether the server behind the wrapper implements the RNG extension."""
        return self._policy.supports_rng

    async def infer(self, obs: dict, step: int | None = None) -> dict:
        """Query the remote policy, apply the rules to its chunk; step names the firing (default: query index)."""
        if self._stage_obs_key is not None and self._rules.stage is not None:
            obs = {**obs, self._stage_obs_key: self._rules.stage}
        self._given.reply = await self._policy.infer(obs)
        if not self._checked:
            self._checked = True
            self.idle_rules = rule_inputs_problems(self._config, self._given.reply, self._interval, obs_sample=obs)
            if self.idle_rules and self._strict:
                raise RulesCannotFire("; ".join(self.idle_rules))
        return self._rules.infer(obs, step=step)

    async def reset(self) -> None:
        """Reset the remote policy and the rules' stage; the firing log is kept."""
        await self._policy.reset()
        self._rules.reset()

    async def reset_rng(self, seed: int) -> None:
        """Pass through: reset the server-side RNG."""
        await self._policy.reset_rng(seed)

    async def rng_state(self) -> Any:
        """Pass through: read the server-side RNG state."""
        return await self._policy.rng_state()

    async def keepalive(self) -> Any:
        """Pass through: keep the connection alive without inference."""
        return await self._policy.keepalive()

    async def episode_start(self, experiment: str, task: str, episode_id: str, task_info: dict | None = None) -> Any:
        """Pass through: the episode-start control message (sent only to servers that accept it)."""
        return await self._policy.episode_start(experiment, task, episode_id, task_info=task_info)

    async def episode_end(self, success: bool | None) -> Any:
        """Pass through: openpi's episode-end control message."""
        return await self._policy.episode_end(success)

    async def close(self) -> None:
        """Close the inner connection."""
        await self._policy.close()
