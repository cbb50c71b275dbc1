"""What several command groups share: flags that override the configuration, the backend, summaries."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rescue.cli.console import ENDED, console

# Flags that override a configuration key, by argparse dest: each command group registers its own beside its
# add_argument (`override`), so a new flag is one line in one file.
OVERRIDES: dict[str, str] = {}


def override(p: argparse.ArgumentParser | argparse._ArgumentGroup, *flags: str, key: str, **kwargs: Any) -> None:
    """Add a flag whose value, when given, overrides the configuration's dotted `key`."""
    action = p.add_argument(*flags, **kwargs)
    OVERRIDES[action.dest] = key


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration keys the command line sets (None where a flag was not given: skipped when applied)."""
    return {key: getattr(args, dest, None) for dest, key in OVERRIDES.items()}


def ids(text: str, flag: str) -> list[int]:
    """--tasks or --inits as ids; a bad one is bad input (exit 2), named."""
    from rescue.core.catalog import parse_ids
    from rescue.core.configuration.config_files import ConfigError

    try:
        return parse_ids(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r}: {exc}") from None


def suite_tasks(suite: str, text: str) -> list[int]:
    """--suite and --tasks checked against the catalog as a manifest's are: a typo (with what it may mean) or a
    task the suite lacks is bad input (exit 2), named in one line."""
    from rescue.core.catalog import format_ids, libero_catalog
    from rescue.core.configuration.config_files import ConfigError

    catalog = libero_catalog()
    known = catalog.suite(suite)
    if known is None:
        raise ConfigError(f"--suite {suite!r}: {catalog.refusal(suite) or f'unknown suite; {catalog.hint(suite)}'}")
    tasks = ids(text, "--tasks")
    beyond = [t for t in tasks if t >= len(known.tasks)]
    if beyond:
        raise ConfigError(f"--tasks {text!r}: {suite} has tasks 0-{len(known.tasks) - 1}, not {format_ids(beyond)}")
    return tasks


def config(args: argparse.Namespace):
    from rescue.core.configuration.config_files import load_config

    return load_config(getattr(args, "config", None), overrides(args))


def print_rescue_summary(study: Path) -> None:
    from rescue.read.export import export_study
    from rescue.read.terminal import render_summary

    console.print(render_summary(export_study(study)))


def print_eval_summary(study: Path) -> None:
    from rescue.read.terminal import render_eval
    from rescue.run.commands import eval_summary

    console.print(render_eval(eval_summary(study)))


def summary_for(study: Path) -> None:
    from rescue.study.folder import load_study_config

    (print_eval_summary if load_study_config(study).is_evaluation else print_rescue_summary)(study)


def outcome(study: Path) -> int:
    """Print why a run ended as it did; its exit code (docs/reference.md: exit codes)."""
    from rescue.study.folder import study_outcome

    outcome = study_outcome(study)
    if outcome.ended == "decided":
        print(f"rescue: {outcome.message}")
    elif outcome.ended != "finished":
        print(f"rescue: {outcome.message}", file=sys.stderr)
    return ENDED[outcome.ended]


def print_pairings(suites) -> None:
    """For each LIBERO-PRO suite named: whether its episodes pair with its base suite's by identical episode."""
    from rescue.core.catalog import libero_catalog

    for suite in suites:
        line = libero_catalog().pairing(suite)
        if line:
            console.print(line, soft_wrap=True)


def add_backend_options(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--warm-simulators", metavar="DIR",
                   help="local: lease free simulators from the warm pool `rescue serve-simulators DIR` keeps, before "
                        "starting any (default: $RESCUE_WARM_SIMULATORS; 'off' for none)")


def backend(args: argparse.Namespace):
    from rescue.core.configuration.config_files import ConfigError
    from rescue.env.backend import Backend

    if args.backend == "local":
        if args.address:
            raise ConfigError("--address needs --backend ray")
        from rescue.env.warm import warm_folder

        return Backend(warm=warm_folder(args.warm_simulators))
    if args.warm_simulators not in (None, "off"):
        raise ConfigError("--warm-simulators needs --backend local")
    return Backend("ray", args.address, args.ray_actor_cpus, args.ray_actor_gpus, args.ray_resource or None,
                   args.ray_placement_timeout)


def add_policy_options(p: argparse.ArgumentParser) -> None:
    """What an evaluation needs: where the policy is, how often it is asked, the simulators."""
    add_backend_options(p)
    p.add_argument("--config", help="TOML configuration file (flags override it)")
    override(p, "--simulators", key="env.simulators", type=int, help="simulator processes (config default: 2)")
    override(p, "--cases-in-flight", key="cases_in_flight", type=int, help="cases run at once (config default: 4)")
    override(p, "--policy-url", key="policy.url", help="ws:// URL of a policy server (vla-eval+ws:// for a vla-eval model server; default: serve the embedded policy)")
    override(p, "--policy-factory", key="policy.factory", help="module:function of an in-process policy to serve")
    override(p, "--policy-processes", key="policy.processes", type=int, metavar="N",
                   help="processes of their own serving the in-process policy (0: the command process; "
                        "default: one per 8 simulators from 4 simulators on)")
    override(p, "--replan-interval", key="policy.replan_interval", type=int, metavar="C",
                   help="env steps between policy queries (default: the server's announced action_horizon)")
    add_protocol_option(p)


def add_run_options(p: argparse.ArgumentParser) -> None:
    """A rescue study's: the policy's, then the VLM's and the continuations."""
    add_policy_options(p)
    override(p, "--vlm-url", key="vlm.base_url", help="OpenAI-compatible base URL (default: the local endpoint)")
    override(p, "--vlm-model", key="vlm.model", help="model name sent to the VLM endpoint")
    override(p, "--vlm-api", key="vlm.api", choices=["chat", "responses"], help="Chat Completions or Responses (config default: chat)")
    override(p, "--batch-size", key="vlm.batch_size", type=int, help="cases per VLM call (1: no batching)")
    override(p, "--continuations", key="continuations", type=int, metavar="K",
                   help="continue every arm K times from the snapshot at q (config default: 1; needs fork at q)")


def add_protocol_option(p: argparse.ArgumentParser) -> None:
    override(p, "--episode-protocol", key="env.episode_protocol", choices=["rescue", "openpi", "lerobot", "vla-eval"],
                   help="how an episode starts (default: openpi for a policy server, rescue for the embedded policies)")
