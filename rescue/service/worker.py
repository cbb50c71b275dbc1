"""`rescue serve`: take jobs in submission order, one at a time, each in a child process; serve the API.

Each job runs as `python -m rescue.service.job JOB_DIR` (rescue.service.job),
in the worker's process group, so a kill of the group (systemd's default
KillMode, `kill -9 -PGID`) takes the child and its simulators with it.

Restart after a crash: a job left `running` is taken first again and resumed as
`rescue resume` would. If only the worker died, its child may still be alive and
hold the study's owner lock: the worker asks it to drain (SIGTERM; arms in flight
finish, nothing new is claimed), waits for the lock to be free, and kills it only
past a deadline. The child is recognized by its pid in the job's state file and in
the study's owner lock, and by its command line naming the job, never by name.

SIGTERM (or SIGINT) drains: the running child is sent SIGTERM, its arms in flight
finish, the job goes back to `queued` (its study is resumed at the next start), and
the worker exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import sys
import time
from pathlib import Path

import structlog

import rescue
from rescue.service.queue import OPEN_STATES, Job, list_jobs, queue_lock, write_state
from rescue.study.folder import EXIT_ALL_UNKNOWN, EXIT_OK, EXIT_STOPPED, open_journal
from rescue.study.layout import StudyLayout
from rescue.study.owner import StudyBusy, own_study

log = structlog.get_logger("rescue.service")

# How long an orphaned child of a dead worker may take to drain before it is killed.
ORPHAN_DRAIN_S = 600.0
SERVE_INFO = "serve.json"


class ServeError(RuntimeError):
    """The worker cannot start as asked (a bind beyond loopback without a key)."""


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_job_child(pid: int, job: Job) -> bool:
    """Whether pid is a live job runner of this job (a reused pid is left alone)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    job_id = job.spec.job_id.encode()
    return b"rescue.service.job" in cmdline and any(arg.rstrip(b"/").endswith(b"/" + job_id) for arg in cmdline)


def _lock_owner(study: Path) -> int | None:
    try:
        return int(StudyLayout.of(study).lock.read_text().strip())
    except (OSError, ValueError):
        return None


class Worker:
    """Takes jobs from a queue folder, one at a time, and runs each in a child process."""

    def __init__(self, queue: Path, poll_s: float = 0.5, verbose: bool = False):
        self.queue = Path(queue)
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
        orphans = [p for p in pids if _alive(p) and _is_job_child(p, job)]
        for pid in orphans:
            log.warning("serve.orphan_draining", job=job.spec.job_id, pid=pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + ORPHAN_DRAIN_S
        while any(_alive(p) and _is_job_child(p, job) for p in orphans) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in orphans:
            if _alive(pid) and _is_job_child(pid, job):
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

    async def _run(self, job: Job) -> None:
        self.current = job
        env = dict(os.environ)
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
                *args, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env,
                start_new_session=True,
            )
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
        await asyncio.to_thread(self._record, job, code)

    @staticmethod
    def _drain_study(job: Job) -> bool:
        if not StudyLayout.of(job.layout.study).is_study():
            return False
        with open_journal(job.layout.study, readonly=False) as journal:
            journal.request_drain()
        return True

    def _record(self, job: Job, code: int) -> None:
        cancelled = job.layout.cancel.exists()
        now = time.time()
        if code in (EXIT_OK, EXIT_ALL_UNKNOWN):
            state, message = "finished", _last_line(job.layout.log, "finished")
        elif self.stopping.is_set() and not cancelled and code in (EXIT_STOPPED, -signal.SIGTERM):
            # The service was stopped, not the job: it is resumed at the next start.
            state, message = "queued", "drained by a stop of the worker; resumed at its next start"
        elif cancelled:
            state, message = "stopped", "cancelled"
        else:
            state, message = "stopped", _last_line(job.layout.log, f"exited {code}")
        with queue_lock(self.queue):
            write_state(job, state=state, pid=None, exit_code=code, message=message,
                        finished_at=now if state != "queued" else None)
        log.info("serve.job_ended", job=job.spec.job_id, state=state, exit_code=code)


def _last_line(path: Path, default: str) -> str:
    try:
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        return default
    return lines[-1][:500] if lines else default


async def serve_async(queue: Path, host: str, port: int, api_key: str | None, verbose: bool = False) -> int:
    """Run the worker and the HTTP API until SIGTERM or SIGINT; 0 after a clean drain."""
    from aiohttp import web

    from rescue.service.api import make_app

    worker = Worker(queue, verbose=verbose)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    runner = web.AppRunner(make_app(queue, api_key, worker), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    info = {"schema_version": "rescue-serve/1", "pid": os.getpid(), "host": host, "port": bound, "started_at": time.time()}
    (Path(queue) / SERVE_INFO).write_text(json.dumps(info) + "\n")
    print(f"rescue serve: queue {queue}, http://{host}:{bound}/", flush=True)
    try:
        await worker.run()
    finally:
        await runner.cleanup()
    return 0


def serve(queue: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 8765,
          api_key_env: str | None = None, verbose: bool = False) -> int:
    """`rescue serve`: refuse a bind beyond loopback without an API key, then run until stopped."""
    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        raise ServeError(f"--api-key-env {api_key_env}: the environment variable is not set")
    if not is_loopback(host) and not api_key:
        raise ServeError(f"binding {host} (beyond loopback) needs an API key: --api-key-env VAR with VAR set")
    Path(queue).mkdir(parents=True, exist_ok=True)
    return asyncio.run(serve_async(Path(queue), host, port, api_key, verbose))
