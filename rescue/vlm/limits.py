"""One limiter for every request a study sends to the VLM: concurrency and requests per minute.

A study has one VLM client, in the coordinator process, whichever backend runs
its simulators; so this limiter holds for the whole study, on one machine or a
cluster. Requests start evenly spaced (60/requests_per_minute seconds apart),
which never exceeds the provider's per-minute budget in any window.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator


class RequestLimiter:
    """`async with limiter.slot():` around each request; None for either limit means none."""

    def __init__(self, max_concurrent: int | None = None, per_minute: float | None = None):
        self._slots = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        self._interval = 60.0 / per_minute if per_minute else 0.0
        self._next = float("-inf")  # when the next request may start
        self._spacing = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Wait for a free slot and for the request's turn; hold the slot while the request runs."""
        if self._slots is not None:
            await self._slots.acquire()
        try:
            if self._interval:
                async with self._spacing:
                    wait = self._next - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    self._next = time.monotonic() + self._interval
            yield
        finally:
            if self._slots is not None:
                self._slots.release()
