"""The `rescue` command: each subcommand parses, calls one library function, prints."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from rescue import __version__
from rescue.run.progress import LiveProgress
from rescue.study import layout

# Off a terminal (a log file, nohup, Slurm) rich would wrap tables at 80 columns and truncate the per-group
# ones; COLUMNS still wins where it is set.
console = Console(stderr=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 132)

# `rescue export` of a study that is not finished, without --partial.
EXIT_UNFINISHED = 5


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "env.simulators": getattr(args, "simulators", None),
        "cases_in_flight": getattr(args, "cases_in_flight", None),
        "policy.url": getattr(args, "policy_url", None),
        "policy.factory": getattr(args, "policy_factory", None),
        "policy.processes": getattr(args, "policy_processes", None),
        "vlm.base_url": getattr(args, "vlm_url", None),
        "vlm.model": getattr(args, "vlm_model", None),
        "vlm.api": getattr(args, "vlm_api", None),
        "vlm.batch_size": getattr(args, "batch_size", None),
        "env.episode_protocol": getattr(args, "episode_protocol", None),
        "continuations": getattr(args, "continuations", None),
        "policy.replan_interval": getattr(args, "replan_interval", None),
    }


def _ids(text: str, flag: str) -> list[int]:
    """--tasks or --inits as ids; a bad one is bad input (exit 2), named."""
    from rescue.core.catalog import parse_ids
    from rescue.core.config_files import ConfigError

    try:
        return parse_ids(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r}: {exc}") from None


def _suite_tasks(suite: str, text: str) -> list[int]:
    """--suite and --tasks checked against the catalog as a manifest's are: a typo (with what it may mean) or a
    task the suite lacks is bad input (exit 2), named in one line."""
    from rescue.core.catalog import format_ids, libero_catalog
    from rescue.core.config_files import ConfigError

    catalog = libero_catalog()
    known = catalog.suite(suite)
    if known is None:
        raise ConfigError(f"--suite {suite!r}: {catalog.refusal(suite) or f'unknown suite; {catalog.hint(suite)}'}")
    tasks = _ids(text, "--tasks")
    beyond = [t for t in tasks if t >= len(known.tasks)]
    if beyond:
        raise ConfigError(f"--tasks {text!r}: {suite} has tasks 0-{len(known.tasks) - 1}, not {format_ids(beyond)}")
    return tasks


def _config(args: argparse.Namespace):
    from rescue.core.config_files import load_config

    return load_config(getattr(args, "config", None), _overrides(args))


def _print_rescue_summary(study: Path) -> None:
    from rescue.read.export import export_study
    from rescue.read.terminal import render_summary

    console.print(render_summary(export_study(study)))


def _print_eval_summary(study: Path) -> None:
    from rescue.read.terminal import render_eval
    from rescue.run.commands import eval_summary

    console.print(render_eval(eval_summary(study)))


def _summary_for(study: Path) -> None:
    from rescue.study.folder import load_study_config

    (_print_eval_summary if load_study_config(study).is_evaluation else _print_rescue_summary)(study)


def _outcome(study: Path) -> int:
    """Print why a run ended as it did; its exit code (docs/reference.md: exit codes)."""
    from rescue.study.folder import study_outcome

    outcome = study_outcome(study)
    if outcome.code:
        print(f"rescue: {outcome.message}", file=sys.stderr)
    return outcome.code


def cmd_run(args: argparse.Namespace) -> int:
    from rescue.run import commands

    with LiveProgress("cases", console) as live:
        if args.continue_from:
            study = commands.continue_from(Path(args.continue_from), Path(args.target), live, args.verbose, _backend(args))
        else:
            study = commands.run_manifest(Path(args.target), args.study and Path(args.study), _config(args), live,
                                         args.verbose, _backend(args), pilot_run=args.pilot_run)
    console.print(f"study: {study}")
    if args.continue_from:
        console.print(f"[bold]prior part[/bold] ({args.continue_from}):")
        _summary_for(Path(args.continue_from))
        console.print("[bold]continuation[/bold]:")
    _summary_for(study)
    return _outcome(study)


def cmd_resume(args: argparse.Namespace) -> int:
    from rescue.run import commands

    with LiveProgress("cases", console) as live:
        interrupted = commands.resume(Path(args.study), live, args.verbose, _backend(args), args.lab_budget)
    if interrupted:
        console.print(f"{len(interrupted)} started-unfinished case(s) recorded as unknown (interrupted): {', '.join(interrupted)}")
    _summary_for(Path(args.study))
    return _outcome(Path(args.study))


def cmd_eval(args: argparse.Namespace) -> int:
    from rescue.run import commands

    tasks = _suite_tasks(args.suite, args.tasks)
    with LiveProgress("episodes", console) as live:
        study = commands.evaluate(args.suite, tasks, args.episodes, args.horizon, args.study and Path(args.study),
                                 _config(args), live, args.verbose, args.first_init, _backend(args))
    console.print(f"study: {study}")
    _print_eval_summary(study)
    _print_pairings([args.suite])
    return _outcome(study)


def cmd_demo(args: argparse.Namespace) -> int:
    from rescue.read.verify import verify_study
    from rescue.run import commands

    tasks = tuple(_ids(args.tasks, "--tasks"))
    with LiveProgress("episodes, then cases", console) as live:
        paths = commands.demo(Path(args.root), tasks, args.episodes, args.max_cases, live, args.verbose)
    console.print(f"baseline evaluation: {paths['baseline']}")
    _print_eval_summary(paths["baseline"])
    if "rescue" not in paths:
        console.print("the policy did not fail on these episodes; nothing to rescue")
        return 0
    console.print(f"failure manifest: {paths['manifest']}\nrescue study: {paths['rescue']}")
    _print_rescue_summary(paths["rescue"])
    from rescue.read.html.report import write_report

    console.print(f"report: {write_report(paths['rescue'])}")
    report = verify_study(paths["rescue"])
    console.print("verify: " + ("[green]ok[/green]" if report.ok else f"[red]{len(report.problems)} problem(s)[/red]"))
    return 0 if report.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from rescue.read.status import render_status, study_status

    while True:
        status = study_status(Path(args.study))
        if args.json:
            print(json.dumps(status.model_dump(mode="json")), flush=True)
        else:
            if args.watch:
                console.clear()
            console.print(render_status(status))
        if not args.watch:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def cmd_drain(args: argparse.Namespace) -> int:
    from rescue.study.folder import open_journal

    with open_journal(Path(args.study), readonly=False) as journal:
        journal.request_drain()
    console.print(f"{args.study}: no new case will be claimed; arms in flight finish")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from rescue.read.export import export_study, write_export
    from rescue.study.layout import StudyLayout

    study = Path(args.study)
    out = Path(args.out) if args.out else StudyLayout.of(study).export_json
    export = export_study(study)
    main = export.coverage["main"]
    unfinished = not all(c.complete for c in export.coverage.values() if c.n_manifest)
    if unfinished and not args.partial:
        print(f"rescue: {study} is unfinished ({main.n_summarized} of {main.n_manifest} main cases have a verdict, "
              f"{main.n_pending} never started, {main.n_in_flight} in flight); nothing written. "
              "`rescue export --partial` writes it with its coverage stated", file=sys.stderr)
        return EXIT_UNFINISHED
    write_export(export, out, out.with_suffix(".csv"))
    console.print(f"wrote {out} and {out.with_suffix('.csv')}" + (" (partial: see its coverage)" if unfinished else ""))
    # The export reports the stored verdicts; `rescue verify` is what re-derives them.
    console.print(f"it reports the verdicts as stored; `rescue verify {study}` re-checks every one")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rescue.read.html.side_by_side import write_comparison_report
    from rescue.read.html.report import write_report

    if len(args.studies) == 1:
        console.print(f"wrote {write_report(Path(args.studies[0]), args.out, video=args.video)}")
        return 0
    if args.video:
        from rescue.core.config_files import ConfigError

        raise ConfigError("--video makes one study's videos; give one study folder with it")
    console.print(f"wrote {write_comparison_report([Path(s) for s in args.studies], args.out or 'comparison.html')}")
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    from rescue.read.lab_usage import lab_usage
    from rescue.read.terminal import render_lab_usage

    # Folders named must exist; the defaults are searched when they do.
    optional = ([] if args.folders else [layout.STUDIES]) + ([args.queue] if args.queue else [])
    usage = lab_usage(args.folders, optional)
    if args.json:
        print(usage.model_dump_json())
    else:
        console.print(render_lab_usage(usage))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from rescue.read.verify import verify_study
    from rescue.study.folder import open_journal

    open_journal(Path(args.study)).close()  # a folder that is not a study is bad input, not a failed check
    report = verify_study(Path(args.study))
    print(report.render())
    return 0 if report.ok else 1


def cmd_preflight(args: argparse.Namespace) -> int:
    from rescue.run.preflight import preflight

    report = preflight(Path(args.manifest), _config(args), args.cases, args.clients, args.idle_s)
    print(report.render())
    return 0 if report.ok else 1


def cmd_manifest_check(args: argparse.Namespace) -> int:
    from rescue.core.manifest import load_manifest

    # Checked against the shipped benchmark catalog: no simulator starts.
    manifest = load_manifest(args.file, catalog=None if args.no_env else "libero")
    if not args.pilot_run:
        manifest.require_main_cohort()
    from rescue.core.manifest import read_manifest_bytes
    from rescue.run.commands import check_outcomes

    check_outcomes(manifest, read_manifest_bytes(args.file), Path(args.eval) if args.eval else None)
    console.print(f"{args.file}: {len(manifest.cases)} cases ({len(manifest.pilot_cases)} pilot), sha256 {manifest.sha256}")
    if not args.no_env:
        _print_pairings(dict.fromkeys(case.suite for case in manifest.cases))
    return 0


def _print_pairings(suites) -> None:
    """For each LIBERO-PRO suite named: whether its episodes pair with its base suite's by identical episode."""
    from rescue.core.catalog import libero_catalog

    for suite in suites:
        line = libero_catalog().pairing(suite)
        if line:
            console.print(line, soft_wrap=True)


