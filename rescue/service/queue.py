"""The job queue: one folder per submitted study under `QUEUE/jobs/<job-id>/`.

A job folder holds the manifest as submitted (`manifest.jsonl`), the job's
settings as given (`config.json`: job-settable keys only, see service.settings; the
service's endpoint and policy are added when the job starts) and the sha256 of
their study configuration, `job.json` (who, when, what, the endpoint and policy it
named), `state.json` (queued, running, finished,
stopped), the child's output `job.log`, and from its start the study folder
`study-<stamp>-<hex>/` (the job id's stamp: each study id stays unique). A job is laid out under a private name and renamed into place, so a
listing never sees half a job. Short transitions (the worker taking a job, a
cancel) hold the queue's `flock`, so a cancelled queued job is never started.

This module only reads and writes files: no simulator, server or SDK.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.config_files import ConfigError
from rescue.core.configuration.work_limit import config_work_problem
from rescue.core.manifest import Manifest, parse_manifest, read_manifest_bytes
from rescue.service.settings import ServiceConfig, service_config_from_env
from rescue.service.job_request import JobRequest, request_of, resolve_job
from rescue.study import layout
from rescue.study.files import write_atomic
from rescue.study.folder import StudyError

JOBS = "jobs"
QUEUE_LOCK = ".queue.lock"
JOB_SPEC = "job.json"
JOB_STATE = "state.json"
CONFIG_SHA256 = "config.sha256"
CANCEL = "cancel"
JOB_LOG = "job.log"
STUDY = "study"

JobStateName = Literal["queued", "running", "finished", "stopped"]
# A job the worker may take: never started, or started and not ended (a crash, a worker drain).
OPEN_STATES: tuple[str, ...] = ("queued", "running")


class QueueError(StudyError):
    """A job that does not exist, or a queue request that cannot be carried out."""


# The format of a job folder (its job.json, state.json, manifest and configuration), written in job.json.
JOB_SCHEMA_VERSION = 1


class JobSpec(BaseModel):
    """What was submitted, fixed at submission."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    job_id: str
    """The job's id and its folder's name: `job-<UTC time>-<hex>`."""
    name: str
    """A name for people (by default the manifest file's stem)."""
    submitted_at: float
    """When the job was submitted, Unix time in seconds."""
    cases: int
    """Cases in the submitted manifest."""
    manifest_sha256: str
    """sha256 of the submitted manifest's bytes (kept byte for byte in the job folder)."""
    config_sha256: str
    """sha256 of the configuration as given (its identity not yet resolved: the study's own differs)."""
    manifest_source: str | None = None
    """The path or name the manifest was submitted under; None: not recorded."""
    vlm_endpoint: str | None = None
    """The service's VLM endpoint the job named (`vlm.endpoint`); None: the service's default when it starts."""
    policy_name: str | None = None
    """The service's policy the job named (`policy.name`); None: the service's default when it starts."""
    # Job folders made before the version was written hold none: they are version 1.
    schema_version: Literal[1] = JOB_SCHEMA_VERSION
    """The format of the job folder; a reader refuses a version it does not know."""


class JobState(BaseModel):
    """Where a job stands; rewritten atomically by the worker and by `cancel`."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    state: JobStateName = "queued"
    """`queued`, `running`, `finished` or `stopped`."""
    updated_at: float = Field(default_factory=time.time)
    """When this state was written, Unix time in seconds."""
    started_at: float | None = None
    """The first start, Unix time in seconds; None: never started."""
    finished_at: float | None = None
    """When the job ended `finished` or `stopped`, Unix time in seconds; None while it has not."""
    runs: int = 0
    """Starts of the job's child (a resume after a crash is a second run)."""
    pid: int | None = None
    """The child running it, while running; None otherwise."""
    exit_code: int | None = None
    """The last run's exit code, as `rescue run`/`resume` would exit; None: no run has ended."""
    message: str | None = None
    """One line for people: `starting`, `resuming`, `cancelled`, or the last line of the job's log; None at first."""
    cancel_requested: bool = False
    """Whether `cancel` asked the running job to drain (it then ends `stopped` and is never resumed)."""
    killed_by: str | None = None
    """The signal that ended the last run's child from outside (`SIGKILL`, ...), with `(out of memory)` when the
    kernel's OOM killer sent it; its claimed cases were then made `unknown` with this reason. None: it exited."""


@dataclass(frozen=True)
class JobLayout:
    """Where each file of one job folder lives."""

    root: Path

    @property
    def job_id(self) -> str:
        return self.root.name

    @property
    def spec(self) -> Path:
        return self.root / JOB_SPEC

    @property
    def state(self) -> Path:
        return self.root / JOB_STATE

    @property
    def manifest(self) -> Path:
        return self.root / layout.MANIFEST

    @property
    def config(self) -> Path:
        return self.root / layout.CONFIG

    @property
    def config_sha256(self) -> Path:
        return self.root / CONFIG_SHA256

    @property
    def cancel(self) -> Path:
        return self.root / CANCEL

    @property
    def log(self) -> Path:
        return self.root / JOB_LOG

    @property
    def study(self) -> Path:
        """The job's study folder, named like `rescue run`'s so each study id is unique."""
        return self.root / f"{STUDY}-{self.job_id.removeprefix('job-')}"


