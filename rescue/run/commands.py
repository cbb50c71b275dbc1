"""What the commands do, as library functions: run, resume, continue, evaluate, demo."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator, Literal

from pydantic import BaseModel, ConfigDict

from rescue.core.catalog import format_ids
from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.config_files import ConfigError
from rescue.core.configuration.schema import RANGES
from rescue.core.configuration.work_limit import MAX_HOURS, config_work_problem
from rescue.core.digest import digest_json, digest_text
from rescue.core.episode_protocol import get_protocol
from rescue.core.figures.evaluation import EvalSummary, case_id_of, episode_cases, failure_cases, mark_pilot, summarize_eval
from rescue.core.manifest import Case, Manifest, ManifestError, case_places, load_manifest, parse_manifest, read_manifest_bytes
from rescue.core.configuration.names import EMBEDDED_POLICY
from rescue.core.verdicts import Verdict
from rescue.core.sham import ShamConfig
from rescue.core.figures.success_sample import (
    DESIGN,
    SamplingFrame,
    frame_disagreement,
    frame_of,
    frame_refusal,
    frame_tags,
    sample_cases,
    sample_successes,
)
from rescue.core.vla_eval_settings import episode_settings
from rescue.env.backend import LOCAL, Backend
from rescue.env.warm import WARM_ENV, kept_warm, warm_folder
from rescue.policy.wires import VLA_EVAL, wire_of
from rescue.run.engine import run_study
from rescue.run.recovery import complement_manifest, recover
from rescue.run.stopping import order_meta
from rescue.run.observer import RunObserver
from rescue.run.peers import check_live_identity, probe_policy, resolved_config, study_protocol
from rescue.study import logs
from rescue.study.files import write_manifest
from rescue.study.folder import StudyError, create_study, load_study_config, new_study_dir, open_journal, study_outcome
from rescue.study.journal import STOP_REASON_KEY, STOPPED_NOW_KEY, Journal
from rescue.study.ledger import check_ledger
from rescue.study.layout import STUDIES, StudyLayout
from rescue.study.owner import own_study

OnCase = RunObserver | Callable[[Verdict], None] | None


def _manifest_of(cases: list[Case], source: str, catalog: str | None = "libero") -> Manifest:
    body = "".join(c.model_dump_json(exclude_none=True) + "\n" for c in cases)
    return parse_manifest(body.encode(), source, catalog=catalog)


def _run(
    study_dir: Path, on_case: OnCase, verbose: bool, config: StudyConfig | None = None, backend: Backend = LOCAL
) -> None:
    # `config`: the one the study was just created from, whose VLM key (never written) the run needs.
    key = config.given_keys() if config is not None else None
    try:
        with own_study(study_dir):
            logs.configure(StudyLayout.of(study_dir).events, verbose)
            asyncio.run(run_study(study_dir, on_case, vlm_api_key=key, backend=backend))
    finally:
        backend.disconnect()


def _free_disk(study_dir: Path) -> int | None:
    """The bytes free on the file system a study folder would be made on (None when that cannot be read)."""
    folder = study_dir.resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def new_study(study_dir: Path | None, manifest: Manifest, config: StudyConfig, extra_meta: dict | None = None,
              max_hours: float = MAX_HOURS) -> Path:
    """Fix the study's identity against its policy server, then create its folder (nothing on failure)."""
    study_dir = Path(study_dir) if study_dir else new_study_dir()
    horizons = [c.horizon for c in manifest.cases]
    limits = {"max_hours": max_hours, "free_disk": _free_disk(study_dir)}
    problem = (config.sham.by_task_problem(c.task for c in manifest.cases)
               or config_work_problem(config, horizons, **limits) or stopping_problem(config, manifest.cases))
    if problem is not None:
        raise ConfigError(problem)
    if config.vlm.lab_budget is not None:
        check_ledger(config.vlm.lab_ledger)  # a ledger that cannot be used is named before the study exists
    resolved = asyncio.run(resolved_config(config))
    problem = config_work_problem(resolved, horizons, **limits)  # C is known now: a query point that cannot fire
    if problem is not None:
        raise ConfigError(problem)
    create_study(study_dir, manifest, resolved, {**order_meta(manifest.cases, resolved), **(extra_meta or {})})
    return study_dir


