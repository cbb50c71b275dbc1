"""A study against a vla-eval server, before its identity is fixed: what its HELLO asks of the study (pure; the
parameters' arithmetic is rescue.core.vla_eval_settings')."""

from __future__ import annotations

from typing import Any

from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.identity import IdentityError
from rescue.core.vla_eval_observation import BASE, name_for
from rescue.core.vla_eval_settings import merged_params, refusal


def study_with_server(config: StudyConfig, metadata: dict[str, Any]) -> StudyConfig:
    """A study against a vla-eval server, before its identity is fixed: the profile its HELLO asks for (unless
    the config names a variant), or IdentityError in one line for what cannot be honoured."""
    params = merged_params({}, dict(metadata.get("observation_params") or {}))
    problem = refusal(params)
    if problem is not None:
        raise IdentityError(f"the vla-eval server asks for {problem}")
    if config.policy.replan_interval is None:
        raise IdentityError(
            "a vla-eval server plays its chunk one action per observation and announces no chunk size: set [policy] "
            "replan_interval (or --replan-interval) to its chunk_size (10 in pi0's and OpenVLA-OFT's shipped configs, "
            "1 for OpenVLA), so that q falls on a chunk boundary")
    if any(rule.enabled for rule in config.rules.rules()):
        raise IdentityError("rules rewrite the policy's chunks, and a vla-eval server keeps its chunk on its side and "
                            "answers one action per observation: set [rules] enabled = [] for it")
    observation = config.policy.observation
    if observation in (None, BASE):
        observation = name_for(params)
    return config.model_copy(update={"policy": config.policy.model_copy(update={"observation": observation})})
