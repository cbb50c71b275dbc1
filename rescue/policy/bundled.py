"""Serve an in-process policy factory on loopback, as the embedded default does."""

from __future__ import annotations

import importlib
from typing import Callable

from rescue.policy.ws_server import PolicyServer


def load_factory(spec: str) -> Callable[[], object]:
    """Import `module:function` and return the factory."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"policy factory must look like module:function, got {spec!r}")
    return getattr(importlib.import_module(module), name)


def policy_metadata(factory: Callable[[], object], spec: str) -> dict:
    """Metadata announced first on every connection: the factory and its action horizon."""
    sample = factory()
    return {"policy": spec, "action_horizon": int(getattr(sample, "action_horizon", 0))}


async def serve_factory(spec: str, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None) -> PolicyServer:
    """Start a websocket policy server for a factory; the caller stops it."""
    factory = load_factory(spec)
    server = PolicyServer(factory, policy_metadata(factory, spec), host=host, port=port, api_key=api_key)
    await server.start()
    return server