def cmd_catalog(args: argparse.Namespace) -> int:
    from rescue.core.catalog import libero_catalog
    from rescue.core.config_files import ConfigError
    from rescue.read.terminal import render_catalog

    catalog = libero_catalog()
    if args.suite is not None and catalog.suite(args.suite) is None:
        raise ConfigError(catalog.refusal(args.suite) or f"unknown suite {args.suite!r}; {catalog.hint(args.suite)}")
    console.print(render_catalog(catalog, args.suite))
    return 0


def cmd_manifest_from_eval(args: argparse.Namespace) -> int:
    from rescue.run.commands import manifest_from_eval

    inits = None if args.inits is None else _ids(args.inits, "--inits")
    successes = args.successes
    if successes not in (None, "all"):
        from rescue.core.config_files import ConfigError

        if not successes.isdigit():
            raise ConfigError(f"--successes {successes!r}: 'all', or how many successes to sample (0 or more)")
        successes = int(successes)
    cases = manifest_from_eval(Path(args.study), Path(args.out), args.pilot_tasks, args.limit, inits, successes, args.seed)
    pilot = [c.case_id for c in cases if c.pilot]
    won = sum(c.outcome == "success" for c in cases)
    console.print(f"wrote {len(cases) - won} failure case(s)" + (f" and {won} success case(s)" if successes is not None else "")
                  + f" to {args.out}" + (f"; pilot: {', '.join(pilot)}" if pilot else ""))
    return 0


