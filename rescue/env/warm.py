"""Simulators that outlive one study: a warm pool that runs lease from (opt-in).

`rescue serve-simulators DIR --size N` keeps N simulator processes running, each listening on
DIR/sim-<i>.sock. A run given `--warm-simulators DIR` (or RESCUE_WARM_SIMULATORS=DIR) leases the free
ones before it starts processes of its own, and hands them back when it ends. A warm simulator keeps
the LIBERO envs it built (within its memory budget), so a study that runs a task another study ran
before starts without importing LIBERO, building the env or paying its first reset: about 3 CPU-s
per simulator on a warm compiled-model cache (docs/benchmarks.md).

A lease is an exclusive lock on DIR/sim-<i>.lock, held by the run's process: the kernel releases it
when that process ends, however it ends (SIGKILL included), and the simulator goes back to waiting
for the next run. A run gets the same simulator it would start itself or none: the warm simulator
must have been started from the same Python and package, with the run's hash seed and the
environment the adapter reads (renderer, compiled-model cache); anything else is refused and the
run starts its own. Nothing about a study depends on where its simulators came from: every arm
starts with a reset or a restore, which put a simulator in the same state whatever it ran before
(the fingerprints prove it, as for simulators a study reuses between its own cases).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import structlog

from rescue.core.configuration.names import resolve
from rescue.env.pool import (
    SIM_HASH_SEED,
    Simulator,
    SimulatorError,
    answer_calls,
    die_with,
    ignore_driver_signals,
    quiet,
    shield_args,
    start_shielded,
)

log = structlog.get_logger()

# The environment variable a run reads when `--warm-simulators` is not given (`off`: none).
WARM_ENV = "RESCUE_WARM_SIMULATORS"
# The adapter a warm pool serves unless told otherwise.
DEFAULT_ADAPTER = "rescue.env.libero:LiberoAdapter"
# What the adapter reads from the environment: a warm simulator serves only runs that agree on each.
ADAPTER_ENVIRONMENT = ("MUJOCO_GL", "PYOPENGL_PLATFORM", "RESCUE_MODEL_CACHE")
# How long a run waits for a leased simulator to answer (it may be finishing a call of a run that died).
ANSWER_S = 30.0
# How often the server looks for a simulator that died (it is started again).
WATCH_S = 1.0
# What stops the server a command keeps for itself (`kept_warm`), and how long it may take.
KEPT_STOP = signal.SIGUSR1
STOP_S = 30.0
KEY, READY, LOG = "key", "ready", "simulators.log"
# The longest path a Unix socket may have (sun_path holds 108 bytes on Linux, 104 on macOS, with its NUL).
SOCKET_PATH_MAX = 103


def warm_folder(given: str | None) -> str | None:
    """The warm pool a run leases from: `given` (a flag), else RESCUE_WARM_SIMULATORS; None for none or `off`."""
    value = given if given is not None else os.environ.get(WARM_ENV)
    return None if not value or value == "off" else value


def _facts(hash_seed: str) -> dict[str, Any]:
    """What must be the same in a run and a warm simulator for the simulator to be the run's own."""
    import rescue

    return {
        "python": sys.executable,
        "package": os.path.dirname(os.path.abspath(rescue.__file__)),
        "hash_seed": hash_seed,
        **_adapter_environment(),
    }


def _adapter_environment() -> dict[str, str | None]:
    """ADAPTER_ENVIRONMENT's values as the LIBERO adapter takes them (its renderer defaults: rescue.env.libero)."""
    values = {name: os.environ.get(name) for name in ADAPTER_ENVIRONMENT}
    values["MUJOCO_GL"] = values["MUJOCO_GL"] or "egl"
    values["PYOPENGL_PLATFORM"] = values["PYOPENGL_PLATFORM"] or values["MUJOCO_GL"]
    return values


def _socket(folder: Path, index: int) -> Path:
    return folder / f"sim-{index}.sock"


def _lock(folder: Path, index: int) -> Path:
    return folder / f"sim-{index}.lock"


# -- the warm simulator process ------------------------------------------------------------------------


def _warm_main(ready, folder: str, index: int, adapter_spec: str, parent: int, pdeathsig: bool) -> None:
    """Process main: listen on the socket; serve one run at a time, keeping the adapter (its envs) between runs."""
    die_with(parent, pdeathsig)
    ignore_driver_signals()
    root = Path(folder)
    own_log = str(root / LOG)
    quiet(own_log)
    path = _socket(root, index)
    path.unlink(missing_ok=True)
    listener = mpc.Listener(str(path), family="AF_UNIX", authkey=(root / KEY).read_bytes())
    ready.send(os.getpid())
    ready.close()
    facts = _facts(os.environ.get("PYTHONHASHSEED", ""))
    adapter, kwargs_now = None, None
    while True:
        try:
            conn = listener.accept()
        except (OSError, EOFError, mpc.AuthenticationError):
            continue
        try:
            kind, wanted = conn.recv()
            refused = _refusal(kind, wanted, adapter_spec, facts)
            if refused:
                conn.send(("refused", refused))
                continue
            quiet(wanted["log_path"])  # the lease's lines go to the run's simulator log
            kwargs = wanted["kwargs"]
            if adapter is not None and kwargs != kwargs_now and not _retarget(adapter, kwargs):
                adapter.close()
                adapter = None
            if adapter is None:
                try:
                    adapter = resolve(adapter_spec)(**kwargs)
                except BaseException:
                    import traceback

                    conn.send(("error", traceback.format_exc()))
                    continue
            kwargs_now = kwargs
            conn.send(("ready", os.getpid()))
            answer_calls(conn, adapter, until=("release", "stop"))
        except (EOFError, OSError):
            pass  # the run died before or during its lease: the next one resets or restores
        finally:
            conn.close()
            quiet(own_log)


