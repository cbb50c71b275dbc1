"""Paired comparison of two policies (or wrapper settings) on identical episodes.

Each side runs as its own evaluation study over one shared episode manifest
(`a/` and `b/` under the comparison folder): same suite, tasks, initial states,
env and policy seeds, on the same engine and journal, so claim-before-run and
resume hold for both. Pairs are matched by episode id. A pair enters the
paired figures only when both episodes completed and their initial-state
fingerprints are equal; every other pair is counted and named, never dropped
silently. Orientation: a *win* is a pair that B succeeded and A failed, and
every difference is B minus A.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

from rescue.core.config import StudyConfig, load_config
from rescue.core.evaluation import EvalSummary, episode_cases, summarize_labels
from rescue.core.manifest import parse_manifest
from rescue.core.records import EpisodeLabel, Verdict
from rescue.core.stats import block_bootstrap_ci, mcnemar_exact, paired_diff_ci
from rescue.run.engine import run_study
from rescue.run.peers import resolved_config
from rescue.study.files import write_atomic
from rescue.study.folder import StudyError, create_study, load_study_config, new_study_dir
from rescue.study.journal import Journal, journal_path
from rescue.study.layout import STUDIES, StudyLayout

log = structlog.get_logger()

PLAN_FILE = "compare.json"
RESULT_FILE = "comparison.json"
SIDES = ("a", "b")

# How a pair was treated, checked in this order (first match wins).
PairStatus = Literal["unmatched", "unexecuted", "fingerprint_mismatch", "unknown", "paired"]
EXCLUDED: tuple[PairStatus, ...] = ("fingerprint_mismatch", "unknown", "unexecuted", "unmatched")
Outcome = Literal["win", "loss", "both_success", "both_fail"]


# --- the pure part: pairing and paired figures -----------------------------------


class Episode(BaseModel):
    """One side's episode as the comparison sees it."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    case_id: str
    """The episode's case id (the same on both sides)."""
    task: str
    """`suite/task_id`."""
    group: str
    """The manifest's group of the episode."""
    label: EpisodeLabel | None = None
    """success, failure or unknown; None: never run (unexecuted)."""
    fingerprint: str | None = None
    """The initial-state fingerprint of the run; None when it did not reset."""
    result_sha256: str | None = None
    """sha256 of the stored arm record (the journal's digest); None when none is stored."""


class Pair(BaseModel):
    """One episode id on both sides: how it was treated and, when paired, its outcome."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    case_id: str
    """The episode's case id."""
    task: str
    """`suite/task_id`."""
    group: str
    """The manifest's group of the episode."""
    status: PairStatus
    """How the pair was treated: `paired`, or why it was excluded (first match of PairStatus's order)."""
    outcome: Outcome | None = None
    """win (B only succeeded), loss (A only), both_success or both_fail; None unless paired."""
    reason: str
    """One line saying why the pair got its status."""
    a_label: str | None = None
    """Side A's label; None: never run."""
    b_label: str | None = None
    """Side B's label; None: never run."""
    a_fingerprint: str | None = None
    """Side A's initial-state fingerprint; None when it did not reset."""
    b_fingerprint: str | None = None
    """Side B's initial-state fingerprint; None when it did not reset."""
    a_result_sha256: str | None = None
    """sha256 of side A's stored arm record; None when none is stored."""
    b_result_sha256: str | None = None
    """sha256 of side B's stored arm record; None when none is stored."""


class PairCounts(BaseModel):
    """Pairs of one slice: the paired outcomes and every excluded pair by reason."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    n: int = 0
    """Every pair of the slice, excluded ones included."""
    paired: int = 0
    """Pairs in the paired figures (both sides ran, same fingerprint, neither unknown)."""
    wins: int = 0
    """B succeeded, A failed."""
    losses: int = 0
    """A succeeded, B failed."""
    ties: int = 0
    """both_success + both_fail."""
    both_success: int = 0
    """Both sides succeeded."""
    both_fail: int = 0
    """Both sides failed."""
    fingerprint_mismatch: int = 0
    """Excluded: the two sides' initial-state fingerprints differ."""
    unknown: int = 0
    """Excluded: either side's episode is unknown (infrastructure)."""
    unexecuted: int = 0
    """Excluded: either side never ran the episode."""
    unmatched: int = 0
    """Excluded: the episode id exists on one side only."""

    def add(self, pair: Pair) -> None:
        """Count one pair."""
        self.n += 1
        if pair.status != "paired":
            setattr(self, pair.status, getattr(self, pair.status) + 1)
            return
        self.paired += 1
        field = {"win": "wins", "loss": "losses", "both_success": "both_success", "both_fail": "both_fail"}[pair.outcome]
        setattr(self, field, getattr(self, field) + 1)
        self.ties = self.both_success + self.both_fail


