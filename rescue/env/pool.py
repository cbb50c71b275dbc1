"""Simulators in their own processes, driven from asyncio.

Physics and rendering are CPU-bound Python; one process per simulator lets
arms use every core while the event loop stays free for policy and VLM I/O.
A simulator process is held by one arm at a time. The helpers that shield a
child from the driver's signals and end it with the driver serve every kind of
child the driver starts (the policy processes too).
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing import resource_tracker
from typing import Any, Callable

import numpy as np
import structlog

from rescue.core.configuration.names import resolve
from rescue.env.protocol import CaseLike, ChunkResult, Observe, ProfileLike, ProtocolLike, ResetResult, case_fields

log = structlog.get_logger()


class SimulatorError(RuntimeError):
    """The simulator process failed or died; the message carries its traceback."""


def quiet(log_path: str | None) -> None:
    """Send a child's own chatter (import banners, renderer warnings) to a file, not the terminal."""
    target = os.open(log_path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)


# Signals meant for the driver: a terminal's Ctrl-C reaches the whole foreground process group,
# and a child (a simulator, a policy process) must outlive it so that the arms in flight can finish (the
# driver drains, then stops its children itself). A child starts with them blocked (see `start_shielded`)
# and ignores them.
DRIVER_SIGNALS = (signal.SIGINT, signal.SIGTERM)


# How often a child's watchdog looks whether its driver still lives.
PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(parent: int, by_signal: bool) -> None:
    """A child (a simulator) never outlives its driver, however the driver ends (SIGKILL included): the kernel
    kills it when its creating thread ends (`PR_SET_PDEATHSIG`, Linux; only when the driver's main
    thread spawned it, since a worker thread may end before the process does), and a watchdog thread
    ends it once its parent is no longer `parent` (any POSIX system; within PARENT_POLL_S). Without them a
    simulator that was booting or stepping when the driver died went on for as long as that took,
    and kept the multiprocessing resource tracker alive with it."""
    if by_signal and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog still does it
    if os.getppid() != parent:  # the driver died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def ignore_driver_signals() -> None:
    """In a child started by `start_shielded`: ignore the driver's signals from now on (the driver stops it)."""
    for sig in DRIVER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, DRIVER_SIGNALS)  # a pending one is discarded: ignored


def shield_args() -> tuple[int, bool]:
    """The (parent, by_signal) a child started from here passes to `die_with`: by the kernel's signal only
    when this is the main thread, whose end is the process's."""
    return os.getpid(), threading.current_thread() is threading.main_thread()


_spawn_lock = threading.Lock()


def start_shielded(process: Any, hash_seed: str | None = None) -> None:
    """Start a spawned `process` with PYTHONHASHSEED `hash_seed` (None: this process's environment's) and the
    driver's signals blocked.

    A spawned child reads PYTHONHASHSEED from the environment it inherits at start, and inherits this
    thread's signal mask: blocked, the driver's signals cannot kill it while it boots, before it calls
    `ignore_driver_signals` (a signal sent meanwhile waits for this thread)."""
    with _spawn_lock:
        before = os.environ.get("PYTHONHASHSEED")
        if hash_seed is not None:
            os.environ["PYTHONHASHSEED"] = hash_seed
        # A spawned process's start first starts multiprocessing's resource tracker if it is not running (the
        # process's first spawn), and that unblocks SIGINT and SIGTERM in this thread whatever they were before:
        # the first simulator of a run booted unshielded, and a Ctrl-C then killed it under its first arm. Started
        # here, before the mask is set, the tracker's start cannot undo it.
        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, DRIVER_SIGNALS)
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if before is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = before


def _serve(conn, adapter_spec: str, adapter_kwargs: dict, log_path: str | None = None,
           parent: int | None = None, pdeathsig: bool = False) -> None:
    """Process main: build the adapter, then answer (method, args) requests until told to stop."""
    if parent is not None:
        die_with(parent, pdeathsig)
    ignore_driver_signals()
    quiet(log_path)
    try:
        adapter = resolve(adapter_spec)(**adapter_kwargs)
    except BaseException:  # report the failure instead of dying silently
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    answer_calls(conn, adapter)
    adapter.close()


