"""A robustness table like LIBERO-PRO's, with the test each row allows, and a rescue study on it, through the CLI.

1. `rescue eval` of the embedded vision-language policy on `libero_object`, on `libero_object_lan@base-inits`
   (libero_object's episodes, the policy told libero_object_lan's words: the paired language perturbation),
   and on each LIBERO-PRO perturbation suite of libero_object that builds here (language, object, swap, task, a
   distractor), each at the same task ids and initial-state indices FIRST..FIRST+EPISODES-1 (default 30-31:
   never trained on). An existing evaluation of `libero_object` that holds those episodes is reused with
   `--base EVAL_STUDY`.
2. Each row against `libero_object`, by the test the catalog's measurements allow: paired (exact McNemar,
   Newcombe's paired CI) where the episodes are identical (only `@base-inits`), else unpaired (difference of two
   proportions, Newcombe's hybrid score CI, Fisher's exact p): no shipped perturbation suite shares an initial
   state with its base, so `(task, index)` is not the same episode there. A distractor suite orders its tasks
   otherwise; its episodes are matched to their base task through the catalog.
3. `rescue manifest from-eval` of every perturbed row's failures, one manifest, and `rescue run` of it with
   control, assisted and a permuted sham arm (fork at q); its per-kind sham comparison is within one suite and
   case, so paired. Printed: both tables. Everything lands under OUT (default studies/robustness).

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/robustness.py [OUT] [--episodes 2] [--first 30] [--base EVAL_STUDY]
     [--limit N]   (at most N failures of each perturbed row in the rescue study)
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
sys.path.insert(0, str(ROOT))

from rescue.core.catalog import libero_catalog  # noqa: E402
from rescue.core.figures.robustness import SuiteComparison, compare_with_base  # noqa: E402
from rescue.core.figures.stats import Summary

BASE = "libero_object"
PERTURBED = ["libero_object_lan@base-inits", "libero_object_lan", "libero_object_object", "libero_object_swap",
             "libero_object_task", "libero_object_with_mug"]
CONFIG = """fork_at_q = true
[sham]
source = "permuted"
seed = 0
"""


def rescue(*args: str) -> None:
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_PROGRESS_EVERY_S": "300"}
    subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=env, check=True)


def export(study: Path, out: Path) -> dict:
    rescue("export", str(study), "--out", str(out))
    return json.loads(out.read_text())


def outcomes(data: dict, suite: str, inits: range) -> dict[tuple[int, int], bool]:
    """Success per episode of the export, keyed by (base task id, initial-state index): a suite whose task ids are
    not its base's (a distractor) is mapped through the catalog's measured task match."""
    catalog, out = libero_catalog(), {}
    for row in data["episode_rows"]:
        if row["init_state_index"] not in inits:
            continue
        task_id = int(row["task"].rsplit("/", 1)[1])
        versus = catalog.task(suite, task_id).versus_base
        out[(versus.base_task if versus else task_id, row["init_state_index"])] = row["label"] == "success"
    return out


def pct(x: float) -> str:
    return f"{100 * x:+.0f}"


def fmt_p(p: float) -> str:
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}".rstrip("0").rstrip(".") if p < 1 else "1"


def row_text(suite: str, kind: str, differs: str, c: SuiteComparison | None, ok: int, n: int) -> str:
    rate = f"{ok}/{n} ({100 * ok / n:.0f}%)"
    if c is None:
        return f"| `{suite}` | {kind} | | {rate} | | | |"
    discordant = f"; {c.perturbed_only} / {c.base_only} discordant" if c.design == "paired" else ""
    test = ("paired (identical episodes), exact McNemar" if c.design == "paired"
            else "unpaired (other episodes), Fisher's exact")
    return (f"| `{suite}` | {kind} | {differs} | {rate} | {test}{discordant} | {pct(c.diff)} pts "
            f"[{pct(c.ci[0])}, {pct(c.ci[1])}] | {fmt_p(c.p)} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="studies/robustness")
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--first", type=int, default=30)
    ap.add_argument("--base", help="an existing evaluation study of libero_object holding these episodes")
    ap.add_argument("--limit", type=int, help="at most this many failures of each perturbed row (manifest order)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    inits = range(args.first, args.first + args.episodes)
    catalog = libero_catalog()
    results, manifests = {}, []
    started = time.time()
    for suite in [BASE, *PERTURBED]:
        folder = suite.replace("@", ".")
        study = Path(args.base).resolve() if suite == BASE and args.base else out / f"eval-{folder}"
        if not study.exists():
            rescue("eval", "--suite", suite, "--episodes", str(args.episodes), "--first-init", str(args.first),
                   "--study", str(study))
        data = export(study, out / f"eval-{folder}.json")
        results[suite] = outcomes(data, suite, inits)
        if suite != BASE:
            manifest = out / f"failures-{folder}.jsonl"
            limit = ["--limit", str(args.limit)] if args.limit else []
            rescue("manifest", "from-eval", str(study), "--out", str(manifest), "--inits", f"{inits[0]}-{inits[-1]}", *limit)
            manifests.append(manifest)
    eval_s = time.time() - started
    failures = out / "failures.jsonl"
    failures.write_text("".join(m.read_text() for m in manifests))
    (out / "study.toml").write_text(CONFIG)
    study = out / "rescue"
    t0 = time.time()
    if not (study / "journal.sqlite").exists():
        rescue("run", str(failures), "--study", str(study), "--config", str(out / "study.toml"))
    rescue("verify", str(study))
    run_s = time.time() - t0
    result = export(study, out / "rescue.json")
    s = result["summary"]
    print(f"\nevaluations: {eval_s / 60:.1f} min; rescue study: {run_s / 60:.1f} min\n")
    print("| suite | perturbation | changes vs libero_object (catalog) | success | test vs libero_object | "
          "difference, 95% CI | p |")
    print("|---|---|---|---|---|---|---|")
    base = results[BASE]
    rows = []
    for suite in [BASE, *PERTURBED]:
        mine = results[suite]
        entry = catalog.suite(suite)
        summary = entry.versus_base()
        c = None if suite == BASE else compare_with_base(base, mine, summary.identical_episodes)
        differs = "" if summary is None else "; ".join(
            [summary.episodes_text().replace(" initial states equal", " inits equal"),
             summary.model_text(), summary.wording_text()])
        kind = entry.perturbation + ("@base-inits" if "@" in suite else "")
        print(row_text(suite, kind, differs, c, sum(mine.values()), len(mine)))
        rows.append({"suite": suite, "kind": kind, "success": sum(mine.values()), "n": len(mine),
                     "per_task": [sum(v for (t, _), v in mine.items() if t == task) for task in range(10)],
                     "comparison": None if c is None else c.model_dump(mode="json")})
    print("\nper task (base task ids 0-9, successes of the episodes):")
    for row in rows:
        print(f"  {row['suite']:32s} {' '.join(map(str, row['per_task']))}")
    print("\n| kind | failures (N) | rescued | sham rescued | K | assisted only / sham only | exact McNemar p |")
    print("|---|---|---|---|---|---|---|")
    rescued = Summary.model_validate(s)
    for kind, b in sorted(rescued.per_group.items()):
        sham = next(a for a in b.arms if a.arm == "sham")
        versus = next(c for c in b.comparisons if (c.first, c.second) == (rescued.arm, "sham"))
        print(f"| {kind} | {b.n} | {b.rescued} | {sham.r} | {versus.k} | "
              f"{versus.pairs.first_only} / {versus.pairs.second_only} | {fmt_p(versus.mcnemar_p)} |")
    sham = next(a for a in rescued.arms if a.arm == "sham")
    versus = rescued.comparison(rescued.arm, "sham")
    print(f"| all | {rescued.n} | {rescued.r} | {sham.r} | {versus.k} | "
          f"{versus.pairs.first_only} / {versus.pairs.second_only} | {fmt_p(versus.mcnemar_p)} |")
    (out / "robustness.json").write_text(json.dumps({"rows": rows, "summary": s}, indent=2) + "\n")


if __name__ == "__main__":
    main()
