"""What a policy is, in process and across the wire.

A policy maps an observation dict to a reply whose "actions" is a chunk of
shape (C, action_dim), as in openpi. The optional RNG extension lets an arm
start from a known sampling state and lets keepalive prove it did not move.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict


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

    async def episode_start(self, experiment: str, task: str, episode_id: str, task_info: dict | None = None) -> dict | None:
        """Mark an episode's start to a server that announced EPISODE_EXTENSION; else do nothing (None).
        `task_info`: the episode's suite, task_id and episode_idx, for a wire that carries them (vla-eval's)."""
        ...

    async def episode_end(self, success: bool | None) -> dict | None:
        """Mark an episode's end to a server that announced EPISODE_EXTENSION; else do nothing (None)."""
        ...

    async def close(self) -> None:
        """Close the connection."""
        ...
