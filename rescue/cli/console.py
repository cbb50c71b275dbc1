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
# 4 every case unknown; 5 export of an unfinished study.
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_PEER = 3  # a peer the study needs does not answer before the first claim: nothing ran
# `rescue export` of a study that is not finished, without --partial.
EXIT_UNFINISHED = 5
