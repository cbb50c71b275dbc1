"""The in-process policy served from processes of its own, so the command process is not the bound.

Served inside the command's event loop, the embedded policy saturates one core at a
handful of simulators. Each policy process serves the factory on loopback in its own
asyncio loop; each arm's connection goes to the next process (`Peers.next_policy_url`).
Like a simulator, a policy process ignores the driver's signals (the driver drains its
arms, then stops it) and dies with the driver, however the driver ends.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
import traceback
from typing import Any

import structlog

from rescue.core.failfast import PeerUnreachable, one_line
from rescue.env.pool import die_with, ignore_driver_signals, quiet, shield_args, start_shielded
from rescue_serve.limits import DEFAULT_MAX_CONNECTIONS

log = structlog.get_logger()

# How long a policy process may take to import its factory, build a policy and listen (torch included, on a
# busy machine): a bound on a hang, not a claim about speed.
START_S = 300.0
# How long a policy process may take to close its connections and exit when asked.
STOP_S = 10.0


class PolicyProcessError(PeerUnreachable):
    """A policy process did not start (its factory failed, or it died): the command stops with nothing run."""


def _serve(conn: Any, factory: str, log_path: str | None, max_connections: int, parent: int, by_signal: bool) -> None:
    """Process main: serve `factory` on loopback, send the URL, serve until told to stop, send the counts."""
    die_with(parent, by_signal)
    ignore_driver_signals()
    quiet(log_path)
    from rescue.study import logs

    logs.configure(None, verbose=True)  # this process's events, as text, to its log
    asyncio.run(_serve_until_stopped(conn, factory, max_connections))


async def _serve_until_stopped(conn: Any, factory: str, max_connections: int) -> None:
    from rescue.policy.bundled import serve_factory

    try:
        server = await serve_factory(factory, max_connections=max_connections)
    except BaseException as exc:  # told to the driver in one line; the traceback goes to the log
        traceback.print_exc()
        conn.send(("error", f"{type(exc).__name__}: {one_line(str(exc))}"))
        return
    conn.send(("ready", server.url))
    try:
        await asyncio.to_thread(conn.recv)  # "stop"; EOFError: the driver is gone
    except EOFError:
        pass
    counts = {"connections": server.connections, "requests": server.requests}
    await server.stop()
    try:
        conn.send(("stopped", counts))
    except (BrokenPipeError, OSError):
        pass  # the driver is gone: nobody to tell


class PolicyProcess:
    """One process serving the in-process policy on loopback; `url` is set once it listens."""

    def __init__(self, factory: str, name: str = "policy", log_path: str | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.factory = factory
        self.name = name
        self.url: str | None = None
        self._proc = ctx.Process(target=_serve, args=(child, factory, log_path, max_connections, *shield_args()),
                                 name=name, daemon=True)
        start_shielded(self._proc)
        child.close()

    @property
    def pid(self) -> int | None:
        """The process id (None before start)."""
        return self._proc.pid

    def wait_url(self, timeout: float = START_S) -> str:
        """Wait until the process listens and return its URL; PolicyProcessError when it fails or does not."""
        try:
            answered = self._conn.poll(timeout)
            kind, payload = self._conn.recv() if answered else ("error", f"no answer within {timeout:g} s")
        except (EOFError, OSError):
            self._proc.join(1.0)
            kind, payload = "error", f"the process died (exit code {self._proc.exitcode})"
        if kind != "ready":
            raise PolicyProcessError(f"the policy {self.factory!r} could not be served from a process of its own "
                                     f"({payload}); fix policy.factory, or serve it in the command process with "
                                     "--policy-processes 0; nothing was claimed")
        self.url = payload
        return payload

    def ask_to_stop(self) -> None:
        """Tell the process to close its connections and exit (`finish` waits for it)."""
        if self._proc.is_alive():
            try:
                self._conn.send("stop")
            except (BrokenPipeError, OSError):
                pass  # it is going already

    def finish(self, timeout: float = STOP_S) -> dict[str, int] | None:
        """Wait for a process asked to stop (kill it if it does not go); its counts of connections and
        requests, or None when it could not tell."""
        counts = None
        try:
            while self._conn.poll(timeout):
                kind, payload = self._conn.recv()
                if kind == "stopped":
                    counts = payload
                    break
        except (EOFError, OSError):
            pass  # it ended without a word
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        return counts

    def stop(self, timeout: float = STOP_S) -> dict[str, int] | None:
        """Ask the process to stop and wait for it; its counts, as `finish` says."""
        self.ask_to_stop()
        return self.finish(timeout)


def serve_in_processes(factory: str, n: int, log_path: str | None = None, timeout: float = START_S,
                       max_connections: int = DEFAULT_MAX_CONNECTIONS) -> list[PolicyProcess]:
    """Start `n` policy processes serving `factory` and wait until each listens (within `timeout` in all);
    PolicyProcessError, with every process stopped, when one does not."""
    processes = [PolicyProcess(factory, f"policy-{i}", log_path, max_connections) for i in range(n)]
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.wait_url(max(0.0, deadline - time.monotonic()))
    except BaseException:
        for process in processes:
            process.stop(timeout=1.0)
        raise
    log.info("policy.processes", factory=factory, pids=[p.pid for p in processes], urls=[p.url for p in processes])
    return processes


def stop_processes(processes: list[PolicyProcess]) -> None:
    """Stop every policy process (all asked first, then each waited for), logging what each served."""
    for process in processes:
        process.ask_to_stop()
    for process in processes:
        counts = process.finish() or {}
        log.info("policy.process_stopped", pid=process.pid, connections=counts.get("connections"),
                 requests=counts.get("requests"))