def cmd_manifest_from_results(args: argparse.Namespace) -> int:
    from rescue.core.results import ResultsError
    from rescue.run.commands import manifest_from_results

    try:
        cases = manifest_from_results(Path(args.results), args.kind, Path(args.out), args.seed)
    except ResultsError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_BAD_INPUT
    console.print(f"wrote {len(cases)} failure case(s) to {args.out} ({args.kind} episode protocol, each fingerprinted)")
    told_otherwise = [c.case_id for c in cases if "prompt" in c.tags]
    if told_otherwise:
        console.print(f"{len(told_otherwise)} of them were told other words than the {args.kind} protocol sends (tag "
                      f"`prompt`; e.g. {told_otherwise[0]}): their arms will be initial_state_deviation unless [env] "
                      "instruction tells those words")
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from rich.table import Table

    from rescue.run import commands

    with LiveProgress("episodes, setting by setting", console) as live:
        root, rows = commands.ablate(Path(args.manifest), args.rules.split(","), args.study and Path(args.study),
                                    _config(args), live, args.verbose)
    table = Table(title=f"ablation: {root}")
    for col in ("setting", "rules on", "success", "unknown", "vs all_on: wins", "losses", "McNemar p", "difference [95% CI]"):
        table.add_column(col)
    for r in rows:
        ci = "n/a" if r.diff_ci is None else f"{100 * r.diff:+.1f}% [{100 * r.diff_ci[0]:+.1f}%, {100 * r.diff_ci[1]:+.1f}%]"
        table.add_row(r.setting, ",".join(r.enabled) or "-", f"{r.success}/{r.n}", str(r.unknown), str(r.wins),
                      str(r.losses), f"{r.mcnemar_p:.4f}", ci)
    console.print(table)
    console.print(f"wrote {root / 'ablation.json'}")
    # A setting whose every case is unknown compared nothing: the ablation did not do its work.
    from rescue.study.folder import study_outcome

    for r in rows:
        outcome = study_outcome(r.study)
        if outcome.code:
            print(f"rescue: setting {r.setting}: {outcome.message}", file=sys.stderr)
            return outcome.code
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from rescue.run.diagnose import diagnose, from_arm_result, plot_timelines, summary_table, write_csv, write_transitions
    from rescue.study.folder import open_journal

    arms = []
    for study in args.studies:
        with open_journal(Path(study)) as journal:
            for by_arm in journal.all_arms().values():
                for name, arm in by_arm.items():
                    if args.arm is None or name in args.arm:
                        arms.append(from_arm_result(f"{Path(study).name}:{name}", arm))
    if not any(arm.queries for arm in arms):
        print("rescue: these arms record no per-query behaviour (studies from before it was recorded)", file=sys.stderr)
        return EXIT_BAD_INPUT
    diag = diagnose(arms, source=args.stage_source)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_csv(diag, out / "instances.csv"), write_transitions(diag, out / "transitions.json")]
    if args.timeline:
        written.append(plot_timelines(diag, arms, args.timeline, out / "timeline.png", source=args.stage_source))
    print(summary_table(diag))
    console.print("wrote " + ", ".join(str(p) for p in written))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from rescue.read.terminal import render_compare
    from rescue.run import compare

    interrupted: dict[str, list[str]] = {}
    if args.resume:
        study = Path(args.resume)
        with LiveProgress("episodes (A, then B)", console) as live:
            interrupted = compare.resume_compare(study, live, args.verbose)
        result = compare.compare_studies(study)
    else:
        if (args.a is None and args.policy_a is None) or (args.b is None and args.policy_b is None):
            raise compare.StudyError("give two config files (A B), or --policy-a and --policy-b, or --resume STUDY")
        shared = {"env.simulators": args.simulators, "cases_in_flight": args.cases_in_flight,
                  "env.episode_protocol": args.episode_protocol}
        config_a, name_a = compare.side_config(args.a, args.policy_a, shared)
        config_b, name_b = compare.side_config(args.b, args.policy_b, shared)
        study = Path(args.study) if args.study else compare.new_compare_dir()
        tasks = _suite_tasks(args.suite, args.tasks)
        with LiveProgress("episodes (A, then B)", console) as live:
            request = compare.CompareRequest(suite=args.suite, tasks=tasks, episodes=args.episodes, horizon=args.horizon,
                                             first_init=args.first_init, seed=args.seed, reps=args.reps)
            result = compare.compare_policies(study, request, (config_a, config_b), (name_a, name_b), live, args.verbose)
    for side, ids in interrupted.items():
        if ids:
            console.print(f"side {side}: {len(ids)} started-unfinished episode(s) recorded as unknown (interrupted): {', '.join(ids)}")
    console.print(f"comparison: {study} (sides {study / 'a'} and {study / 'b'})")
    console.print(render_compare(result))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from rescue.core.config_files import config_data
    from rescue.service.settings import job_request, load_service_config
    from rescue.service.queue import submit_file

    # A job chooses among the service's named endpoints and policies; its other settings are checked
    # against what a job may set, and the whole request against the service's configuration.
    data = config_data(args.config, {
        "vlm.endpoint": args.vlm_endpoint, "policy.name": args.policy, "env.simulators": args.simulators,
        "cases_in_flight": args.cases_in_flight, "vlm.model": args.vlm_model, "vlm.api": args.vlm_api,
        "vlm.batch_size": args.batch_size,
    })
    service = load_service_config(args.service_config) if args.service_config else None
    spec = submit_file(Path(args.queue), Path(args.manifest), job_request(data), args.name, service)
    print(f"queued {spec.job_id} ({spec.cases} cases, {spec.name}) in {args.queue}")
    return 0


