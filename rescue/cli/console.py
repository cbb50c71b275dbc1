"""The console every command prints to, and every exit code of the `rescue` command."""

from __future__ import annotations

import os
import sys

from rich.console import Console

# Off a terminal (a log file, nohup, Slurm) rich would wrap tables at 80 columns and truncate the per-group
# ones; COLUMNS still wins where it is set.
console = Console(stderr=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 132)


# Exit codes (docs/reference.md lists them): 0 done; 1 verify found problems, or an internal error;
# 2 bad input (manifest, config, a folder that is not a study, a changed policy server);
# 3 a run stopped with cases never run (or a peer did not answer before the first claim);
# 4 every case unknown; 5 export of an unfinished study; 130 interrupted (Ctrl-C).
EXIT_OK = 0  # done: for a run, every case has a verdict
EXIT_PROBLEMS = 1  # `verify` (and `demo`'s) found problems in a study
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_PEER = 3  # a peer the study needs does not answer before the first claim: nothing ran
EXIT_STOPPED = 3  # a run stopped with cases never run (drain, fail-fast, an unreachable policy)
EXIT_ALL_UNKNOWN = 4  # a run left every case with a verdict, and every one unknown
# `rescue export` of a study that is not finished, without --partial.
EXIT_UNFINISHED = 5
EXIT_INTERRUPTED = 130  # Ctrl-C outside a run's own signal handling, as a shell reports it (128 + SIGINT)

# The exit code of `rescue run`, `resume`, `eval` and `ablate` by how the study ended (rescue.study.folder.StudyOutcome).
ENDED: dict[str, int] = {"finished": EXIT_OK, "decided": EXIT_OK, "stopped": EXIT_STOPPED,
                         "all_unknown": EXIT_ALL_UNKNOWN}
