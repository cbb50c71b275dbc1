"""Which wire a policy URL speaks, and a connection over it: openpi's (`ws://`, `wss://`, the default) or
vla-eval's (`vla-eval+ws://`, `vla-eval+wss://`, rescue.policy.vla_eval_client)."""

from __future__ import annotations

from typing import Any

from rescue.policy.client import WebsocketPolicyClient
from rescue.policy.vla_eval_client import SCHEME as VLA_EVAL_SCHEME
from rescue.policy.vla_eval_client import WIRE as VLA_EVAL
from rescue.policy.vla_eval_client import VlaEvalPolicyClient

OPENPI = "openpi"


def wire_of(url: str | None) -> str:
    """The wire a policy URL speaks: `vla-eval` for `vla-eval+ws://`, else `openpi` (None: the bundled server's)."""
    return VLA_EVAL if url is not None and url.startswith(VLA_EVAL_SCHEME) else OPENPI


def is_stepwise(policy: Any) -> bool:
    """Whether a connection answers one action per observation (vla-eval's wire), so an arm sends it an
    observation at every env step; a wrapper around one says so through the metadata it passes on."""
    metadata = getattr(policy, "metadata", None) or {}
    return getattr(policy, "stepwise", False) or metadata.get("wire") == VLA_EVAL


async def connect(url: str, api_key: str | None = None, connect_timeout_s: float = 30.0) -> WebsocketPolicyClient:
    """A connection to the policy server at `url`, over the wire its scheme names."""
    kind = VlaEvalPolicyClient if wire_of(url) == VLA_EVAL else WebsocketPolicyClient
    return await kind.connect(url, api_key=api_key, connect_timeout_s=connect_timeout_s)
