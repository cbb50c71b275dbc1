"""What a policy is to the server, and the wire's extensions beyond openpi.

A policy maps an observation dict to a reply whose "actions" is a chunk of
shape (C, action_dim), as in openpi. The optional RNG extension lets an arm
start from a known sampling state and lets keepalive prove it did not move.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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

# Metadata keys a served policy announces about itself.
ACTION_HORIZON_KEY = "action_horizon"  # C: actions executed per query
OBSERVATION_KEY = "observation"  # the observation profile it reads
# Whether the policy keeps no state between calls, so a forked arm may skip replaying the prefix
# (rescue.core.configuration.identity.STATELESS_KEY reads it; tests/test_serve_dist.py holds the two equal).
STATELESS_KEY = "stateless"
TORCH_THREADS_KEY = "torch_threads"  # the thread count torch was pinned to (outputs differ across counts)


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


class BadInput(Exception):
    """What the user gave cannot be served; the message is the one line to print."""
