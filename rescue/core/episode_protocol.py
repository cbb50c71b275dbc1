"""Episode protocols: how an episode starts, as data (DESIGN §10), beside observation profiles.

An arm is the user's episode only if it starts the way the user's evaluation started it. What
decides that is the reset (a soft reset of a cached env, or what a freshly built env does: openpi's
and LeRobot's `OffScreenRenderEnv` rebuild the model at every reset), when the env is seeded and
with what (before every reset with the case's seed, or once per task with episodes run in order, so
that episode k starts from the random stream k earlier resets left), the settle steps, the horizon
per suite and when success is checked.

A hard reset is reproduced exactly without rebuilding anything (measured bit for bit against
LIBERO's own hard resets): the model fields the reset writes go back to the compiled model's, the
solver's warm start is what two forward passes of a fresh model leave, and the gripper's smoothed
action starts at zero. Episode k of a task seeded once is reproduced by replaying the random draws
of the k resets before it (a reset draws only from numpy's global stream: fixture placement, robot
noise), without their physics.

What the policy is told is part of the protocol too. openpi's and LeRobot's loops send LIBERO's
`task.language`, the words of the BDDL file's name; a LIBERO-PRO language or task perturbation
rewrites only the BDDL's `(:language ...)`, so under their loops a `_lan` suite's policy hears its
base suite's words. This tool's own protocol tells the rewritten words. A study may choose the other
(`[env] instruction`); the choice is in the protocol's digest, so in the study's identity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rescue.core.catalog import OFFICIAL_HORIZON, libero_catalog
from rescue.core.digest import canonical_json

InstructionChoice = Literal["perturbed", "task.language"]
# The case tag that carries an episode's reset ordinal in its evaluation's process (`rescue manifest from-vla-eval`).
RESET_ORDINAL_TAG = "reset_ordinal"
# Fields added after studies recorded protocol digests: in the digest only when they differ from these defaults.
_DIGESTED_UNLESS = {"gripper": "as_sent", "reset_ordinal": "init_state_index"}


class EpisodeProtocol(BaseModel):
    """How an episode of a benchmark task is started, stepped and judged."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str
    """The protocol's name (a study's `[env] episode_protocol`)."""
    description: str
    """Whose evaluation it reproduces, in one line."""
    reset: Literal["soft", "hard"]
    """`soft`: the cached env's own soft reset; `hard`: what a freshly built env starts from (openpi's and
    LeRobot's default, `hard_reset=True`), reproduced exactly on the cached env."""
    seeding: Literal["per_episode", "per_task"]
    """`per_episode`: `env.seed(case.env_seed)` right before the episode's reset; `per_task`:
    `env.seed(case.env_seed)` once when the task's env is built, then the task's episodes in order (episode
    k = `init_state_index` k starts from the random stream the k resets before it left)."""
    settle_steps: int = Field(ge=0)
    """No-op steps after setting the initial state, so objects settle; not counted in the horizon."""
    settle_action: tuple[float, ...]
    """The action of the settle steps."""
    horizons: dict[str, int]
    """The suite's step limit (H) an evaluation under this protocol uses; a suite missing here takes its base
    suite's (see `horizon`)."""
    episode_seeds: Literal["init_state_index", "task_seed", "seed_plus_index"]
    """The `env_seed` an evaluation gives episode k: k itself (rescue), the task's one seed (openpi: 7, every
    episode), or `seed_base + k` (LeRobot: 1000 + k)."""
    seed_base: int = 0
    """openpi's task seed (7) or LeRobot's start seed (1000); unused by `init_state_index`."""
    success: Literal["after_every_step"] = "after_every_step"
    """When success is checked: after every env step, and the episode ends at the first success (all three)."""
    camera_size: int = 256
    """The cameras' render size the evaluation built its env with: a profile camera that leaves its size to the
    protocol (`lerobot-libero`'s) renders at it."""
    episode_markers: Literal["announced", "never"] = "announced"
    """Whether an arm sends `episode_start`/`episode_end` frames: `announced`, to a server whose metadata
    announces them (the bundled one); `never`, as openpi's own LIBERO client and LeRobot (its policies run in
    process). openpi's `examples/libero/main.py` on its main branch (unchanged from 2025-02-03 to commit 15a9616
    of 2026-06-16, the newest read) and `openpi-client` 0.1.2 (which has no such methods) send none; only an
    unmerged pull request (#919) adds them."""
    instruction: InstructionChoice = "perturbed"
    """What the policy is told: `task.language`, LIBERO's task name in words, as openpi's and LeRobot's loops
    send it for every suite (for a LIBERO-PRO `_lan` or `_task` suite, its base suite's words); `perturbed`, the
    suite's own wording (the catalog's `instruction`: the BDDL's rewritten `(:language ...)` where the suite
    rewrote its base's, else `task.language`). A `<suite>@base-inits` is told the perturbed words under either."""
    gripper: Literal["as_sent", "sign"] = "as_sent"
    """What the env does with the policy's gripper action: `as_sent` (robosuite's gripper reads it as is); `sign`:
    vla-eval's LIBERO benchmark sends -1 for a negative value and +1 otherwise (0.0 becomes +1) before the step."""
    reset_ordinal: Literal["init_state_index", "recorded"] = "init_state_index"
    """Under `per_task` seeding, how many resets of the task's env came before an episode: its initial-state index
    (episodes in order: openpi); `recorded`: the case's `reset_ordinal` tag, the order its evaluation's process
    ran the task's episodes in (vla-eval's sharded runs claim them from a queue), else the index."""

    def sha256(self) -> str:
        """Digest of the definition (a study records it; a changed built-in is refused on resume).

        `instruction` counts only when it is `task.language`: every protocol told the perturbed words before the
        field existed, so a definition that still does keeps the digest its studies recorded."""
        data = self.model_dump(mode="json", exclude={"instruction"} if self.instruction == "perturbed" else None)
        for key, default in _DIGESTED_UNLESS.items():
            if data.get(key) == default:
                data.pop(key)
        return hashlib.sha256(canonical_json(data).encode("utf-8")).hexdigest()

    def told(self, suite: str, task_id: int) -> str:
        """The instruction an episode of (`suite`, `task_id`) gives the policy under this protocol."""
        task = libero_catalog().task(suite, task_id)
        if task is None:
            raise ValueError(f"{suite} has no task {task_id} in the catalog")
        return task.told(self.instruction)

    def horizon(self, suite: str) -> int:
        """H of a suite under this protocol: its own, else its base suite's (`libero_object_swap` -> `libero_object`)."""
        if suite in self.horizons:
            return self.horizons[suite]
        known = libero_catalog().suite(suite)
        if known is None or known.base not in self.horizons:
            raise ValueError(f"the {self.name} protocol has no horizon for suite {suite!r}")
        return self.horizons[known.base]

    def executed(self, chunk: np.ndarray) -> np.ndarray:
        """The actions as the protocol's env runs them (`gripper`); the chunk itself when it runs them as sent."""
        if self.gripper == "as_sent":
            return chunk
        out = np.array(chunk, dtype=np.float64, copy=True)
        out[:, -1] = np.where(out[:, -1] < 0, -1.0, 1.0)
        return out

    def resets_before(self, init_state_index: int, tags: Mapping[str, Any]) -> int:
        """Under `per_task` seeding, the resets of the task's env before this episode's (`reset_ordinal`)."""
        recorded = tags.get(RESET_ORDINAL_TAG)
        if self.reset_ordinal == "recorded" and type(recorded) is int and recorded >= 0:
            return recorded
        return init_state_index

    def episode_seed(self, index: int) -> int:
        """The `env_seed` of episode `index` of a task under this protocol."""
        if self.episode_seeds == "init_state_index":
            return index
        if self.episode_seeds == "task_seed":
            return self.seed_base
        return self.seed_base + index


