"""Input tokens per case with and without batching, against the local endpoint.

Asks for the same 8 cases once at batch size 1 (8 calls, three images each) and
once at batch size 8 (one call, one contact sheet), and prints the input tokens
per case the endpoint reported for each, and their ratio. The endpoint's counts
are an estimate (text length / 4 plus a tile cost per image), not a provider's.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import numpy as np

from rescue.core.configuration.vlm_config import VLMConfig
from rescue.core.images import VLM_VIEWS
from rescue.embedded.endpoint import EndpointOptions, start_endpoint
from rescue.study.receipts import ReceiptLog, read_receipts
from rescue.study.usage import usage_summary
from rescue.vlm.answers import SubgoalRequest
from rescue.vlm.client import VLMClient

INSTRUCTIONS = [
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "put the cream cheese in the bowl",
    "put the wine bottle on top of the cabinet",
    "open the top drawer of the cabinet",
    "turn on the stove",
    "pick up the ketchup and place it in the basket",
    "put the white mug on the left plate",
    "push the plate to the front of the stove",
]


def _cases(size: int = 256) -> list[SubgoalRequest]:
    rng = np.random.default_rng(0)
    return [
        SubgoalRequest(
            case_id=f"bench-{i}",
            instruction=text,
            remaining_steps=400,
            views={n: rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for n in VLM_VIEWS},
        )
        for i, text in enumerate(INSTRUCTIONS)
    ]


async def _input_tokens_per_case(base_url: str, batch_size: int, folder: Path) -> float:
    path = folder / f"receipts-b{batch_size}.jsonl"
    config = VLMConfig(base_url=base_url, batch_size=batch_size, batch_window_s=5.0)
    client = VLMClient(config, ReceiptLog(path))
    try:
        answers = await asyncio.gather(*(client.ask(c) for c in _cases()))
    finally:
        await client.aclose()
    if any(a.status != "ok" for a in answers):
        raise RuntimeError(f"not every case got a subgoal at batch size {batch_size}")
    summary = usage_summary(read_receipts(path))
    total = summary.tokens["input"].total
    if total is None:
        raise RuntimeError("the endpoint omitted input tokens")
    return total / summary.cases


async def main() -> int:
    """Run both settings and print the comparison."""
    runner, base_url = await start_endpoint(EndpointOptions())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            single = await _input_tokens_per_case(base_url, 1, Path(tmp))
            batched = await _input_tokens_per_case(base_url, 8, Path(tmp))
    finally:
        await runner.cleanup()
    print(f"input tokens per case, batch size 1: {single:.1f}")
    print(f"input tokens per case, batch size 8: {batched:.1f}")
    print(f"ratio (batch 8 / batch 1): {batched / single:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