def answer_calls(conn, adapter: Any, until: tuple[str, ...] = ("stop",)) -> bool:
    """Answer (method, args) requests with the adapter's replies until one of `until` comes (True) or the
    driver is gone (False: killed, crashed or closed its end)."""
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return False
        if method in until:
            return True
        try:
            reply = ("ok", getattr(adapter, method)(*args))
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return False  # the driver is gone (killed or crashed): nothing to answer


class Simulator:
    """Async typed proxy of an EnvAdapter living in a simulator process (the arm's view of a simulator).

    Subclasses supply `_invoke`; every adapter method is a typed coroutine here.
    """

    async def _invoke(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    async def task_instruction(self, case: CaseLike) -> str:
        """The task's own instruction for a case."""
        return await self._invoke("task_instruction", case)

    async def reset(self, case: CaseLike, profile: ProfileLike = None, protocol: ProtocolLike = None) -> ResetResult:
        """Start the case's episode as `protocol` says (None: rescue); observations follow `profile` (None: privileged)."""
        return await self._invoke("reset", case, profile, protocol)

    async def run_chunk(self, actions: np.ndarray, max_steps: int, observe: Observe = "always") -> ChunkResult:
        """Step through actions (at most max_steps), stopping early on success."""
        return await self._invoke("run_chunk", actions, max_steps, observe)

    async def render(self, cameras: list[str], size: int = 256) -> dict[str, np.ndarray]:
        """Render the named cameras now, upright uint8 HxWx3."""
        return await self._invoke("render", list(cameras), size)

    async def snapshot(self) -> dict:
        """The simulator's state, restorable in any simulator process."""
        return await self._invoke("snapshot")

    async def restore(self, snap: dict) -> None:
        """Put the simulator in a snapshot's state."""
        await self._invoke("restore", snap)

    async def state_digest(self) -> str:
        """Digest of the full simulator state now."""
        return await self._invoke("state_digest")

    # The tasks loaded through this proxy (reset, restore), least recent first. The process may have
    # closed some of their envs since (its memory budget): where an arm goes is a preference, never a result.
    _task_keys: tuple[tuple[str, int], ...] = ()

    @property
    def task_key(self) -> tuple[str, int] | None:
        """(suite, task_id) the simulator loaded last, or None."""
        return self._task_keys[-1] if self._task_keys else None

    def loaded_tasks(self) -> tuple[tuple[str, int], ...]:
        """The tasks loaded through this proxy, most recent first."""
        return self._task_keys[::-1]

    def recency(self, key: tuple[str, int] | None) -> int:
        """How recently the simulator loaded `key`'s task: 0 never, higher the more recent."""
        return self._task_keys.index(key) + 1 if key in self._task_keys else 0

    def _answer(self, method: str, args: tuple, kind: str, payload: Any) -> Any:
        """A simulator process's reply to a call: its payload, or SimulatorError for an error reply."""
        if kind == "error":
            raise SimulatorError(f"{self.name}.{method} failed:\n{payload}")
        self._note(method, args)
        return payload

    def _note(self, method: str, args: tuple) -> None:
        """Track the loaded task after a call that succeeded."""
        key = None
        if method == "reset":
            c = case_fields(args[0])
            key = (c.suite, c.task_id)
        elif method == "restore" and isinstance(args[0], dict) and "key" in args[0]:
            key = tuple(args[0]["key"])
        if key is not None:
            self._task_keys = (*(k for k in self._task_keys if k != key), key)


# The hash seed of simulator processes: LIBERO builds parts of its scene by iterating sets,
# so the process's hash seed must be pinned for everything it builds to be the same everywhere.
SIM_HASH_SEED = "0"


class SimProcess(Simulator):
    """One simulator process with a blocking call interface, wrapped for asyncio."""

    def __init__(
        self,
        adapter_spec: str,
        adapter_kwargs: dict | None = None,
        name: str = "sim",
        log_path: str | None = None,
        hash_seed: str | int = SIM_HASH_SEED,
    ):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # The child dies with this process (see `die_with`).
        args = (child, adapter_spec, adapter_kwargs or {}, log_path, *shield_args())
        self._proc = ctx.Process(target=_serve, args=args, name=name, daemon=True)
        self._lock = threading.Lock()
        self.name = name
        self.hash_seed = str(hash_seed)
        start_shielded(self._proc, self.hash_seed)
        child.close()
        self._started = False

    def _call(self, method: str, *args) -> Any:
        with self._lock:
            try:
                if not self._started:
                    kind, payload = self._conn.recv()
                    if kind == "error":
                        raise SimulatorError(f"{self.name} failed to start:\n{payload}")
                    self._started = True
                self._conn.send((method, args))
                kind, payload = self._conn.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
                raise SimulatorError(f"{self.name} died (exit code {self._proc.exitcode})") from exc
        return self._answer(method, args, kind, payload)

    async def _invoke(self, method: str, *args: Any) -> Any:
        # A thread keeps the event loop free while the process computes.
        return await asyncio.to_thread(self._call, method, *args)

    def alive(self) -> bool:
        """True while the process runs."""
        return self._proc.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the process to exit; kill it if it does not."""
        if self._proc.is_alive():
            try:
                with self._lock:
                    self._conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()


class SimPool:
    """A fixed set of simulator processes handed to arms one at a time.

    `lease`: where simulators are leased from before processes of the pool's own are started (a warm pool,
    rescue.env.warm): called as lease(spec, kwargs, name=, log_path=, hash_seed=), it returns a simulator or
    None. A leased simulator goes back when the pool closes."""

    def __init__(
        self,
        size: int,
        adapter_spec: str,
        adapter_kwargs: dict | None = None,
        log_path: str | None = None,
        hash_seed: str | int = SIM_HASH_SEED,
        lease: Callable[..., Simulator | None] | None = None,
    ):
        self._log_path = log_path
        self._lease = lease
        self._init_queue(hash_seed)
        self._sims = [self._spawn(f"sim-{i}", adapter_spec, adapter_kwargs) for i in range(size)]
        self._free: list[SimProcess] = list(self._sims)
        self._spec, self._kwargs = adapter_spec, adapter_kwargs

    def _init_queue(self, hash_seed: str | int) -> None:
        self._hash_seed = str(hash_seed)
        self._changed = asyncio.Condition()
        self._urgent = 0  # waiters for arms of cases already started: they go before new cases
        # Who held each simulator last (by name): a lease that comes back to the
        # simulator it left finds its state untouched and needs no restore.
        self._last_holder: dict[str, object] = {}
        # Set when no simulator can be had any more; every taker is told this reason.
        self._failure: str | None = None

    def _spawn(self, name: str, spec: str, kwargs: dict | None) -> Simulator:
        if self._lease is not None:
            sim = self._lease(spec, kwargs or {}, name=name, log_path=self._log_path, hash_seed=self._hash_seed)
            if sim is not None:
                return sim
        return SimProcess(spec, kwargs, name=name, log_path=self._log_path, hash_seed=self._hash_seed)

    @property
    def hash_seed(self) -> str:
        """PYTHONHASHSEED of every simulator process of the pool (recorded with a study)."""
        return self._hash_seed

    async def acquire(self, prefer: Callable[[SimProcess], Any] | None = None) -> SimProcess:
        """Wait for a free simulator (the one `prefer` ranks highest); a dead one is replaced."""
        sim, _ = await self.take(prefer)
        return sim

    async def take(
        self, prefer: Callable[[SimProcess], Any] | None = None, holder: object | None = None, urgent: bool = True
    ) -> tuple[SimProcess, bool]:
        """Like acquire, for a named holder; also says whether the holder had this simulator last
        (so its state is exactly as the holder left it: nobody acquired it in between).

        A non-urgent taker (a worker about to claim a new case) waits while any urgent one (an
        arm of a case already started) does: started cases finish before new ones begin."""
        sim = await self._next_free(prefer, urgent)
        if not sim.alive():
            sim.stop()  # a leased warm simulator goes back (a dead process has nothing to stop)
            idx = self._sims.index(sim)
            self._last_holder.pop(sim.name, None)
            sim = self._spawn(sim.name, self._spec, self._kwargs)
            self._sims[idx] = sim
        return sim, self._hand_to(sim, holder)

    async def _next_free(self, prefer: Callable[[Any], Any] | None, urgent: bool) -> Any:
        """Wait for a free simulator (urgent takers first) and take it off the free list."""
        async with self._changed:
            if urgent:
                self._urgent += 1
            try:
                await self._changed.wait_for(
                    lambda: self._failure is not None or (bool(self._free) and (urgent or self._urgent == 0))
                )
            finally:
                if urgent:
                    self._urgent -= 1
                    self._changed.notify_all()
            if self._failure is not None:
                raise SimulatorError(self._failure)
            sim = max(self._free, key=prefer) if prefer else self._free[0]
            self._free.remove(sim)
            return sim

    def _hand_to(self, sim: Any, holder: object | None) -> bool:
        """Record the new holder; True when it held this simulator last (its state is untouched)."""
        previous = self._last_holder.get(sim.name)
        self._last_holder[sim.name] = holder
        return holder is not None and previous is holder

    def last_holder(self, sim: SimProcess) -> object | None:
        """Who took this simulator last (None after an anonymous acquire)."""
        return self._last_holder.get(sim.name)

    def release(self, sim: SimProcess) -> None:
        """Give a simulator back."""
        self._free.append(sim)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        """Stop every simulator process."""
        for sim in self._sims:
            sim.stop()


class SimLease(Simulator):
    """An arm's hold on a simulator of the pool; while the arm waits for the VLM it lets go.

    It is itself a Simulator: the typed methods go to the held process. `suspend`
    snapshots the simulator and returns it to the pool, so another arm can use it;
    `resume` takes a simulator back (the same one when nobody used it meanwhile,
    else one restored from the snapshot).
    """

    def __init__(self, pool: SimPool, task: tuple[str, int] | None = None):
        """`task`: the (suite, task_id) the arm will reset, when known: a simulator that loaded it is preferred."""
        self._pool = pool
        self.sim: SimProcess | None = None
        self._snapshot: dict | None = None
        self._key: tuple[str, int] | None = task
        # Whether the last resume restored the snapshot into a simulator another arm had used.
        self.restored = False

    async def acquire(self, urgent: bool = True) -> "SimLease":
        """Take a simulator, preferring one that has this lease's task loaded (urgent: for a started case)."""
        self.sim, _ = await self._pool.take(self._rank, holder=self, urgent=urgent)
        return self

    def _rank(self, sim: SimProcess) -> tuple[bool, int]:
        # The simulator this lease left (its state untouched), then the one that loaded the task most recently.
        return self._pool.last_holder(sim) is self, sim.recency(self._key)

    async def _invoke(self, method: str, *args: Any) -> Any:
        if self.sim is None:
            raise SimulatorError("the lease holds no simulator")
        if method == "reset":
            c = case_fields(args[0])
            self._key = (c.suite, c.task_id)
        return await self.sim._invoke(method, *args)

    async def suspend(self) -> None:
        """Snapshot the simulator and give it back to the pool."""
        self._snapshot = await self.snapshot()
        sim, self.sim = self.sim, None
        self._pool.release(sim)
        log.info("sim.suspended", sim=sim.name)

    async def resume(self) -> None:
        """Hold a simulator again, in the state the arm left."""
        # A fresh process (the old one died) or one another arm used must be restored.
        sim, reused = await self._pool.take(self._rank, holder=self)
        self.sim = sim
        if not reused:
            await self.sim.restore(self._snapshot)
        self.restored = not reused
        self._snapshot = None
        log.info("sim.resumed", sim=sim.name, restored=not reused)

    def release(self) -> None:
        """Give the simulator back for good."""
        if self.sim is not None:
            sim, self.sim = self.sim, None
            self._pool.release(sim)


def as_float_chunk(actions: Any) -> np.ndarray:
    """A policy's action chunk as a 2-D float64 array."""
    arr = np.asarray(actions, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"action chunk must be 2-D, got shape {arr.shape}")
    return arr
