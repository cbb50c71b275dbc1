"""The failures users already have: LeRobot's eval_info.json and openpi-style results become a manifest."""

from __future__ import annotations

import json

import pytest

from rescue.core.catalog import libero_catalog
from rescue.core.results import ResultsError, lerobot_episodes, openpi_episodes

pytestmark = pytest.mark.fast


def _lerobot(successes_by_task: dict[int, list[bool]], group: str = "libero_object") -> bytes:
    per_task = [{"task_group": group, "task_id": t, "metrics": {"sum_rewards": [0.0] * len(s), "max_rewards": [0.0] * len(s),
                                                              "successes": s, "video_paths": []}}
                for t, s in successes_by_task.items()]
    return json.dumps({"per_task": per_task, "per_group": {}, "overall": {}}).encode()


def test_lerobot_episode_j_is_seeded_start_plus_j_from_initial_state_j():
    episodes = lerobot_episodes(_lerobot({3: [True, False, False]}), "eval_info.json", libero_catalog())
    assert [(e.episode, e.init_state_index, e.env_seed, e.success) for e in episodes] == [
        (0, 0, 1000, True), (1, 1, 1001, False), (2, 2, 1002, False)]
    assert lerobot_episodes(_lerobot({3: [False]}), "x", libero_catalog(), seed=42)[0].env_seed == 42


def test_unmappable_entries_are_named_with_path_and_field():
    bad = json.dumps({"per_task": [
        {"task_group": "libero_nowhere", "task_id": 0, "metrics": {"successes": [False]}},
        {"task_group": "libero_object", "task_id": 99, "metrics": {"successes": [False]}},
        {"task_group": "libero_object", "task_id": 1, "metrics": {"successes": "no"}},
    ]}).encode()
    with pytest.raises(ResultsError) as err:
        lerobot_episodes(bad, "eval_info.json", libero_catalog())
    assert err.value.problems == [
        "eval_info.json: per_task[0].metrics.successes[0]: suite: 'libero_nowhere' is not a suite of libero",
        "eval_info.json: per_task[1].metrics.successes[0]: task_id: libero_object has no task 99",
        "eval_info.json: per_task[2].metrics.successes: expected a list of true/false per episode",
    ]
    lines = b'{"suite": "libero_object", "task_id": 0, "episode": 60, "success": false}\n{"suite": "libero_object", "task_id": 0}\n'
    with pytest.raises(ResultsError) as err:
        openpi_episodes(lines, "results.jsonl", libero_catalog())
    assert err.value.problems == [
        "results.jsonl:1: episode: libero_object task 0 has 50 initial states, not 61",
        "results.jsonl:2: episode: missing or of the wrong type",
        "results.jsonl:2: success: missing or of the wrong type",
    ]
