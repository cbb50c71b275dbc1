"""Paired comparison of two policies (or wrapper settings) on identical episodes.

Each side runs as its own evaluation study over one shared episode manifest
(`a/` and `b/` under the comparison folder): same suite, tasks, initial states,
env and policy seeds, on the same engine and journal, so claim-before-run and
resume hold for both. The pairing and the paired figures are pure
(`rescue.core.figures.comparison`); this module runs the two studies and reads them.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

from rescue.core.figures.comparison import SIDES, Comparison, Episode, compare_episodes
from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.config_files import load_config
from rescue.core.figures.evaluation import episode_cases
from rescue.core.manifest import parse_manifest
from rescue.core.verdicts import Verdict
from rescue.run.engine import run_study
from rescue.run.peers import resolved_config
from rescue.study.files import write_atomic
from rescue.study.folder import StudyError, create_study, load_study_config, new_study_dir
from rescue.study.journal import Journal, journal_path
from rescue.study.layout import STUDIES, StudyLayout

log = structlog.get_logger()

PLAN_FILE = "compare.json"
RESULT_FILE = "comparison.json"


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
