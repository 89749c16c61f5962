"""stats: bootstrap intervals, tau and per-depth acceptance on hand-made numbers."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from lightning_spec import stats


def _record(accepted: int, committed: int, depth: int) -> SimpleNamespace:
    """A step on a chain of `depth` drafts that accepted the first `accepted`."""
    return SimpleNamespace(
        accepted=list(range(accepted)),
        committed=[0] * committed,
        tree=SimpleNamespace(parents=list(range(-1, depth - 1)), max_depth=depth),
    )


def _sample(count: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(3.0, 1.0) for _ in range(count)]


def test_bootstrap_interval_contains_the_mean() -> None:
    values = _sample(30)
    low, high = stats.bootstrap_ci(values)
    assert low < sum(values) / len(values) < high


def test_bootstrap_is_deterministic_with_a_seed() -> None:
    values = _sample(25)
    assert stats.bootstrap_ci(values, seed=7) == stats.bootstrap_ci(values, seed=7)
    assert stats.bootstrap_ci(values, seed=7) != stats.bootstrap_ci(values, seed=8)


def test_bootstrap_interval_shrinks_with_more_data() -> None:
    small = stats.bootstrap_ci(_sample(10, seed=1))
    large = stats.bootstrap_ci(_sample(1000, seed=1))
    assert (large[1] - large[0]) < 0.5 * (small[1] - small[0])
    # roughly 2 * 1.96 / sqrt(1000) wide for a unit-variance sample
    assert 0.08 < large[1] - large[0] < 0.18


def test_bootstrap_edge_cases() -> None:
    assert stats.bootstrap_ci([]) is None
    assert stats.bootstrap_ci([2.5]) == (2.5, 2.5)
    with pytest.raises(ValueError):
        stats.bootstrap_ci([1.0, 2.0], confidence=1.5)
    with pytest.raises(ValueError):
        stats.bootstrap_ci(([1.0, 2.0], [1.0]), stats.ratio_of_sums_of)


def test_paired_bootstrap_resamples_columns_together() -> None:
    # tokens = 2 * seconds on every prompt: every resample's ratio of sums is exactly 2
    seconds = [1.0, 2.0, 5.0, 0.5]
    tokens = [2 * s for s in seconds]
    assert stats.bootstrap_ci((tokens, seconds), stats.ratio_of_sums_of) == pytest.approx((2, 2))


def test_median_matches_statistics_median() -> None:
    assert stats.median([1.0, 3.0, 2.0, 10.0]) == 2.5
    assert stats.median([]) is None


def test_tau_from_records() -> None:
    # committed 5, 3, 1 over three steps: (5 + 3 + 1) / 3
    records = [_record(4, 5, 4), _record(2, 3, 4), _record(0, 1, 4)]
    assert stats.tau_from_records(records) == pytest.approx(3.0)
    assert stats.tau_from_records([]) is None


def test_tau_summary_pools_over_prompts() -> None:
    # prompt A: 10 tokens in 2 steps, prompt B: 6 tokens in 6 steps -> 16 / 8 = 2
    summary = stats.tau_summary([10, 6], [2, 6], resamples=200)
    assert summary["tau"] == pytest.approx(2.0)
    low, high = summary["tau_ci"]
    assert 1.0 <= low <= 2.0 <= high <= 5.0
    assert stats.tau_summary([], [])["tau"] is None


def test_per_depth_acceptance_on_hand_made_records() -> None:
    # chain of 4; accepted lengths 0, 1, 2, 4, 4
    # depth 1: 5 at risk, 4 accepted (all but the 0)          -> 0.8
    # depth 2: 4 at risk (a >= 1), 3 accepted (a >= 2)        -> 0.75
    # depth 3: 3 at risk (a >= 2), 2 accepted (a >= 3)        -> 2/3
    # depth 4: 2 at risk (a >= 3), 2 accepted                 -> 1.0
    records = [_record(a, a + 1, 4) for a in (0, 1, 2, 4, 4)]
    alpha = stats.alpha_from_records(records)
    assert alpha == pytest.approx([0.8, 0.75, 2 / 3, 1.0])


def test_per_depth_acceptance_with_varying_depths() -> None:
    # a depth-2 tree cannot be at risk at depth 3; nothing reached depth 4 -> None
    alpha = stats.per_depth_acceptance([2, 3, 0], [2, 4, 4])
    # depth 1: 3 at risk, 2 accepted; depth 2: 2 at risk, 2 accepted;
    # depth 3: only the depth-4 step with a=3 is at risk and accepted; depth 4: at risk, not
    assert alpha == pytest.approx([2 / 3, 1.0, 1.0, 0.0])
    assert stats.per_depth_acceptance([0, 0], 3) == [0.0, None, None]
    with pytest.raises(ValueError):
        stats.per_depth_acceptance([5], [4])


def test_speedup_summary_on_hand_made_timings() -> None:
    # the method takes half the baseline's time for the same tokens on every prompt
    tokens = [64, 64, 32]
    base_seconds = [4.0, 2.0, 1.0]
    seconds = [s / 2 for s in base_seconds]
    summary = stats.speedup_summary(tokens, seconds, tokens, base_seconds, resamples=200)
    assert summary["median"] == pytest.approx(2.0)
    assert summary["total"] == pytest.approx(2.0)
    assert summary["median_ci"] == pytest.approx([2.0, 2.0])
    assert summary["total_ci"] == pytest.approx([2.0, 2.0])


def test_speedup_median_and_total_differ_when_they_should() -> None:
    # per-prompt speedups 1, 1, 4: median 1; the long prompt dominates the total
    tokens = [10, 10, 100]
    base = [1.0, 1.0, 40.0]
    seconds = [1.0, 1.0, 10.0]
    summary = stats.speedup_summary(tokens, seconds, tokens, base, resamples=200)
    assert summary["median"] == pytest.approx(1.0)
    # totals: method 120 / 12 = 10 tok/s, baseline 120 / 42 tok/s -> 42 / 12 = 3.5
    assert summary["total"] == pytest.approx(3.5)
    empty = stats.speedup_summary([], [], [], [])
    assert empty == {"median": None, "median_ci": None, "total": None, "total_ci": None}