def cmd_queue(args: argparse.Namespace) -> int:
    from rich.table import Table

    from rescue.service.queue import job_view, list_jobs

    views = [job_view(job) for job in list_jobs(Path(args.queue))]
    if args.json:
        print(json.dumps([v.model_dump(mode="json") for v in views]))
        return 0
    table = Table(title=f"queue: {args.queue}")
    for col in ("job", "name", "state", "cases done", "labels", "message"):
        table.add_column(col)
    for v in views:
        labels = " ".join(f"{k}={n}" for k, n in v.labels.items())
        table.add_row(v.job_id, v.name, v.state, f"{v.done}/{v.cases}", labels, v.message or "")
    console.print(table)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from rescue.service.queue import cancel_job

    console.print(cancel_job(Path(args.queue), args.job))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from rescue.service.worker import ServeError, serve

    try:
        return serve(Path(args.queue), args.host, args.port, args.api_key_env, args.verbose, args.config)
    except ServeError as exc:
        print(f"rescue: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _add_backend_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where the simulators run (docs/ray.md)")
    g.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local simulator processes, or simulator actors on a Ray cluster")
    g.add_argument("--address", help="Ray: the cluster (auto, host:port or ray://host:10001); "
                   "none starts a one-machine cluster for this run")
    g.add_argument("--ray-actor-cpus", type=float, default=1.0, help="Ray: CPUs each simulator actor asks for")
    g.add_argument("--ray-actor-gpus", type=float, default=0.0, help="Ray: GPUs each simulator actor asks for")
    g.add_argument("--ray-resource", default="simulator",
                   help="Ray: custom resource of nodes with the simulator installed, 1 per actor ('' for none)")
    g.add_argument("--ray-placement-timeout", type=float, default=600.0,
                   help="Ray: seconds a simulator actor may wait for a node before the study stops")


