"""Plain statistics for benchmark tables: bootstrap intervals, medians, pooled rates.

Benchmarks report numbers over a few dozen prompts on a shared machine, so every headline figure
comes with a 95% percentile-bootstrap interval over prompts (docs/benchmarking.md): resample the prompts
with replacement, recompute the statistic, take the 2.5% and 97.5% quantiles. Resampling whole
prompts (not steps) keeps the dependence between the steps of one answer inside each resample.

tau and per-depth acceptance are defined once, in `lightning_spec.metrics` (docs/benchmarking.md: tau
= tokens committed per target verification = accepted drafts + 1, pooled over steps; alpha_j =
P(draft j accepted | drafts 1..j-1 accepted), counting only depths the tree offered on the
accepted path); `tau_from_records`, `per_depth_acceptance` and `alpha_from_records` are
re-exported here for existing callers. These functions take plain numbers and return `None`
where a quantity is undefined, which JSON writes as null (never NaN).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_spec.metrics import alpha_from_records, per_depth_acceptance, tau_from_records

__all__ = [
    "bootstrap_ci",
    "mean_of",
    "median",
    "median_of",
    "per_depth_acceptance",
    "alpha_from_records",
    "ratio_of_sums",
    "ratio_of_sums_of",
    "speedup_summary",
    "tau_from_records",
    "tau_summary",
]

Interval = tuple[float, float]


def median(values: Sequence[float]) -> float | None:
    """Median, or None for an empty sequence (so an empty category never raises)."""
    return float(statistics.median(values)) if len(values) else None


def ratio_of_sums(numerators: Sequence[float], denominators: Sequence[float]) -> float | None:
    """sum(numerators) / sum(denominators): a pooled rate such as tokens per step or per second."""
    total = float(sum(denominators))
    return float(sum(numerators)) / total if total > 0 else None


def _resample_indices(count: int, resamples: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, count, (resamples, count), generator=generator)


def bootstrap_ci(
    values: Sequence[float] | tuple[Sequence[float], ...],
    statistic: Callable[..., Tensor] | None = None,
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Interval | None:
    """Percentile bootstrap interval of `statistic` over resampled units (prompts).

    `values` is one sequence (one number per prompt) or a tuple of parallel sequences (e.g.
    tokens and seconds per prompt) resampled with the same indices, which is what a paired
    ratio needs. `statistic` is batched so thousands of resamples cost one tensor operation: it
    receives one float64 tensor [resamples, n] per sequence and returns [resamples]; the default
    is the mean (see `mean_of`, `ratio_of_sums_of`, `median_of`). Deterministic for a given
    `seed`. None when there are no values; one value gives a degenerate interval.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    columns = _as_columns(values)
    count = len(columns[0])
    if count == 0:
        return None
    if any(len(column) != count for column in columns):
        raise ValueError("parallel value sequences must have the same length")
    statistic = statistic or mean_of
    indices = _resample_indices(count, resamples, seed)
    samples = [torch.as_tensor(column, dtype=torch.float64)[indices] for column in columns]
    estimates = statistic(*samples)
    estimates = estimates[torch.isfinite(estimates)]
    if estimates.numel() == 0:
        return None
    tail = (1.0 - confidence) / 2.0
    quantiles = torch.tensor([tail, 1.0 - tail], dtype=torch.float64)
    low, high = torch.quantile(estimates, quantiles)
    return float(low), float(high)


def mean_of(values: Tensor) -> Tensor:
    """Batched mean over the last axis (a `bootstrap_ci` statistic)."""
    return values.mean(dim=-1)


def median_of(values: Tensor) -> Tensor:
    """Batched median over the last axis, midpoint of the two middle values for even counts."""
    return torch.quantile(values, 0.5, dim=-1)


def ratio_of_sums_of(numerators: Tensor, denominators: Tensor) -> Tensor:
    """Batched sum(numerators) / sum(denominators) over the last axis."""
    return numerators.sum(dim=-1) / denominators.sum(dim=-1)


def _as_columns(values: Sequence[Any]) -> list[list[float]]:
    if isinstance(values, tuple) and values and isinstance(values[0], (list, tuple)):
        return [[float(v) for v in column] for column in values]
    return [[float(v) for v in values]]


def tau_summary(
    committed: Sequence[int],
    steps: Sequence[int],
    *,
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Pooled tau over prompts (sum committed / sum steps) with its bootstrap interval.

    One entry per prompt: tokens committed by verification steps (the prefill's token is not
    a verification and is excluded by the caller) and the number of steps.
    """
    keep = [(c, s) for c, s in zip(committed, steps, strict=True) if s > 0]
    if not keep:
        return {"tau": None, "tau_ci": None}
    c, s = [k[0] for k in keep], [k[1] for k in keep]
    interval = bootstrap_ci((c, s), ratio_of_sums_of, resamples=resamples, seed=seed)
    return {"tau": ratio_of_sums(c, s), "tau_ci": _rounded(interval)}


def speedup_summary(
    tokens: Sequence[int],
    seconds: Sequence[float],
    baseline_tokens: Sequence[int],
    baseline_seconds: Sequence[float],
    *,
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Speedup of a method over a baseline measured on the same prompts, two ways.

    `median`: the median over prompts of (tokens/s of the method) / (tokens/s of the baseline),
    robust to a prompt hit by a noisy neighbour; `total`: the ratio of pooled rates
    (sum tokens / sum seconds), which weights long answers more. Each with a bootstrap interval
    over prompts (pairs resampled together).
    """
    rows = [
        (t, s, bt, bs)
        for t, s, bt, bs in zip(tokens, seconds, baseline_tokens, baseline_seconds, strict=True)
        if s > 0 and bs > 0 and t > 0 and bt > 0
    ]
    if not rows:
        return {"median": None, "median_ci": None, "total": None, "total_ci": None}
    ratios = [(t / s) / (bt / bs) for t, s, bt, bs in rows]
    columns = tuple([row[i] for row in rows] for i in range(4))

    def pooled(t: Tensor, s: Tensor, bt: Tensor, bs: Tensor) -> Tensor:
        return ratio_of_sums_of(t, s) / ratio_of_sums_of(bt, bs)

    rate = ratio_of_sums(columns[0], columns[1])
    base = ratio_of_sums(columns[2], columns[3])
    return {
        "median": median(ratios),
        "median_ci": _rounded(bootstrap_ci(ratios, median_of, resamples=resamples, seed=seed)),
        "total": rate / base if rate is not None and base else None,
        "total_ci": _rounded(bootstrap_ci(columns, pooled, resamples=resamples, seed=seed)),
    }


def _rounded(interval: Interval | None, digits: int = 6) -> list[float] | None:
    return None if interval is None else [round(interval[0], digits), round(interval[1], digits)]
