"""A study's life: demo, run, eval, resume, ablate."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rescue.cli.common import (
    add_backend_options,
    add_policy_options,
    add_run_options,
    backend,
    config,
    ids,
    outcome,
    print_eval_summary,
    print_pairings,
    print_rescue_summary,
    suite_tasks,
    summary_for,
)
from rescue.cli.console import ENDED, EXIT_OK, EXIT_PROBLEMS, console
from rescue.run.progress import LiveProgress


def cmd_demo(args: argparse.Namespace) -> int:
    from rescue.read.verify import verify_study
    from rescue.run import commands

    tasks = tuple(ids(args.tasks, "--tasks"))
    with LiveProgress("episodes, then cases", console) as live:
        paths = commands.demo(Path(args.root), tasks, args.episodes, args.max_cases, live, args.verbose)
    console.print(f"baseline evaluation: {paths['baseline']}")
    print_eval_summary(paths["baseline"])
    if "rescue" not in paths:
        console.print("the policy did not fail on these episodes; nothing to rescue")
        return 0
    console.print(f"failure manifest: {paths['manifest']}\nrescue study: {paths['rescue']}")
    print_rescue_summary(paths["rescue"])
    from rescue.read.html.report import write_report

    console.print(f"report: {write_report(paths['rescue'])}")
    report = verify_study(paths["rescue"])
    console.print("verify: " + ("[green]ok[/green]" if report.ok else f"[red]{len(report.problems)} problem(s)[/red]"))
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def hours(value: float) -> float:
    """--max-hours: a finite positive number of hours, or bad input in one line."""
    import math

    from rescue.core.configuration.config_files import ConfigError

    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--max-hours {value:g}: a finite positive number of hours")
    return value


def print_estimate(manifest: Path, settings) -> None:
    """What the study will cost on this machine, in a line, before it runs (a manifest that does not load is the
    run's to refuse, with its lines)."""
    from rescue.core.configuration.work_limit import work_estimate
    from rescue.core.manifest import ManifestError, load_manifest

    try:
        cases = load_manifest(manifest, catalog=None).cases
    except ManifestError:
        return
    console.print(f"estimate: {work_estimate(settings, [c.horizon for c in cases]).text()}")


def cmd_run(args: argparse.Namespace) -> int:
    from rescue.run import commands

    with LiveProgress("cases", console) as live:
        if args.continue_from:
            study = commands.continue_from(Path(args.continue_from), Path(args.target), live, args.verbose, backend(args))
        else:
            settings = config(args)
            if args.no_stop:
                settings = settings.model_copy(update={"stopping": None})
            limits = {} if args.max_hours is None else {"max_hours": hours(args.max_hours)}
            print_estimate(Path(args.target), settings)
            study = commands.run_manifest(Path(args.target), args.study and Path(args.study), settings, live,
                                         args.verbose, backend(args), pilot_run=args.pilot_run, **limits)
    console.print(f"study: {study}")
    if args.continue_from:
        console.print(f"[bold]prior part[/bold] ({args.continue_from}):")
        summary_for(Path(args.continue_from))
        console.print("[bold]continuation[/bold]:")
    summary_for(study)
    return outcome(study)


def cmd_resume(args: argparse.Namespace) -> int:
    from rescue.run import commands

    with LiveProgress("cases", console) as live:
        interrupted = commands.resume(Path(args.study), live, args.verbose, backend(args), args.lab_budget)
    if interrupted:
        console.print(f"{len(interrupted)} started-unfinished case(s) recorded as unknown (interrupted): {', '.join(interrupted)}")
    summary_for(Path(args.study))
    return outcome(Path(args.study))


def cmd_eval(args: argparse.Namespace) -> int:
    from rescue.run import commands

    tasks = suite_tasks(args.suite, args.tasks)
    with LiveProgress("episodes", console) as live:
        study = commands.evaluate(args.suite, tasks, args.episodes, args.horizon, args.study and Path(args.study),
                                 config(args), live, args.verbose, args.first_init, backend(args))
    console.print(f"study: {study}")
    print_eval_summary(study)
    print_pairings([args.suite])
    return outcome(study)


def cmd_ablate(args: argparse.Namespace) -> int:
    from rich.table import Table

    from rescue.run import commands

    with LiveProgress("episodes, setting by setting", console) as live:
        root, rows = commands.ablate(Path(args.manifest), args.rules.split(","), args.study and Path(args.study),
                                    config(args), live, args.verbose)
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
        ended = study_outcome(r.study)
        if ended.ended != "finished":
            print(f"rescue: setting {r.setting}: {ended.message}", file=sys.stderr)
            return ENDED[ended.ended]
    return 0


def add_commands(sub) -> None:
    """demo, run, eval, resume, ablate."""
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
    p.add_argument("--max-hours", type=float, default=None, metavar="H", help="the longest a study may be estimated "
                   "to take on its simulators before it is refused (default 168: a week; the refusal gives the estimate)")
    p.add_argument("--no-stop", action="store_true", help="run every case even though the configuration declares a "
                   "[stopping] rule (the study is created without it)")
    add_run_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("eval", help="baseline evaluation of a policy over official initial states")
    p.add_argument("--suite", default="libero_object", help="LIBERO suite")
    p.add_argument("--tasks", default="0,1,2,3,4,5,6,7,8,9", help="task ids, comma-separated")
    p.add_argument("--episodes", type=int, default=50, help="official initial states per task")
    p.add_argument("--first-init", type=int, default=0, help="index of the first initial state")
    p.add_argument("--horizon", type=int, help="step limit (default: the suite's official one)")
    p.add_argument("--study", help="study folder (default: a new folder under studies/)")
    add_policy_options(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("resume", help="record interrupted cases as unknown and run the never-started ones")
    p.add_argument("study", help="study folder")
    p.add_argument("--lab-budget", type=float, metavar="CAP", help="a new cap for the lab budget the study declared "
                   "([vlm] lab_budget), for this run")
    add_backend_options(p)
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("ablate", help="one study per rule switch (each off alone, all off, all on), paired against all on")
    p.add_argument("manifest", help="the instances (JSON lines), run with control arms only")
    p.add_argument("--rules", required=True, help="comma-separated rules, e.g. stage_rollback,gripper_recovery,chunk_compression")
    p.add_argument("--study", help="folder of the ablation's studies (default: a new folder under studies/)")
    add_run_options(p)
    p.set_defaults(func=cmd_ablate)
