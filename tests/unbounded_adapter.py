"""The LIBERO adapter without a memory budget: it keeps every env it builds (the reference runs of
tests/test_memory_budget.py, `[env] adapter = "tests.unbounded_adapter:UnboundedAdapter"`)."""

from __future__ import annotations

from rescue.env.libero import LiberoAdapter


class UnboundedAdapter(LiberoAdapter):
    """LiberoAdapter with `max_rss_gb=None`: no env is ever closed while the process lives."""

    def __init__(self, **kwargs):
        super().__init__(**{**kwargs, "max_rss_gb": None})
