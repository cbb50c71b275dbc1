"""Simulators in their own processes, driven from asyncio.

Physics and rendering are CPU-bound Python; one process per simulator lets
arms use every core while the event loop stays free for policy and VLM I/O.
A simulator process is held by one arm at a time.
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing as mp
import os
import threading
import traceback
from typing import Any, Callable

import numpy as np
import structlog

log = structlog.get_logger()


class SimulatorError(RuntimeError):
    """The simulator process failed or died; the message carries its traceback."""


def _load(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _quiet(log_path: str | None) -> None:
    """Send the simulator's own chatter (import banners, renderer warnings) to a file, not the terminal."""
    target = os.open(log_path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)


def _serve(conn, adapter_spec: str, adapter_kwargs: dict, log_path: str | None = None) -> None:
    """Process main: build the adapter, then answer (method, args) requests until told to stop."""
    _quiet(log_path)
    try:
        adapter = _load(adapter_spec)(**adapter_kwargs)
    except BaseException:  # report the failure instead of dying silently
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        if method == "stop":
            break
        try:
            reply = ("ok", getattr(adapter, method)(*args))
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break  # the driver is gone (killed or crashed): nothing to answer
    adapter.close()


class SimProcess:
    """One simulator process with a blocking call interface, wrapped for asyncio."""

    def __init__(self, adapter_spec: str, adapter_kwargs: dict | None = None, name: str = "sim", log_path: str | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        args = (child, adapter_spec, adapter_kwargs or {}, log_path)
        self._proc = ctx.Process(target=_serve, args=args, name=name, daemon=True)
        self._lock = threading.Lock()
        self.name = name
        self._proc.start()
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
        if kind == "error":
            raise SimulatorError(f"{self.name}.{method} failed:\n{payload}")
        return payload

    async def call(self, method: str, *args) -> Any:
        """Call an adapter method in the simulator process without blocking the loop."""
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
    """A fixed set of simulator processes handed to arms one at a time."""

    def __init__(self, size: int, adapter_spec: str, adapter_kwargs: dict | None = None, log_path: str | None = None):
        self._log_path = log_path
        self._sims = [SimProcess(adapter_spec, adapter_kwargs, name=f"sim-{i}", log_path=log_path) for i in range(size)]
        self._free: list[SimProcess] = list(self._sims)
        self._changed = asyncio.Condition()
        self._spec, self._kwargs = adapter_spec, adapter_kwargs

    async def acquire(self, prefer: Callable[[SimProcess], int] | None = None) -> SimProcess:
        """Wait for a free simulator (the one `prefer` ranks highest); a dead one is replaced."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._free))
            sim = max(self._free, key=prefer) if prefer else self._free[0]
            self._free.remove(sim)
        if not sim.alive():
            idx = self._sims.index(sim)
            sim = SimProcess(self._spec, self._kwargs, name=sim.name, log_path=self._log_path)
            self._sims[idx] = sim
        return sim

    def release(self, sim: SimProcess) -> None:
        """Give a simulator back."""
        self._free.append(sim)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify()

    def close(self) -> None:
        """Stop every simulator process."""
        for sim in self._sims:
            sim.stop()


class SimLease:
    """An arm's hold on a simulator of the pool; while the arm waits for the VLM it lets go.

    `suspend` snapshots the simulator and returns it to the pool, so another arm
    can use it; `resume` takes a simulator back (the same one when nobody used it
    meanwhile, else one restored from the snapshot).
    """

    def __init__(self, pool: SimPool):
        self._pool = pool
        self.sim: SimProcess | None = None
        self._snapshot: Any = None
        self._key: Any = None

    async def acquire(self) -> "SimLease":
        """Take a simulator, preferring one that has this lease's task loaded."""
        self.sim = await self._pool.acquire(self._rank)
        self.sim.holder = self
        return self

    def _rank(self, sim: SimProcess) -> int:
        if getattr(sim, "holder", None) is self:
            return 2
        return 1 if self._key is not None and getattr(sim, "task_key", None) == self._key else 0

    async def call(self, method: str, *args: Any) -> Any:
        """Call the held simulator."""
        if self.sim is None:
            raise SimulatorError("the lease holds no simulator")
        if method == "reset":
            self._key = (args[0]["suite"], args[0]["task_id"])
            self.sim.task_key = self._key
        return await self.sim.call(method, *args)

    async def suspend(self) -> None:
        """Snapshot the simulator and give it back to the pool."""
        self._snapshot = await self.call("snapshot")
        sim, self.sim = self.sim, None
        self._pool.release(sim)
        log.info("sim.suspended", sim=sim.name)

    async def resume(self) -> None:
        """Hold a simulator again, in the state the arm left."""
        sim = await self._pool.acquire(self._rank)
        reused = getattr(sim, "holder", None) is self
        self.sim, sim.holder, sim.task_key = sim, self, self._key
        if not reused:
            await self.sim.call("restore", self._snapshot)
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
