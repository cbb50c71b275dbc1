"""A simulator process's memory budget (DESIGN §12): what it may hold, and what building an env costs."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# A simulator process's memory budget (DESIGN §12), in GB of 1e9 bytes of resident memory: before it
# builds a task's env, the process closes the envs it used least recently until what it holds now plus
# what a build costs at its peak fits. One libero_object env holds about 0.65 GB (the compiled model
# 0.24 GB, textures 0.15 GB of it; its GL context 0.38 GB, textures most of it) and its build peaks
# about 0.5 GB above that (the compiler's scratch), so 2.5 GB keeps two such envs.
DEFAULT_MAX_RSS_GB = 2.5


def _memory() -> tuple[int, int]:
    """This process's resident set size now and at its peak so far (VmRSS, VmHWM), bytes; 0 where unknown."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    found[line[:5]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found.get("VmRSS", 0), found.get("VmHWM", 0)


def give_back_free_memory() -> None:
    """Return the C heap's free pages to the system (glibc keeps them otherwise: the compiler's scratch
    and a closed env's model would stay resident)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


class MemoryBudget:
    """What a simulator process may hold (DESIGN §12), and what a new env of each suite costs at its peak.

    A call that builds an env is measured from its start to its end (the build, the first reset's
    digests): when it raised the process's peak (VmHWM), the rise over the resident size it started
    from is its exact cost; otherwise that difference bounds it. The larger of those is kept per suite
    (a suite's tasks share their scene); a suite not measured yet is built alone.
    """

    def __init__(self, max_rss_gb: float | None):
        self.limit = None if max_rss_gb is None else int(max_rss_gb * 1e9)
        self.cost: dict[str, int] = {}
        self._watch: tuple[str, int, int] | None = None

    def fits(self, suite: str) -> bool:
        """Whether an env of `suite` can be built beside what the process holds now."""
        if self.limit is None:
            return True
        return suite in self.cost and _memory()[0] + self.cost[suite] <= self.limit

    def building(self, suite: str) -> None:
        """An env of `suite` is about to be built: measure from here."""
        self._watch = (suite, *_memory())

    def settle(self) -> None:
        """The call that built an env (if one did) is over: give the scratch back and note what it cost."""
        if self._watch is None:
            return
        (suite, rss, _), self._watch = self._watch, None
        give_back_free_memory()
        self.cost[suite] = max(self.cost.get(suite, 0), _memory()[1] - rss)


def settles_memory(method):
    """Mark a method that may build an env: the budget learns what the build cost when it returns."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            self._memory.settle()

    return call