def stopping_problem(config: StudyConfig, cases: list[Case]) -> str | None:
    """Why the manifest cannot be tested by the configuration's `[stopping]` rule, in one line; None: it can."""
    rule = config.stopping
    if rule is None:
        return None
    main = [c for c in cases if not c.pilot]
    wins = sum(c.historical_outcome == "success" for c in main)
    if rule.test == "harm" and not wins:
        return "stopping: test = 'harm' reads the historical successes; the manifest holds none (--successes)"
    if rule.test in ("rescue", "sham", "arms") and wins == len(main):
        return f"stopping: test = {rule.test!r} reads the failures; the manifest holds none"
    if rule.test == "net":
        frame = frame_of(main)
        if frame is None or frame_refusal(frame, len(main) - wins, wins) is not None \
                or frame.sampled is not None or frame.failures_sampled is not None:
            return ("stopping: test = 'net' reads every episode of the evaluation (the net change over a census); "
                    "write the manifest with --successes all and every failure")
    return None


# The tag `rescue manifest from-eval` writes on each case: the episode protocol its failure happened under.
PROTOCOL_TAG = "episode_protocol"


def check_protocol_tags(manifest: Manifest, protocol: str) -> None:
    """Refuse cases a tag says are episodes of another protocol than the study's (they would not be the
    episodes that failed), naming the first few; ManifestError, nothing written."""
    other = [c for c in manifest.cases if c.tags.get(PROTOCOL_TAG, protocol) != protocol]
    if other:
        ids = ", ".join(c.case_id for c in other[:3]) + (" ..." if len(other) > 3 else "")
        raise ManifestError([f"{manifest.source}: {len(other)} case(s) ({ids}) are episodes of the "
                             f"{other[0].tags[PROTOCOL_TAG]!r} episode protocol, this study runs {protocol!r}; "
                             f"set [env] episode_protocol = {other[0].tags[PROTOCOL_TAG]!r} (or --episode-protocol)"])


def run_manifest(
    manifest_path: Path,
    study_dir: Path | None,
    config: StudyConfig,
    on_case: OnCase = None,
    verbose: bool = False,
    backend: Backend = LOCAL,
    pilot_run: bool = False,
    max_hours: float = MAX_HOURS,
) -> Path:
    """Create a study from a manifest and run every case (on `backend`'s simulators).

    `pilot_run`: the manifest may hold pilot cases only (otherwise an empty main cohort is refused); `max_hours`:
    the longest it may be estimated to take (a study estimated longer is refused, with the estimate)."""
    manifest = load_manifest(manifest_path)
    if not pilot_run:
        manifest.require_main_cohort()
    check_protocol_tags(manifest, study_protocol(config).name)
    check_outcomes(manifest, read_manifest_bytes(manifest_path))
    backend.connect(config.env.simulators)  # a backend that cannot be used is refused before the study exists
    study_dir = new_study(study_dir, manifest, config, max_hours=max_hours)
    _run(study_dir, on_case, verbose, config, backend)
    return study_dir


def resume(
    study_dir: Path, on_case: OnCase = None, verbose: bool = False, backend: Backend = LOCAL, lab_budget: float | None = None
) -> list[str]:
    """Record started-unfinished cases as unknown (interrupted), then run the never-started ones.

    The policy server is checked against the study's identity first: a server
    announcing another action horizon or profile is refused with nothing written.
    A study owned by a live process is refused too (its in-flight cases are not interrupted).
    `lab_budget`: a new cap for the lab budget the study declared (its `[vlm] lab_budget` otherwise).
    """
    study_dir = Path(study_dir)
    if lab_budget is not None and not (math.isfinite(lab_budget) and RANGES["vlm.lab_budget"].holds(lab_budget)):
        raise ConfigError(f"--lab-budget {lab_budget:g}: a cap is {RANGES['vlm.lab_budget'].text()}, as [vlm] lab_budget is")
    config = _ready_to_go_on(study_dir, "resume that study instead")
    if lab_budget is not None and config.vlm.lab_budget is None:
        raise ConfigError(f"{study_dir} declares no lab budget ([vlm] lab_budget); --lab-budget changes the cap of one")
    backend.connect(config.env.simulators)
    try:
        with own_study(study_dir):
            with Journal.open(study_dir) as journal:
                journal.clear_drain()
                journal.delete_meta(STOP_REASON_KEY)
                journal.delete_meta(STOPPED_NOW_KEY)
            logs.configure(StudyLayout.of(study_dir).events, verbose)
            interrupted = recover(study_dir)
            asyncio.run(run_study(study_dir, on_case, backend=backend, lab_budget=lab_budget))
    finally:
        backend.disconnect()
    return interrupted