NOOP_GRIPPER_OPEN = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0)

RESCUE = EpisodeProtocol(
    name="rescue",
    description="this tool's own: seeded before every reset, soft reset of a cached env (studies before protocols)",
    reset="soft", seeding="per_episode", settle_steps=10, settle_action=NOOP_GRIPPER_OPEN,
    horizons=dict(OFFICIAL_HORIZON), episode_seeds="init_state_index",
)
# openpi's examples/libero/main.py: OffScreenRenderEnv(bddl, camera_heights=256, camera_widths=256) (hard_reset
# default True), env.seed(7) once per task right after building it, episodes in order, env.reset() then
# set_init_state(initial_states[k]), 10 steps of [0]*6 + [-1], then max_steps per suite; "prompt" is
# str(task.language). LIBERO-PRO's own repository ships no policy loop of its own: its README has the user
# rename the suite in such a loop, so its users' policies hear task.language too.
OPENPI = EpisodeProtocol(
    name="openpi",
    description="openpi's LIBERO client (examples/libero/main.py): hard resets, env.seed(7) once per task, episodes in order",
    reset="hard", seeding="per_task", settle_steps=10, settle_action=NOOP_GRIPPER_OPEN,
    horizons=dict(OFFICIAL_HORIZON), episode_seeds="task_seed", seed_base=7, episode_markers="never",
    instruction="task.language",
)
# LeRobot's LIBERO env (src/lerobot/envs/libero.py): hard resets, env.seed(seed) before each reset with
# seed = 1000 + episode (lerobot-eval's start seed), init state j for episode j, 10 settle steps inside the
# reset, TASK_SUITE_MAX_STEPS (libero_spatial 280, where openpi has 220); task_description = task.language.
# lerobot-eval's `--env.type=libero` config (src/lerobot/envs/configs.py, LiberoEnv) builds the env with
# observation_height = observation_width = 360, where the env class's own default and openpi's are 256.
LEROBOT = EpisodeProtocol(
    name="lerobot",
    description="LeRobot's LIBERO evaluation (lerobot-eval): hard resets, env.seed(1000 + episode) before each, 360x360 renders",
    reset="hard", seeding="per_episode", settle_steps=10, settle_action=NOOP_GRIPPER_OPEN,
    horizons={**OFFICIAL_HORIZON, "libero_spatial": 280}, episode_seeds="seed_plus_index", seed_base=1000,
    camera_size=360, episode_markers="never", instruction="task.language",
)
# vla-eval's LIBERO benchmark (benchmarks/libero/benchmark.py, 0.8.0): OffScreenRenderEnv(bddl, 256, 256), hard resets,
# env.seed(env_seed) once when the task's env is built (7; a server's observation_params or the run's config may
# say 0), then per episode env.reset(), set_init_state(initial_states[episode_idx]), 10 steps of [0]*6 + [-1];
# the gripper action is sign-discretised; task.language is the task description; its runner sends
# episode_start/episode_end. A sharded run claims episodes from a queue: a case carries its reset ordinal.
VLA_EVAL = EpisodeProtocol(
    name="vla-eval",
    description="vla-eval's LIBERO benchmark: hard resets, env.seed once per task env, episodes in their recorded "
                "order, the gripper sign-discretised",
    reset="hard", seeding="per_task", settle_steps=10, settle_action=NOOP_GRIPPER_OPEN,
    horizons=dict(OFFICIAL_HORIZON), episode_seeds="task_seed", seed_base=7, episode_markers="announced",
    instruction="task.language", gripper="sign", reset_ordinal="recorded",
)
PROTOCOLS: dict[str, EpisodeProtocol] = {p.name: p for p in (RESCUE, OPENPI, LEROBOT, VLA_EVAL)}
# The protocol of a study that names none: an external policy server is evaluated the way openpi's
# client runs it (as its observation profile defaults to openpi-libero); the bundled policies keep
# this tool's own protocol, which every study made before protocols used.
EXTERNAL_DEFAULT = "openpi"
BUNDLED_DEFAULT = "rescue"


def get_protocol(name: str | None, instruction: str | None = None) -> EpisodeProtocol:
    """A built-in protocol by name (None: `rescue`, the protocol of studies made before there were others),
    telling the policy `instruction` (`[env] instruction`) instead of its own choice when that is given."""
    protocol = PROTOCOLS.get(name or BUNDLED_DEFAULT)
    if protocol is None:
        raise ValueError(f"unknown episode protocol {name!r}; built in: {', '.join(PROTOCOLS)}")
    if instruction is None or instruction == protocol.instruction:
        return protocol
    if instruction not in get_args(InstructionChoice):
        raise ValueError(f"unknown instruction choice {instruction!r}; one of {', '.join(get_args(InstructionChoice))}")
    return protocol.model_copy(update={"instruction": instruction})
