"""The positive control of whether and when to ask (DESIGN §18), through the CLI: the embedded vision-language policy
(the bundled server, RNG control) on held-out initial states of the 10 `libero_object` tasks, every failure and every
success of its evaluation replayed (`rescue manifest from-eval --successes all`), the local advisor asked

- at a fixed early point (a quarter of the horizon, which every success reaches) and at the pre-registered half,
- where a `stall` trigger fires (the end effector and the task's object stood still over its window),
- where a random placebo fires, at the stall trigger's budget: its rate fixed before the held-out study runs, from a
  pilot on other held-out initial states (the stall trigger's share of asked episodes there and their lengths,
  `rescue.core.triggers.placebo_rate`).

The stall trigger's window and distance, unless given, are chosen on the pilot alone, by a rule declared here: of
windows 2, 3, 4, 6 queries and distances 0.005, 0.01, 0.02, 0.04 m, the pair whose firing on the pilot's control
arms asks the largest share of its failures minus the share of its successes (ties: the smaller window, then the
smaller distance). The pilot's control arms record what a stall reads, so every pair is evaluated on them.

It holds when the stall trigger exposes fewer successes than the early point, keeps most of its rescues (more than
half of the early point's), and the placebo at a matched budget rescues fewer than the trigger.

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/asking_control.py [OUT] [--pilot-first 30 --pilot-episodes 2]
     [--first 44 --episodes 6] [--window W --distance D]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's rescue, not an installed one

from rescue.core.asking import TriggerConfig
from rescue.core.triggers import first_firing, placebo_rate
from rescue.read.export import StudyExport, read_export

H, C = 280, 8  # libero_object's horizon; the embedded policy's chunk


def env() -> dict:
    return {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_PROGRESS_EVERY_S": "300"}


def rescue(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=env(), check=True)


def stall_table(window: int, distance: float) -> str:
    return f"""
[[trigger]]
name = "stall"
kind = "stall"
window = {window}
distance = {distance}
"""


def cohort(out: Path, first: int, episodes: int) -> Path:
    """Evaluate held-out initial states [first, first + episodes) of every task; every failure and success a case."""
    evaluation, manifest = out / "eval", out / "cases.jsonl"
    if not evaluation.exists():
        rescue("eval", "--suite", "libero_object", "--episodes", str(episodes), "--first-init", str(first),
               "--study", str(evaluation))
    rescue("manifest", "from-eval", str(evaluation), "--out", str(manifest), "--successes", "all")
    return manifest


def study(out: Path, manifest: Path, config_text: str) -> StudyExport:
    config, folder = out / "study.toml", out / "study"
    config.write_text(config_text)
    if not folder.exists():
        rescue("run", str(manifest), "--config", str(config), "--study", str(folder))
    else:
        rescue("resume", str(folder))  # a run stopped part-way goes on with the cases never started
    rescue("verify", str(folder))
    rescue("export", str(folder), "--out", str(out / "export.json"))
    return read_export(out / "export.json")


WINDOWS, DISTANCES = (2, 3, 4, 6), (0.005, 0.01, 0.02, 0.04)


def pilot_controls(pilot_dir: Path) -> list[tuple[object, bool]]:
    """The pilot's control arms (with what a stall reads at each query) and whether each episode was a success."""
    import sqlite3

    from rescue.core.records import ArmResult

    con = sqlite3.connect(f"file:{pilot_dir / 'study' / 'journal.sqlite'}?mode=ro", uri=True)
    rows = con.execute("SELECT a.data, c.data FROM arms a JOIN cases c USING (case_id) WHERE a.arm = 'control'").fetchall()
    con.close()
    return [(ArmResult.model_validate_json(a), json.loads(c).get("outcome") == "success") for a, c in rows]


def asked_shares(controls, trigger: TriggerConfig) -> tuple[float, float]:
    """The shares of the pilot's failures and successes the trigger fires on."""
    fired = [(first_firing(trigger, a.queries, a.case_id, H, C) is not None, ok) for a, ok in controls]
    fails, succs = [f for f, ok in fired if not ok], [f for f, ok in fired if ok]
    return sum(fails) / max(1, len(fails)), sum(succs) / max(1, len(succs))


def choose(controls) -> tuple[int, float]:
    """The declared rule: the window and distance that ask most of the pilot's failures and least of its successes."""
    print("pilot sweep (window, distance): share of failures asked, of successes asked")
    best = None
    for window in WINDOWS:
        for distance in DISTANCES:
            f, s = asked_shares(controls, TriggerConfig(name="s", kind="stall", window=window, distance=distance))
            print(f"  {window} {distance}: {f:.2f}, {s:.2f}")
            if best is None or f - s > best[0]:
                best = (f - s, window, distance)
    return best[1], best[2]