def _refusal(kind: str, wanted: dict, adapter_spec: str, facts: dict) -> str | None:
    """Why a run may not lease this simulator; None when it may."""
    if kind != "lease":
        return f"not a lease: {kind!r}"
    if wanted.get("spec") != adapter_spec:
        return f"it serves {adapter_spec}, not {wanted.get('spec')}"
    differ = [name for name, value in facts.items() if wanted.get("facts", {}).get(name) != value]
    return f"it differs in {', '.join(differ)}" if differ else None


def _retarget(adapter: Any, kwargs: dict) -> bool:
    """Whether the adapter took a new run's settings without being built again (the memory budget can change)."""
    retarget = getattr(adapter, "retarget", None)
    return bool(retarget is not None and retarget(**kwargs))


# -- the server ------------------------------------------------------------------------------------


class _Member:
    """One warm simulator process of the server."""

    def __init__(self, folder: Path, index: int, adapter_spec: str, hash_seed: str):
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_warm_main, args=(theirs, str(folder), index, adapter_spec, *shield_args()),
                                   name=f"warm-sim-{index}", daemon=True)
        start_shielded(self.process, hash_seed)
        theirs.close()
        self._ready = mine

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.poll(timeout):
            raise SimulatorError(f"{self.process.name} did not start listening within {timeout:g} s")
        try:
            self._ready.recv()
        except EOFError:
            raise SimulatorError(f"{self.process.name} failed to start (exit code {self.process.exitcode})") from None


