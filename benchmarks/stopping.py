"""The `[stopping]` rule by simulation (DESIGN §20), through the project's own decision (`decide`): studies of paired
outcomes with a known effect, looked at after every case, up to a maximum. Printed per effect and K: how often the
rule stops for efficacy and for futility, the coverage of the interval it reports at its stop, the mean cases to
a decision, and the fixed number of cases an exact one-shot test needs for the same power. Pure computation.

A case's paired score is the mean over K continuations of (first arm - second arm), each continuation +1 with
chance 0.05 + effect, -1 with chance 0.05, else 0 (so the effect is the mean paired difference).

Run: .venv/bin/python benchmarks/stopping.py [STUDIES] [MAXIMUM]   (defaults 2000 studies, at most 200 cases)
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rescue.core.figures.exact_stats import mcnemar_exact  # noqa: E402
from rescue.core.figures.sequential import decide  # noqa: E402

ALPHA, MINIMUM, EFFECT, LOSS = 0.05, 10, 0.10, 0.05


def draw(rng: np.random.Generator, n: int, effect: float, k: int) -> np.ndarray:
    u = rng.random((n, k))
    return np.where(u < LOSS + effect, 1.0, np.where(u < 2 * LOSS + effect, -1.0, 0.0)).mean(axis=1)


def fixed_power(rng: np.random.Generator, n: int, effect: float, k: int, studies: int) -> float:
    """Power of a one-shot test at n cases: exact McNemar (K = 1) or the exact sign-flip test (K > 1), two-sided."""
    from rescue.core.figures.continuations import sign_flip_p

    hits = 0
    for _ in range(studies):
        d = draw(rng, n, effect, k)
        if k == 1:
            p = mcnemar_exact(int((d > 0).sum()), int((d < 0).sum()))
        else:
            p = sign_flip_p([int(round(x * k)) for x in d])
        hits += p < ALPHA and d.mean() > 0
    return hits / studies


def fixed_n_for(power: float, effect: float, k: int, maximum: int, rng: np.random.Generator) -> int | None:
    """The least n (searched on a grid) whose one-shot test reaches `power` (at most 0.99: a power of 1 in a
    simulation says only that it is high); None past the maximum."""
    if power <= 0.0:
        return None
    target = min(power, 0.99)
    for n in list(range(5, 60, 5)) + list(range(60, maximum + 1, 10)):
        if fixed_power(rng, n, effect, k, 1000) >= target:
            return n
    return None


def main() -> None:
    studies = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    maximum = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    rng = np.random.default_rng(20261206)
    start = time.time()
    print(f"{studies} studies a row, alpha {ALPHA} per boundary, minimum {MINIMUM}, maximum {maximum}, "
          f"futility below {EFFECT:g}; continuations +1 at {LOSS} + effect, -1 at {LOSS}")
    print("| effect | K | efficacy stops | futility stops | reached the maximum | coverage at the stop | mean cases "
          "| fixed n at equal power | mean / fixed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in (1, 3):
        for effect in (0.0, 0.10, 0.25, 0.50):
            counts = {"efficacy": 0, "futility": 0, "maximum": 0}
            covered, cases = 0, []
            for _ in range(studies):
                d = draw(rng, maximum, effect, k)
                got = decide([(str(i), float(x)) for i, x in enumerate(d)], ALPHA, MINIMUM, "both", EFFECT, True)
                counts[got.outcome] += 1
                covered += got.interval[0] <= effect <= got.interval[1]
                cases.append(got.at)
            power = counts["efficacy"] / studies
            fixed = fixed_n_for(power, effect, k, maximum, rng) if effect > 0 else None
            mean = float(np.mean(cases))
            ratio = f"{mean / fixed:.2f}" if fixed else "n/a"  # the sequential rule's mean over the one-shot n
            print(f"| {100 * effect:.0f} pp | {k} | {counts['efficacy'] / studies:.3f} | {counts['futility'] / studies:.3f} "
                  f"| {counts['maximum'] / studies:.3f} | {covered / studies:.3f} | {mean:.1f} | {fixed or 'n/a'} | {ratio} |",
                  flush=True)
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
