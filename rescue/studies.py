"""What the commands do, as library functions: run, resume, continue, evaluate, demo."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Callable

from rescue import logs
from rescue.catalog import OFFICIAL_HORIZON
from rescue.config import StudyConfig
from rescue.engine import STOP_REASON_KEY, complement_manifest, recover, run_study
from rescue.evaluation import EvalSummary, episode_cases, failure_cases, mark_pilot, summarize_eval
from rescue.journal import Journal
from rescue.layout import StudyLayout
from rescue.manifest import Case, Manifest, load_manifest, parse_manifest, write_manifest
from rescue.owner import own_study
from rescue.records import Verdict
from rescue.sham import ShamConfig
from rescue.services import check_live_identity, resolved_config
from rescue.study import StudyError, create_study, load_study_config, new_study_dir, open_journal

OnCase = Callable[[Verdict], None] | None


def _manifest_of(cases: list[Case], source: str, catalog: str | None = "libero") -> Manifest:
    body = "".join(c.model_dump_json(exclude_none=True) + "\n" for c in cases)
    return parse_manifest(body.encode(), source, catalog=catalog)


def _run(study_dir: Path, on_case: OnCase, verbose: bool) -> None:
    with own_study(study_dir):
        logs.configure(StudyLayout.of(study_dir).events, verbose)
        asyncio.run(run_study(study_dir, on_case))


def new_study(study_dir: Path | None, manifest: Manifest, config: StudyConfig, extra_meta: dict | None = None) -> Path:
    """Fix the study's identity against its policy server, then create its folder (nothing on failure)."""
    study_dir = Path(study_dir) if study_dir else new_study_dir()
    create_study(study_dir, manifest, asyncio.run(resolved_config(config)), extra_meta)
    return study_dir


def run_manifest(
    manifest_path: Path, study_dir: Path | None, config: StudyConfig, on_case: OnCase = None, verbose: bool = False
) -> Path:
    """Create a study from a manifest and run every case."""
    study_dir = new_study(study_dir, load_manifest(manifest_path), config)
    _run(study_dir, on_case, verbose)
    return study_dir


def resume(study_dir: Path, on_case: OnCase = None, verbose: bool = False) -> list[str]:
    """Record started-unfinished cases as unknown (interrupted), then run the never-started ones.

    The policy server is checked against the study's identity first: a server
    announcing another action horizon or profile is refused with nothing written.
    A study owned by a live process is refused too (its in-flight cases are not interrupted).
    """
    study_dir = Path(study_dir)
    with open_journal(study_dir) as journal:
        meta = journal.meta()
    if meta.get("continued_by"):
        raise StudyError(f"{study_dir} was continued by {meta['continued_by']}; resume that study instead")
    config = load_study_config(study_dir)
    _check_vlm_key(config)
    asyncio.run(check_live_identity(config))
    with own_study(study_dir):
        with Journal.open(study_dir) as journal:
            journal.clear_drain()
            journal.delete_meta(STOP_REASON_KEY)
        logs.configure(StudyLayout.of(study_dir).events, verbose)
        interrupted = recover(study_dir)
        asyncio.run(run_study(study_dir, on_case))
    return interrupted


def _check_vlm_key(config: StudyConfig) -> None:
    # A key given in the TOML is never stored in the study: say how to supply it again.
    if "assisted" in config.arms:
        message = config.vlm.missing_key_message()
        if message is not None:
            raise StudyError(message)


def continue_from(prior: Path, new_dir: Path, on_case: OnCase = None, verbose: bool = False) -> Path:
    """Run the never-claimed complement of a prior study as a new study (partition by claim)."""
    prior, new_dir = Path(prior), Path(new_dir)
    with open_journal(prior) as journal:
        meta = journal.meta()
    if meta.get("continued_by"):
        raise StudyError(f"{prior} was already continued by {meta['continued_by']}")
    config = load_study_config(prior)
    _check_vlm_key(config)
    # The continuation is the same study in two parts: same identity, same server.
    asyncio.run(check_live_identity(config))
    with own_study(prior):
        recover(prior)
        cases = complement_manifest(prior)
        if not cases:
            raise StudyError(f"{prior} has no never-started case to continue with")
        with Journal.open(prior) as journal:
            # Close the prior study to dispatch first, so no case can run in both.
            journal.set_meta("continued_by", str(new_dir))
            journal.request_drain()
    # The prior study's cases were checked against the benchmark when it was created.
    manifest = _manifest_of(cases, str(StudyLayout.of(prior).manifest), catalog=None)
    create_study(new_dir, manifest, config, {"continues": str(prior)})
    _run(new_dir, on_case, verbose)
    return new_dir


def evaluate(
    suite: str,
    tasks: list[int],
    episodes: int,
    horizon: int | None,
    study_dir: Path | None,
    config: StudyConfig,
    on_case: OnCase = None,
    verbose: bool = False,
    first_init: int = 0,
) -> Path:
    """A baseline evaluation: control arms over official initial states, same journal and rules."""

    horizon = horizon or OFFICIAL_HORIZON[suite]
    cases = episode_cases(suite, tasks, episodes, horizon, first_init)
    config = config.model_copy(update={"arms": ("control",), "sham": ShamConfig()})  # episodes: one arm
    study_dir = new_study(study_dir, _manifest_of(cases, f"{suite} x{episodes}"), config)
    _run(study_dir, on_case, verbose)
    return study_dir


def eval_summary(study_dir: Path) -> EvalSummary:
    """Success per task and group of an evaluation study, with unknown and unexecuted episodes."""
    with open_journal(study_dir) as journal:
        return summarize_eval(journal.cases(), journal.verdicts())


def manifest_from_eval(eval_dir: Path, out: Path, pilot_tasks: int = 0, limit: int | None = None) -> list[Case]:
    """Write the failure manifest of an evaluation study, with fingerprints and provenance."""
    if not load_study_config(eval_dir).is_evaluation:
        raise StudyError(f"{eval_dir} is not an evaluation study")
    with open_journal(eval_dir) as journal:
        meta = journal.meta()
        provenance = {
            "eval_study": meta.get("study_id"),
            "eval_config_sha256": meta.get("config_sha256"),
            "eval_manifest_sha256": meta.get("manifest_sha256"),
        }
        cases = failure_cases(journal.cases(), journal.verdicts(), journal.all_arms(), provenance)
    if limit is not None:
        cases = cases[:limit]
    if pilot_tasks:
        cases = mark_pilot(cases, pilot_tasks)
    write_manifest(cases, out)
    return cases


def demo(
    root: Path = Path("queue"),
    tasks: tuple[int, ...] = (0, 1, 2, 3),
    episodes: int = 3,
    max_cases: int = 6,
    on_case: OnCase = None,
    verbose: bool = False,
) -> dict[str, Path]:
    """Evaluate the embedded default, collect its real failures, and run the rescue study over them."""
    base = Path(root) / f"demo-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    # The rescue study runs the sham arm too: each case's subgoal is also tried on another case.
    config = StudyConfig(keyframes=True, sham={"source": "permuted"})
    baseline = evaluate("libero_object", list(tasks), episodes, None, base / "baseline", config, on_case, verbose)
    manifest = base / "failures.jsonl"
    cases = manifest_from_eval(baseline, manifest, limit=max_cases)
    paths = {"baseline": baseline, "manifest": manifest}
    if cases:
        paths["rescue"] = run_manifest(manifest, base / "rescue", config, on_case, verbose)
    (base / "demo.json").write_text(json.dumps({k: str(v) for k, v in paths.items()}, indent=2) + "\n")
    return paths
