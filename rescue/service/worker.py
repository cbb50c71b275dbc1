"""`rescue serve`: take jobs in submission order, one at a time, each in a child process; serve the API.

Each job runs as `python -m rescue.service.job JOB_DIR` (rescue.service.job) in a
session of its own, so a signal meant for the worker (a terminal's Ctrl-C, `kill
-PGID`) reaches the job only as the worker's drain; a kill of the unit's cgroup
(systemd) takes the child and its simulators with it.

Restart after a crash: a job left `running` is taken first again and resumed as
`rescue resume` would. If only the worker died, its child may still be alive and
hold the study's owner lock: the worker asks it to drain (SIGTERM; arms in flight
finish, nothing new is claimed), waits for the lock to be free, and kills it only
past a deadline. The child is recognized by its pid in the job's state file and in
the study's owner lock, and by its command line naming the job, never by name.

SIGTERM (or SIGINT) drains: the running child is sent SIGTERM, its arms in flight
finish, the job goes back to `queued` (its study is resumed at the next start), and
the worker exits 0.

One worker per queue: it holds an OS lock on `QUEUE/.serve.lock` for its whole
life (released by the kernel however it dies), so a second `rescue serve` on the
same queue is refused naming the first one's pid, before it looks at any job.

A job's choices are resolved against the service's configuration when it starts
(rescue.service.settings): the child gets the resolved study configuration on its
stdin; a stored study is checked against the same choices before it is resumed.
A job the service does not allow ends `stopped` without a child.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

import rescue
from rescue.core.configuration.config_files import ConfigError
from rescue.service.settings import NO_KEY_ENV, SERVICE_CONFIG_ENV, ServiceConfig, load_service_config
from rescue.service.job_request import resolve_job, study_problems
from rescue.service.queue import (
    OPEN_STATES,
    Job,
    list_jobs,
    queue_lock,
    read_request,
    write_state,
)
from rescue.service.job import EXIT_ALL_UNKNOWN, EXIT_BAD_INPUT, EXIT_OK, EXIT_STOPPED
from rescue.study.folder import StudyError, load_study_config, open_journal
from rescue.study.layout import StudyLayout
from rescue.study.owner import StudyBusy, alive, own_study

log = structlog.get_logger("rescue.service")

# How long an orphaned child of a dead worker may take to drain before it is killed.
ORPHAN_DRAIN_S = 600.0
# How long the worker waits for a killed job's study lock (its simulators ending) before it leaves the cases claimed.
SETTLE_WAIT_S = 60.0
SERVE_INFO = "serve.json"
SERVE_LOCK = ".serve.lock"


class ServeError(RuntimeError):
    """The worker cannot start as asked: a bind beyond loopback without a key, a bad service
    configuration, or a queue another worker serves."""


def _is_job_child(pid: int, job: Job) -> bool:
    """Whether pid is a live job runner of this job (a reused pid is left alone)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    job_id = job.spec.job_id.encode()
    return b"rescue.service.job" in cmdline and any(arg.rstrip(b"/").endswith(b"/" + job_id) for arg in cmdline)


