"""Where a study's failures came from: the baseline its manifest names, read from the cases' provenance tags.

`rescue manifest from-eval` tags every failure with the evaluation study it came from (its id and
digests, its policy, its episodes and successes, its episode protocol, the initial states it ran and the
split the failures were taken from); `from-lerobot` and `from-openpi` tag theirs with the results file
(its name and sha256, its episodes and successes). The tags travel in the manifest and are kept with every
case in the study's journal, so the baseline is read from the study's own cases, also for a study whose
baseline folder or results file is gone. A manifest whose cases carry none of these tags was written by
hand, and says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict

from rescue.core.manifest import Case

# The tags `rescue manifest from-*` write, by the field of BaselineSource each fills.
TAGS = {
    "eval_study": "eval_study", "eval_config_sha256": "eval_config_sha256",
    "eval_manifest_sha256": "eval_manifest_sha256", "policy": "eval_policy", "episodes": "eval_episodes",
    "successes": "eval_successes", "failures": "eval_failures", "episode_protocol": "episode_protocol",
    "suites": "eval_suites", "tasks": "eval_tasks", "inits": "eval_inits", "taken_inits": "taken_inits",
    "taken_limit": "taken_limit", "results_file": "results_file", "results_sha256": "results_sha256",
    "created": "eval_created",
}
# A tag that says the case came from somewhere (`episode_protocol` alone may be a hand-written hint).
SOURCE_TAGS = ("eval_study", "results_sha256")


class BaselineSource(BaseModel):
    """One baseline the manifest's failures came from, as its cases' tags name it (None: not recorded)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    kind: Literal["evaluation", "lerobot", "openpi", "results"]
    """`evaluation`: a `rescue eval` study (`rescue manifest from-eval`); `lerobot`, `openpi`: a results file of
    that evaluation (`from-lerobot`, `from-openpi`); `results`: a results file of another kind."""
    cases: int
    """The study's cases that name this source."""
    eval_study: str | None = None
    """The evaluation study's id."""
    eval_config_sha256: str | None = None
    """sha256 of the evaluation study's resolved configuration."""
    eval_manifest_sha256: str | None = None
    """sha256 of the evaluation study's manifest (its episodes)."""
    policy: str | None = None
    """The evaluated policy: a factory (`module:function`) or its server (`ws://host:port`)."""
    episodes: int | None = None
    """Episodes the evaluation ran (its manifest's, or the results file's)."""
    successes: int | None = None
    """Of them, the successes."""
    failures: int | None = None
    """Of them, the failures (the candidates for this study's cases)."""
    episode_protocol: str | None = None
    """The episode protocol the evaluation ran under (its failures are replayed under it)."""
    suites: str | None = None
    """The benchmark suites the evaluation ran, comma-separated."""
    tasks: str | None = None
    """The task ids it ran (`0-3,7`)."""
    inits: str | None = None
    """The initial states it ran (`0-49`)."""
    taken_inits: str | None = None
    """The split the failures were taken from (`--inits`, e.g. held-out `30-39`); None: every initial state."""
    taken_limit: int | None = None
    """At most this many failures were taken (`--limit`); None: every one."""
    results_file: str | None = None
    """The imported results file's name."""
    results_sha256: str | None = None
    """sha256 of the imported results file's bytes."""
    created: float | None = None
    """When the evaluation study was created (seconds since the epoch); None: not recorded."""

    @property
    def success_rate(self) -> float | None:
        """Successes over episodes (unknown episodes count in the denominator, as the evaluation counts them)."""
        return self.successes / self.episodes if self.episodes and self.successes is not None else None


class Baseline(BaseModel):
    """Where the study's cases came from: each baseline its manifest names, and the cases that name none."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    sources: list[BaselineSource]
    """Each source the cases name, in the order first named (one, for a manifest from one evaluation)."""
    by_hand: int
    """Cases that name no source: a manifest written by hand (or by another tool) for them."""

    @property
    def written_by_hand(self) -> bool:
        """Whether no case names where it came from."""
        return not self.sources


_INT_FIELDS = ("episodes", "successes", "failures", "taken_limit")


def _value(field: str, value: object) -> str | int | float | None:
    # A tag is a free label: one of another type than ours (a hand edit) is not recorded rather than refused.
    if value is None or isinstance(value, bool):
        return None
    if field in _INT_FIELDS:
        return value if isinstance(value, int) else None
    if field == "created":
        return float(value) if isinstance(value, (int, float)) else None
    return str(value)


def _kind(tags: dict) -> str:
    if tags.get("eval_study") is not None:
        return "evaluation"
    protocol = tags.get("episode_protocol")
    return protocol if protocol in ("lerobot", "openpi") else "results"


def baseline_of(cases: Iterable[Case]) -> Baseline:
    """The baseline sources the cases' provenance tags name, and how many cases name none."""
    found: dict[tuple, BaselineSource] = {}
    by_hand = 0
    for case in cases:
        if not any(case.tags.get(t) is not None for t in SOURCE_TAGS):
            by_hand += 1
            continue
        values = {field: _value(field, case.tags.get(tag)) for field, tag in TAGS.items()}
        key = tuple(sorted((k, str(v)) for k, v in values.items()))
        if key in found:
            found[key].cases += 1
            continue
        found[key] = BaselineSource(kind=_kind(case.tags), cases=1, **{k: v for k, v in values.items() if v is not None})
    return Baseline(sources=list(found.values()), by_hand=by_hand)
