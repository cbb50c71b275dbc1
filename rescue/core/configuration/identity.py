"""What decides a case's arms, fixed when a study is created (pure).

The replanning interval C, the query-point rule, the observation profile and
what the policy server announced about itself are resolved once, written
into the study's configuration (so its sha256 covers them) and compared on
every later start: a resume or a continuation against a server that
announces something else is refused before anything is written.
"""

from __future__ import annotations

from typing import Any

# The metadata keys a policy server announces about itself that make it "the same policy"; `torch_threads`
# (rescue-serve's adapters pin and announce it): a sampling policy's outputs differ across thread counts.
# `wire` and `observation_params`: a vla-eval server's (its HELLO's; rescue.policy.vla_eval_client).
IDENTITY_KEYS = ("policy", "action_horizon", "observation", "torch_threads", "wire", "observation_params")


class IdentityError(ValueError):
    """A study cannot be created or continued with the policy server as it announces itself."""


def _plain(value: Any) -> Any:
    # Metadata arrives as msgpack: numpy scalars and tuples become JSON-comparable values.
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def announced_identity(metadata: dict[str, Any]) -> dict[str, Any]:
    """The identity fields of a server's metadata frame (openpi's is often empty)."""
    return {key: _plain(metadata[key]) for key in IDENTITY_KEYS if key in metadata}


def resolve_interval(configured: int | None, metadata: dict[str, Any]) -> int:
    """C: the configured interval, else the server's `action_horizon`; IdentityError when neither."""
    if configured is not None:
        if configured <= 0:
            raise IdentityError(f"policy.replan_interval must be positive, got {configured}")
        return configured
    announced = _plain(metadata.get("action_horizon"))
    if isinstance(announced, int) and not isinstance(announced, bool) and announced > 0:
        return announced
    raise IdentityError(
        "the policy server announces no action_horizon (openpi's servers usually don't); "
        "set [policy] replan_interval or --replan-interval (openpi's LIBERO client replans every 5 steps)"
    )


def resolve_observation(configured: str | None, metadata: dict[str, Any], default: str) -> str:
    """The observation profile: configured, else announced by the server, else the default."""
    if configured:
        return configured
    announced = metadata.get("observation")
    return str(announced) if announced else default


def identity_changes(recorded: dict[str, Any], metadata: dict[str, Any]) -> list[str]:
    """One line per identity field whose announced value differs from the one recorded at creation."""
    now = announced_identity(metadata)
    return [
        f"{key}: the study was created with {recorded.get(key)!r}, the server now announces {now.get(key)!r}"
        for key in IDENTITY_KEYS
        if recorded.get(key) != now.get(key)
    ]


# The metadata key a server announces a stateless policy with (DESIGN §13).
STATELESS_KEY = "stateless"


def resolve_stateless(configured: bool | None, metadata: dict[str, Any], rng_control: bool) -> bool | None:
    """Whether the policy keeps no state between calls: configured, else announced, else true for a server
    without the RNG extension (openpi's `Policy.infer` keeps none), else unset (under RNG control the prefix is
    replayed). IdentityError for a stateful policy whose server gives no RNG control: neither a replay nor a
    snapshot at q can put it where the prefix left it."""
    announced = _plain(metadata.get(STATELESS_KEY))
    stateless = configured if configured is not None else announced if isinstance(announced, bool) else None
    if stateless is None and not rng_control:
        stateless = True
    if stateless is False and not rng_control:
        where = "policy.stateless = false" if configured is False else "the server announces stateless = false"
        raise IdentityError(
            f"the policy keeps state between calls ({where}) and its server gives no RNG control: neither replaying "
            "the prefix nor continuing from the snapshot at q puts it where the prefix left it; serve it behind "
            "`rescue serve-policy` with reset_rng (docs/own-vla.md), or declare it stateless if it is"
        )
    return stateless


def resolve_fork(configured: bool | None, rng_control: bool, continuations: int, query_points: bool = False) -> bool:
    """Whether the arms fork at q: configured, else whenever the server gives no RNG control (two independent
    replays of a sampling policy part at step 0), the arms continue more than once (DESIGN §13) or the study
    declares extra query points (DESIGN §14)."""
    if configured is not None:
        return configured
    return not rng_control or continuations > 1 or query_points
