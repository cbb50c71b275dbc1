"""Coverage and bias of the net change (DESIGN §17) by simulation, through the project's own sampler
(`sample_cases`) and estimator (`net_change`), over populations whose net change is known. Shared by the fast
test (tests/test_harm_coverage.py) and the benchmark that records the table (benchmarks/harm_coverage.py).

A population is a list of episodes, each a historical failure or success of a task, with the chance that the
assisted arm and the control arm succeed from its initial state (0 or 1: a deterministic policy). K continuations
per arm share one uniform draw per continuation (paired continuation seeds: both arms' k-th continuation see the
same noise), so a case's K paired differences are positively correlated, as under `continuations = K`.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import numpy as np

from rescue.core.figures.harm import net_change
from rescue.core.figures.success_sample import sample_cases
from rescue.core.manifest import Case


@dataclass(frozen=True)
class Episode:
    """One episode of an evaluation: its task, its historical outcome, and each arm's chance of success."""

    task: int
    success: bool
    assisted: float
    control: float


@dataclass(frozen=True)
class Regime:
    """A population, how many of its successes (and failures) a study replays, and K."""

    name: str
    episodes: tuple[Episode, ...]
    successes_sampled: int | None  # None: every success
    failures_sampled: int | None = None
    k: int = 1

    @property
    def deterministic(self) -> bool:
        return self.k == 1 and all(p in (0.0, 1.0) for e in self.episodes for p in (e.assisted, e.control))

    @property
    def truth(self) -> float:
        """The net change for these episodes: the mean over all of (assisted - control) chance of success."""
        return math.fsum(e.assisted - e.control for e in self.episodes) / len(self.episodes)


def _episodes(task_counts: list[tuple[int, bool, float, float, int]]) -> tuple[Episode, ...]:
    """(task, success, assisted, control, how many) rows."""
    return tuple(Episode(t, s, a, c) for t, s, a, c, n in task_counts for _ in range(n))


def _twelve_and_twelve(broken: int) -> tuple[Episode, ...]:
    # 12 failures, 4 rescued; 12 successes of one task, `broken` of them broken by the advice.
    return _episodes([(0, False, 1.0, 0.0, 4), (0, False, 0.0, 0.0, 8), (1, True, 0.0, 1.0, broken),
                      (1, True, 1.0, 1.0, 12 - broken)])


def _four_tasks(per_task: int, broken_tasks: tuple[int, ...], broken_per_task: int) -> tuple[Episode, ...]:
    rows = [(t, False, 1.0 if t % 2 else 0.0, 0.0, 3) for t in range(4)]
    for t in range(4):
        broken = broken_per_task if t in broken_tasks else 0
        rows += [(t, True, 0.0, 1.0, broken), (t, True, 1.0, 1.0, per_task - broken)]
    return _episodes(rows)


def _sampling(broken: int) -> tuple[Episode, ...]:
    # A policy that samples: every episode's chances strictly between 0 and 1.
    return _episodes([(0, False, 0.6, 0.1, 4), (0, False, 0.2, 0.1, 8), (1, True, 0.3, 0.9, broken),
                      (1, True, 0.85, 0.9, 12 - broken)])


REGIMES: tuple[Regime, ...] = (
    *(Regime(f"12 F + 12 S, harm {b}/12, {n} of 12 successes, K = 1", _twelve_and_twelve(b), n)
      for b in (2, 1) for n in (4, 6, 8)),
    Regime("four tasks, one success each (one broken), 2 sampled", _four_tasks(1, (3,), 1), 2),
    *(Regime(f"four tasks of three successes, harm in tasks 2-3, {n} sampled", _four_tasks(3, (2, 3), 3), n)
      for n in (2, 6)),
    *(Regime(f"four tasks of three successes, harm 1/12, {n} sampled", _four_tasks(3, (3,), 1), n) for n in (2, 6)),
    Regime("12 F + 12 S, 6 of 12 failures and 4 of 12 successes", _twelve_and_twelve(2), 4, failures_sampled=6),
    *(Regime(f"a policy that samples, harm 2/12, {n} of 12 successes, K = {k}", _sampling(2), n, k=k)
      for k in (1, 2) for n in (4, 8)),
    Regime("census, K = 1 (exact replays)", _twelve_and_twelve(2), None),
    Regime("census, a policy that samples, K = 2", _sampling(2), None, k=2),
)


def _scores(episodes: list[Episode], k: int, harm: bool, rng: np.random.Generator) -> list[float]:
    out = []
    for e in episodes:
        u = rng.random(k)  # one draw per continuation, shared by both arms (paired seeds)
        a, c = (u < e.assisted).astype(float), (u < e.control).astype(float)
        out.append(float(np.mean(c - a if harm else a - c)))
    return out


def _cases(episodes: list[Episode], kind: str) -> list[Case]:
    return list(_cases_of_tasks(tuple(e.task for e in episodes), kind))


@functools.lru_cache(maxsize=256)
def _cases_of_tasks(tasks: tuple[int, ...], kind: str) -> tuple[Case, ...]:
    return tuple(Case(case_id=f"{kind}{i}", suite="libero_object", task_id=t, init_state_index=i, env_seed=i,
                      horizon=280) for i, t in enumerate(tasks))


def _picked(episodes: tuple[Episode, ...], regime: Regime, seed: int) -> tuple[list[Episode], list[Episode], int, int]:
    """The failures and successes the project's sampler draws (and how many of each the population has)."""
    fails = [e for e in episodes if not e.success]
    wins = [e for e in episodes if e.success]
    picked_f = [fails[int(c.case_id[1:])] for c in sample_cases(_cases(fails, "f"), regime.failures_sampled, seed)]
    picked_s = [wins[int(c.case_id[1:])] for c in sample_cases(_cases(wins, "s"), regime.successes_sampled, seed)]
    return picked_f, picked_s, len(fails), len(wins)