class Job(BaseModel):
    """A job as read from its folder."""

    spec: JobSpec
    state: JobState
    path: str

    @property
    def layout(self) -> JobLayout:
        return JobLayout(Path(self.path))


def jobs_dir(queue: str | os.PathLike[str]) -> Path:
    """The folder of a queue's jobs."""
    return Path(queue) / JOBS


@contextlib.contextmanager
def queue_lock(queue: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the queue's lock for a short transition (taking a job, cancelling one)."""
    jobs_dir(queue).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(queue) / QUEUE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# A job's name is shown in listings and pages: one line of text.
MAX_NAME_CHARS = 200


def check_name(name: str | None) -> None:
    """Refuse a job name that is not one short line of text (ConfigError)."""
    if name is None:
        return
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise ConfigError(f"name: a text of 1 to {MAX_NAME_CHARS} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ConfigError("name: one line, no control characters")


def validate_job(manifest_bytes: bytes, source: str, request: JobRequest, service: ServiceConfig) -> Manifest:
    """Check a submission as the worker and `rescue run` will before anything runs: ManifestError or ConfigError.

    The job's choices must be the service's (`resolve_job`); the worker resolves them
    again when the job starts, under the service configuration it has then."""
    config = resolve_job(request, service)
    manifest = parse_manifest(manifest_bytes, source, catalog="libero")
    manifest.require_main_cohort()  # a job runs as `rescue run` without --pilot-run
    problem = (request.config.sham.by_task_problem(c.task for c in manifest.cases)
               or config_work_problem(config, [c.horizon for c in manifest.cases], service.limits.arm_steps))
    if problem is not None:
        raise ConfigError(f"config: {problem}")
    return manifest


def _new_job_id() -> str:
    return f"job-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


def submit_job(
    queue: str | os.PathLike[str], manifest_bytes: bytes, source: str, config: StudyConfig | JobRequest,
    name: str | None = None, service: ServiceConfig | None = None,
) -> JobSpec:
    """Validate a manifest and a job's settings and place a queued job; nothing is written when either is bad.

    `config` is a job request (`service.settings.job_request`) or a study configuration,
    which may then set job-settable keys only; `service`: the choices it is checked
    against (default: RESCUE_SERVICE_CONFIG's, else the embedded defaults)."""
    request = config if isinstance(config, JobRequest) else request_of(config)
    check_name(name)
    manifest = validate_job(manifest_bytes, source, request, service or service_config_from_env())
    jobs = jobs_dir(queue)
    jobs.mkdir(parents=True, exist_ok=True)
    job_id = _new_job_id()
    # Only what the job set: the worker adds the service's endpoint and policy when the job starts.
    settings = request.settings()
    config_json = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    spec = JobSpec(
        job_id=job_id,
        name=name or Path(source).stem,
        submitted_at=time.time(),
        cases=len(manifest.cases),
        manifest_sha256=manifest.sha256,
        config_sha256=StudyConfig.model_validate(settings).sha256(),
        manifest_source=source,
        vlm_endpoint=request.endpoint,
        policy_name=request.policy,
    )
    tmp = jobs / f".{job_id}.submitting-{os.getpid()}"
    try:
        tmp.mkdir()
        job = JobLayout(tmp)
        job.manifest.write_bytes(manifest_bytes)  # byte for byte: its sha256 is the manifest's
        job.config.write_text(config_json, encoding="utf-8")
        job.config_sha256.write_text(spec.config_sha256 + "\n", encoding="utf-8")
        job.state.write_text(JobState().model_dump_json(indent=2) + "\n", encoding="utf-8")
        write_atomic(job.spec, spec.model_dump_json(indent=2) + "\n")
        os.rename(tmp, jobs / job_id)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return spec


def submit_file(queue: str | os.PathLike[str], manifest_path: str | os.PathLike[str], config: StudyConfig | JobRequest,
                name: str | None = None, service: ServiceConfig | None = None) -> JobSpec:
    """`rescue submit`: read a manifest file and submit it."""
    path = Path(manifest_path)
    data = read_manifest_bytes(path)  # a regular file within the size bound, as `rescue run` reads it
    return submit_job(queue, data, str(path), config, name, service)


def read_request(job: Job) -> JobRequest:
    """A queued job's request: its settings (config.json) and its choices (job.json); ConfigError when refused.

    Checked again here, not trusted from submission: anyone who can write the
    queue folder can write a job folder by hand."""
    try:
        config = StudyConfig.model_validate_json(job.layout.config.read_text(encoding="utf-8"))
    except (OSError, ValidationError) as exc:
        raise ConfigError(f"{job.spec.job_id}: the job's configuration is unreadable ({type(exc).__name__})") from None
    return request_of(config, job.spec.vlm_endpoint, job.spec.policy_name)


def read_job(path: Path) -> Job:
    """A job from its folder; QueueError when it is not a job."""
    job = JobLayout(path)
    try:
        spec = JobSpec.model_validate_json(job.spec.read_text(encoding="utf-8"))
        state = JobState.model_validate_json(job.state.read_text(encoding="utf-8"))
    except (OSError, ValidationError) as exc:
        raise QueueError(f"{path} is not a readable job ({type(exc).__name__})") from None
    return Job(spec=spec, state=state, path=str(path))


def find_job(queue: str | os.PathLike[str], job_id: str) -> Job:
    """One job by id; QueueError when the queue holds no such job."""
    if not job_id or "/" in job_id or job_id.startswith("."):
        raise QueueError(f"no job {job_id!r}")
    path = jobs_dir(queue) / job_id
    if not path.is_dir():
        raise QueueError(f"no job {job_id!r} in {jobs_dir(queue)}")
    return read_job(path)


def list_jobs(queue: str | os.PathLike[str]) -> list[Job]:
    """Every job, in submission order."""
    folder = jobs_dir(queue)
    if not folder.is_dir():
        return []
    jobs = []
    for path in folder.iterdir():
        if path.name.startswith(".") or not path.is_dir():
            continue
        try:
            jobs.append(read_job(path))
        except QueueError:
            continue  # removed while listing
    return sorted(jobs, key=lambda j: (j.spec.submitted_at, j.spec.job_id))


def write_state(job: Job, **changes) -> Job:
    """Replace fields of a job's state file atomically; the updated job."""
    state = job.state.model_copy(update={**changes, "updated_at": time.time()})
    write_atomic(job.layout.state, state.model_dump_json(indent=2) + "\n")
    return job.model_copy(update={"state": state})


def cancel_job(queue: str | os.PathLike[str], job_id: str) -> str:
    """Remove a queued job, or drain a running one (no new case is claimed; arms in flight finish).

    Returns what was done, in words. A running job is marked so that the worker
    ends it `stopped` and never resumes it.
    """
    with queue_lock(queue):
        job = find_job(queue, job_id)
        if job.state.state == "queued" and job.state.runs == 0:
            shutil.rmtree(job.layout.root)
            return f"{job_id}: removed from the queue"
        if job.state.state not in OPEN_STATES:
            return f"{job_id}: already {job.state.state}; nothing to cancel"
        job.layout.cancel.write_text(f"{time.time()}\n")
        write_state(job, cancel_requested=True)
    study = job.layout.study
    if layout.StudyLayout.of(study).is_study():
        from rescue.study.folder import open_journal

        with open_journal(study, readonly=False) as journal:
            journal.request_drain()
    return f"{job_id}: draining (no new case is claimed; arms in flight finish)"


class JobView(BaseModel):
    """A job as the API and `rescue queue` show it: state, counts, labels, ETA."""

    job_id: str
    name: str
    state: JobStateName
    message: str | None = None
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    runs: int = 0
    cases: int
    done: int = 0  # finished or interrupted cases
    states: dict[str, int] = Field(default_factory=dict)
    labels: dict[str, int] = Field(default_factory=dict)
    eta_s: float | None = None
    draining: bool = False
    study: str | None = None  # the study folder, relative to the queue folder
    report: bool = False  # the finished job's report.html exists


def job_view(job: Job, now: float | None = None) -> JobView:
    """A job's view, with its study's counts when the study exists (read-only, no lock taken)."""
    view = JobView(
        job_id=job.spec.job_id, name=job.spec.name, state=job.state.state, message=job.state.message,
        submitted_at=job.spec.submitted_at, started_at=job.state.started_at, finished_at=job.state.finished_at,
        exit_code=job.state.exit_code, runs=job.state.runs, cases=job.spec.cases,
    )
    study = layout.StudyLayout.of(job.layout.study)
    if not study.is_study():
        return view
    from rescue.read.status import study_status

    try:
        status = study_status(study.root)
    except Exception as exc:  # a journal mid-write: show the job without its counts this time
        return view.model_copy(update={"message": view.message or f"counts unavailable: {type(exc).__name__}"})
    done = status.states.get("finished", 0) + status.states.get("interrupted", 0)
    eta = None
    now = time.time() if now is None else now
    if job.state.state == "running" and done and job.state.started_at:
        eta = (now - job.state.started_at) / done * (status.cases - done)
    labels = {k: v for k, v in {**status.labels, **status.pilot_labels}.items() if v}
    return view.model_copy(update={
        "done": done, "states": status.states, "labels": labels, "eta_s": eta, "draining": status.draining,
        "study": f"{JOBS}/{job.spec.job_id}/{study.root.name}", "report": study.report.is_file(),
    })
