"""The McNemar test and the normal quantile, computed without importing scipy.stats, are scipy.stats's own bit for
bit: every p-value and interval a study ever printed or exported (and `rescue verify` re-derives) stays the same."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import binomtest, norm

from rescue.core.figures import exact_stats
from rescue.core.figures.exact_stats import mcnemar_exact, normal_quantile

pytestmark = pytest.mark.fast


def test_mcnemar_is_scipys_binomial_test_bit_for_bit_on_every_table_up_to_60_pairs():
    differ = [(b, n - b) for n in range(1, 61) for b in range(n + 1)
              if mcnemar_exact(b, n - b) != binomtest(b, n, 0.5).pvalue]
    assert differ == []


def test_mcnemar_is_scipys_on_large_and_lopsided_tables():
    rng = np.random.default_rng(3)
    tables = [(int(b), int(n - b)) for n in rng.integers(101, 5000, 100) for b in (rng.integers(0, n + 1),)]
    tables += [(0, 4999), (4999, 0), (2500, 2500), (2500, 2501), (1, 1), (0, 1)]
    assert [t for t in tables if mcnemar_exact(*t) != binomtest(t[0], sum(t), 0.5).pvalue] == []


def test_the_normal_quantile_is_scipys_norm_ppf_bit_for_bit():
    qs = np.concatenate([np.linspace(1e-9, 1 - 1e-9, 20001), [0.5, 0.975, 0.995, 0.95, 0.9, 0.8, 1e-300]])
    ours, theirs = np.array([normal_quantile(float(q)) for q in qs]), norm.ppf(qs)
    assert qs[ours != theirs].tolist() == []


def test_a_scipy_without_the_binomial_functions_gets_scipy_stats_own_test(monkeypatch):
    expected = binomtest(3, 14, 0.5).pvalue
    monkeypatch.setitem(sys.modules, "scipy.special._ufuncs", None)  # its import now fails
    assert exact_stats.mcnemar_exact(3, 11) == expected


def test_a_command_that_prints_figures_does_not_import_scipy_stats():
    code = ("import sys; from rescue.core.figures.exact_stats import mcnemar_exact, paired_diff_ci, wilson_interval;"
            "from rescue.core.figures.harm import net_change;"
            "mcnemar_exact(3, 9); paired_diff_ci(3, 9, 20); wilson_interval(3, 20);"
            "print('scipy.stats' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
