"""The `rescue` command: each subcommand parses, calls one library function, prints."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from rescue import layout
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=False)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "env.simulators": getattr(args, "simulators", None),
        "cases_in_flight": getattr(args, "cases_in_flight", None),
        "policy.url": getattr(args, "policy_url", None),
        "policy.factory": getattr(args, "policy_factory", None),
        "vlm.base_url": getattr(args, "vlm_url", None),
        "vlm.model": getattr(args, "vlm_model", None),
        "vlm.api": getattr(args, "vlm_api", None),
        "vlm.batch_size": getattr(args, "batch_size", None),
    }


def _config(args: argparse.Namespace):
    from rescue.config import load_config

    return load_config(getattr(args, "config", None), _overrides(args))


class _Live:
    """A progress bar over cases, with the running label counts."""

    def __init__(self, title: str):
        self.counts: Counter[str] = Counter()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[labels]}"), console=console, transient=False,
        )
        self.task = self.progress.add_task(title, total=None, labels="")

    def __call__(self, verdict) -> None:
        self.counts[verdict.label] += 1
        labels = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        self.progress.update(self.task, advance=1, labels=labels)

    def __enter__(self) -> "_Live":
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


def _print_rescue_summary(study: Path) -> None:
    from rescue.export import export_study
    from rescue.report import render_summary

    console.print(render_summary(export_study(study)))


def _print_eval_summary(study: Path) -> None:
    from rescue.report import render_eval
    from rescue.studies import eval_summary

    console.print(render_eval(eval_summary(study)))


def _summary_for(study: Path) -> None:
    from rescue.study import load_study_config

    (_print_eval_summary if load_study_config(study).is_evaluation else _print_rescue_summary)(study)


def cmd_run(args: argparse.Namespace) -> int:
    from rescue import studies

    with _Live("cases") as live:
        if args.continue_from:
            study = studies.continue_from(Path(args.continue_from), Path(args.target), live, args.verbose)
        else:
            study = studies.run_manifest(Path(args.target), args.study and Path(args.study), _config(args), live, args.verbose)
    console.print(f"study: {study}")
    if args.continue_from:
        console.print(f"[bold]prior part[/bold] ({args.continue_from}):")
        _summary_for(Path(args.continue_from))
        console.print("[bold]continuation[/bold]:")
    _summary_for(study)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    from rescue import studies

    with _Live("cases") as live:
        interrupted = studies.resume(Path(args.study), live, args.verbose)
    if interrupted:
        console.print(f"{len(interrupted)} started-unfinished case(s) recorded as unknown (interrupted): {', '.join(interrupted)}")
    _summary_for(Path(args.study))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from rescue import studies

    tasks = [int(t) for t in args.tasks.split(",")]
    with _Live("episodes") as live:
        study = studies.evaluate(args.suite, tasks, args.episodes, args.horizon, args.study and Path(args.study), _config(args), live, args.verbose, args.first_init)
    console.print(f"study: {study}")
    _print_eval_summary(study)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rescue import studies
    from rescue.verify import verify_study

    tasks = tuple(int(t) for t in args.tasks.split(","))
    with _Live("episodes, then cases") as live:
        paths = studies.demo(Path(args.root), tasks, args.episodes, args.max_cases, live, args.verbose)
    console.print(f"baseline evaluation: {paths['baseline']}")
    _print_eval_summary(paths["baseline"])
    if "rescue" not in paths:
        console.print("the policy did not fail on these episodes; nothing to rescue")
        return 0
    console.print(f"failure manifest: {paths['manifest']}\nrescue study: {paths['rescue']}")
    _print_rescue_summary(paths["rescue"])
    from rescue.htmlreport import write_report

    console.print(f"report: {write_report(paths['rescue'])}")
    report = verify_study(paths["rescue"])
    console.print("verify: " + ("[green]ok[/green]" if report.ok else f"[red]{len(report.problems)} problem(s)[/red]"))
    return 0 if report.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from rescue.status import render_status, study_status

    console.print(render_status(study_status(Path(args.study))))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    from rescue.journal import Journal

    with Journal.open(Path(args.study)) as journal:
        journal.request_drain()
    console.print(f"{args.study}: no new case will be claimed; arms in flight finish")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from rescue.export import export_study, write_export

    study = Path(args.study)
    from rescue.layout import StudyLayout

    out = Path(args.out) if args.out else StudyLayout.of(study).export_json
    write_export(export_study(study), out, out.with_suffix(".csv"))
    console.print(f"wrote {out} and {out.with_suffix('.csv')}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rescue.htmlreport import write_report

    console.print(f"wrote {write_report(Path(args.study), args.out, video=args.video)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from rescue.verify import verify_study

    report = verify_study(Path(args.study))
    print(report.render())
    return 0 if report.ok else 1


def cmd_preflight(args: argparse.Namespace) -> int:
    from rescue.preflight import preflight

    report = preflight(Path(args.manifest), _config(args), args.cases, args.clients, args.idle_s)
    print(report.render())
    return 0 if report.ok else 1


def cmd_manifest_check(args: argparse.Namespace) -> int:
    from rescue.manifest import load_manifest

    # Checked against the shipped benchmark catalog: no simulator starts.
    manifest = load_manifest(args.file, catalog=None if args.no_env else "libero")
    console.print(f"{args.file}: {len(manifest.cases)} cases ({len(manifest.pilot_cases)} pilot), sha256 {manifest.sha256}")
    return 0


def cmd_manifest_from_eval(args: argparse.Namespace) -> int:
    from rescue.studies import manifest_from_eval

    cases = manifest_from_eval(Path(args.study), Path(args.out), args.pilot_tasks, args.limit)
    pilot = [c.case_id for c in cases if c.pilot]
    console.print(f"wrote {len(cases)} failure case(s) to {args.out}" + (f"; pilot: {', '.join(pilot)}" if pilot else ""))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from rescue import compare
    from rescue.report import render_compare

    interrupted: dict[str, list[str]] = {}
    if args.resume:
        study = Path(args.resume)
        with _Live("episodes (A, then B)") as live:
            interrupted = compare.resume_compare(study, live, args.verbose)
        result = compare.compare_studies(study)
    else:
        if (args.a is None and args.policy_a is None) or (args.b is None and args.policy_b is None):
            raise compare.StudyError("give two config files (A B), or --policy-a and --policy-b, or --resume STUDY")
        shared = {"env.simulators": args.simulators, "cases_in_flight": args.cases_in_flight}
        config_a, name_a = compare.side_config(args.a, args.policy_a, shared)
        config_b, name_b = compare.side_config(args.b, args.policy_b, shared)
        study = Path(args.study) if args.study else compare.new_compare_dir()
        tasks = [int(t) for t in args.tasks.split(",")]
        with _Live("episodes (A, then B)") as live:
            result = compare.compare_policies(
                study, args.suite, tasks, args.episodes, args.horizon, (config_a, config_b), (name_a, name_b),
                args.first_init, args.seed, args.reps, live, args.verbose,
            )
    for side, ids in interrupted.items():
        if ids:
            console.print(f"side {side}: {len(ids)} started-unfinished episode(s) recorded as unknown (interrupted): {', '.join(ids)}")
    console.print(f"comparison: {study} (sides {study / 'a'} and {study / 'b'})")
    console.print(render_compare(result))
    return 0


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--simulators", type=int, help="simulator processes")
    p.add_argument("--cases-in-flight", type=int)
    p.add_argument("--policy-url", help="ws:// URL of a policy server (default: serve the embedded policy)")
    p.add_argument("--policy-factory", help="module:function of an in-process policy to serve")
    p.add_argument("--vlm-url", help="OpenAI-compatible base URL (default: the local endpoint)")
    p.add_argument("--vlm-model")
    p.add_argument("--vlm-api", choices=["chat", "responses"])
    p.add_argument("--batch-size", type=int, help="cases per VLM call (1: no batching)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="rescue", description="VLM-assisted failure rescue for robot-policy evaluation")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every event on the terminal")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="evaluate the embedded policy, collect failures, run a rescue study")
    p.add_argument("--root", default="queue")
    p.add_argument("--tasks", default="0,1,2,3")
    p.add_argument("--episodes", type=int, default=3)
    p.add_argument("--max-cases", type=int, default=6)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("run", help="run a rescue study over a failure manifest")
    p.add_argument("target", help="MANIFEST, or with --continue-from the NEW study folder")
    p.add_argument("--study", help="study folder (default: a new folder under queue/)")
    p.add_argument("--continue-from", metavar="STUDY", help="run the never-claimed complement of STUDY")
    _add_run_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("eval", help="baseline evaluation of a policy over official initial states")
    p.add_argument("--suite", default="libero_object")
    p.add_argument("--tasks", default="0,1,2,3,4,5,6,7,8,9")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--first-init", type=int, default=0)
    p.add_argument("--horizon", type=int)
    p.add_argument("--study")
    _add_run_options(p)
    p.set_defaults(func=cmd_eval)

    for name, func, help_ in [
        ("resume", cmd_resume, "record interrupted cases as unknown and run the never-started ones"),
        ("status", cmd_status, "counts by state and label, and VLM usage"),
        ("drain", cmd_drain, "stop claiming new cases; arms in flight finish"),
        ("verify", cmd_verify, "re-derive every classification, hash and figure; non-zero on disagreement"),
    ]:
        p = sub.add_parser(name, help=help_)
        p.add_argument("study")
        p.set_defaults(func=func)

    p = sub.add_parser("export", help="per-case JSON (versioned schema) and CSV")
    p.add_argument("study")
    p.add_argument("--out")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("preflight", help="check determinism across clients and keepalive over an idle hold")
    p.add_argument("manifest")
    p.add_argument("--cases", type=int, default=2, help="run the control arms of the first K cases (0: idle hold only)")
    p.add_argument("--clients", type=int, default=3, help="concurrent clients per case, each its own connection and simulator")
    p.add_argument("--idle-s", type=float, default=30.0, help="hold a connection idle this long (the longest VLM wait)")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--policy-url", help="ws:// URL of a policy server (default: serve the embedded policy)")
    p.add_argument("--policy-factory", help="module:function of an in-process policy to serve")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("report", help="an HTML page: figures, and per case both arms' keyframes, the subgoal, the verdict")
    p.add_argument("study")
    p.add_argument("--out", help=f"default: STUDY/{layout.REPORT}")
    p.add_argument("--video", action="store_true", help="an mp4 per arm from the stored frames (needs imageio and imageio-ffmpeg)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("manifest", help="check or produce failure manifests")
    msub = p.add_subparsers(dest="manifest_command", required=True)
    m = msub.add_parser("check", help="validate a manifest; every error names its line and field")
    m.add_argument("file")
    m.add_argument("--no-env", action="store_true", help="skip checking suites, tasks, initial states, instructions and horizons against the LIBERO catalog")
    m.set_defaults(func=cmd_manifest_check)
    m = msub.add_parser("from-eval", help="write the failure manifest of an evaluation study")
    m.add_argument("study")
    m.add_argument("--out", required=True)
    m.add_argument("--pilot-tasks", type=int, default=0, help="declare the first failure of each of the first K tasks pilot")
    m.add_argument("--limit", type=int)
    m.set_defaults(func=cmd_manifest_from_eval)

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
    p.add_argument("--study", help="comparison folder (default: a new folder under queue/)")
    p.add_argument("--simulators", type=int, help="simulator processes")
    p.add_argument("--cases-in-flight", type=int)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("serve-vlm", help="the local OpenAI-compatible endpoint", add_help=False)
    p.set_defaults(func=None, forward="rescue.vlm.endpoint:serve_main")
    p = sub.add_parser("serve-policy", help="serve an in-process policy over the openpi websocket protocol", add_help=False)
    p.set_defaults(func=None, forward="rescue.policy.ws_server:serve_main")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rescue` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("serve-vlm", "serve-policy"):
        import importlib

        module, _, name = build_parser().parse_known_args(argv[:1])[0].forward.partition(":")
        serve: Callable[[list[str]], int] = getattr(importlib.import_module(module), name)
        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    from rescue import logs
    from rescue.identity import IdentityError
    from rescue.manifest import ManifestError
    from rescue.study import StudyError

    logs.configure(None, args.verbose)
    try:
        return args.func(args)
    except ManifestError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 2
    except (StudyError, IdentityError) as exc:
        print(f"rescue: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
