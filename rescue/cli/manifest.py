"""`rescue catalog`, `rescue manifest check | from-eval | from-lerobot | from-openpi | from-vla-eval`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rescue.cli.common import ids, print_pairings
from rescue.cli.console import EXIT_BAD_INPUT, console


def cmd_catalog(args: argparse.Namespace) -> int:
    from rescue.core.catalog import libero_catalog
    from rescue.core.configuration.config_files import ConfigError
    from rescue.read.terminal import render_catalog

    catalog = libero_catalog()
    if args.suite is not None and catalog.suite(args.suite) is None:
        raise ConfigError(catalog.refusal(args.suite) or f"unknown suite {args.suite!r}; {catalog.hint(args.suite)}")
    console.print(render_catalog(catalog, args.suite))
    return 0


def cmd_manifest_check(args: argparse.Namespace) -> int:
    from rescue.core.manifest import load_manifest

    # Checked against the shipped benchmark catalog: no simulator starts.
    manifest = load_manifest(args.file, catalog=None if args.no_env else "libero")
    if not args.pilot_run:
        manifest.require_main_cohort()
    from rescue.core.manifest import read_manifest_bytes
    from rescue.run.commands import check_outcomes

    unchecked = check_outcomes(manifest, read_manifest_bytes(args.file), Path(args.eval) if args.eval else None)
    console.print(f"{args.file}: {len(manifest.cases)} cases ({len(manifest.pilot_cases)} pilot), sha256 {manifest.sha256}")
    for study in unchecked:
        console.print(f"notice: evaluation {study} is not found here (--eval names its folder): the rows' outcomes "
                      "are not checked against it")
    if not args.no_env:
        print_pairings(dict.fromkeys(case.suite for case in manifest.cases))
    return 0


def _count(value: str, flag: str) -> int:
    """A count given on the command line: ASCII digits only (`str.isdigit` takes superscripts)."""
    from rescue.core.configuration.config_files import ConfigError

    if not (value.isascii() and value.isdigit()):
        raise ConfigError(f"{flag} {value!r}: 'all', or how many to sample (0 or more)")
    return int(value)


def cmd_manifest_from_eval(args: argparse.Namespace) -> int:
    from rescue.run.commands import manifest_from_eval

    inits = None if args.inits is None else ids(args.inits, "--inits")
    successes = args.successes
    if successes not in (None, "all"):
        successes = _count(successes, "--successes")
    seed = 0 if args.seed is None else args.seed
    cases = manifest_from_eval(Path(args.study), Path(args.out), args.pilot_tasks, args.limit, inits, successes, seed,
                               failures=args.failures)
    pilot = [c.case_id for c in cases if c.pilot]
    won = sum(c.outcome == "success" for c in cases)
    lost = sum(c.outcome != "success" and not c.pilot for c in cases)
    console.print(f"wrote {len(cases) - won} failure case(s)" + (f" and {won} success case(s)" if successes is not None else "")
                  + f" to {args.out}" + (f"; pilot: {', '.join(pilot)}" if pilot else ""))
    # What was asked for and could not be, said in a line each (the manifest is written as it can be).
    if isinstance(successes, int) and successes > won:
        console.print(f"notice: --successes {successes}: the evaluation has {won} successes; all are taken")
    if args.failures is not None and args.failures > lost:
        console.print(f"notice: --failures {args.failures}: the evaluation has {lost} failures outside the pilot; "
                      "all are taken")
    if args.seed is not None and successes in (None, "all") and args.failures is None:
        console.print(f"notice: --seed {args.seed} draws nothing: it seeds --successes N or --failures N")
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


def cmd_manifest_from_vla_eval(args: argparse.Namespace) -> int:
    from rescue.core.results import ResultsError
    from rescue.run.vla_eval_import import manifest_from_vla_eval

    successes = args.successes
    if successes not in (None, "all"):
        successes = _count(successes, "--successes")
    try:
        cases, run = manifest_from_vla_eval(Path(args.recording), Path(args.out), successes, args.seed)
    except ResultsError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_BAD_INPUT
    won = sum(c.outcome == "success" for c in cases)
    console.print(f"wrote {len(cases) - won} failure case(s)" + (f" and {won} success case(s)" if args.successes is not None else "")
                  + f" to {args.out} (vla-eval episode protocol: each case's env seed, horizon and reset ordinal are its run's)")
    if run.errors:
        reasons = ", ".join(f"{reason} x{n}" for reason, n in sorted(run.error_reasons.items()))
        console.print(f"{len(run.errors)} errored episode(s) left out of every denominator ({reasons})")
    return 0


def add_commands(sub) -> None:
    """catalog, manifest check | from-eval | from-lerobot | from-openpi | from-vla-eval."""
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
    m.add_argument("--limit", type=int, help="the first N failures (after --inits), in manifest order: a quick try, not a "
                   "sample (no net change is extrapolated from it)")
    m.add_argument("--failures", type=int, help="a seeded sample of N failures (after --inits and the pilot), every "
                   "failure equally likely, stratified by task")
    m.add_argument("--successes", help="add historical successes (after --inits): 'all', or a seeded sample of N, every "
                   "success equally likely, stratified by task")
    m.add_argument("--seed", type=int, help="the seed of the samples (default 0)")
    m.set_defaults(func=cmd_manifest_from_eval)
    for kind, what, default_seed in (("lerobot", "LeRobot's eval_info.json (lerobot-eval)", 1000),
                                     ("openpi", "openpi-style results: JSON lines of suite, task_id, episode, success", 7)):
        m = msub.add_parser(f"from-{kind}", help=f"write the failure manifest of {what}, under the {kind} protocol")
        m.add_argument("results")
        m.add_argument("--out", required=True)
        m.add_argument("--seed", type=int, help=f"the evaluation's seed (default {default_seed})")
        m.set_defaults(func=cmd_manifest_from_results, kind=kind)
    m = msub.add_parser("from-vla-eval", help="write the manifest of a vla-eval run (recording-<eval_id>.sqlite, or an "
                        "unsharded run's *_aggregate.json), under the vla-eval protocol; errored episodes counted apart")
    m.add_argument("recording", help="the run's recording-<eval_id>.sqlite (or its *_aggregate.json)")
    m.add_argument("--out", required=True)
    m.add_argument("--successes", help="add historical successes: 'all', or a seeded sample of N stratified by task")
    m.add_argument("--seed", type=int, default=0, help="the seed of the successes' sample (default 0)")
    m.set_defaults(func=cmd_manifest_from_vla_eval)