class Comparison(BaseModel):
    """The paired figures of B against A, with every excluded pair counted and named."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    schema_version: Literal["rescue-comparison/1"] = "rescue-comparison/1"
    """The format of this document (`comparison.json`); files written before it was versioned lack it."""
    a_name: str = "A"
    """Side A's name: its config file's stem and/or its policy."""
    b_name: str = "B"
    """Side B's name."""
    counts: PairCounts
    """The pairs over all episodes."""
    a_rate: float | None
    """A's success rate over the paired episodes (0-1); None when none is paired."""
    b_rate: float | None
    """B's success rate over the paired episodes (0-1); None when none is paired."""
    diff: float | None
    """b_rate - a_rate; None when none is paired."""
    mcnemar_p: float
    """Exact McNemar p-value on wins and losses (two-sided binomial test)."""
    confidence: float
    """The confidence level of both intervals (e.g. 0.95)."""
    newcombe_ci: tuple[float, float] | None
    """Newcombe's square-and-add interval of diff, paired, analytic; None when none is paired."""
    bootstrap_ci: tuple[float, float] | None
    """Percentile interval of diff resampling whole tasks; None when none is paired."""
    bootstrap_seed: int
    """The block bootstrap's seed."""
    bootstrap_reps: int
    """The block bootstrap's resamples."""
    a: EvalSummary
    """Side A over all its episodes, unknown and unexecuted included (fixed denominator)."""
    b: EvalSummary
    """Side B over all its episodes, unknown and unexecuted included (fixed denominator)."""
    per_task: dict[str, PairCounts] = Field(default_factory=dict)
    """The pairs per task (`suite/task_id`)."""
    per_group: dict[str, PairCounts] = Field(default_factory=dict)
    """The pairs per manifest group."""
    excluded: dict[str, list[str]] = Field(default_factory=dict)
    """Excluded episode ids by status."""
    pairs: list[Pair] = Field(default_factory=list)
    """Every pair, in manifest order."""


def _pair(case_id: str, a: Episode | None, b: Episode | None) -> Pair:
    ref = a or b
    assert ref is not None
    fields = dict(
        case_id=case_id, task=ref.task, group=ref.group,
        a_label=a.label if a else None, b_label=b.label if b else None,
        a_fingerprint=a.fingerprint if a else None, b_fingerprint=b.fingerprint if b else None,
        a_result_sha256=a.result_sha256 if a else None, b_result_sha256=b.result_sha256 if b else None,
    )
    if a is None or b is None:
        return Pair(status="unmatched", reason=f"only on side {'a' if a else 'b'}", **fields)
    if a.task != b.task:
        return Pair(status="unmatched", reason=f"task {a.task} on side a, {b.task} on side b", **fields)
    if a.label is None or b.label is None:
        missing = [side for side, ep in (("a", a), ("b", b)) if ep.label is None]
        return Pair(status="unexecuted", reason=f"never run on side {' and '.join(missing)}", **fields)
    # As in DESIGN §3, a deviation is decided before anything else about the episodes.
    if a.fingerprint and b.fingerprint and a.fingerprint != b.fingerprint:
        return Pair(status="fingerprint_mismatch", reason="initial-state fingerprints differ", **fields)
    if "unknown" in (a.label, b.label):
        sides = [side for side, ep in (("a", a), ("b", b)) if ep.label == "unknown"]
        return Pair(status="unknown", reason=f"unknown on side {' and '.join(sides)}", **fields)
    if not a.fingerprint or not b.fingerprint:
        return Pair(status="fingerprint_mismatch", reason="a completed episode has no fingerprint", **fields)
    a_ok, b_ok = a.label == "success", b.label == "success"
    outcome: Outcome = "win" if b_ok and not a_ok else "loss" if a_ok and not b_ok else "both_success" if a_ok else "both_fail"
    return Pair(status="paired", outcome=outcome, reason="fingerprints match, both completed", **fields)


