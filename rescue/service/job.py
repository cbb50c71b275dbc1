"""One job, run in a child process of the worker: `python -m rescue.service.job JOB_DIR`.

The study library functions own their event loop (`asyncio.run`), the
simulators and the study's owner lock, so each job runs in a process of its
own; its exit code is `rescue run`'s (0, 3 stopped, 4 all unknown, 2 bad
input, 1 internal). A job whose study exists is resumed exactly as
`rescue resume` does (claimed-unfinished cases become unknown, interrupted);
otherwise the study is created (its identity resolved now) and run, with the
study configuration the worker resolved from the job's choices and gives on
stdin (rescue.service.settings.resolve_job), never the job folder's as written.
Paths it prints are relative to the job folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rescue.core.configuration.config import StudyConfig
from rescue.service.queue import JobLayout
from rescue.study.layout import StudyLayout

# The job process's exit codes, which a job's state records: `rescue run`'s (rescue/cli/console.py names the
# command's; the service stands below the command, so it names its own, and tests/test_exit_codes.py holds them equal).
EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_STOPPED = 3
EXIT_ALL_UNKNOWN = 4
ENDED: dict[str, int] = {"finished": EXIT_OK, "decided": EXIT_OK, "stopped": EXIT_STOPPED,
                         "all_unknown": EXIT_ALL_UNKNOWN}


def run_job(job_dir: Path, config_json: str | None = None, verbose: bool = False) -> int:
    """Create and run, or resume, the study of one job; write its report when every case has a verdict.

    `config_json`: the resolved study configuration of a job whose study does not exist yet."""
    from rescue.core.configuration.config_files import ConfigError
    from rescue.run import commands
    from rescue.study.folder import study_outcome

    # The worker's warm simulators, when it keeps some (`rescue serve --keep-simulators N`).
    backend = commands.warm_backend()
    job = JobLayout(Path(job_dir))
    study = job.study.name
    if StudyLayout.of(job.study).is_study():
        interrupted = commands.resume(job.study, verbose=verbose, backend=backend)
        print(f"resumed {study}: {len(interrupted)} started-unfinished case(s) recorded as unknown (interrupted)"
              + (f": {', '.join(interrupted)}" if interrupted else ""), flush=True)
    else:
        if not config_json:
            raise ConfigError("no study configuration on stdin (the worker gives the one it resolved)")
        config = StudyConfig.model_validate_json(config_json)
        commands.run_manifest(job.manifest, job.study, config, verbose=verbose, backend=backend)
        print(f"ran {study}", flush=True)
    outcome = study_outcome(job.study)
    print(outcome.message, flush=True)
    if outcome.ended in ("finished", "all_unknown"):
        from rescue.read.html.report import write_report

        print(f"report: {study}/{Path(write_report(job.study)).name}", flush=True)
    return ENDED[outcome.ended]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the job child process; errors become one line and `rescue run`'s exit codes."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    if len(args) != 1:
        print("usage: python -m rescue.service.job [-v] JOB_DIR < RESOLVED_CONFIG_JSON", file=sys.stderr)
        return EXIT_BAD_INPUT
    from rescue.core.configuration.config_files import ConfigError
    from rescue.core.configuration.identity import IdentityError
    from rescue.core.manifest import ManifestError
    from rescue.study import logs
    from rescue.study.folder import StudyError
    from rescue.study.journal import JournalError

    logs.configure(None, verbose)
    try:
        config_json = None if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
        return run_job(Path(args[0]), config_json, verbose)
    except ManifestError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_BAD_INPUT
    except (StudyError, IdentityError, ConfigError, JournalError) as exc:
        print(f"rescue: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # one line in the job's log; the worker shows it
        print(f"rescue: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