def _ready_to_go_on(study_dir: Path, instead: str) -> StudyConfig:
    """Refuse, with nothing written, a study that cannot go on: already continued, a VLM key to give
    again, or a policy server that is not the one it was created with. Returns its configuration."""
    with open_journal(study_dir) as journal:
        continued_by = journal.meta().get("continued_by")
    if continued_by:
        raise StudyError(f"{study_dir} was continued by {continued_by}; {instead}")
    config = load_study_config(study_dir)
    # A key given in the TOML is never stored in the study: say how to supply it again.
    message = config.missing_key_message()
    if message is not None:
        raise StudyError(message)
    # The same study, the same server: C, the profile and the announced identity must hold.
    asyncio.run(check_live_identity(config))
    return config


def continue_from(
    prior: Path, new_dir: Path, on_case: OnCase = None, verbose: bool = False, backend: Backend = LOCAL
) -> Path:
    """Run the never-claimed complement of a prior study as a new study (partition by claim)."""
    prior, new_dir = Path(prior), Path(new_dir)
    config = _ready_to_go_on(prior, "a study is continued once")
    backend.connect(config.env.simulators)
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
    _run(new_dir, on_case, verbose, backend=backend)
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
    backend: Backend = LOCAL,
) -> Path:
    """A baseline evaluation: control arms over official initial states, same journal and rules."""

    protocol = study_protocol(config)
    if protocol.name == "vla-eval" and wire_of(config.policy.url) == VLA_EVAL:
        # The harness seeds and limits its episodes as the server's HELLO asks (OpenVLA-OFT's: env seed 0).
        seed, asked = episode_settings(asyncio.run(probe_policy(config.policy)))
        protocol = protocol.model_copy(update={"seed_base": protocol.seed_base if seed is None else seed})
        horizon = horizon or asked
    horizon = horizon or protocol.horizon(suite)
    cases = episode_cases(suite, tasks, episodes, horizon, first_init, protocol)
    config = config.model_copy(update={"arms": ("control",), "sham": ShamConfig()})  # episodes: one arm
    backend.connect(config.env.simulators)
    study_dir = new_study(study_dir, _manifest_of(cases, f"{suite} x{episodes}"), config)
    _run(study_dir, on_case, verbose, backend=backend)
    return study_dir


def eval_summary(study_dir: Path) -> EvalSummary:
    """Success per task and group of an evaluation study, with unknown and unexecuted episodes."""
    with open_journal(study_dir) as journal:
        return summarize_eval(journal.cases(), journal.verdicts())