def pair_episodes(a: Sequence[Episode], b: Sequence[Episode]) -> list[Pair]:
    """Match episodes by id (A's order, then B-only ids) and decide how each pair is treated."""
    for side, episodes in (("a", a), ("b", b)):
        ids = [e.case_id for e in episodes]
        if len(ids) != len(set(ids)):
            raise ValueError(f"side {side} lists an episode twice")
    by_a = {e.case_id: e for e in a}
    by_b = {e.case_id: e for e in b}
    order = list(by_a) + [case_id for case_id in by_b if case_id not in by_a]
    return [_pair(case_id, by_a.get(case_id), by_b.get(case_id)) for case_id in order]


def compare_episodes(
    a: Sequence[Episode],
    b: Sequence[Episode],
    seed: int = 0,
    reps: int = 2000,
    confidence: float = 0.95,
    names: tuple[str, str] = ("A", "B"),
) -> Comparison:
    """Pair two sides' episodes and compute wins, losses, ties, McNemar and both intervals."""
    pairs = pair_episodes(a, b)
    counts = PairCounts()
    per_task: dict[str, PairCounts] = {}
    per_group: dict[str, PairCounts] = {}
    excluded: dict[str, list[str]] = {status: [] for status in EXCLUDED}
    for pair in pairs:
        for bucket in (counts, per_task.setdefault(pair.task, PairCounts()), per_group.setdefault(pair.group, PairCounts())):
            bucket.add(pair)
        if pair.status != "paired":
            excluded[pair.status].append(pair.case_id)
    paired = [p for p in pairs if p.status == "paired"]
    n = counts.paired
    a_wins = counts.losses + counts.both_success
    b_wins = counts.wins + counts.both_success
    blocks = [(p.task, p.a_label == "success", p.b_label == "success") for p in paired]
    return Comparison(
        a_name=names[0],
        b_name=names[1],
        counts=counts,
        a_rate=a_wins / n if n else None,
        b_rate=b_wins / n if n else None,
        diff=(b_wins - a_wins) / n if n else None,
        mcnemar_p=mcnemar_exact(counts.wins, counts.losses),
        confidence=confidence,
        newcombe_ci=paired_diff_ci(counts.wins, counts.losses, n, confidence, both_success=counts.both_success) if n else None,
        bootstrap_ci=block_bootstrap_ci(blocks, seed, reps, confidence) if n else None,
        bootstrap_seed=seed,
        bootstrap_reps=reps,
        a=summarize_labels((e.task, e.group, e.label) for e in a),
        b=summarize_labels((e.task, e.group, e.label) for e in b),
        per_task=dict(sorted(per_task.items())),
        per_group=dict(sorted(per_group.items())),
        excluded={k: v for k, v in excluded.items() if v},
        pairs=pairs,
    )


# --- the shell: two evaluation studies on one episode manifest ---------------------


class Side(BaseModel):
    """One side of a comparison: its name (config file and/or policy), resolved config and its sha256."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    name: str
    """The side's name: its config file's stem and/or its policy."""
    config_sha256: str
    """sha256 of the side's resolved configuration (its evaluation study's config digest)."""
    config: dict = Field(default_factory=dict)
    """The resolved configuration, so a side can be created late (after a crash)."""


def write_json(path: Path, data: dict) -> None:
    """A JSON document written atomically."""
    write_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


class ComparePlan(BaseModel):
    """What a comparison runs, written before either side starts."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    schema_version: Literal["rescue-compare-plan/1"] = "rescue-compare-plan/1"
    """The format of this document (`compare.json`); files written before it was versioned lack it."""
    suite: str
    """The suite both sides run."""
    tasks: list[int]
    """Task ids of the suite."""
    episodes: int
    """Initial states per task, from `first_init` on."""
    horizon: int
    """Steps per episode."""
    first_init: int = 0
    """The first initial-state index."""
    seed: int = 0
    """The block bootstrap's seed."""
    reps: int = 2000
    """The block bootstrap's resamples."""
    confidence: float = 0.95
    """The confidence level of the intervals."""
    a: Side
    """Side A."""
    b: Side
    """Side B."""


