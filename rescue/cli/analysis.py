"""Reading and comparing studies: status, export, report, usage, verify, diagnose, compare, preflight."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rescue.cli.common import add_protocol_option, config, suite_tasks
from rescue.cli.console import EXIT_BAD_INPUT, EXIT_OK, EXIT_PROBLEMS, EXIT_UNFINISHED, console
from rescue.run.progress import LiveProgress
from rescue.study import layout


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
    from rescue.read.html.report import write_report
    from rescue.read.html.side_by_side import write_comparison_report

    if len(args.studies) == 1:
        console.print(f"wrote {write_report(Path(args.studies[0]), args.out, video=args.video)}")
        return 0
    if args.video:
        from rescue.core.configuration.config_files import ConfigError

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
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_diagnose(args: argparse.Namespace) -> int:
    from rescue.run.diagnose import (
        diagnose,
        plot_timelines,
        study_arms,
        summary_table,
        write_csv,
        write_transitions,
    )

    arms = study_arms([Path(study) for study in args.studies], args.arm)
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
        tasks = suite_tasks(args.suite, args.tasks)
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


def cmd_preflight(args: argparse.Namespace) -> int:
    from rescue.run.preflight import preflight

    report = preflight(Path(args.manifest), config(args), args.cases, args.clients, args.idle_s)
    print(report.render())
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def add_commands(sub) -> None:
    """status, export, report, usage, verify, diagnose, compare, preflight."""
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

    p = sub.add_parser("verify", help="re-derive every classification, hash and figure; non-zero on disagreement")
    p.add_argument("study", help="study folder")
    p.set_defaults(func=cmd_verify)

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
    add_protocol_option(p)
    p.add_argument("--simulators", type=int, help="simulator processes")
    p.add_argument("--cases-in-flight", type=int)
    p.set_defaults(func=cmd_compare)
