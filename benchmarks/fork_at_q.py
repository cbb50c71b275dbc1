"""Fork at q: simulator compute per case, forked vs independent replays.

The cases are real failures of the embedded policy, found by a short
evaluation first, so both arms run to the horizon as in a rescue study.
Compute is the CPU time of the simulator processes (they are this process's
children, so their time shows in RUSAGE_CHILDREN once they exit), less the
time a simulator process takes to start and build its env, measured alone.
Target: at most 0.78 (the limit for q = H/2 is 0.75).
Run: MUJOCO_GL=egl .venv/bin/python benchmarks/fork_at_q.py [N] [H]
"""

from __future__ import annotations

import resource
import sys

from common import POLICY, cases, manifest, study_config, timed_study

from rescue.core.configuration.config import StudyConfig
from rescue.env.pool import SimProcess


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _startup_cpu(sims: int) -> float:
    """CPU of starting `sims` simulator processes and building one env in each."""
    before = _children_cpu()
    procs = [SimProcess("rescue.env.libero:LiberoAdapter", name=f"startup-{i}") for i in range(sims)]
    for proc in procs:
        proc._call("reset", cases(1, 16)[0].model_dump(mode="json"))
        proc.stop()
    return _children_cpu() - before


def _study_cpu(items, config: StudyConfig) -> tuple[float, float]:
    before = _children_cpu()
    wall = timed_study(items, config)
    return _children_cpu() - before, wall


def failures(n: int, horizon: int) -> list:
    """Real failures of the embedded policy: the cases of a rescue study run to the horizon."""
    import asyncio
    import shutil
    import tempfile
    from pathlib import Path

    from rescue.core.figures.evaluation import failure_cases
    from rescue.run.engine import run_study
    from rescue.run.peers import resolved_config
    from rescue.study.folder import create_study
    from rescue.study.journal import Journal

    root = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    try:
        # One task, so every simulator builds its env once in either mode.
        pool = cases(2 * n, horizon, task_id=1)
        config = asyncio.run(resolved_config(study_config(arms=("control",))))
        create_study(root / "eval", manifest(pool), config)
        asyncio.run(run_study(root / "eval"))
        with Journal.open(root / "eval", readonly=True) as journal:
            found = failure_cases(journal.cases(), journal.verdicts(), journal.all_arms(), {})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return found[:n]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    horizon = int(sys.argv[2]) if len(sys.argv) > 2 else 280
    items = failures(n, horizon)
    n = len(items)
    startup = _startup_cpu(2)
    independent, wall_i = _study_cpu(items, study_config())
    forked, wall_f = _study_cpu(items, study_config(fork_at_q=True))
    per_i, per_f = (independent - startup) / n, (forked - startup) / n
    print(f"{POLICY} policy, {n} cases, H={horizon}; simulator start-up {startup:.1f} s CPU (subtracted)")
    print(f"independent: {per_i:.2f} s CPU per case (wall {wall_i:.1f} s); fork at q: {per_f:.2f} s (wall {wall_f:.1f} s)")
    print(f"fork / independent compute per case: {per_f / per_i:.3f} (target <= 0.78, limit 0.75)")


if __name__ == "__main__":
    main()