def _backend(args: argparse.Namespace):
    from rescue.core.config_files import ConfigError
    from rescue.env.backend import Backend

    if args.backend == "local":
        if args.address:
            raise ConfigError("--address needs --backend ray")
        return Backend()
    return Backend("ray", args.address, args.ray_actor_cpus, args.ray_actor_gpus, args.ray_resource or None,
                   args.ray_placement_timeout)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows an option's default, unless it has none or its help already says which."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_policy_options(p: argparse.ArgumentParser) -> None:
    """What an evaluation needs: where the policy is, how often it is asked, the simulators."""
    _add_backend_options(p)
    p.add_argument("--config", help="TOML configuration file (flags override it)")
    p.add_argument("--simulators", type=int, help="simulator processes (config default: 2)")
    p.add_argument("--cases-in-flight", type=int, help="cases run at once (config default: 4)")
    p.add_argument("--policy-url", help="ws:// URL of a policy server (default: serve the embedded policy)")
    p.add_argument("--policy-factory", help="module:function of an in-process policy to serve")
    p.add_argument("--policy-processes", type=int, metavar="N",
                   help="processes of their own serving the in-process policy (0: the command process; "
                        "default: one per 8 simulators from 4 simulators on)")
    p.add_argument("--replan-interval", type=int, metavar="C",
                   help="env steps between policy queries (default: the server's announced action_horizon)")
    _add_protocol_option(p)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """A rescue study's: the policy's, then the VLM's and the continuations."""
    _add_policy_options(p)
    p.add_argument("--vlm-url", help="OpenAI-compatible base URL (default: the local endpoint)")
    p.add_argument("--vlm-model", help="model name sent to the VLM endpoint")
    p.add_argument("--vlm-api", choices=["chat", "responses"], help="Chat Completions or Responses (config default: chat)")
    p.add_argument("--batch-size", type=int, help="cases per VLM call (1: no batching)")
    p.add_argument("--continuations", type=int, metavar="K",
                   help="continue every arm K times from the snapshot at q (config default: 1; needs fork at q)")


def _add_protocol_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--episode-protocol", choices=["rescue", "openpi", "lerobot"],
                   help="how an episode starts (default: openpi for a policy server, rescue for the embedded policies)")


