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
from typing import Any

import numpy as np


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
        self._free: asyncio.Queue[SimProcess] = asyncio.Queue()
        for sim in self._sims:
            self._free.put_nowait(sim)
        self._spec, self._kwargs = adapter_spec, adapter_kwargs

    async def acquire(self) -> SimProcess:
        """Wait for a free simulator; a dead one is replaced by a fresh process."""
        sim = await self._free.get()
        if not sim.alive():
            idx = self._sims.index(sim)
            sim = SimProcess(self._spec, self._kwargs, name=sim.name, log_path=self._log_path)
            self._sims[idx] = sim
        return sim

    def release(self, sim: SimProcess) -> None:
        """Give a simulator back."""
        self._free.put_nowait(sim)

    def close(self) -> None:
        """Stop every simulator process."""
        for sim in self._sims:
            sim.stop()


def as_float_chunk(actions: Any) -> np.ndarray:
    """A policy's action chunk as a 2-D float64 array."""
    arr = np.asarray(actions, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"action chunk must be 2-D, got shape {arr.shape}")
    return arr
