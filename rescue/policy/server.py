"""`rescue serve-policy`: the serving distribution's server (rescue_serve), one implementation for both commands.

`rescue serve-policy --policy MODULE:FACTORY` is `rescue-serve policy MODULE:FACTORY`
with rescue's name resolution (old module names still load) and the embedded
policy as the default; tests/test_serve_dist.py holds the two wire-identical.
"""

from __future__ import annotations

from collections.abc import Callable

from rescue.core.configuration.names import EMBEDDED_POLICY, resolve
from rescue_serve.cli import policy_main
from rescue_serve.server import DEFAULT_PORT, PolicyServer, policy_metadata
from rescue_serve.server import load_factory as _load_factory
from rescue_serve.wire import Policy

__all__ = ["DEFAULT_PORT", "PolicyServer", "load_factory", "policy_metadata", "serve_main"]


def load_factory(spec: str) -> Callable[[], Policy]:
    """Import "package.module:attr" (old module names resolve too) and return the policy factory it names."""
    return _load_factory(spec, resolve)


def serve_main(argv: list[str] | None = None) -> int:
    """CLI entry: rescue serve-policy [--policy MODULE:FACTORY] [--host] [--port] [--api-key-env] [--idle-timeout]."""
    return policy_main(argv, prog="rescue serve-policy", resolve=resolve, default_policy=EMBEDDED_POLICY)
