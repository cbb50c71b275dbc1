"""Property tests (hypothesis) for the sampling frame a manifest carries (DESIGN §17): the allocation of a sample
over tasks, the seeded sample itself, the frame read back from every row, and a row edited alone."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rescue.core.figures.success_sample import (
    DESIGN,
    SamplingFrame,
    allocate,
    frame_disagreement,
    frame_of,
    frame_refusal,
    frame_tags,
    sample_cases,
)
from rescue.core.manifest import Case

pytestmark = pytest.mark.fast

counts = st.lists(st.integers(0, 30), min_size=1, max_size=8)


@given(counts, st.integers(0, 10**6), st.data())
def test_allocation_sums_to_n_rounds_each_quota_and_never_exceeds_a_task(sizes, seed, data):
    total = sum(sizes)
    n = data.draw(st.integers(0, total))
    got = allocate(sizes, n, seed)
    assert sum(got) == n
    for size, k in zip(sizes, got):
        quota = n * size / total if total else 0
        assert math.floor(quota + 1e-9) <= k <= math.ceil(quota - 1e-9) and k <= size


def _cases(sizes: list[int]) -> list[Case]:
    return [Case(case_id=f"t{t}-{i}", suite="libero_object", task_id=t, init_state_index=i, env_seed=i, horizon=280)
            for t, size in enumerate(sizes) for i in range(size)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=5), st.integers(0, 10**6), st.data())
def test_the_sample_is_seeded_of_its_size_in_manifest_order_and_a_subset(sizes, seed, data):
    cases = _cases(sizes)
    n = data.draw(st.integers(0, len(cases)))
    got = sample_cases(cases, n, seed)
    assert len(got) == n and got == sample_cases(cases, n, seed)
    index = {c.case_id: i for i, c in enumerate(cases)}
    assert [index[c.case_id] for c in got] == sorted(index[c.case_id] for c in got)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.data())
def test_the_frame_reads_back_from_every_row_and_a_row_edited_alone_is_named(failures, successes, data):
    sampled = data.draw(st.one_of(st.none(), st.integers(1, successes)))
    frame = SamplingFrame(failures=failures, successes=successes, sampled=sampled,
                          seed=None if sampled is None else data.draw(st.integers(0, 99)), design=DESIGN)
    rows = [c.model_copy(update={"tags": frame_tags(frame, SamplingFrame(failures=failures, successes=successes))})
            for c in _cases([3])]
    assert frame_of(rows) == frame and frame_disagreement(rows) is None
    tag = data.draw(st.sampled_from(sorted(rows[0].tags)))
    which = data.draw(st.integers(0, len(rows) - 1))
    edited = list(rows)
    value = rows[which].tags[tag]
    other = value + 1 if isinstance(value, int) else value + "-edited"
    edited[which] = rows[which].model_copy(update={"tags": {**rows[which].tags, tag: other}})
    assert tag in frame_disagreement(edited) or "task" in frame_disagreement(edited)


@given(st.integers(1, 50), st.integers(0, 50), st.data())
def test_only_the_declared_census_or_sample_gives_a_net_change(failures, successes, data):
    frame = SamplingFrame(failures=failures, successes=successes, design=DESIGN)
    assert frame_refusal(frame, failures, successes) is None
    fewer = data.draw(st.integers(0, failures - 1))
    assert "hand-made" in frame_refusal(frame, fewer, successes)
    limited = frame.model_copy(update={"limit": max(fewer, 1)})
    if fewer < failures:
        assert "--limit" in frame_refusal(limited, fewer, successes)
