"""The faults the local endpoint can inject, as real providers show them (rescue.embedded.endpoint)."""

from __future__ import annotations

from typing import Literal, get_args

Fault = Literal[
    "none",
    "rate_limit",
    "server_error",
    "drop",
    "malformed_json",
    "overlong_subgoal",
    "wrong_request_id",
    "quota",
    "empty_subgoal",
    "refusal",
]
FAULTS: tuple[str, ...] = get_args(Fault)