def _add_study_commands(sub) -> None:
    """A study's life: demo, run, eval, resume, drain, status, export, report, verify, preflight."""
    p = sub.add_parser("demo", help="evaluate the embedded policy, collect failures, run a rescue study")
    p.add_argument("--root", default="studies", help="folder the demo's studies go under")
    p.add_argument("--tasks", default="0,1,2,3", help="libero_object task ids of the baseline")
    p.add_argument("--episodes", type=int, default=3, help="official initial states per task")
    p.add_argument("--max-cases", type=int, default=6, help="failures taken into the rescue study")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("run", help="run a rescue study over a failure manifest")
    p.add_argument("target", help="MANIFEST, or with --continue-from the NEW study folder")
    p.add_argument("--study", help="study folder (default: a new folder under studies/)")
    p.add_argument("--continue-from", metavar="STUDY", help="run the never-claimed complement of STUDY")
    p.add_argument("--pilot-run", action="store_true", help="the manifest's cases may all be pilot (a pilot run alone)")
    _add_run_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("eval", help="baseline evaluation of a policy over official initial states")
    p.add_argument("--suite", default="libero_object", help="LIBERO suite")
    p.add_argument("--tasks", default="0,1,2,3,4,5,6,7,8,9", help="task ids, comma-separated")
    p.add_argument("--episodes", type=int, default=50, help="official initial states per task")
    p.add_argument("--first-init", type=int, default=0, help="index of the first initial state")
    p.add_argument("--horizon", type=int, help="step limit (default: the suite's official one)")
    p.add_argument("--study", help="study folder (default: a new folder under studies/)")
    _add_policy_options(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("resume", help="record interrupted cases as unknown and run the never-started ones")
    p.add_argument("study", help="study folder")
    p.add_argument("--lab-budget", type=float, metavar="CAP", help="a new cap for the lab budget the study declared "
                   "([vlm] lab_budget), for this run")
    _add_backend_options(p)
    p.set_defaults(func=cmd_resume)

    for name, func, help_ in [
        ("drain", cmd_drain, "stop claiming new cases; arms in flight finish"),
        ("verify", cmd_verify, "re-derive every classification, hash and figure; non-zero on disagreement"),
    ]:
        p = sub.add_parser(name, help=help_)
        p.add_argument("study", help="study folder")
        p.set_defaults(func=func)

    p = sub.add_parser("status", help="counts by state and label, and VLM usage")
    p.add_argument("study", help="study folder")
    p.add_argument("--json", action="store_true", help="one JSON document per look, for scripts")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="look again every SECONDS until interrupted")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("usage", help="VLM calls, tokens, declared cost and latency of every study under the folders, "
                       "per model, endpoint, study and day")
    p.add_argument("folders", nargs="*", metavar="DIR", help=f"folders searched for studies (default: {layout.STUDIES}/)")
    p.add_argument("--queue", default="queue", help="the service's queue folder, searched too when it exists ('' for none)")
    p.add_argument("--json", action="store_true", help="one JSON document (schema rescue-usage/1), for scripts")
    p.set_defaults(func=cmd_usage)

    p = sub.add_parser("export", help="per-case JSON (versioned schema) and CSV")
    p.add_argument("study", help="study folder")
    p.add_argument("--out", help=f"JSON path; the CSV goes beside it (default: STUDY/{layout.EXPORT_JSON})")
    p.add_argument("--partial", action="store_true", help="write the export of an unfinished study (its coverage says so)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("preflight", help="check determinism across clients and keepalive over an idle hold")
    p.add_argument("manifest")
    p.add_argument("--cases", type=int, default=2, help="run the control arms of the first K cases (0: idle hold only)")
    p.add_argument("--clients", type=int, default=3, help="concurrent clients per case, each its own connection and simulator")
    p.add_argument("--idle-s", type=float, default=30.0, help="hold a connection idle this long (the longest VLM wait)")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--policy-url", help="ws:// URL of a policy server (default: serve the embedded policy)")
    p.add_argument("--policy-factory", help="module:function of an in-process policy to serve")
    p.add_argument("--policy-processes", type=int, metavar="N",
                   help="processes of their own serving the in-process policy (0: the command process; "
                        "default: one per 8 simulators from 4 simulators on)")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("report", help="an HTML page: figures, and per case the arms, the subgoal, the verdict; "
                       "or several studies of one manifest side by side")
    p.add_argument("studies", nargs="+", metavar="STUDY", help="one study folder, or several of the same manifest")
    p.add_argument("--out", help=f"default: STUDY/{layout.REPORT} (several studies: comparison.html)")
    p.add_argument("--video", action="store_true", help="an mp4 per arm from the stored frames (needs imageio and imageio-ffmpeg)")
    p.set_defaults(func=cmd_report)


def _add_manifest_commands(sub) -> None:
    """`rescue catalog`, `rescue manifest check | from-eval | from-lerobot | from-openpi`."""
    p = sub.add_parser("catalog", help="the suites a manifest may name, and what each LIBERO-PRO suite changes in its "
                       "base (initial states, model, wording), measured from the installed benchmark")
    p.add_argument("suite", nargs="?", help="one suite (or SUITE@base-inits): how it pairs with its base, task by task")
    p.set_defaults(func=cmd_catalog)
    p = sub.add_parser("manifest", help="check or produce failure manifests")
    msub = p.add_subparsers(dest="manifest_command", required=True)
    m = msub.add_parser("check", help="validate a manifest; every error names its line and field")
    m.add_argument("file")
    m.add_argument("--no-env", action="store_true", help="skip checking suites, tasks, initial states, instructions and horizons against the LIBERO catalog")
    m.add_argument("--pilot-run", action="store_true", help="the cases may all be pilot (a pilot run alone)")
    m.add_argument("--eval", help="the evaluation study the cases name: refuse rows whose outcome contradicts it (default: studies/<its id>)")
    m.set_defaults(func=cmd_manifest_check)
    m = msub.add_parser("from-eval", help="write the failure manifest of an evaluation study")
    m.add_argument("study")
    m.add_argument("--out", required=True)
    m.add_argument("--pilot-tasks", type=int, default=0, help="declare the first failure of each of the first K tasks pilot")
    m.add_argument("--inits", help="only failures of these official initial states, e.g. 30-39 (a held-out split)")
    m.add_argument("--limit", type=int, help="at most this many failures (after --inits), in manifest order")
    m.add_argument("--successes", help="add historical successes (after --inits): 'all', or a seeded sample of N stratified by task")
    m.add_argument("--seed", type=int, default=0, help="the seed of the successes' sample (default 0)")
    m.set_defaults(func=cmd_manifest_from_eval)
    for kind, what, default_seed in (("lerobot", "LeRobot's eval_info.json (lerobot-eval)", 1000),
                                     ("openpi", "openpi-style results: JSON lines of suite, task_id, episode, success", 7)):
        m = msub.add_parser(f"from-{kind}", help=f"write the failure manifest of {what}, under the {kind} protocol")
        m.add_argument("results")
        m.add_argument("--out", required=True)
        m.add_argument("--seed", type=int, help=f"the evaluation's seed (default {default_seed})")
        m.set_defaults(func=cmd_manifest_from_results, kind=kind)


def _add_analysis_commands(sub) -> None:
    """Studies of the policy's behaviour: ablate, diagnose, compare."""
    p = sub.add_parser("ablate", help="one study per rule switch (each off alone, all off, all on), paired against all on")
    p.add_argument("manifest", help="the instances (JSON lines), run with control arms only")
    p.add_argument("--rules", required=True, help="comma-separated rules, e.g. stage_rollback,gripper_recovery,chunk_compression")
    p.add_argument("--study", help="folder of the ablation's studies (default: a new folder under studies/)")
    _add_run_options(p)
    p.set_defaults(func=cmd_ablate)

    p = sub.add_parser("diagnose", help="how arms behaved: stages entered, rule firings, chunks rewritten, path length")
    p.add_argument("studies", nargs="+", metavar="STUDY", help="study folders whose arms are compared")
    p.add_argument("--arm", action="append", help="only these arms (repeatable; default: every arm)")
    p.add_argument("--out", default="diagnostics", help="folder for instances.csv, transitions.json, timeline.png")
    p.add_argument("--timeline", action="append", metavar="CASE", help="plot the stage timeline of this case (repeatable)")
    p.add_argument("--stage-source", choices=["auto", "policy", "wrapper"], default="auto",
                   help="the stage the policy reported, or the one the rule wrapper voted")
    p.set_defaults(func=cmd_diagnose)

    p = sub.add_parser("compare", help="two policies (or wrapper settings) on identical episodes, paired")
    p.add_argument("a", nargs="?", help="TOML configuration of side A")
    p.add_argument("b", nargs="?", help="TOML configuration of side B")
    p.add_argument("--policy-a", help="side A's policy: module:function to serve, or a ws:// URL")
    p.add_argument("--policy-b", help="side B's policy: module:function to serve, or a ws:// URL")
    p.add_argument("--resume", metavar="STUDY", help="resume a comparison: interrupted episodes become unknown")
    p.add_argument("--suite", default="libero_object")
    p.add_argument("--tasks", default="0,1,2,3,4,5,6,7,8,9")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--first-init", type=int, default=0)
    p.add_argument("--horizon", type=int)
    p.add_argument("--seed", type=int, default=0, help="seed of the task-block bootstrap (recorded)")
    p.add_argument("--reps", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--study", help="comparison folder (default: a new folder under studies/)")
    _add_protocol_option(p)
    p.add_argument("--simulators", type=int, help="simulator processes")
    p.add_argument("--cases-in-flight", type=int)
    p.set_defaults(func=cmd_compare)


def _add_service_commands(sub) -> None:
    """The shared service and the bundled servers: submit, queue, cancel, serve, serve-vlm, serve-policy."""
    p = sub.add_parser("submit", help="validate a manifest and its configuration and queue a study for `rescue serve`")
    p.add_argument("manifest")
    p.add_argument("--name", help="a name shown in the queue (default: the manifest's file name)")
    p.add_argument("--queue", default="queue", help="the queue folder (jobs go under QUEUE/jobs/)")
    p.add_argument("--config", help="TOML of the job's settings (only those a job may set: docs/service.md)")
    p.add_argument("--vlm-endpoint", metavar="NAME", help="one of the service's named VLM endpoints")
    p.add_argument("--policy", metavar="NAME", help="one of the service's named policies")
    p.add_argument("--simulators", type=int, help="simulator processes")
    p.add_argument("--cases-in-flight", type=int, help="cases run at once")
    p.add_argument("--vlm-model", help="a model the named endpoint allows")
    p.add_argument("--vlm-api", choices=["chat", "responses"], help="Chat Completions or Responses")
    p.add_argument("--batch-size", type=int, help="cases per VLM call (1: no batching)")
    p.add_argument("--service-config", metavar="TOML",
                   help="check against this service configuration (default: $RESCUE_SERVICE_CONFIG, else the embedded defaults)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("queue", help="the queued, running, finished and stopped jobs")
    p.add_argument("--queue", default="queue", help="the queue folder")
    p.add_argument("--json", action="store_true", help="one JSON list, for scripts")
    p.set_defaults(func=cmd_queue)

    p = sub.add_parser("cancel", help="remove a queued job, or drain a running one")
    p.add_argument("job", help="job id (see `rescue queue`)")
    p.add_argument("--queue", default="queue", help="the queue folder")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("serve", help="the worker: run queued studies one at a time, with an HTTP status API")
    p.add_argument("--queue", default="queue", help="the queue folder")
    p.add_argument("--host", default="127.0.0.1", help="bind address; beyond loopback an API key is required")
    p.add_argument("--port", type=int, default=8765, help="HTTP port")
    p.add_argument("--api-key-env", help="environment variable holding the API key")
    p.add_argument("--config", metavar="TOML", help="the service's configuration: the VLM endpoints and policies "
                   "jobs may name (default: $RESCUE_SERVICE_CONFIG, else only the embedded ones)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("serve-vlm", help="the local OpenAI-compatible endpoint", add_help=False)
    p.set_defaults(func=None, forward="rescue.embedded.endpoint:serve_main")
    p = sub.add_parser("serve-policy", help="serve an in-process policy over the openpi websocket protocol", add_help=False)
    p.set_defaults(func=None, forward="rescue.policy.server:serve_main")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="rescue", description="VLM-assisted failure rescue for robot-policy evaluation")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every event on the terminal")
    parser.add_argument("--version", action="version", version=f"rescue {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Every option's help shows its default.
    _add = sub.add_parser

    def add_parser(name: str, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        return _add(name, **kwargs)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    for add in (_add_study_commands, _add_manifest_commands, _add_analysis_commands, _add_service_commands):
        add(sub)
    return parser


# Exit codes (docs/reference.md lists them): 0 done; 1 verify found problems, or an internal error;
# 2 bad input (manifest, config, a folder that is not a study, a changed policy server);
# 3 a run stopped with cases never run (or a peer did not answer before the first claim);
# 4 every case unknown; 5 export of an unfinished study.
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_PEER = 3  # a peer the study needs does not answer before the first claim: nothing ran


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rescue` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("serve-vlm", "serve-policy"):
        from rescue.core.names import resolve

        serve: Callable[[list[str]], int] = resolve(build_parser().parse_known_args(argv[:1])[0].forward)
        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    import sqlite3

    from rescue.core.config_files import ConfigError
    from rescue.core.failfast import PeerUnreachable
    from rescue.core.identity import IdentityError
    from rescue.core.inputs import InputFileError
    from rescue.core.manifest import ManifestError
    from rescue.env.backend import BackendError
    from rescue.study import logs
    from rescue.study.folder import StudyError
    from rescue.study.journal import JournalError
    from rescue.study.layout import LayoutError

    logs.configure(None, args.verbose)
    try:
        return args.func(args)
    except ManifestError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_BAD_INPUT
    except (StudyError, IdentityError, ConfigError, InputFileError, JournalError, LayoutError, BackendError) as exc:
        print(f"rescue: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PeerUnreachable as exc:
        print(f"rescue: {exc}", file=sys.stderr)
        return EXIT_PEER
    except sqlite3.Error as exc:
        print(f"rescue: the study's journal cannot be used: {exc}", file=sys.stderr)
        return EXIT_INTERNAL
    except OSError as exc:
        # A full disk mid-run lands here: the case in flight stays claimed, and `rescue resume`
        # records it unknown (interrupted) once there is space again.
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"rescue: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_INTERNAL
    except KeyboardInterrupt:
        print("rescue: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # never a traceback for a user; -v shows it
        if args.verbose:
            raise
        print(f"rescue: internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
              "(run with -v for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
