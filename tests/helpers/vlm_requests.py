"""Subgoal requests as the engine asks them (instructions of LIBERO tasks, three small views each), and the VLM
client's settings that keep retries quick in tests."""

from __future__ import annotations

import numpy as np
from conftest import HANG_S

from rescue.core.images import VLM_VIEWS
from rescue.vlm.answers import SubgoalRequest


# request_timeout_s bounds only a hang (conftest.HANG_S): a busy machine's loopback call can take seconds.
FAST = dict(backoff_initial_s=0.01, backoff_max_s=0.05, backoff_jitter_s=0.01, request_timeout_s=HANG_S)

CASES = [
    ("pick up the black bowl between the plate and the ramekin and place it on the plate", "black bowl between the plate and the ramekin"),
    ("put the cream cheese in the bowl", "cream cheese"),
    ("put the wine bottle on top of the cabinet", "wine bottle"),
    ("pick up the ketchup and place it in the basket", "ketchup"),
    ("place the yellow mug on the left plate", "yellow mug"),
    ("pick up the alphabet soup and place it in the basket", "alphabet soup"),
    ("put the moka pot on the stove", "moka pot"),
    ("pick up the salad dressing and place it in the basket", "salad dressing"),
]


def make_request(i: int, instruction: str = CASES[0][0], blank: bool = False) -> SubgoalRequest:
    rng = np.random.default_rng(i)
    views = {
        n: np.full((32, 32, 3), 128, np.uint8) if blank else rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        for n in VLM_VIEWS
    }
    return SubgoalRequest(case_id=f"case-{i}", instruction=instruction, remaining_steps=120, views=views)
