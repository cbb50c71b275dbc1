"""The `[stopping]` rule on the embedded positive-control cohort (DESIGN §20, docs/results.md), through the CLI: the
embedded vision-language policy evaluated on the held-out initial states 30-39 of the 10 `libero_object` tasks, its
failures rescued by the bundled endpoint's subgoal

- once with every case run (`rescue run --no-stop`): the fixed-size study, timed;
- once under a rule (`test = "rescue"`, efficacy or futility, alpha 0.05, at least 5 cases): killed with SIGKILL
  once the rule has decided and kept its decision, resumed, verified and reported.

Printed: the cases each ran and their wall time, the rule's decision and interval, and what the rule would have
saved of the fixed-size study (the decision over its cases in the rule's order, and the arm-time of the rest).

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/stopping_cohort.py [OUT] [--episodes 10] [--first 30]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's rescue, not an installed one

RULE = """
[stopping]
test = "rescue"
stop_for = "both"
minimum = 5
seed = 0
"""


def env() -> dict:
    return {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_PROGRESS_EVERY_S": "300"}


def rescue(*args: str) -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=env(), check=True)
    return time.time() - t0


def decision(study: Path) -> dict | None:
    """The rule's decision as the study's journal keeps it; None: not decided, or no journal yet."""
    from rescue.study.folder import STOPPING_DECISION_KEY, StudyError, open_journal

    try:
        with open_journal(study) as journal:
            return journal.meta().get(STOPPING_DECISION_KEY)
    except (StudyError, sqlite3.Error):  # the run has not made its journal yet
        return None


def run_killed(manifest: Path, config: Path, study: Path) -> float:
    """`rescue run` under the rule, SIGKILLed (its whole process group) once the decision is kept; its wall time."""
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study),
                             "--config", str(config)], cwd=ROOT, env=env(), start_new_session=True)
    while decision(study) is None:
        if proc.poll() is not None:
            raise SystemExit(f"the ruled run exited {proc.returncode} before its rule decided")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return time.time() - t0


def arm_seconds(study: Path) -> dict[str, float]:
    """Per case, the wall its arms took (the latest end minus the earliest start, from the events log)."""
    spans: dict[str, list[float]] = {}
    for line in (study / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") in ("arm.started", "arm.finished") and event.get("case_id") and "timestamp" in event:
            spans.setdefault(event["case_id"], []).append(_seconds(event["timestamp"]))
    return {case: max(ts) - min(ts) for case, ts in spans.items() if len(ts) > 1}


def _seconds(stamp: str | float) -> float:
    if isinstance(stamp, (int, float)):
        return float(stamp)
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="studies/stopping-cohort")
    parser.add_argument("--episodes", type=int, default=10, help="held-out initial states per task")
    parser.add_argument("--first", type=int, default=30, help="the first held-out initial state")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    evaluation, manifest, config = out / "eval", out / "held_out.jsonl", out / "rule.toml"
    times = {}
    if not evaluation.exists():
        times["evaluation"] = rescue("eval", "--suite", "libero_object", "--episodes", str(args.episodes),
                                     "--first-init", str(args.first), "--study", str(evaluation))
    rescue("manifest", "from-eval", str(evaluation), "--out", str(manifest))
    config.write_text(RULE)
    full, ruled = out / "full", out / "ruled"
    if not full.exists():
        times["every case (--no-stop)"] = rescue("run", str(manifest), "--study", str(full), "--config", str(config),
                                                 "--no-stop")
    if not ruled.exists():
        times["under the rule, until killed"] = run_killed(manifest, config, ruled)
        times["resume"] = rescue("resume", str(ruled))
    rescue("verify", str(ruled))
    rescue("verify", str(full))
    rescue("report", str(ruled))
    rescue("export", str(ruled))
    rescue("export", str(full))
    ruled_export = json.loads((ruled / "export.json").read_text())
    full_export = json.loads((full / "export.json").read_text())

    # What the rule would have decided over the fixed-size study's cases, in its order.
    from rescue.core.configuration.config_files import load_config
    from rescue.core.figures.sequential import main_order, study_decision, study_order
    from rescue.study.folder import open_journal, read_study

    rule = load_config(config).stopping
    with open_journal(full) as journal:
        records = read_study(full, journal)
    main = main_order(study_order(records.cases, rule.seed), records.cases)
    judged = {c.case_id: (records.record(c), records.verdicts[c.case_id]) for c in records.cases
              if c.case_id in records.verdicts}
    would = study_decision(rule, *rule.arms(records.config.primary_arm), main, judged)
    spent = arm_seconds(full)
    upto = main[: main.index(would.case_id) + 1]
    kept = sum(spent.get(c, 0.0) for c in upto)
    total = sum(spent.values())

    print()
    print(", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items()))
    s = full_export["summary"]
    print(f"every case: {s['n']} failures, rescued {s['r']}, McNemar p = {s['versus_control']['mcnemar_p']:.2g}")
    stop = ruled_export["stopping"]
    d = stop["decision"]
    print(f"under the rule: {stop['described']}; decided {d['outcome']} at {d['at']} of {stop['main']}, "
          f"{stop['ran']} cases ran; mean {100 * d['mean']:+.1f} pp [{100 * d['interval'][0]:+.1f}, "
          f"{100 * d['interval'][1]:+.1f}] (confidence sequence); its own R = {ruled_export['summary']['r']}")
    print(f"over the fixed-size study's cases the rule decides {would.outcome} at {would.at} of {len(main)}: "
          f"the arms of {len(upto)} cases took {kept / 60:.1f} of {total / 60:.1f} arm-minutes ({kept / total:.0%})")


if __name__ == "__main__":
    main()
