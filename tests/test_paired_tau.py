"""bench/paired_tau.py on a hand-made bench result."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paired(bench_script):  # noqa: ANN001, ANN201
    return bench_script("paired_tau")


def _entry(dataset: str, a: tuple[int, int], b: tuple[int, int]) -> dict:
    return {
        "dataset": dataset,
        "methods": {
            "A": {"committed_by_verification": a[0], "verifications": a[1]},
            "B": {"committed_by_verification": b[0], "verifications": b[1]},
        },
    }


def test_paired_gain_and_difference(paired) -> None:
    result = {
        "per_prompt": [
            _entry("mtbench", (22, 10), (20, 10)),
            _entry("mtbench", (33, 15), (30, 15)),
            _entry("humaneval", (24, 10), (20, 10)),
        ]
    }
    report = paired.compare(result, "A", "B", resamples=500)
    pooled = report["pooled"]
    assert pooled["tau_a"] == pytest.approx(79 / 35) and pooled["tau_b"] == pytest.approx(70 / 35)
    assert pooled["gain"] == pytest.approx(79 / 70 - 1)
    low, high = pooled["gain_ci"]
    assert 0 < low <= pooled["gain"] <= high  # every prompt gains: the interval excludes 0
    assert report["mtbench"]["prompts"] == 2 and report["humaneval"]["gain"] == pytest.approx(0.2)
    assert report["mtbench"]["mean_difference"] == pytest.approx((0.2 + 0.2) / 2)