def manifest_from_eval(
    eval_dir: Path, out: Path, pilot_tasks: int = 0, limit: int | None = None, inits: list[int] | None = None,
    successes: int | Literal["all"] | None = None, seed: int = 0, failures: int | None = None,
) -> list[Case]:
    """Write the failure manifest of an evaluation study, with fingerprints and provenance
    (only failures of the initial states `inits`, when given; then the first `limit`, or a seeded sample of
    `failures` of them after the pilot is declared); with `successes`, its historical successes too (all, or a
    seeded sample of that many), every case tagged with the sampling frame and its design (DESIGN §17)."""
    if limit is not None and failures is not None:
        raise ConfigError("--limit takes the first failures, --failures a random sample of them: give one")
    for flag, value in (("--limit", limit), ("--failures", failures)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} {value}: a number of failures is 0 or more")
    if successes is not None and successes != "all" and successes < 0:
        raise ConfigError(f"--successes {successes}: a sample size is 0 or more, or 'all'")
    config = load_study_config(eval_dir)
    if not config.is_evaluation:
        raise StudyError(f"{eval_dir} is not an evaluation study")
    with open_journal(eval_dir) as journal:
        meta = journal.meta()
        episodes = journal.cases()
        verdicts = journal.verdicts()
        overall = summarize_eval(episodes, verdicts).overall
        # Where the failures came from travels with each case (rescue.core.figures.baseline reads it back).
        provenance = {
            "eval_study": meta.get("study_id"),
            "eval_config_sha256": meta.get("config_sha256"),
            "eval_manifest_sha256": meta.get("manifest_sha256"),
            "eval_created": meta.get("created_at"),
            # The failures are episodes of this protocol: a study must replay them under it.
            PROTOCOL_TAG: config.env.episode_protocol or "rescue",
            "eval_policy": config.policy.name(),
            "eval_episodes": overall.n, "eval_successes": overall.success, "eval_failures": overall.failure,
            **_episode_tags([(c.suite, c.task_id, c.init_state_index) for c in episodes]),
            "taken_inits": format_ids(inits) if inits is not None else None,
            "taken_limit": limit,
        }
        arms = journal.all_arms()
        cases = failure_cases(episodes, verdicts, arms, provenance)
        won = failure_cases(episodes, verdicts, arms, provenance, outcome="success") if successes is not None else []
    if inits is not None:
        cases = [c for c in cases if c.init_state_index in inits]
        won = [c for c in won if c.init_state_index in inits]
    frame_failures = len(cases)
    if failures is not None:
        # The pilot is declared over every failure, then the main cohort drawn from the rest.
        cases = mark_pilot(cases, pilot_tasks) if pilot_tasks else cases
        pilots = [c for c in cases if c.pilot]
        chosen = sample_cases([c for c in cases if not c.pilot], failures, seed)
        keep = {c.case_id for c in pilots + chosen}
        cases = [c for c in cases if c.case_id in keep]
    else:
        if limit is not None:
            cases = cases[:limit]
        if pilot_tasks:
            cases = mark_pilot(cases, pilot_tasks)
    if successes is not None or failures is not None:
        main_failures = sum(1 for c in cases if not c.pilot)
        per_task = {t: SamplingFrame(failures=sum(c.task == t for c in episodes if verdicts.get(c.case_id) is not None
                                                  and verdicts[c.case_id].label == "failure"
                                                  and (inits is None or c.init_state_index in inits)),
                                     successes=sum(c.task == t for c in won))
                    for t in sorted({c.task for c in episodes})}
        sampled_s = None if successes in (None, "all") or successes >= len(won) else successes
        chosen_s = sample_successes(won, sampled_s, seed)
        outside_pilot = frame_failures - sum(1 for c in cases if c.pilot)
        sampled_f = None if failures is None or failures >= outside_pilot else main_failures
        frame = SamplingFrame(failures=frame_failures, successes=len(won), sampled=sampled_s,
                              seed=seed if sampled_s is not None else None, failures_sampled=sampled_f,
                              failure_seed=seed if sampled_f is not None else None, design=DESIGN)
        cases = [c.model_copy(update={"outcome": c.historical_outcome, "tags": {**c.tags, **frame_tags(frame, per_task[c.task])}})
                 for c in cases + chosen_s]
    write_manifest(cases, out)
    return cases


def check_outcomes(manifest: Manifest, data: bytes, eval_dir: Path | None = None) -> list[str]:
    """Refuse rows whose historical outcome contradicts the evaluation they name (its folder under `studies/`,
    or `eval_dir`), naming line and field, and rows that disagree on the sampling frame; return the evaluations
    named but not found here (their outcomes are not checked)."""
    odd = frame_disagreement(manifest.cases)
    if odd is not None:
        raise ManifestError([f"{manifest.source}: {odd}: every row carries the same frame (edit none by hand)"])
    named = {c.tags.get("eval_study") for c in manifest.cases} - {None}
    labels: dict[str, dict[str, str]] = {}
    unchecked = []
    for study in sorted(named, key=str):
        folder = eval_dir if eval_dir is not None else Path(STUDIES) / str(study)
        if not (folder / StudyLayout.of(folder).config.name).is_file():
            unchecked.append(str(study))
            continue
        with open_journal(folder) as journal:
            if journal.meta().get("study_id") == study:
                labels[str(study)] = {k: v.label for k, v in journal.verdicts().items()}
    places = case_places(data, manifest.source)
    problems = []
    for case in manifest.cases:
        found = labels.get(str(case.tags.get("eval_study")))
        if found is None:
            continue
        label = found.get(case.case_id)
        where = places.get(case.case_id, manifest.source)
        if label is None:
            problems.append(f"{where}: case_id: {case.case_id!r} is no episode of evaluation {case.tags['eval_study']}")
        elif label != case.historical_outcome:
            problems.append(f"{where}: outcome: {case.historical_outcome!r}, but evaluation {case.tags['eval_study']} "
                            f"recorded {label!r} for {case.case_id}")
    if problems:
        raise ManifestError(problems)
    return unchecked


def _episode_tags(episodes: list[tuple[str, int, int]]) -> dict[str, str]:
    """The suites, task ids and initial states an evaluation ran, as provenance tags."""
    return {"eval_suites": ",".join(sorted({s for s, _, _ in episodes})),
            "eval_tasks": format_ids(t for _, t, _ in episodes), "eval_inits": format_ids(i for _, _, i in episodes)}


