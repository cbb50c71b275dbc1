"""The shared service: submit, queue, cancel, serve, drain."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rescue.cli.console import EXIT_BAD_INPUT, console


def cmd_submit(args: argparse.Namespace) -> int:
    from rescue.core.configuration.config_files import config_data
    from rescue.service.queue import submit_file
    from rescue.service.settings import load_service_config
    from rescue.service.job_request import job_request

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

    keep = args.keep_simulators
    if args.warm_simulators_count is not None:
        print("rescue serve: --warm-simulators N is now --keep-simulators N", file=sys.stderr)
        keep = args.warm_simulators_count
    try:
        return serve(Path(args.queue), args.host, args.port, args.api_key_env, args.verbose, args.config, keep)
    except ServeError as exc:
        print(f"rescue: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def cmd_drain(args: argparse.Namespace) -> int:
    from rescue.study.folder import open_journal

    with open_journal(Path(args.study), readonly=False) as journal:
        journal.request_drain()
    console.print(f"{args.study}: no new case will be claimed; arms in flight finish")
    return 0


def add_commands(sub) -> None:
    """submit, queue, cancel, serve, drain."""
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
    p.add_argument("--keep-simulators", type=int, default=0, metavar="N",
                   help="simulators the worker keeps between its jobs, with the envs they built (default: 0, each "
                        "job starts its own)")
    # The count's old spelling (a run's --warm-simulators names a folder): still taken, with a notice.
    p.add_argument("--warm-simulators", type=int, dest="warm_simulators_count", metavar="N", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("drain", help="stop claiming new cases; arms in flight finish")
    p.add_argument("study", help="study folder")
    p.set_defaults(func=cmd_drain)