def new_compare_dir(root: str | os.PathLike[str] = STUDIES) -> Path:
    """A fresh, unique comparison folder name under root."""
    fresh = new_study_dir(root)
    return fresh.with_name("compare-" + fresh.name.removeprefix("study-"))


def side_config(config_path: str | os.PathLike[str] | None, policy: str | None, overrides: dict | None = None) -> tuple[StudyConfig, str]:
    """One side's configuration and name: a TOML file, a policy (`module:function` or ws:// URL), or both."""
    if config_path is None and policy is None:
        raise StudyError("each side needs a config file or a policy (module:function or ws:// URL)")
    extra = dict(overrides or {})
    if policy is not None:
        if policy.startswith(("ws://", "wss://")):
            extra["policy.url"] = policy
        else:
            extra["policy.factory"] = policy
    config = load_config(config_path, extra)
    name = " + ".join(part for part in (config_path and Path(config_path).stem, policy) if part)
    return config.model_copy(update={"arms": ("control",)}), name


def load_plan(study_dir: str | os.PathLike[str]) -> ComparePlan:
    """The plan a comparison folder was created with."""
    path = Path(study_dir) / PLAN_FILE
    if not path.exists():
        raise StudyError(f"{study_dir} holds no comparison ({PLAN_FILE} is missing)")
    return ComparePlan.model_validate_json(path.read_text(encoding="utf-8"))


class CompareRequest(BaseModel):
    """The episodes a comparison runs on both sides, and its statistics' settings."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    suite: str
    """The suite both sides run."""
    tasks: list[int]
    """Task ids of the suite."""
    episodes: int
    """Initial states per task, from `first_init` on."""
    horizon: int | None = None
    """None: the suite's official horizon."""
    first_init: int = 0
    """The first initial-state index."""
    seed: int = 0
    """The block bootstrap's seed."""
    reps: int = 2000
    """The block bootstrap's resamples."""
    confidence: float = 0.95
    """The confidence level of the intervals."""


def create_compare(
    study_dir: str | os.PathLike[str],
    request: CompareRequest,
    configs: tuple[StudyConfig, StudyConfig],
    names: tuple[str, str],
) -> ComparePlan:
    """Lay out a comparison: the plan, then both evaluation studies on one episode manifest."""

    study_dir = Path(study_dir)
    if (study_dir / PLAN_FILE).exists():
        raise StudyError(f"{study_dir} already holds a comparison; use `rescue compare --resume {study_dir}`")
    sides = []
    for name, config in zip(names, configs):
        # Each side's identity (C, observation, what its server announces) is fixed in the plan.
        config = asyncio.run(resolved_config(config.model_copy(update={"arms": ("control",)})))
        sides.append(Side(name=name, config_sha256=config.sha256(), config=config.model_dump(mode="json")))
    protocols = {p.sha256(): p for p in (StudyConfig.model_validate(side.config).env.protocol() for side in sides)}
    if len(protocols) > 1:
        names = sorted(f"{p.name} telling {p.instruction}" for p in protocols.values())
        raise StudyError(f"the two sides would start their episodes by different protocols ({', '.join(names)}); "
                         "a paired comparison needs the same episodes: set the same [env] episode_protocol (and "
                         "[env] instruction) on both")
    horizon = request.horizon or next(iter(protocols.values())).horizon(request.suite)
    plan = ComparePlan(**request.model_dump(exclude={"horizon"}), horizon=horizon, a=sides[0], b=sides[1])
    study_dir.mkdir(parents=True, exist_ok=True)
    write_json(study_dir / PLAN_FILE, plan.model_dump(mode="json"))
    _create_sides(study_dir, plan)
    return plan


def _create_sides(study_dir: Path, plan: ComparePlan) -> None:
    """Create each side's evaluation study that does not exist yet, all on one episode manifest."""
    protocol = StudyConfig.model_validate(plan.a.config).env.protocol()
    cases = episode_cases(plan.suite, plan.tasks, plan.episodes, plan.horizon, plan.first_init, protocol)
    body = "".join(c.model_dump_json(exclude_none=True) + "\n" for c in cases)
    manifest = parse_manifest(body.encode(), f"{plan.suite} x{plan.episodes}")
    # Both sides exist before either runs, so a crash leaves both resumable.
    for side in SIDES:
        if journal_path(study_dir / side).exists():
            continue
        spec: Side = getattr(plan, side)
        config = StudyConfig.model_validate(spec.config)
        if config.sha256() != spec.config_sha256:
            raise StudyError(f"side {side}'s configuration in {PLAN_FILE} does not match its sha256")
        meta = {"kind": "evaluation", "compare": study_dir.name, "side": side}
        create_study(study_dir / side, manifest, config, meta)


