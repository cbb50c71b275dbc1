"""The rule wrappers around a remote policy: rules applied to each reply before the arm runs it.

The frozen policy sits behind an async websocket client, so the synchronous
RuleWrapper cannot hold it. This wrapper awaits the remote reply and hands it
to a RuleWrapper whose inner "policy" just returns that reply: the rules,
their order, the stage bookkeeping and the firing log stay in one place.
Everything else (reset, RNG extension, keepalive) passes straight through.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from wrappers.rules import ActionLayout, RuleSet, RuleWrapper

# The embedded LIBERO adapter reports the finger joints as `robot0_gripper_qpos`
# (about 0.04 each when open); there is no openpi-style `observation/state`.
LIBERO_LAYOUT = ActionLayout(state_key="robot0_gripper_qpos", gripper_state_dims=(0,))


class RulesConfig(RuleSet):
    """Which rules an arm's policy runs behind, with their parameters and the action layout."""

    layout: ActionLayout = Field(default_factory=lambda: LIBERO_LAYOUT)
    stage_key: str = "stage"  # reply key carrying the policy's stage (the scripted policy: "phase")
    stage_obs_key: str | None = None  # obs key to hand the wrapper's stage back to the policy

    @model_validator(mode="after")
    def _buildable(self) -> RulesConfig:
        # Unknown names or parameters fail when the configuration loads, not mid-study.
        try:
            self.rules()
        except TypeError as exc:
            raise ValueError(f"bad rule parameters: {exc}") from exc
        return self


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


class AsyncRuleWrapper:
    """An async policy connection whose replies pass through the enabled rules; firings are logged."""

    def __init__(self, policy: Any, rules: RulesConfig) -> None:
        self._policy = policy
        self._given = _Reply()
        self._stage_obs_key = rules.stage_obs_key
        self._rules = RuleWrapper(self._given, rules.rules(), layout=rules.layout, stage_key=rules.stage_key)

    @property
    def firings(self) -> list[dict]:
        """Every firing so far: step, rule, and the digests of the chunk before and after."""
        return self._rules.firings

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

    async def episode_start(self, experiment: str, task: str, episode_id: str) -> Any:
        """Pass through: openpi's episode-start control message (sent only to servers that accept it)."""
        return await self._policy.episode_start(experiment, task, episode_id)

    async def episode_end(self, success: bool | None) -> Any:
        """Pass through: openpi's episode-end control message."""
        return await self._policy.episode_end(success)

    async def close(self) -> None:
        """Close the inner connection."""
        await self._policy.close()
