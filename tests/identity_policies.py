"""Policy factories for tests: the scripted default with another action horizon, or turning hostile mid-episode."""

import numpy as np

from rescue.embedded.scripted import ScriptedPickPlace


def make_ten_step_policy() -> ScriptedPickPlace:
    """The scripted policy planning 10 actions per chunk (the default plans 8)."""
    return ScriptedPickPlace(action_horizon=10)


class TurnsHostile(ScriptedPickPlace):
    """The scripted policy until its `start`-th query of an episode (1-based); from then on every action
    it answers is `value` (NaN, an infinity), or the chunk has `dims` dimensions per action."""

    def __init__(self, start: int, value: float | None = None, dims: int | None = None) -> None:
        self.start, self.value, self.dims, self.queries = start, value, dims, 0
        super().__init__()

    def reset(self) -> None:
        """A new episode: count its queries from one again."""
        super().reset()
        self.queries = 0

    def infer(self, obs: dict) -> dict:
        """The scripted reply, turned hostile from the `start`-th query on."""
        self.queries += 1
        reply = super().infer(obs)
        if self.queries >= self.start:
            actions = np.asarray(reply["actions"], dtype=np.float64)
            if self.dims is not None:
                actions = np.zeros((len(actions), self.dims))
            if self.value is not None:
                actions = np.full_like(actions, self.value)
            reply["actions"] = actions
        return reply


def make_nan_from_second_query() -> TurnsHostile:
    """NaN actions from an episode's second query on (before the query point of any horizon over 2C)."""
    return TurnsHostile(start=2, value=float("nan"))


def make_inf_from_fifth_query() -> TurnsHostile:
    """+Inf actions from an episode's fifth query on (step 4C: after q when H <= 6C)."""
    return TurnsHostile(start=5, value=float("inf"))


def make_six_dims_from_fifth_query() -> TurnsHostile:
    """Six-dimensional actions (LIBERO's are seven) from an episode's fifth query on."""
    return TurnsHostile(start=5, dims=6)


class Echo:
    """The observation's `state` (its first 7 floats) as every action of a chunk of 10: a reply that shows
    which request it answers."""

    action_horizon = 10

    def infer(self, obs: dict) -> dict:
        """A chunk of 10 copies of the state's first 7 floats."""
        return {"actions": np.tile(np.asarray(obs["state"], dtype=np.float32)[:7], (10, 1))}

    def reset(self) -> None:
        """Nothing to forget."""


def make_echo_policy() -> Echo:
    """The echo policy (for tests of the wire, where what the policy computes is beside the point)."""
    return Echo()