def serve(folder: str, size: int, adapter_spec: str = DEFAULT_ADAPTER, hash_seed: str | int = SIM_HASH_SEED,
          start_s: float = 120.0, stop_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Keep `size` warm simulators listening in `folder` until one of `stop_signals`; one that dies is started
    again. `folder/ready` holds the server's pid once every simulator listens."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    longest = len(str(_socket(root.resolve(), size - 1)).encode())
    if longest > SOCKET_PATH_MAX:
        raise SimulatorError(f"{folder}: too long a path for the simulators' sockets ({longest} bytes, at most "
                             f"{SOCKET_PATH_MAX}); name a shorter folder")
    if _listening(root):  # a pool serves the folder, or is starting to (its sockets listen before it writes READY)
        owner = (root / READY).read_text().split()[:1] if (root / READY).exists() else []
        raise SimulatorError(f"{folder}: a warm pool{f' (pid {owner[0]})' if owner else ''} serves it already")
    (root / READY).unlink(missing_ok=True)
    key = root / KEY
    key.write_bytes(secrets.token_bytes(32))
    key.chmod(0o600)
    stop = threading.Event()
    for sig in stop_signals:
        signal.signal(sig, lambda *_: stop.set())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    members = [_Member(root, i, adapter_spec, str(hash_seed)) for i in range(size)]
    try:
        for member in members:
            member.wait_ready(start_s)
        (root / READY).write_text(f"{os.getpid()} {size} {adapter_spec}\n")
        print(f"rescue: {size} warm simulator{'s' if size != 1 else ''} in {folder}", flush=True)
        while not stop.wait(WATCH_S):
            for i, member in enumerate(members):
                if not member.process.is_alive():
                    log.warning("warm.restarted", index=i, exitcode=member.process.exitcode)
                    members[i] = _Member(root, i, adapter_spec, str(hash_seed))
                    members[i].wait_ready(start_s)
    finally:
        (root / READY).unlink(missing_ok=True)
        for member in members:
            member.process.kill()
        for i, member in enumerate(members):
            member.process.join()
            _socket(root, i).unlink(missing_ok=True)


def _listening(root: Path) -> bool:
    """Whether a simulator of a pool listens in `root` (its first socket takes a connection)."""
    import socket

    with socket.socket(socket.AF_UNIX) as probe:
        return probe.connect_ex(str(_socket(root, 0))) == 0


def _server_main(folder: str, size: int, adapter_spec: str, parent: int, pdeathsig: bool) -> None:
    """Process main of a server that a command keeps for itself (`kept_warm`): it dies with the command, ignores
    the command's signals (a terminal's Ctrl-C reaches it too) and stops on KEPT_STOP, which the command sends."""
    die_with(parent, pdeathsig)
    ignore_driver_signals()
    quiet(str(Path(folder) / LOG))
    serve(folder, size, adapter_spec, stop_signals=(KEPT_STOP,))


@contextlib.contextmanager
def kept_warm(size: int, adapter_spec: str = DEFAULT_ADAPTER, start_s: float = 300.0) -> Iterator[str]:
    """A warm pool of `size` simulators for as long as the block runs (a worker between its jobs, the demo
    between its studies), in a new temporary folder it yields and removes after. The server and its
    simulators die with this process, however it ends, and ignore a terminal's Ctrl-C (the studies drain
    first, then the block ends and stops them)."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="rescue-warm-")
    ctx = mp.get_context("spawn")
    process = ctx.Process(target=_server_main, args=(folder, size, adapter_spec, *shield_args()), name="warm-simulators")
    start_shielded(process)
    try:
        deadline = time.monotonic() + start_s
        while not (Path(folder) / READY).exists():
            if not process.is_alive() or time.monotonic() > deadline:
                raise SimulatorError(f"the warm simulators in {folder} did not start (exit code {process.exitcode}); "
                                     f"see {Path(folder) / LOG}")
            time.sleep(0.1)
        yield folder
    finally:
        if process.pid is not None and process.is_alive():
            os.kill(process.pid, KEPT_STOP)  # it stops its simulators and waits for them
            process.join(STOP_S)
        if process.is_alive():
            process.kill()  # its simulators die with it (die_with)
        process.join()
        shutil.rmtree(folder, ignore_errors=True)


# -- a run's lease ---------------------------------------------------------------------------------


class WarmSim(Simulator):
    """A run's lease on a warm simulator: the typed calls of a simulator process; `stop` hands it back."""

    def __init__(self, conn, lock_fd: int, name: str, hash_seed: str, pid: int):
        self._conn, self._lock_fd = conn, lock_fd
        self._lock = threading.Lock()
        self.name, self.hash_seed, self.pid = name, hash_seed, pid
        self._gone = False

    def _call(self, method: str, *args) -> Any:
        with self._lock:
            if self._conn is None:
                raise SimulatorError(f"{self.name} was handed back")
            try:
                self._conn.send((method, args))
                kind, payload = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._gone = True
                raise SimulatorError(f"{self.name} (warm simulator, pid {self.pid}) died") from exc
        return self._answer(method, args, kind, payload)

    async def _invoke(self, method: str, *args: Any) -> Any:
        return await asyncio.to_thread(self._call, method, *args)

    def alive(self) -> bool:
        """True while the lease holds and the process runs: between calls nothing may be waiting on the
        connection but the end of a process that died."""
        if self._conn is None or self._gone:
            return False
        try:
            return not self._conn.poll()
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Hand the simulator back to the warm pool (it keeps running)."""
        with self._lock:
            if self._conn is None:
                return
            try:
                if not self._gone:
                    self._conn.send(("release", ()))
            except OSError:
                pass
            self._conn.close()
            self._conn = None
            os.close(self._lock_fd)


def lease(folder: str, adapter_spec: str, kwargs: dict, name: str, log_path: str | None,
          hash_seed: str | int = SIM_HASH_SEED) -> WarmSim | None:
    """A free warm simulator of the pool in `folder` that can be this run's own, leased; None when there is none
    (no pool there, every simulator leased, or none can serve this run: the reason is logged)."""
    root = Path(folder)
    if not (root / READY).exists():
        log.info("warm.none", folder=folder, reason="no warm pool serves it")
        return None
    authkey = (root / KEY).read_bytes()
    wanted = {"spec": adapter_spec, "kwargs": kwargs, "log_path": log_path, "facts": _facts(str(hash_seed))}
    for index in sorted(int(p.stem.split("-")[1]) for p in root.glob("sim-*.sock")):
        fd = os.open(_lock(root, index), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # another run holds it
        sim = _handshake(root, index, authkey, wanted, fd, name, str(hash_seed))
        if sim is not None:
            return sim
        os.close(fd)
    return None


def _handshake(root: Path, index: int, authkey: bytes, wanted: dict, fd: int, name: str, hash_seed: str) -> WarmSim | None:
    try:
        conn = mpc.Client(str(_socket(root, index)), family="AF_UNIX", authkey=authkey)
    except (OSError, EOFError, mpc.AuthenticationError) as exc:
        log.info("warm.unreachable", index=index, error=str(exc))
        return None
    try:
        conn.send(("lease", wanted))
        if not conn.poll(ANSWER_S):
            raise TimeoutError(f"no answer within {ANSWER_S:g} s")
        kind, payload = conn.recv()
    except (OSError, EOFError, TimeoutError) as exc:
        conn.close()
        log.info("warm.unreachable", index=index, error=str(exc))
        return None
    if kind != "ready":
        conn.close()
        log.info("warm.refused", index=index, reason=str(payload).strip().splitlines()[-1])
        return None
    log.info("warm.leased", index=index, sim=name, pid=payload)
    return WarmSim(conn, fd, name, hash_seed, payload)
