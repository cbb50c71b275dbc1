"""A configuration key added to StudyConfig must be added everywhere a key lives, or this test names what it missed."""

from __future__ import annotations

import pytest

from rescue.core.configuration.config import HASHED_UNLESS_DEFAULT, HASHED_WHEN_SET, StudyConfig

pytestmark = pytest.mark.fast

# The keys every study's digest has held since digests were first recorded. Any other key must be hashed only when
# set (HASHED_WHEN_SET) or when not its old default (HASHED_UNLESS_DEFAULT), or every older study's config.json
# would hash differently today and `rescue verify` would fail it.
FIRST_DIGEST_KEYS = frozenset({
    "allow_idle_rules", "arms", "cases_in_flight", "env.adapter", "env.image_size", "env.simulators", "fail_fast_arms",
    "fork_at_q", "keepalive_s", "keyframes", "policy.announced", "policy.api_key_env", "policy.factory",
    "policy.observation", "policy.observation_sha256", "policy.replan_interval", "policy.url", "query_rule",
    "release_simulator_while_waiting", "rules.enabled", "rules.layout", "rules.params", "rules.stage_key",
    "rules.stage_obs_key", "rules.vote_window", "rules.votes_to_change", "sham.seed", "sham.source", "sham.text",
    "vlm.api", "vlm.api_key_env", "vlm.api_key_from_config", "vlm.backoff_initial_s", "vlm.backoff_jitter_s",
    "vlm.backoff_max_s", "vlm.base_url", "vlm.batch_size", "vlm.batch_window_s", "vlm.deadline_s", "vlm.image_detail",
    "vlm.image_format", "vlm.max_attempts", "vlm.max_output_tokens", "vlm.max_subgoal_chars", "vlm.model",
    "vlm.prompt_root", "vlm.prompt_template", "vlm.reasoning_effort", "vlm.request_timeout_s", "vlm.seed", "vlm.store",
    "vlm.structured", "vlm.temperature",
})

WHERE = ("add it to HASHED_WHEN_SET (rescue/core/configuration/config.py) so older studies' digests hold; decide whether a job may "
         "set it (JOB_KEYS, rescue/service/settings.py, then `python -m rescue.service.keydocs`); give it a range in "
         "rescue/core/configuration/schema.py if it is a number; a flag, if any, beside its parser in rescue/cli/; then "
         "`python -m rescue.read.schemas`")


def _dotted(section: str | None, key: str) -> str:
    return key if section is None else f"{section}.{key}"


def configuration_keys(model: type[StudyConfig] = StudyConfig) -> set[str]:
    """Every key of a default study configuration, dotted one level deep as HASHED_WHEN_SET names them."""
    keys = set()
    for section, part in model().model_dump(mode="json").items():
        keys |= {f"{section}.{key}" for key in part} if isinstance(part, dict) else {section}
    return keys


def forgotten_keys(model: type[StudyConfig] = StudyConfig) -> list[str]:
    """Keys neither in the first digest nor hashed only when set."""
    hashed = {_dotted(s, k) for s, k in HASHED_WHEN_SET} | {_dotted(s, k) for s, k, _ in HASHED_UNLESS_DEFAULT}
    return sorted(configuration_keys(model) - FIRST_DIGEST_KEYS - hashed)


def test_every_configuration_key_is_in_the_first_digest_or_hashed_only_when_set():
    forgotten = forgotten_keys()
    assert forgotten == [], f"new configuration key(s) {forgotten}: {WHERE}"


def test_the_check_names_a_key_that_was_forgotten():
    # A model with one more key, in no list: the check must name it.
    from pydantic import create_model

    assert forgotten_keys(create_model("Wider", __base__=StudyConfig, new_knob=(int, 1))) == ["new_knob"]


def test_no_key_is_both_first_and_hashed_when_set():
    hashed = {_dotted(s, k) for s, k in HASHED_WHEN_SET}
    assert FIRST_DIGEST_KEYS.isdisjoint(hashed)
    assert FIRST_DIGEST_KEYS <= configuration_keys()  # no typo, and no key removed without a way to read old studies
