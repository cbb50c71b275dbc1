"""The figures of a study, pure functions of its judged cases: paired tables and exact tests, K-continuation
estimates, harm and the net change with the successes' sample, evaluations and baselines, robustness."""
