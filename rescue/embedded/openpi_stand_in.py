"""A CPU stand-in for pi0 behind openpi's own server: the embedded vision-language policy, which samples its
actions, served by the real `openpi_server` package exactly as openpi's `scripts/serve_policy.py` serves a
checkpoint: empty metadata (no action horizon, no RNG extension), one sampling stream for the life of the
process, no way for a client to seed it (DESIGN §13; docs/own-vla.md walks through a study against it).

    pip install openpi-server
    python -m rescue.embedded.openpi_stand_in --port 8000
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    """Serve the embedded vision-language policy with openpi's server on a port, until killed."""
    parser = argparse.ArgumentParser(prog="python -m rescue.embedded.openpi_stand_in", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (openpi's default: 8000)")
    args = parser.parse_args(argv)
    try:
        from openpi_server import WebsocketPolicyServer
    except ImportError:
        raise SystemExit("openpi_stand_in: the openpi-server package is not installed (pip install openpi-server)") from None
    from rescue.embedded.vision_language import make_policy

    print(f"serving the embedded vision-language policy with openpi's server at ws://{args.host}:{args.port}", flush=True)
    WebsocketPolicyServer(make_policy(), host=args.host, port=args.port, metadata={}).serve_forever()


if __name__ == "__main__":
    main()
