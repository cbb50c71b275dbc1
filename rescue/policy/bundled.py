"""Serve an in-process policy factory on loopback, as the embedded default does."""

from __future__ import annotations

from rescue.policy.server import PolicyServer, load_factory, policy_metadata

__all__ = ["load_factory", "policy_metadata", "serve_factory"]


async def serve_factory(spec: str, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None) -> PolicyServer:
    """Start a websocket policy server for a factory; the caller stops it."""
    factory = load_factory(spec)
    server = PolicyServer(factory, policy_metadata(factory, spec), host=host, port=port, api_key=api_key)
    await server.start()
    return server