def pilot_rate(controls, stall: TriggerConfig, placebo: TriggerConfig) -> tuple[float, float]:
    """The stall trigger's share of asked episodes in the pilot, and the placebo rate that matches it."""
    asked = [first_firing(stall, a.queries, a.case_id, H, C) is not None for a, _ in controls]
    share = sum(asked) / len(asked)
    return share, placebo_rate(share, [a.steps for a, _ in controls], placebo, H, C, [stall, placebo])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="studies/asking-control")
    parser.add_argument("--pilot-first", type=int, default=30)
    parser.add_argument("--pilot-episodes", type=int, default=2)
    parser.add_argument("--first", type=int, default=44, help="the held-out cohort's first initial state")
    parser.add_argument("--episodes", type=int, default=6, help="held-out initial states per task")
    parser.add_argument("--window", type=int, help="the stall's window (default: chosen on the pilot)")
    parser.add_argument("--distance", type=float, default=0.02, help="its distance, with --window")
    parser.add_argument("--seed", type=int, default=0, help="the placebo's seed")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    times = {}

    # The pilot: another held-out split, the stall trigger alone, to fix the placebo's rate before the study.
    t0 = time.time()
    pilot_dir = out / "pilot"
    pilot_dir.mkdir(parents=True, exist_ok=True)
    study(pilot_dir, cohort(pilot_dir, args.pilot_first, args.pilot_episodes), stall_table(3, 0.02))
    times["pilot"] = time.time() - t0
    controls = pilot_controls(pilot_dir)
    window, distance = choose(controls)
    if args.window is not None:
        window, distance = args.window, args.distance
    stall = TriggerConfig(name="stall", kind="stall", window=window, distance=distance)
    placebo = TriggerConfig(name="placebo", kind="random", matches="stall", rate=1.0, seed=args.seed)
    share, rate = pilot_rate(controls, stall, placebo)
    print(f"declared: stall window {window}, distance {distance}; on the pilot it asked {share:.3f} of "
          f"{len(controls)} episodes; the placebo's rate {rate:.4f}")

    held = out / "held-out"
    held.mkdir(parents=True, exist_ok=True)
    config = f"""[[query_point]]
name = "early"
fraction = 0.25
{stall_table(window, distance)}
[[trigger]]
name = "placebo"
kind = "random"
matches = "stall"
rate = {rate:.4f}
seed = {args.seed}
"""
    t0 = time.time()
    export = study(held, cohort(held, args.first, args.episodes), config)
    times["held-out"] = time.time() - t0
    report(export, times)


def report(export: StudyExport, times: dict[str, float]) -> None:
    s = export.summary
    a = s.asking
    print("\n" + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items())
          + f"; {s.n} failures, {s.harm.successes if s.harm else 0} successes\n")
    print("| arm | way | failures asked | successes asked | calls/episode | rescued (of failures) | broken | "
          "net change, these episodes | per call |")
    print("|---|---|---|---|---|---|---|---|---|")
    rescued = {f.arm: f.r for f in s.figures()}
    for w in a.ways:
        h = s.harm.of(w.arm) if s.harm else None
        net = w.net
        change = "n/a" if net is None or net.change is None else f"{100 * net.change:+.1f} pp"
        if net is not None and net.these_episodes is not None:
            change += " exact" if net.these_episodes.exact else (
                f" [{100 * net.these_episodes.low:+.1f}, {100 * net.these_episodes.high:+.1f}]")
        print(f"| {w.arm} | {w.kind} | {w.failures.asked}/{w.failures.episodes} | "
              f"{w.successes.asked if w.successes else 0}/{w.successes.episodes if w.successes else 0} | "
              f"{w.calls_per_episode:.2f} | {rescued.get(w.arm)} | {h.counts['broken'] if h else 'n/a'} | {change} | "
              f"{'n/a' if w.change_per_call is None else f'{100 * w.change_per_call:+.1f} pp'} |")
    print("\n| first | second | only first | only second | K | exact McNemar p | Holm |")
    print("|---|---|---|---|---|---|---|")
    for c in a.comparisons:
        print(f"| {c.first} | {c.second} | {c.pairs.first_only} | {c.pairs.second_only} | {c.k} | "
              f"{c.mcnemar_p:.3g} | {c.holm_p:.3g} |")
    for b in a.budgets:
        print(f"\nbudget: placebo {b.placebo_calls:.3f} vs stall {b.trigger_calls:.3f} calls per episode: "
              f"{'matched' if b.matched else 'NOT matched'}")
    stall = a.way("assisted@stall")
    checks = {
        "the stall trigger exposes fewer successes than the early point":
            stall.successes is not None and stall.successes.asked < s.harm.of("assisted@early").exposed,
        "it keeps most of the early point's rescues (more than half)":
            rescued["assisted@stall"] > rescued["assisted@early"] / 2,
        "the placebo at its budget rescues fewer": rescued["assisted@placebo"] < rescued["assisted@stall"],
    }
    print()
    for what, ok in checks.items():
        print(f"{'holds' if ok else 'DOES NOT HOLD'}: {what}")
    print(f"\n{a.reading}")


if __name__ == "__main__":
    main()
