"""The serving distribution's server (rescue_serve), one implementation for `rescue serve-policy` and `rescue-serve`,
with rescue's name resolution (old module names still load); tests/test_serve_dist.py holds the two wire-identical.
"""

from __future__ import annotations

from collections.abc import Callable

from rescue.core.configuration.names import resolve
from rescue_serve.server import DEFAULT_PORT, PolicyServer, policy_metadata
from rescue_serve.server import load_factory as _load_factory
from rescue_serve.wire import Policy

__all__ = ["DEFAULT_PORT", "PolicyServer", "load_factory", "policy_metadata"]


def load_factory(spec: str) -> Callable[[], Policy]:
    """Import "package.module:attr" (old module names resolve too) and return the policy factory it names."""
    return _load_factory(spec, resolve)
