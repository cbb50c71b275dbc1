"""The failures users already have: another evaluation's per-episode results read as episodes (pure).

Two shapes are read:

- LeRobot's `eval_info.json` (`lerobot-eval`): `per_task` is a list of `{task_group, task_id,
  metrics: {successes: [...]}}`; episode j of a task is the j-th entry of `successes`. lerobot-eval
  seeds episode j with `seed + j` (its `--seed`, 1000 by default; the file does not keep seeds) and
  sets initial state `j % 50`, so that is how an entry maps to an episode. (With a synchronous vector
  env of several sub-envs an early finisher is reset unseeded and skips an initial state; such a file's
  episodes are not these; use one env, or asynchronous envs, as lerobot-eval does by default.)
- openpi-style results, one JSON object per line: `{"suite": "libero_spatial", "task_id": 0,
  "episode": 3, "success": false}` (openpi's LIBERO example logs its results but writes no such file;
  write one line per episode from its loop). Episode k of a task under openpi's protocol starts from
  initial state k with the task seeded once with 7 (`"seed"` may say otherwise). `"prompt"`, when given,
  is the instruction the loop sent; it is part of the episode's fingerprint, so an arm told other words
  is an `initial_state_deviation`, not that episode.

Every entry that cannot be mapped is named with its line or path and field; nothing is kept then.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rescue.core.catalog import Catalog


@dataclass(frozen=True)
class Episode:
    """One episode of another evaluation: where it started, how it was seeded, whether it succeeded."""

    suite: str
    task_id: int
    episode: int
    init_state_index: int
    env_seed: int
    success: bool
    where: str
    prompt: str | None = None
    """The instruction the evaluation's loop sent, when its results say (openpi-style `"prompt"`)."""


class ResultsError(ValueError):
    """Results that cannot be read as episodes; `problems` names each (line or path, field)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _int(value: Any) -> bool:
    return type(value) is int and value >= 0


def _check(episode: Episode, catalog: Catalog, problems: list[str], field: str) -> bool:
    suite = catalog.suite(episode.suite)
    if suite is None:
        problems.append(f"{episode.where}: suite: {episode.suite!r} is not a suite of {catalog.benchmark}")
        return False
    task = catalog.task(episode.suite, episode.task_id)
    if task is None:
        problems.append(f"{episode.where}: task_id: {episode.suite} has no task {episode.task_id}")
        return False
    if episode.init_state_index >= task.init_states:
        problems.append(f"{episode.where}: {field}: {episode.suite} task {episode.task_id} has {task.init_states} "
                        f"initial states, not {episode.init_state_index + 1}")
        return False
    return True


def lerobot_episodes(data: bytes, source: str, catalog: Catalog, seed: int = 1000) -> list[Episode]:
    """The episodes of a LeRobot `eval_info.json` (seed: lerobot-eval's `--seed`)."""
    try:
        info = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ResultsError([f"{source}: not JSON ({exc})"]) from None
    per_task = info.get("per_task") if isinstance(info, dict) else None
    if not isinstance(per_task, list):
        raise ResultsError([f"{source}: per_task: expected LeRobot's list of per-task results"])
    problems: list[str] = []
    out: list[Episode] = []
    for i, entry in enumerate(per_task):
        where = f"{source}: per_task[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where}: expected an object")
            continue
        group, task_id = entry.get("task_group"), entry.get("task_id")
        successes = (entry.get("metrics") or {}).get("successes") if isinstance(entry.get("metrics"), dict) else None
        if not isinstance(group, str):
            problems.append(f"{where}.task_group: expected the suite's name")
            continue
        if not _int(task_id):
            problems.append(f"{where}.task_id: expected a task id")
            continue
        if not isinstance(successes, list) or not all(isinstance(s, bool) for s in successes):
            problems.append(f"{where}.metrics.successes: expected a list of true/false per episode")
            continue
        suite = catalog.suite(group)
        count = None
        if suite is not None and catalog.task(group, task_id) is not None:
            count = catalog.task(group, task_id).init_states
        for j, success in enumerate(successes):
            episode = Episode(group, task_id, j, j % count if count else j, seed + j, success,
                              f"{where}.metrics.successes[{j}]")
            if _check(episode, catalog, problems, "successes"):
                out.append(episode)
    if problems:
        raise ResultsError(problems)
    return out


def openpi_episodes(data: bytes, source: str, catalog: Catalog, seed: int = 7) -> list[Episode]:
    """The episodes of openpi-style results (JSON lines: suite, task_id, episode, success; seed optional)."""
    problems: list[str] = []
    out: list[Episode] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            row = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            problems.append(f"{where}: not JSON ({exc})")
            continue
        if not isinstance(row, dict):
            problems.append(f"{where}: expected an object")
            continue
        bad = [f for f, ok in (("suite", isinstance(row.get("suite"), str)), ("task_id", _int(row.get("task_id"))),
                               ("episode", _int(row.get("episode"))), ("success", isinstance(row.get("success"), bool)),
                               ("seed", "seed" not in row or _int(row.get("seed"))),
                               ("prompt", "prompt" not in row or (isinstance(row.get("prompt"), str) and row["prompt"])))
               if not ok]
        if bad:
            problems += [f"{where}: {field}: missing or of the wrong type" for field in bad]
            continue
        episode = Episode(row["suite"], row["task_id"], row["episode"], row["episode"], row.get("seed", seed), row["success"],
                          where, row.get("prompt"))
        if _check(episode, catalog, problems, "episode"):
            out.append(episode)
    if problems:
        raise ResultsError(problems)
    if not out:
        raise ResultsError([f"{source}: no episodes"])
    return out