def manifest_from_results(
    results: Path, kind: str, out: Path, seed: int | None = None, adapter: str = "rescue.env.libero:LiberoAdapter"
) -> list[Case]:
    """Write the failure manifest of another evaluation's results (`lerobot`: an eval_info.json; `openpi`:
    JSON lines), its episodes under that evaluation's protocol, each fingerprinted by replaying its reset."""
    from rescue.core.catalog import libero_catalog
    from rescue.core.manifest import read_manifest_bytes
    from rescue.core.results import lerobot_episodes, openpi_episodes
    from rescue.env.pool import SimProcess

    data = read_manifest_bytes(results, "results file")  # a regular file, bounded, as a manifest is read
    protocol = get_protocol(kind)
    read = lerobot_episodes if kind == "lerobot" else openpi_episodes
    episodes = read(data, str(results), libero_catalog(), **({"seed": seed} if seed is not None else {}))
    failures = [e for e in episodes if not e.success]
    source = {"source": f"{kind} results {results.name}", "results_file": results.name,
              "results_sha256": hashlib.sha256(data).hexdigest(), PROTOCOL_TAG: protocol.name,
              "eval_episodes": len(episodes), "eval_successes": len(episodes) - len(failures), "eval_failures": len(failures),
              **_episode_tags([(e.suite, e.task_id, e.init_state_index) for e in episodes])}
    cases = [
        Case(case_id=case_id_of(e.suite, e.task_id, e.episode), suite=e.suite, task_id=e.task_id, init_state_index=e.init_state_index, env_seed=e.env_seed,
             horizon=protocol.horizon(e.suite), group=e.suite.removeprefix("libero_"), tags=source)
        for e in failures
    ]
    # The historical fingerprint: the episode's reset replayed under its protocol, in a simulator process,
    # with the words the results say the loop sent (an arm told others is not that episode: a deviation).
    sim = SimProcess(adapter, name="sim-fingerprint")
    try:
        cases = [_historical(c, e.prompt, sim._call("reset", c, None, protocol)) for c, e in zip(cases, failures)]
    finally:
        sim.stop()
    write_manifest(cases, out)
    return cases


def _historical(case: Case, prompt: str | None, reset) -> Case:
    """The case with its historical fingerprint: the replayed reset's, its instruction part the results' prompt
    when they give one (then a `prompt` tag too where it is not what the protocol tells)."""
    parts = dict(reset.fingerprint_parts)
    if prompt is None or digest_text(prompt) == parts.get("instruction"):
        return case.model_copy(update={"fingerprint": reset.fingerprint})
    parts["instruction"] = digest_text(prompt)
    return case.model_copy(update={"fingerprint": digest_json(parts), "tags": {**case.tags, "prompt": prompt}})


def demo(
    root: Path = Path(STUDIES),
    tasks: tuple[int, ...] = (0, 1, 2, 3),
    episodes: int = 3,
    max_cases: int = 6,
    on_case: OnCase = None,
    verbose: bool = False,
) -> dict[str, Path]:
    """Evaluate the embedded vision-language policy, collect its real failures, and run the rescue study over them."""
    base = Path(root) / f"demo-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    # The policy reads the openpi-libero contract (images, 8-float state, prompt), as a VLA does.
    # The rescue study runs the sham arm too: each case's subgoal is also tried on another case.
    config = StudyConfig(keyframes=True, sham={"source": "permuted"}, policy={"factory": EMBEDDED_POLICY})
    # The rescue study leases the simulators the evaluation built its envs in (rescue.env.warm), unless the
    # caller names warm simulators of its own.
    with _warm_for(config.env.simulators) as folder:
        backend = Backend(warm=folder)
        baseline = evaluate("libero_object", list(tasks), episodes, None, base / "baseline", config, on_case, verbose,
                            backend=backend)
        manifest = base / "failures.jsonl"
        cases = manifest_from_eval(baseline, manifest, limit=max_cases)
        paths = {"baseline": baseline, "manifest": manifest}
        if cases:
            paths["rescue"] = run_manifest(manifest, base / "rescue", config, on_case, verbose, backend=backend)
    (base / "demo.json").write_text(json.dumps({k: str(v) for k, v in paths.items()}, indent=2) + "\n")
    return paths


def warm_backend() -> Backend:
    """Local simulators, leased first from the warm pool RESCUE_WARM_SIMULATORS names, if any (a service job's)."""
    return Backend(warm=warm_folder(None))


