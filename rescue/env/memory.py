"""A simulator process's memory budget (DESIGN §12): what it may hold, and what building an env costs."""

from __future__ import annotations

import ctypes
import functools

# A simulator process's memory budget (DESIGN §12), in GB of 1e9 bytes of resident memory: before it
# builds a task's env, the process closes the envs it used least recently until what it holds now plus
# what a build costs at its peak fits. One libero_object env holds about 0.65 GB (the compiled model
# 0.24 GB, textures 0.15 GB of it; its GL context 0.38 GB, textures most of it) and its build peaks
# about 0.5 GB above that (the compiler's scratch). The floor, 2.5 GB, keeps one such env: a second's
# build peaks past it (measured: benchmarks/env_memory.py --budget 2.5).
DEFAULT_MAX_RSS_GB = 2.5
# Without `[env] max_simulator_rss_gb`, simulators on this machine share this part of the memory
# available when the run starts (MemAvailable), each at least the floor: the rest is the command's,
# the policy's and the machine's.
MACHINE_SHARE = 0.5


def available_bytes() -> int | None:
    """The memory this machine can give without swapping (MemAvailable), bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_budget_gb(simulators: int, available: int) -> float:
    """Each simulator's budget when none is configured: a share of `available` bytes, at least the floor."""
    share = MACHINE_SHARE * available / max(1, simulators) / 1e9
    return max(DEFAULT_MAX_RSS_GB, round(share, 1))


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


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's `malloc_trim`, found among the symbols the process has loaded; None where the C library has none.
    Not by `ctypes.util.find_library`: that runs `ldconfig -p` in a child process, which a simulator holding
    gigabytes would start at every env it builds or closes (and a memory sampler would take the child, a copy
    of the simulator until it execs, for a simulator more)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def give_back_free_memory() -> None:
    """Return the C heap's free pages to the system (glibc keeps them otherwise: the compiler's scratch
    and a closed env's model would stay resident)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def simulator_budget(configured: float | None, simulators: int, on_this_machine: bool) -> tuple[float, str]:
    """Each simulator's memory budget in GB, and where it came from (one line, for the run's events).

    `configured`: `[env] max_simulator_rss_gb`, which wins; else a share of this machine's available
    memory when the simulators run here (`on_this_machine`), else the floor (the memory of a cluster's
    other nodes is not read from here)."""
    if configured is not None:
        return configured, "[env] max_simulator_rss_gb"
    if not on_this_machine:
        return DEFAULT_MAX_RSS_GB, "the floor (the simulators run on other machines)"
    available = available_bytes()
    if available is None:
        return DEFAULT_MAX_RSS_GB, "the floor (this machine does not say its available memory)"
    gb = default_budget_gb(simulators, available)
    return gb, (f"{MACHINE_SHARE:g} of the {available / 1e9:.1f} GB available when the run started, shared by "
                f"{simulators} simulator{'s' if simulators != 1 else ''} (at least {DEFAULT_MAX_RSS_GB:g} GB)")


def _forget_peak() -> bool:
    """Set this process's peak resident size (VmHWM) to its size now, so the next peak is one call's own
    (Linux: /proc/self/clear_refs); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryBudget:
    """What a simulator process may hold (DESIGN §12), and what a new env of each suite costs at its peak.

    A call that builds an env is measured from its start to its end (the build, the first reset's
    digests): the process's peak is set to its size at the start, so the rise of the peak over that
    size is the build's exact cost. A process's first build also pays for what happens once (the GL
    context, the libraries' first use), so a suite is priced by its costliest later build (beside the
    envs the process holds) once one was measured, by its first until then; a suite's tasks share
    their scene, and so does a suite that perturbs only its base's wording, goal or placement (the
    adapter prices it as its base: `Catalog.scene_suite`). A suite not measured yet is built alone.
    Where the peak cannot be set, the rise over the lifetime peak bounds the cost, and every build is
    priced as a first.
    """

    def __init__(self, max_rss_gb: float | None):
        self.limit = None if max_rss_gb is None else int(max_rss_gb * 1e9)
        self.cost: dict[str, int] = {}  # suite -> its costliest build after the process's first
        self.first_cost: dict[str, int] = {}  # suite -> the costliest build that paid for the first time
        self.builds = 0
        self._watch: tuple[str, int, bool] | None = None

    def price(self, suite: str) -> int | None:
        """What building an env of `suite` costs at its peak, as measured; None before its first build."""
        return self.cost.get(suite, self.first_cost.get(suite))

    def fits(self, suite: str) -> bool:
        """Whether an env of `suite` can be built beside what the process holds now."""
        if self.limit is None:
            return True
        price = self.price(suite)
        return price is not None and _memory()[0] + price <= self.limit

    def over(self) -> bool:
        """Whether the process holds more than its budget now."""
        return self.limit is not None and _memory()[0] > self.limit

    def building(self, suite: str) -> None:
        """An env of `suite` is about to be built: measure from here."""
        after_first = _forget_peak() and self.builds > 0
        self.builds += 1
        self._watch = (suite, _memory()[0], after_first)

    def settle(self) -> None:
        """The call that built an env (if one did) is over: give the scratch back and note what it cost."""
        if self._watch is None:
            return
        (suite, rss, after_first), self._watch = self._watch, None
        give_back_free_memory()
        costs = self.cost if after_first else self.first_cost
        costs[suite] = max(costs.get(suite, 0), _memory()[1] - rss)


def settles_memory(method):
    """Mark a method that may build an env: the budget learns what the build cost when it returns."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            self._memory.settle()

    return call
