"""The bundled servers: serve-vlm (the local VLM endpoint), serve-policy (an in-process policy on the openpi
wire), serve-simulators (a warm pool runs lease from)."""

from __future__ import annotations

import argparse
import os
import sys

from rescue.cli.console import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK


def cmd_serve_vlm(args: argparse.Namespace) -> int:
    import asyncio

    from pydantic import ValidationError

    from rescue.embedded.endpoint import EndpointOptions, serve_until_signalled

    expected = None
    if args.api_key_env:
        expected = os.environ.get(args.api_key_env)
        if not expected:
            args.parser.error(f"environment variable {args.api_key_env} is unset or empty")
    try:
        options = EndpointOptions(
            latency_s=args.latency, latency_jitter_s=args.latency_jitter, fault=args.fault, fault_count=args.fault_count,
            expected_api_key=expected, answer=args.answer, model=args.model,
        )
    except ValidationError as exc:
        args.parser.error(exc.errors()[0]["msg"].removeprefix("Value error, "))
    try:
        asyncio.run(serve_until_signalled(options, args.host, args.port))
    except OSError as exc:
        print(f"rescue serve-vlm: cannot listen on {args.host}:{args.port}: {exc.strerror or exc} "
              "(is another server on that port? choose one with --port)", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def cmd_serve_policy(args: argparse.Namespace) -> int:
    from rescue_serve.cli import policy_main

    from rescue.core.configuration.names import EMBEDDED_POLICY, resolve

    # `rescue-serve policy` with rescue's name resolution (old module names still load) and the embedded policy
    # as the default: its flags are the serving distribution's, so the two commands serve alike.
    return policy_main(args.argv, prog="rescue serve-policy", resolve=resolve, default_policy=EMBEDDED_POLICY)


def cmd_serve_simulators(args: argparse.Namespace) -> int:
    from rescue.env.pool import SimulatorError
    from rescue.env.warm import serve

    if args.size < 1:
        print(f"rescue: --size {args.size}: at least one simulator", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        serve(args.folder, args.size, *([args.adapter] if args.adapter else []))
    except SimulatorError as exc:
        print(f"rescue: {exc}", file=sys.stderr)
        return EXIT_INTERNAL
    return EXIT_OK


def add_commands(sub) -> None:
    """serve-vlm, serve-policy, serve-simulators."""
    from rescue.embedded.faults import FAULTS

    p = sub.add_parser("serve-vlm", help="the local OpenAI-compatible endpoint",
                       description="A local OpenAI-compatible endpoint that answers with the embedded subgoal model.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8001, help="port to bind (0: any free port; serve-policy takes 8000)")
    p.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    p.add_argument("--latency-jitter", type=float, default=0.0, help="extra random seconds, uniform")
    p.add_argument("--fault", default="none", choices=FAULTS, help="fault to inject")
    p.add_argument("--fault-count", type=int, default=1, help="how many first requests the fault hits")
    p.add_argument("--api-key-env", help="require the API key held by this environment variable (401 otherwise)")
    p.add_argument("--answer", default="model", metavar="MODE",
                   help="model: the subgoal model on the views (offered to keep the instruction, it keeps it when it "
                        "sees the object held and on its way); wrong-object: a subgoal naming another object of "
                        "the instruction's scene; fixed:TEXT: always TEXT; keep: keep the instruction whenever "
                        "offered (loopback advisors for controls)")
    p.add_argument("--model", default="rescue-advisor-v0", help="the model name it reports")
    p.set_defaults(func=cmd_serve_vlm, parser=p)

    # Every argument goes to the serving distribution's parser as it is (`-h` included): no prefix of its own.
    p = sub.add_parser("serve-policy", help="serve an in-process policy over the openpi websocket protocol",
                       add_help=False, prefix_chars="\x00")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_serve_policy)

    p = sub.add_parser("serve-simulators", help="keep simulators warm for runs to lease (--warm-simulators DIR)",
                       description="Keep simulator processes warm in FOLDER for runs to lease.")
    p.add_argument("folder", help="where the simulators listen; runs name it with --warm-simulators")
    p.add_argument("--size", type=int, default=2, help="warm simulator processes")
    p.add_argument("--adapter", metavar="MODULE:CLASS",
                   help="the simulator adapter they serve (default: the LIBERO adapter)")
    p.set_defaults(func=cmd_serve_simulators)
