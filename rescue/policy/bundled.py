"""Serve an in-process policy factory on loopback, as the embedded default does, with the serving distribution's
server (rescue_serve) and rescue's name resolution (old module names still load)."""

from __future__ import annotations

from collections.abc import Callable

from rescue_serve.limits import DEFAULT_MAX_CONNECTIONS
from rescue_serve.server import PolicyServer, policy_metadata
from rescue_serve.server import load_factory as _load_factory
from rescue_serve.wire import Policy

from rescue.core.configuration.names import resolve


def load_factory(spec: str) -> Callable[[], Policy]:
    """Import "package.module:attr" (old module names resolve too) and return the policy factory it names."""
    return _load_factory(spec, resolve)


async def serve_factory(spec: str, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                        max_connections: int = DEFAULT_MAX_CONNECTIONS) -> PolicyServer:
    """Start a websocket policy server for a factory (at most `max_connections` connections at once: a study's own
    server takes every arm its cases in flight open at once); the caller stops it."""
    factory = load_factory(spec)
    server = PolicyServer(factory, policy_metadata(factory, spec), host=host, port=port, api_key=api_key,
                          max_connections=max_connections)
    await server.start()
    return server
