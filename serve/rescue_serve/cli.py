"""The `rescue-serve` command: serve a policy factory, a saved LeRobot policy or an openpi checkpoint.

    rescue-serve policy MODULE:FACTORY            a factory returning a policy (what `rescue serve-policy` runs)
    rescue-serve lerobot PATH [--rename-map JSON] [--mode auto|chunk|step]
    rescue-serve openpi --config NAME --dir CHECKPOINT

Every form takes --host, --port, --api-key-env, and the limits a client is
held to: --max-connections, --max-frame-mb, --frame-timeout, --idle-timeout
(rescue_serve/limits.py). Bad input is one line on stderr and exit status 2;
the server prints `serving policy at ws://HOST:PORT/` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from rescue_serve.limits import DEFAULT_FRAME_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_FRAME
from rescue_serve.server import DEFAULT_PORT, PolicyServer, import_attr, load_factory, policy_metadata
from rescue_serve.wire import BadInput


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The options every form of the command shares."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind (0: any free port)")
    parser.add_argument("--api-key-env", help="name of the environment variable holding the api key")
    parser.add_argument("--max-connections", type=_positive(int), default=DEFAULT_MAX_CONNECTIONS,
                        help="connections served at once; one more is closed with code 1013 and the reason (a study "
                             "opens one per arm of each case in flight)")
    parser.add_argument("--max-frame-mb", type=_positive(float), default=DEFAULT_MAX_FRAME / 2**20,
                        help="MiB of one message at most; a larger declared size is refused before it is read "
                             "(close code 1009)")
    parser.add_argument("--frame-timeout", type=_positive(float), default=DEFAULT_FRAME_TIMEOUT_S,
                        help="seconds from a frame's first byte to its last; a client slower than that is closed "
                             "with code 1008 and what it sent is let go")
    parser.add_argument("--idle-timeout", type=_positive(float), default=None,
                        help="close connections that complete no frame (a ping is one) for this many seconds while "
                             "the server waits on them")


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` above 0."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
        return value

    return parse


def run_server(prog: str, args: argparse.Namespace, factory: Callable[[], Any], metadata: dict) -> int:
    """Serve `factory` with `metadata` as `args` say until SIGINT/SIGTERM; 2 on bad input, 0 after a signal."""
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            print(f"{prog}: environment variable {args.api_key_env} is unset or empty", file=sys.stderr)
            return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    server = PolicyServer(
        factory,
        metadata,
        host=args.host,
        port=args.port,
        api_key=api_key,
        idle_timeout_s=args.idle_timeout,
        max_msg_size=int(args.max_frame_mb * 2**20),
        frame_timeout_s=args.frame_timeout,
        max_connections=args.max_connections,
    )
    try:
        asyncio.run(server.serve_until_signalled())
    except OSError as exc:
        print(f"{prog}: cannot listen on {args.host}:{args.port}: {exc.strerror or exc} "
              "(is another server on that port? choose one with --port)", file=sys.stderr)
        return 2
    return 0


def policy_main(
    argv: list[str] | None = None,
    prog: str = "rescue-serve policy",
    resolve: Callable[[str], Any] = import_attr,
    default_policy: str | None = None,
) -> int:
    """Serve MODULE:FACTORY: each connection gets the policy the factory returns (`rescue serve-policy` is this)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=policy_main.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    if default_policy is None:
        parser.add_argument("policy", help="MODULE:FACTORY returning a policy")
    else:
        parser.add_argument("--policy", default=default_policy, help="MODULE:FACTORY returning a policy")
    add_server_options(parser)
    args = parser.parse_args(argv)
    try:
        factory = load_factory(args.policy, resolve)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        what = "--policy " if default_policy is not None else ""
        print(f"{prog}: {what}{args.policy!r} cannot be loaded: {type(exc).__name__}: "
              f"{' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    # Clients read the replanning interval and the observation profile from it when declared.
    return run_server(prog, args, factory, policy_metadata(factory, args.policy))


def _rename_map(text: str) -> dict[str, str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise argparse.ArgumentTypeError(f'expected a JSON object of key names, e.g. {{"observation.images.top": '
                                         f'"observation.images.image"}}, got {text!r}')
    return value


def lerobot_main(argv: list[str] | None = None, prog: str = "rescue-serve lerobot") -> int:
    """Serve a saved LeRobot policy directory with its own pre/post processors."""
    parser = argparse.ArgumentParser(
        prog=prog, description=lerobot_main.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("path", help="a policy directory saved by LeRobot (config.json, weights, processors)")
    parser.add_argument("--rename-map", type=_rename_map, default={},
                        help="JSON object: observation key the client sends -> key the policy was trained on")
    parser.add_argument("--mode", choices=("auto", "chunk", "step"), default="auto",
                        help="chunk: predict_action_chunk, stateless; step: select_action at C = 1, stateful; "
                             "auto: step for policies with an observation history (n_obs_steps > 1), else chunk")
    parser.add_argument("--observation", default="lerobot-libero", help="the observation profile to announce")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--threads", type=int, default=1, help="torch's thread count (pinned and announced)")
    parser.add_argument("--action-dim", type=int, default=7,
                        help="the action dimension the client's simulator takes (LIBERO: 7)")
    add_server_options(parser)
    args = parser.parse_args(argv)
    from rescue_serve.lerobot import LeRobotServed

    try:
        served = LeRobotServed.load(
            args.path,
            rename_map=args.rename_map,
            mode=args.mode,
            observation=args.observation,
            device=args.device,
            threads=args.threads,
            action_dim=args.action_dim,
        )
    except BadInput as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    print(f"{prog}: {served.describe()}", file=sys.stderr, flush=True)
    return run_server(prog, args, served.session, served.metadata())


def openpi_main(argv: list[str] | None = None, prog: str = "rescue-serve openpi") -> int:
    """Serve an openpi checkpoint with the noise of each connection's seeded stream."""
    parser = argparse.ArgumentParser(
        prog=prog, description=openpi_main.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--config", required=True, help="openpi training config name, e.g. pi05_libero")
    parser.add_argument("--dir", required=True, help="the checkpoint directory")
    parser.add_argument("--default-prompt", default=None, help="prompt used when an observation carries none")
    parser.add_argument("--action-horizon", type=int, default=5, help="actions executed per query (openpi's LIBERO: 5)")
    parser.add_argument("--observation", default="openpi-libero", help="the observation profile to announce")
    add_server_options(parser)
    args = parser.parse_args(argv)
    from rescue_serve.openpi import OpenpiServed

    try:
        served = OpenpiServed.load(args.config, args.dir, default_prompt=args.default_prompt,
                                   action_horizon=args.action_horizon, observation=args.observation)
    except BadInput as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return run_server(prog, args, served.session, served.metadata())


COMMANDS = {"policy": policy_main, "lerobot": lerobot_main, "openpi": openpi_main}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `rescue-serve`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(f"rescue-serve: expected one of {', '.join(COMMANDS)} (rescue-serve --help)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:], prog=f"rescue-serve {argv[0]}")


if __name__ == "__main__":
    sys.exit(main())