@contextlib.contextmanager
def own_queue(queue: Path) -> Iterator[None]:
    """Hold the queue's worker lock for the block; ServeError naming the running worker's pid when it is held."""
    path = Path(queue) / SERVE_LOCK
    # Not inherited by the job children (os.open is close-on-exec): an orphan of a dead worker does not hold it.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = path.read_text().strip() or "?"
            except OSError:
                owner = "?"
            raise ServeError(f"{queue} is served by process {owner} (a running `rescue serve`); "
                             "one worker per queue: stop that one first (SIGTERM drains it)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


def _lock_owner(study: Path) -> int | None:
    try:
        return int(StudyLayout.of(study).lock.read_text().strip())
    except (OSError, ValueError):
        return None


class Worker:
    """Takes jobs from a queue folder, one at a time, and runs each in a child process."""

    def __init__(self, queue: Path, poll_s: float = 0.5, verbose: bool = False, service: ServiceConfig | None = None):
        self.queue = Path(queue)
        self.service = service or ServiceConfig()
        self.poll_s = poll_s
        self.verbose = verbose
        self.stopping = asyncio.Event()
        self.current: Job | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._stops = 0

    def stop(self) -> None:
        """Drain: the running job's arms in flight finish, then the worker exits. A second stop
        is passed on to the job too, which then stops its arms now (their cases become unknown)."""
        self._stops += 1
        if self._stops > 2:
            return
        log.warning("serve.draining" if self._stops == 1 else "serve.stopping_now")
        self.stopping.set()
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)

    async def run(self) -> None:
        """Work through the queue until stopped."""
        while not self.stopping.is_set():
            job = await asyncio.to_thread(self._take)
            if job is None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), self.poll_s)
                continue
            await self._run(job)

    def _take(self) -> Job | None:
        """The first open job in submission order, marked running; cancelled ones end stopped."""
        with queue_lock(self.queue):
            for job in list_jobs(self.queue):
                if job.state.state not in OPEN_STATES:
                    continue
                if job.state.state == "running":
                    self._reap_orphan(job)
                if job.layout.cancel.exists() or job.state.cancel_requested:
                    write_state(job, state="stopped", pid=None, finished_at=time.time(), message="cancelled")
                    continue
                return write_state(
                    job, state="running", runs=job.state.runs + 1, pid=None,
                    started_at=job.state.started_at or time.time(),
                    message="resuming" if StudyLayout.of(job.layout.study).is_study() else "starting",
                )
        return None

    def _reap_orphan(self, job: Job) -> None:
        """A job left running by a dead worker: let its orphaned child drain, then wait for the study's lock."""
        pids = {p for p in (job.state.pid, _lock_owner(job.layout.study)) if p and p != os.getpid()}
        orphans = [p for p in pids if alive(p) and _is_job_child(p, job)]
        for pid in orphans:
            log.warning("serve.orphan_draining", job=job.spec.job_id, pid=pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + ORPHAN_DRAIN_S
        while any(alive(p) and _is_job_child(p, job) for p in orphans) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in orphans:
            if alive(pid) and _is_job_child(pid, job):
                log.error("serve.orphan_killed", job=job.spec.job_id, pid=pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if StudyLayout.of(job.layout.study).is_study():
            # The kernel frees the lock when the last holder dies; wait for it, never steal it.
            while True:
                try:
                    with own_study(job.layout.study):
                        return
                except StudyBusy:
                    if time.monotonic() > deadline + 60:
                        raise
                    time.sleep(0.2)

    def _prepare(self, job: Job) -> str | None:
        """The resolved study configuration (JSON) of a job to create, None for one to resume;
        ConfigError when the service does not allow what the job or its stored study points at."""
        if StudyLayout.of(job.layout.study).is_study():
            try:
                problems = study_problems(load_study_config(job.layout.study), self.service)
            except StudyError as exc:
                raise ConfigError(str(exc)) from None
            if problems:
                raise ConfigError("the study's configuration is not this service's: " + "; ".join(problems))
            return None
        return resolve_job(read_request(job), self.service).model_dump_json()

    def _refuse(self, job: Job, why: str) -> None:
        """End a job the service does not allow, without starting it; the reason goes to its log and state."""
        with open(job.layout.log, "a", encoding="utf-8") as out:
            out.write(f"--- run {job.state.runs} refused at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
                      f"rescue: refused: {why}\n")
        with queue_lock(self.queue):
            # A job the service refuses at its start exits as bad input does.
            write_state(job, state="stopped", pid=None, exit_code=EXIT_BAD_INPUT, message=f"refused: {why}"[:500],
                        finished_at=time.time())
        log.warning("serve.job_refused", job=job.spec.job_id, why=why)

    async def _run(self, job: Job) -> None:
        try:
            config_json = await asyncio.to_thread(self._prepare, job)
        except ConfigError as exc:
            await asyncio.to_thread(self._refuse, job, str(exc))
            return
        self.current = job
        env = dict(os.environ)
        env.pop(NO_KEY_ENV, None)  # an endpoint without a key gets the client's placeholder, nothing else
        # The child imports the same rescue package as this worker.
        package_root = str(Path(rescue.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = package_root + os.pathsep + env.get("PYTHONPATH", "")
        args = [sys.executable, "-m", "rescue.service.job", *(["-v"] if self.verbose else []), job.path]
        with open(job.layout.log, "ab") as out:
            out.write(f"--- run {job.state.runs} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode())
            out.flush()
            # A session of its own: a terminal's Ctrl-C reaches the worker, which drains the job;
            # it must not reach the job (and its simulators) directly.
            self._proc = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.PIPE, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env,
                start_new_session=True,
            )
        oom_kills = _oom_kills()
        assert self._proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._proc.stdin.write((config_json or "").encode())
            await self._proc.stdin.drain()
        self._proc.stdin.close()
        job = await asyncio.to_thread(write_state, job, pid=self._proc.pid)
        log.info("serve.job_started", job=job.spec.job_id, pid=self._proc.pid, run=job.state.runs)
        drained = False
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._proc.wait()), self.poll_s)
            if self._proc.returncode is not None:
                break
            if not drained and job.layout.cancel.exists():
                drained = await asyncio.to_thread(self._drain_study, job)
        code = self._proc.returncode
        self._proc = None
        self.current = None
        await asyncio.to_thread(self._record, job, code, oom_kills != _oom_kills())

    @staticmethod
    def _drain_study(job: Job) -> bool:
        if not StudyLayout.of(job.layout.study).is_study():
            return False
        with open_journal(job.layout.study, readonly=False) as journal:
            journal.request_drain()
        return True

    def _record(self, job: Job, code: int, oom: bool = False) -> None:
        cancelled = job.layout.cancel.exists()
        now = time.time()
        killed = None
        if code < 0 and not (self.stopping.is_set() and code == -signal.SIGTERM):
            # Killed from outside (the kernel's OOM killer, a kill -9): its claimed cases become unknown, saying so.
            killed = _signal_name(-code) + (" (out of memory)" if oom and code == -signal.SIGKILL else "")
            settled = self._settle_killed(job, killed)
            state, message = "stopped", (f"the job's process was killed by {killed}; "
                                         f"{len(settled)} claimed case(s) recorded as unknown")
        elif code in (EXIT_OK, EXIT_ALL_UNKNOWN):
            state, message = "finished", _last_line(job.layout.log, "finished")
        elif self.stopping.is_set() and not cancelled and code in (EXIT_STOPPED, -signal.SIGTERM):
            # The service was stopped, not the job: it is resumed at the next start.
            state, message = "queued", "drained by a stop of the worker; resumed at its next start"
        elif cancelled:
            state, message = "stopped", "cancelled"
        else:
            state, message = "stopped", _last_line(job.layout.log, f"exited {code}")
        with queue_lock(self.queue):
            write_state(job, state=state, pid=None, exit_code=code, message=message, killed_by=killed,
                        finished_at=now if state != "queued" else None)
        log.info("serve.job_ended", job=job.spec.job_id, state=state, exit_code=code, killed_by=killed)

    @staticmethod
    def _settle_killed(job: Job, killed: str) -> list[str]:
        """The claimed cases of a job whose child was killed: `unknown`, their reason naming the signal."""
        from rescue.run.recovery import recover

        if not StudyLayout.of(job.layout.study).is_study():
            return []
        # Its simulators may hold the study's lock a moment longer (they end with their parent): wait, never steal.
        deadline = time.monotonic() + SETTLE_WAIT_S
        while True:
            try:
                with own_study(job.layout.study):
                    return recover(job.layout.study, reason=f"interrupted: the job's process was killed by {killed}")
            except StudyBusy as exc:
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                log.error("serve.job_not_settled", job=job.spec.job_id, error=str(exc))
            except StudyError as exc:
                log.error("serve.job_not_settled", job=job.spec.job_id, error=str(exc))
            return []


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _oom_kills() -> int | None:
    """How many processes the kernel's OOM killer ended in this process's cgroup so far (None: not known)."""
    try:
        group = Path("/proc/self/cgroup").read_text().strip().splitlines()[-1].split(":", 2)[2]
        for line in (Path("/sys/fs/cgroup") / group.lstrip("/") / "memory.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        return None
    return None


def _last_line(path: Path, default: str) -> str:
    try:
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        return default
    return lines[-1][:500] if lines else default


@contextlib.contextmanager
def _kept_warm(size: int) -> Iterator[None]:
    """`size` warm simulators for the worker's life, named to its jobs in RESCUE_WARM_SIMULATORS."""
    if size <= 0:
        yield
        return
    from rescue.run.commands import WARM_ENV, kept_simulators

    before = os.environ.get(WARM_ENV)
    with kept_simulators(size) as folder:
        os.environ[WARM_ENV] = folder
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(WARM_ENV, None)
            else:
                os.environ[WARM_ENV] = before


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (0: a free port); ServeError when it cannot be had (taken, no such address)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        taken = exc.errno == errno.EADDRINUSE
        why = "the port is taken (another server listens on it)" if taken else exc.strerror or exc
        raise ServeError(f"cannot listen on {host}:{port}: {why}; give --port another port (0: any free one)") from None
    return sock


async def serve_async(queue: Path, sock: socket.socket, api_key: str | None, verbose: bool = False,
                      service: ServiceConfig | None = None) -> int:
    """Run the worker and the HTTP API on `sock` (listening) until SIGTERM or SIGINT; 0 after a clean drain."""
    from aiohttp import web

    from rescue.service.api import make_app

    service = service or ServiceConfig()
    worker = Worker(queue, verbose=verbose, service=service)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    runner = web.AppRunner(make_app(queue, api_key, worker, service), access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    host, bound = sock.getsockname()[:2]
    info = {"schema_version": "rescue-serve/1", "pid": os.getpid(), "host": host, "port": bound, "started_at": time.time()}
    (Path(queue) / SERVE_INFO).write_text(json.dumps(info) + "\n")
    print(f"rescue serve: queue {queue}, http://{host}:{bound}/", flush=True)
    try:
        await worker.run()
    finally:
        await runner.cleanup()
    return 0


def serve(queue: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 8765,
          api_key_env: str | None = None, verbose: bool = False, config: str | os.PathLike[str] | None = None,
          keep_simulators: int = 0) -> int:
    """`rescue serve`: refuse a bind beyond loopback without an API key, or a queue another worker serves,
    then run until stopped. `config`: the service's configuration file (default: RESCUE_SERVICE_CONFIG's;
    none: the embedded defaults). `keep_simulators`: simulators the worker keeps between its jobs, which
    every job leases (rescue.env.warm); 0: each job starts its own."""
    from rescue.service.api import is_loopback

    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        raise ServeError(f"--api-key-env {api_key_env}: the environment variable is not set")
    if not is_loopback(host) and not api_key:
        raise ServeError(f"binding {host} (beyond loopback) needs an API key: --api-key-env VAR with VAR set")
    try:
        service = load_service_config(config if config is not None else os.environ.get(SERVICE_CONFIG_ENV) or None)
    except ConfigError as exc:
        raise ServeError(f"service configuration: {exc}") from None
    sock = _listen(host, port)  # first: a port that cannot be had leaves nothing behind
    try:
        Path(queue).mkdir(parents=True, exist_ok=True)
        with own_queue(Path(queue)), _kept_warm(keep_simulators):
            return asyncio.run(serve_async(Path(queue), sock, api_key, verbose, service))
    finally:
        sock.close()
