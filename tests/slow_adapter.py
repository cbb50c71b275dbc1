"""A simulator adapter that takes ten minutes to build (a stand-in for a slow env build), for tests that
kill the driver while its simulators are still starting: `[env] adapter = "slow_adapter:SlowBootAdapter"`."""

from __future__ import annotations

import time

BOOT_S = 600


class SlowBootAdapter:
    """Sleeps BOOT_S in its constructor; never gets further in a test."""

    def __init__(self, **kwargs) -> None:
        time.sleep(BOOT_S)
