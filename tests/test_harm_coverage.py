"""The net change's intervals hold where users run them (DESIGN §17): simulated studies of known populations, drawn
by the project's own sampler and estimated by its own estimator (tests/harm_coverage.py), in the small-sample
regimes: a few sampled successes, rare harm, tasks with one or three successes, K = 1 and K = 2 with paired
continuation seeds, a census. Each interval covers the truth at the nominal 95% or more, within simulation error;
none is zero-width unless it is a census of exact replays; the estimate is unbiased to under a point.
benchmarks/harm_coverage.py runs the same with more studies and records the table in docs/benchmarks.md."""

from __future__ import annotations

import pytest
from harm_coverage import REGIMES, benchmark, bias, these_episodes

pytestmark = pytest.mark.fast

STUDIES = 200


@pytest.mark.parametrize("regime", REGIMES, ids=[r.name for r in REGIMES])
def test_the_interval_for_these_episodes_covers_and_the_estimate_is_unbiased(regime):
    tally, _ = these_episodes(regime, STUDIES)
    assert tally.coverage >= tally.floor(), (regime.name, tally.coverage)
    exact_census = regime.deterministic and regime.successes_sampled is None and regime.failures_sampled is None
    if exact_census:
        assert tally.zero_width == tally.studies  # exact for these episodes, and said so
    else:
        assert tally.zero_width == 0
    assert abs(bias(regime, 2000)) < 1.0


@pytest.mark.parametrize("regime", REGIMES[::3] + (REGIMES[-2],), ids=[r.name for r in REGIMES[::3] + (REGIMES[-2],)])
def test_the_interval_for_the_benchmark_covers_and_is_never_a_point(regime):
    tally = benchmark(regime, STUDIES)
    assert tally.studies >= STUDIES * 0.95
    assert tally.coverage >= tally.floor(), (regime.name, tally.coverage)
    assert tally.zero_width == 0


def test_the_simulation_would_see_an_interval_that_collapses():
    """The old estimator's failure, replayed: an interval of zero width around agreeing samples covers the truth
    only when the sample happens to hold the broken success; the tally says so."""
    from harm_coverage import Regime, _twelve_and_twelve

    regime = Regime("12 F + 12 S, harm 1/12, 4 of 12", _twelve_and_twelve(1), 4)
    tally, _ = these_episodes(regime, 60)
    assert tally.zero_width == 0 and tally.coverage == 1.0
    # A point interval at the estimate, scored by the same tally, misses whenever the broken success is unsampled.
    import numpy as np

    from harm_coverage import draw

    rng = np.random.default_rng(0)
    misses = sum(abs(draw(regime, regime.episodes, i, rng).change - regime.truth) > 1e-12 for i in range(60))
    assert misses > 20
