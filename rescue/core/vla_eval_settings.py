"""What a vla-eval server's HELLO and a vla-eval run's config ask of an episode, and what of it is honoured (pure).

vla-eval's orchestrator builds its LIBERO benchmark from the run's `params`, then adds each of the server's
`observation_params` the run's config does not name (the config wins) and the benchmark's constructor accepts
(LIBERO_PARAMS; others are dropped, as the harness drops them). From the merged params:
- the profile: `send_wrist_image`, `send_state`, `quat_no_antipodal` (rescue.core.vla_eval_observation);
- the env seed: `env_seed`, else `seed`, else 7 (OpenVLA's and OpenVLA-OFT's servers ask for env seed 0);
- the horizon: the run's `max_steps`, else the params' `max_steps`, else the suite's (220/280/300/520/400, 300
  for a suite without one);
- refused by name, as no episode here is theirs: `absolute_action` (X-VLA's absolute end-effector targets) and
  `num_steps_wait` other than 10 settle steps.
"""

from __future__ import annotations

from typing import Any


# The keyword arguments of vla-eval's LIBEROBenchmark (0.8.0): what a server's observation_params can set.
LIBERO_PARAMS = frozenset({"suite", "seed", "num_steps_wait", "send_wrist_image", "send_state", "absolute_action",
                           "max_steps", "env_seed", "quat_no_antipodal"})
DEFAULT_SEED = 7
SETTLE_STEPS = 10
# The harness's LIBERO step limits (MAX_STEP_MAPPING) and its default for another suite.
MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
DEFAULT_MAX_STEPS = 300
WIRE = "vla-eval"


def merged_params(configured: dict[str, Any], announced: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's params as the harness merges them: the run's, then each of the server's it does not name."""
    merged = dict(configured)
    for key, value in announced.items():
        if key not in merged and key in LIBERO_PARAMS:
            merged[key] = value
    return merged


def refusal(params: dict[str, Any]) -> str | None:
    """Why episodes under these params cannot be replayed here (one line), or None."""
    if params.get("absolute_action"):
        return ("absolute_action = true (absolute end-effector targets, X-VLA's servers) is not supported: rescue "
                "replays LIBERO's delta controller only")
    wait = params.get("num_steps_wait", SETTLE_STEPS)
    if wait != SETTLE_STEPS:
        return f"num_steps_wait = {wait!r} is not supported: the vla-eval episode protocol settles {SETTLE_STEPS} steps"
    return None


def env_seed(params: dict[str, Any]) -> int | None:
    """The seed the harness gives `env.seed()`: `env_seed`, else `seed`, else 7; None when it is no seed."""
    value = params["env_seed"] if params.get("env_seed") is not None else params.get("seed", DEFAULT_SEED)
    return value if type(value) is int and 0 <= value < 2**32 else None


def horizon(max_steps: Any, params: dict[str, Any], suite: str) -> int:
    """The step limit of an episode: the run's `max_steps`, else the params', else the suite's (LIBEROBenchmark's
    table: 300 for a suite not in it; LIBERO-PRO's benchmark passes its base suite)."""
    for value in (max_steps, params.get("max_steps")):
        if type(value) is int and value > 0:
            return value
    return MAX_STEPS.get(suite, DEFAULT_MAX_STEPS)


def base_suite(suite: str) -> str:
    """The LIBERO suite a LIBERO-PRO suite's step limit comes from in the harness (a prefix of its name)."""
    return next((base for base in MAX_STEPS if suite == base or suite.startswith(f"{base}_")), suite)


def episode_settings(metadata: dict[str, Any]) -> tuple[int | None, int | None]:
    """The env seed and step limit a vla-eval server's HELLO gives the harness's LIBERO episodes when the run's
    config says nothing (None: the HELLO names none, or no usable one)."""
    params = merged_params({}, dict(metadata.get("observation_params") or {}))
    limit = params.get("max_steps")
    return env_seed(params), limit if type(limit) is int and limit > 0 else None


def is_vla_eval(metadata: dict[str, Any]) -> bool:
    """Whether a policy connection's metadata is a vla-eval server's HELLO."""
    return metadata.get("wire") == WIRE