def draw(regime: Regime, episodes: tuple[Episode, ...], seed: int, rng: np.random.Generator, confidence: float = 0.95,
         benchmark: bool = True):
    """One study of the population: the sampler draws its cases, the arms are replayed, the estimator answers."""
    picked_f, picked_s, fails, wins = _picked(episodes, regime, seed)
    return net_change(_scores(picked_f, regime.k, False, rng), fails, _scores(picked_s, regime.k, True, rng),
                      wins, confidence, exact_values=regime.deterministic, seed=seed, benchmark=benchmark)


@dataclass
class Tally:
    """What a regime's simulation found."""

    studies: int = 0
    covered: int = 0
    zero_width: int = 0
    width: float = 0.0
    estimates: float = 0.0

    @property
    def coverage(self) -> float:
        return self.covered / self.studies

    def floor(self, nominal: float = 0.95) -> float:
        """The least coverage that is nominal within simulation error (two standard errors below)."""
        return nominal - 2 * math.sqrt(nominal * (1 - nominal) / self.studies)


def these_episodes(regime: Regime, studies: int, seed: int = 0) -> tuple[Tally, float]:
    """Coverage of the interval for these episodes over `studies` studies of the regime's population, and the
    estimator's bias (points) over as many draws again without intervals."""
    rng = np.random.default_rng(seed)
    tally = Tally()
    truth = regime.truth
    for i in range(studies):
        got = draw(regime, regime.episodes, seed * 100_003 + i, rng, benchmark=False)
        ci = got.these_episodes
        tally.studies += 1
        tally.covered += ci.low - 1e-12 <= truth <= ci.high + 1e-12
        tally.zero_width += ci.high - ci.low < 1e-12
        tally.width += ci.high - ci.low
        tally.estimates += got.change
    return tally, 100 * (tally.estimates / tally.studies - truth)


def bias(regime: Regime, draws: int, seed: int = 1) -> float:
    """The estimator's bias in points, from the sampler alone (means of the drawn scores, no interval)."""
    rng = np.random.default_rng(seed)
    total = 0.0
    for i in range(draws):
        picked_f, picked_s, fails, wins = _picked(regime.episodes, regime, 7919 * i + seed)
        total += (fails * np.mean(_scores(picked_f, regime.k, False, rng))
                  - wins * np.mean(_scores(picked_s, regime.k, True, rng))) / (fails + wins)
    return 100 * (total / draws - regime.truth)


def benchmark(regime: Regime, studies: int, seed: int = 0) -> Tally:
    """Coverage of the interval for the benchmark: each study's episodes are a new draw of the suite's initial
    states (every episode of the regime's population equally likely, with replacement), its true net change the
    population's."""
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    tally = Tally()
    truth = regime.truth
    for i in range(studies):
        episodes = tuple(pick.choice(regime.episodes) for _ in regime.episodes)
        if not any(e.success for e in episodes) or all(e.success for e in episodes):
            continue  # the regime's strata: a study of both
        sampled = regime.successes_sampled
        wins = sum(e.success for e in episodes)
        trimmed = Regime(regime.name, episodes, None if sampled is None or sampled >= wins else sampled,
                         None if regime.failures_sampled is None or regime.failures_sampled >= len(episodes) - wins
                         else regime.failures_sampled, regime.k)
        got = draw(trimmed, episodes, seed * 100_003 + i, rng)
        ci = got.benchmark
        tally.studies += 1
        tally.covered += ci.low - 1e-12 <= truth <= ci.high + 1e-12
        tally.zero_width += ci.high - ci.low < 1e-12
        tally.width += ci.high - ci.low
    return tally


def _old_scores(episodes: list[Episode], k: int, harm: bool, rng: np.random.Generator) -> list[tuple[float, float]]:
    """(score, within-case variance) of each case as `rescue-export/6` computed them from its arms' successes of K:
    [p_a (1 - p_a) + p_c (1 - p_c)] / (K - 1), 0 with K = 1."""
    out = []
    for e in episodes:
        u = rng.random(k)
        a, c = float(np.mean(u < e.assisted)), float(np.mean(u < e.control))
        variance = (a * (1 - a) + c * (1 - c)) / (k - 1) if k > 1 else 0.0
        out.append((c - a if harm else a - c, variance))
    return out


def old_estimator(regime: Regime, studies: int, seed: int = 0) -> Tally:
    """The interval of `rescue-export/6` (normal, two-stage variance; rescue/read/legacy_harm.py) on the same
    kind of draws: how often it covered and how often it was a point."""
    from rescue.read.legacy_harm import _old_net

    rng = np.random.default_rng(seed)
    tally = Tally()
    for i in range(studies):
        picked_f, picked_s, fails, wins = _picked(regime.episodes, regime, seed * 100_003 + i)
        got = _old_net(_old_scores(picked_f, regime.k, False, rng), fails, _old_scores(picked_s, regime.k, True, rng),
                       wins, 0.95)
        tally.studies += 1
        ci = got["change_ci"]
        if ci is None:
            continue
        tally.covered += ci[0] - 1e-12 <= regime.truth <= ci[1] + 1e-12
        tally.zero_width += ci[1] - ci[0] < 1e-12
        tally.width += ci[1] - ci[0]
    return tally
