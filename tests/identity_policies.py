"""A policy factory that differs from the scripted default only in its announced action horizon."""

from rescue.embedded.scripted import ScriptedPickPlace


def make_ten_step_policy() -> ScriptedPickPlace:
    """The scripted policy planning 10 actions per chunk (the default plans 8)."""
    return ScriptedPickPlace(action_horizon=10)
