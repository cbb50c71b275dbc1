"""The check every action chunk passes before the simulator runs it (rescue/core/actions.py), and the
fail-fast stop counting a refused chunk like any other policy error, whatever step it came at."""

from __future__ import annotations

import numpy as np
import pytest

from rescue.core.actions import ActionSpace, BadActionChunk, checked_chunk
from rescue.core.failfast import FailFast, error_line
from rescue.core.records import ArmResult, Assistance

pytestmark = pytest.mark.fast

LIBERO = ActionSpace(low=(-1.0,) * 7, high=(1.0,) * 7)


def _check(actions, due=8, interval=8, space=LIBERO, step=16):
    return checked_chunk({"actions": actions}, interval=interval, due=due, space=space, policy="ws://p:1", step=step)


def _refusal(actions, **kw) -> str:
    with pytest.raises(BadActionChunk) as info:
        _check(actions, **kw)
    return error_line(info.value)


def test_a_good_chunk_passes_unchanged_and_is_cut_to_the_interval():
    chunk = np.linspace(-0.9, 0.9, 10 * 7).reshape(10, 7)
    out = _check(chunk)
    assert out.dtype == np.float64 and out.shape == (8, 7) and np.array_equal(out, chunk[:8])
    assert _check(chunk[0], due=1).shape == (1, 7)  # one action is a chunk of one


@pytest.mark.parametrize("value, kind", [(np.nan, "NaN"), (np.inf, "+Inf"), (-np.inf, "-Inf")])
def test_a_non_finite_action_is_refused_naming_policy_step_and_kind(value, kind):
    chunk = np.zeros((8, 7))
    chunk[3, 2] = value
    line = _refusal(chunk)
    assert line == f"BadActionChunk: policy ws://p:1 answered a chunk with {kind} at step 16; nothing of it ran"
    with pytest.raises(BadActionChunk, match=r"action 3 \(step 19\), dimension 2"):
        _check(chunk)


def test_only_the_actions_that_run_are_checked():
    chunk = np.zeros((8, 7))
    chunk[5:] = np.nan  # past the horizon: never run
    assert _check(chunk, due=5).shape == (8, 7)
    long = np.zeros((12, 7))
    long[8:] = np.inf  # past the replan interval: dropped
    assert _check(long).shape == (8, 7)


def test_the_wrong_shape_or_no_numbers_is_refused():
    assert "actions of 6 dimensions" in _refusal(np.zeros((8, 6)))
    assert "a chunk of 3 actions, fewer than the 8 steps" in _refusal(np.zeros((3, 7)))
    assert "shape (2, 8, 7)" in _refusal(np.zeros((2, 8, 7)))
    assert "not a numeric array" in _refusal([["a"] * 7] * 8)
    with pytest.raises(BadActionChunk, match="answered no actions at step 16"):
        checked_chunk({"action": 1}, interval=8, due=8, space=LIBERO, policy="ws://p:1", step=16)
    # Without a known action space any width runs (only finiteness and length are checked).
    assert _check(np.zeros((8, 6)), space=None).shape == (8, 6)


def test_finite_values_past_the_bounds_are_clipped_to_them():
    chunk = np.zeros((8, 7))
    chunk[0, 0], chunk[1, 6], chunk[2, 3] = 1.5, -1e30, 0.25
    out = _check(chunk)
    assert out[0, 0] == 1.0 and out[1, 6] == -1.0 and out[2, 3] == 0.25
    assert chunk[0, 0] == 1.5  # the policy's reply is not written to
    assert np.array_equal(_check(chunk, space=None), chunk)


def _error_arm(case_id: str, error: str) -> ArmResult:
    return ArmResult(case_id=case_id, arm="control", status="error", error=error, steps=0, trace=[],
                     assistance=Assistance(status="control"))


def test_refused_chunks_at_different_steps_are_one_cause_for_the_fail_fast_stop():
    watch = FailFast(k=3)
    errors = []
    for step in (8, 0, 40):
        with pytest.raises(BadActionChunk) as info:
            _check(np.full((8, 7), np.nan), step=step)
        errors.append(error_line(info.value))
    assert watch.observe([_error_arm("a", errors[0]), _error_arm("a", errors[1])]) is None
    stop = watch.observe([_error_arm("b", errors[2])])
    assert stop is not None and "first 3 arms" in stop and "BadActionChunk" in stop and "ws://p:1" in stop
