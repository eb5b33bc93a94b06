"""benchmarks/gpu/verify_run.py's accuracy summary: what a lossy wire format changed against a
reference, counted as the fp8 accuracy benchmark and the GPU verification report it."""

from __future__ import annotations

import pytest

from benchmarks.gpu.verify_run import accuracy_summary


def test_equal_completions_have_no_drift() -> None:
    s = accuracy_summary([["a", "b"]], [["a", "b"]], [[-0.5, -1.0]], [[-0.5, -1.0]])
    assert (s["completions"], s["equal"], s["first_token_equal"]) == (1, 1, 1)
    assert s["mean_tokens_in_common"] == 2
    assert (s["drift_mean"], s["drift_max"], s["drift_tokens"]) == (0.0, 0.0, 2)


def test_drift_counts_only_the_tokens_before_the_first_difference() -> None:
    ref = [["a", "b", "c"], ["x", "y", "z"]]
    got = [["a", "q", "c"], ["w", "y", "z"]]
    s = accuracy_summary(ref, got, [[-0.1, -0.2, -0.3], [-1.0, -1.0, -1.0]],
                         [[-0.3, -9.0, -0.3], [-5.0, -1.0, -1.0]])
    assert (s["equal"], s["first_token_equal"]) == (0, 1)
    assert s["mean_tokens_in_common"] == pytest.approx(0.5)        # 1 and 0 tokens in common
    # only the first completion's first token agrees: its drift is 0.2; after "q" the contexts differ
    assert (s["drift_tokens"], s["drift_mean"], s["first_drift_max"]) == (1, pytest.approx(0.2), pytest.approx(0.2))


def test_missing_log_probs_are_skipped() -> None:
    s = accuracy_summary([["a", "b"]], [["a", "b"]], [[None, -1.0]], [[None, -1.5]])
    assert s["drift_tokens"] == 1 and s["drift_mean"] == pytest.approx(0.5)
    assert s["first_drift_mean"] == 0.0
