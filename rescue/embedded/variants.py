"""Variants of the scripted reference policy, for paired comparisons on identical episodes."""

from __future__ import annotations

from rescue.embedded.scripted import ScriptedPickPlace


def make_steady_policy() -> ScriptedPickPlace:
    """The scripted policy with a near-exact grasp (grasp offset noise 2 mm): it misses fewer grasps."""
    return ScriptedPickPlace(grasp_noise=0.002)


def make_shaky_policy() -> ScriptedPickPlace:
    """The scripted policy with a loose grasp (grasp offset noise 3 cm): it misses more grasps."""
    return ScriptedPickPlace(grasp_noise=0.03)