def compare_policies(
    study_dir: str | os.PathLike[str],
    request: CompareRequest,
    configs: tuple[StudyConfig, StudyConfig],
    names: tuple[str, str],
    on_case=None,
    verbose: bool = False,
) -> Comparison:
    """Create a comparison and run it: `rescue compare A B`."""
    create_compare(study_dir, request, configs, names)
    return run_compare(study_dir, on_case, verbose)


def _run_side(side_dir: Path, on_case, verbose: bool) -> None:
    from rescue.study import logs

    logs.configure(StudyLayout.of(side_dir).events, verbose)
    asyncio.run(run_study(side_dir, on_case))


def run_compare(study_dir: str | os.PathLike[str], on_case=None, verbose: bool = False) -> Comparison:
    """Run both sides of a created comparison (A, then B) and write its figures."""
    study_dir = Path(study_dir)
    load_plan(study_dir)
    for side in SIDES:
        log.info("compare.side", side=side, study=str(study_dir / side))
        _run_side(study_dir / side, on_case, verbose)
    return write_comparison(study_dir)


def resume_compare(study_dir: str | os.PathLike[str], on_case=None, verbose: bool = False) -> dict[str, list[str]]:
    """Resume both sides: interrupted episodes become unknown, never-started ones run; returns the interrupted ids."""
    from rescue.run.commands import resume

    study_dir = Path(study_dir)
    _create_sides(study_dir, load_plan(study_dir))
    interrupted: dict[str, list[str]] = {}
    for side in SIDES:
        with Journal.open(study_dir / side, readonly=True) as journal:
            unsettled = any(row.state in ("pending", "claimed") for row in journal.rows())
        # A side with nothing left to run is not restarted (no simulators, no policy server).
        interrupted[side] = resume(study_dir / side, on_case, verbose) if unsettled else []
    write_comparison(study_dir)
    return interrupted


def study_episodes(side_dir: str | os.PathLike[str]) -> list[Episode]:
    """One evaluation study's episodes: label (None when never run), fingerprint, stored result sha256."""
    if not load_study_config(side_dir).is_evaluation:
        raise StudyError(f"{side_dir} is not an evaluation study")
    with Journal.open(side_dir, readonly=True) as journal:
        verdicts: dict[str, Verdict] = journal.verdicts()
        arms = journal.all_arms()
        digests = {row.case_id: row.digest for row in journal.arm_rows() if row.arm == "control"}
        cases = journal.cases()
    out = []
    for case in cases:
        v = verdicts.get(case.case_id)
        arm = arms.get(case.case_id, {}).get("control")
        out.append(
            Episode(
                case_id=case.case_id,
                task=case.task,
                group=case.group,
                label=v.label if v else None,
                fingerprint=arm.fingerprint if arm else None,
                result_sha256=digests.get(case.case_id),
            )
        )
    return out


def compare_studies(study_dir: str | os.PathLike[str]) -> Comparison:
    """The comparison's figures from its two studies as they stand (read-only)."""
    study_dir = Path(study_dir)
    plan = load_plan(study_dir)
    shas = []
    for side in SIDES:
        with Journal.open(study_dir / side, readonly=True) as journal:
            shas.append(journal.meta().get("manifest_sha256"))
    if shas[0] != shas[1]:
        raise StudyError(f"the two sides of {study_dir} ran different episode manifests ({shas[0]} vs {shas[1]})")
    return compare_episodes(
        study_episodes(study_dir / "a"),
        study_episodes(study_dir / "b"),
        seed=plan.seed,
        reps=plan.reps,
        confidence=plan.confidence,
        names=(plan.a.name, plan.b.name),
    )


def write_comparison(study_dir: str | os.PathLike[str]) -> Comparison:
    """Compute the comparison and write it as JSON beside the plan."""
    comparison = compare_studies(study_dir)
    write_json(Path(study_dir) / RESULT_FILE, comparison.model_dump(mode="json"))
    return comparison