def kept_simulators(size: int) -> contextlib.AbstractContextManager[str]:
    """`size` warm simulators while the block runs (rescue.env.warm.kept_warm); it yields their folder."""
    return kept_warm(size)


@contextlib.contextmanager
def _warm_for(size: int) -> Iterator[str | None]:
    """The warm simulators of a command that runs several studies: RESCUE_WARM_SIMULATORS's when set (`off`:
    none, each study starts its own), else `size` kept while the block runs."""
    if os.environ.get(WARM_ENV) is not None:
        yield warm_folder(None)
        return
    with kept_warm(size) as kept:
        yield kept


class AblationRow(BaseModel):
    """One rule setting of an ablation against all rules on, paired by case."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    setting: str
    """The setting's name: `all_on`, `all_off` or `no_<rule>`."""
    enabled: list[str]
    """The rules on in this setting."""
    study: str
    """The setting's evaluation study folder."""
    n: int
    """Instances (manifest cases)."""
    success: int
    """Instances that succeeded under this setting."""
    unknown: int
    """Instances unknown under this setting (infrastructure)."""
    wins: int
    """This setting succeeded where all_on failed."""
    losses: int
    """all_on succeeded where this setting failed."""
    paired: int
    """Cases with a success/failure label in both."""
    mcnemar_p: float
    """Exact McNemar p-value on wins and losses."""
    diff: float | None
    """This setting's success rate minus all_on's over the paired cases (0-1); None when none is paired."""
    diff_ci: tuple[float, float] | None
    """Newcombe paired 95% interval of diff; None when none is paired."""


class Ablation(BaseModel):
    """`ablation.json`: every setting of an ablation against all rules on."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    schema_version: Literal["rescue-ablation/1"] = "rescue-ablation/1"
    """The format of this document."""
    rows: list[AblationRow]
    """One row per setting, in the order the settings ran."""


def ablate(
    manifest_path: Path, rules: list[str], root: Path | None, config: StudyConfig, on_case: OnCase = None, verbose: bool = False
) -> tuple[Path, list[AblationRow]]:
    """Studies that differ by one rule switch (each listed rule off alone, all off, all on), control arms only,
    on the same instances, seeds and C; each is an evaluation study run (or resumed) to the end."""
    from wrappers.async_rules import ablation_configs

    manifest = load_manifest(manifest_path)
    settings = ablation_configs(config.rules, rules)
    if root is None:
        fresh = new_study_dir()
        root = fresh.with_name(fresh.name.replace("study-", "ablation-", 1))
    root.mkdir(parents=True, exist_ok=True)
    for name, rules_config in settings.items():
        study = root / name
        side = config.model_copy(update={"rules": rules_config, "arms": ("control",), "sham": ShamConfig()})
        if not StudyLayout.of(study).is_study():
            new_study(study, manifest, side)
            _run(study, on_case, verbose)
        elif study_outcome(study).ended != "finished":
            resume(study, on_case, verbose)
    rows = ablation_rows(root, settings)
    (root / "ablation.json").write_text(Ablation(rows=rows).model_dump_json(indent=2) + "\n")
    return root, rows


def ablation_rows(root: Path, settings: dict) -> list[AblationRow]:
    """Each setting's success and its paired comparison (exact McNemar, Newcombe CI) against all_on."""
    from rescue.core.figures.exact_stats import mcnemar_exact, paired_diff_ci

    labels: dict[str, dict[str, str]] = {}
    for name in settings:
        with open_journal(root / name) as journal:
            labels[name] = {cid: v.label for cid, v in journal.verdicts().items()}
    base = labels["all_on"]
    rows = []
    for name, rules_config in settings.items():
        mine = labels[name]
        both = [cid for cid in mine if cid in base and {mine[cid], base[cid]} <= {"success", "failure"}]
        wins = sum(mine[c] == "success" and base[c] == "failure" for c in both)
        losses = sum(mine[c] == "failure" and base[c] == "success" for c in both)
        both_success = sum(mine[c] == base[c] == "success" for c in both)
        rows.append(AblationRow(
            setting=name, enabled=list(rules_config.enabled), study=str(root / name), n=len(mine),
            success=sum(v == "success" for v in mine.values()), unknown=sum(v == "unknown" for v in mine.values()),
            wins=wins, losses=losses, paired=len(both), mcnemar_p=mcnemar_exact(wins, losses),
            diff=(wins - losses) / len(both) if both else None,
            diff_ci=paired_diff_ci(wins, losses, len(both), both_success=both_success) if both else None,
        ))
    return rows
