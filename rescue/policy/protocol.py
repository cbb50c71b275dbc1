"""What a policy is, in process and across the wire.

A policy maps an observation dict to a reply whose "actions" is a chunk of
shape (C, action_dim), as in openpi. The optional RNG extension lets an arm
start from a known sampling state and lets keepalive prove it did not move.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

# Wire extensions beyond openpi. A control message is a dict carrying
# CONTROL_KEY; servers announce what they accept in their metadata frame, so a
# client never sends a control message to a plain openpi server (which would
# feed it to the policy as an observation).
CONTROL_KEY = "__rescue__"
CONTROL_EXTENSION = "rescue_control"  # accepts "reset"
RNG_EXTENSION = "rescue_rng"  # accepts "reset_rng" and "rng_state"

# openpi's episode markers (an unmerged change of openpi's client and server; its current LIBERO
# client sends none, and its server's metadata would not announce them), on the inference socket:
# {"__ctrl__": "episode_start", "__experiment__", "__task__", "__episode_id__"} and
# {"__ctrl__": "episode_end", "__success__"}, each answered with a msgpack dict. A server
# that does not know them passes them to its policy as an observation, so a client sends
# them only to a server whose metadata announces EPISODE_EXTENSION.
EPISODE_CONTROL_KEY = "__ctrl__"
EPISODE_EXTENSION = "episode_control"
EPISODE_OPS = ("episode_start", "episode_end")


@runtime_checkable
class Policy(Protocol):
    """A synchronous policy: one observation in, one reply with an action chunk out."""

    def infer(self, obs: dict) -> dict:
        """Return a reply dict with "actions": ndarray (C, action_dim)."""
        ...

    def reset(self) -> None:
        """Forget per-episode state."""
        ...


@runtime_checkable
class SeededPolicy(Policy, Protocol):
    """A policy whose sampling RNG can be reset and inspected."""

    def reset_rng(self, seed: int) -> None:
        """Put the sampling RNG into the state determined by seed."""
        ...

    def rng_state(self) -> str:
        """A digest of the sampling RNG's current state; reading it must not advance it."""
        ...


class RngState(BaseModel):
    """A server's answer to an RNG-state probe."""

    model_config = ConfigDict(frozen=True)

    digest: str
    requests: int  # inference requests since the last reset_rng on this connection
    connection_id: str
    server_instance: str


class PolicyConnection(Protocol):
    """A connection to a policy server, as the arm runner uses it (`WebsocketPolicyClient` is one)."""

    @property
    def supports_rng(self) -> bool:
        """Whether the server implements the RNG extension."""
        ...

    async def infer(self, obs: dict) -> dict:
        """Send one observation, return the reply (with "actions")."""
        ...

    async def reset(self) -> None:
        """Ask the policy to forget per-episode state."""
        ...

    async def reset_rng(self, seed: int) -> None:
        """Reset the server-side sampling RNG of this connection to seed."""
        ...

    async def rng_state(self) -> RngState | None:
        """Read the RNG state without advancing it; None when unsupported."""
        ...

    async def keepalive(self) -> RngState | None:
        """Keep the connection alive without inference; returns the RNG probe when supported."""
        ...

    async def episode_start(self, experiment: str, task: str, episode_id: str) -> dict | None:
        """Mark an episode's start to a server that announced EPISODE_EXTENSION; else do nothing (None)."""
        ...

    async def episode_end(self, success: bool | None) -> dict | None:
        """Mark an episode's end to a server that announced EPISODE_EXTENSION; else do nothing (None)."""
        ...

    async def close(self) -> None:
        """Close the connection."""
        ...
