"""Bench results as rows, markdown tables and strict JSON.

`summarize` turns the per-prompt measurements of `runner.run_bench` into one row per (dataset,
category or overall, method): tau with a 95% bootstrap interval, per-depth acceptance, tokens
per second, speedups against each baseline (median of per-prompt ratios and ratio of totals,
with intervals), greedy mismatches and where the time went. `to_markdown` is the table a
results page or a study's log pastes; `dumps_result` / `write_outputs` write the raw JSON beside it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_spec import stats

__all__ = [
    "BASELINES",
    "REQUIRED_ROW_KEYS",
    "TAU_NOTE",
    "clean_floats",
    "dumps_result",
    "summarize",
    "to_markdown",
    "write_outputs",
]

BASELINES: tuple[str, ...] = (
    "autoregressive",
    "hf_generate",
    "hf_generate_optimized",
    "hf_prompt_lookup",
)
REQUIRED_ROW_KEYS: tuple[str, ...] = (
    "method",
    "dataset",
    "category",
    "temperature",
    "tau",
    "tau_ci",
    "alpha",
    "tokens_per_second",
    "speedup_vs_autoregressive",
    "speedup_vs_autoregressive_ci",
    "speedup_vs_hf_generate",
    "speedup_vs_hf_prompt_lookup",
    "mismatches",
    "num_prompts",
    "new_tokens",
)
"""Every row carries these keys (None where a quantity does not apply)."""
TAU_NOTE = (
    "tau = tokens committed per target verification (accepted draft tokens + 1 bonus/correction "
    "token), pooled over verification steps; the prefill's first token is not counted."
)


# ---------------------------------------------------------------------------------- summary
def summarize(
    per_prompt: list[dict[str, Any]],
    methods: Sequence[str],
    *,
    temperature: float,
    tree: str | None = None,
    resamples: int = 2000,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per (dataset, category or overall, method); see the module docstring."""
    rows: list[dict[str, Any]] = []
    datasets = list(dict.fromkeys(entry["dataset"] for entry in per_prompt))
    for dataset in datasets:
        entries = [e for e in per_prompt if e["dataset"] == dataset]
        groups: list[tuple[str | None, list[dict[str, Any]]]] = [(None, entries)]
        categories = sorted({e["category"] for e in entries if e.get("category") is not None})
        groups += [(c, [e for e in entries if e.get("category") == c]) for c in categories]
        for category, group in groups:
            for method in methods:
                rows.append(
                    _row(
                        group,
                        method,
                        methods,
                        dataset,
                        category,
                        temperature,
                        tree,
                        resamples,
                        seed,
                    )
                )
    return rows


def _row(
    group: list[dict[str, Any]],
    method: str,
    methods: Sequence[str],
    dataset: str,
    category: str | None,
    temperature: float,
    tree: str | None,
    resamples: int,
    seed: int,
) -> dict[str, Any]:
    results = [entry["methods"][method] for entry in group]
    tokens = [r["new_tokens"] for r in results]
    seconds = [r["seconds"] for r in results]
    rates = [t / s for t, s in zip(tokens, seconds, strict=True) if s > 0]
    speculative = method.startswith("speculative")
    row: dict[str, Any] = {
        "method": method,
        "dataset": dataset,
        "category": category,
        "temperature": temperature,
        "tree": (method.rpartition("@")[2] if "@" in method else tree) if speculative else None,
        "tau": None,
        "tau_ci": None,
        "tau_note": None,
        "alpha": None,
    }
    if speculative:
        row.update(
            stats.tau_summary(
                [r["committed_by_verification"] for r in results],
                [r["verifications"] for r in results],
                resamples=resamples,
                seed=seed,
            )
        )
        row["tau_note"] = "measured: committed tokens / verification steps"
        row["alpha"] = stats.per_depth_acceptance(
            [a for r in results for a in r["accept_lengths"]],
            [d for r in results for d in r["tree_depths"]],
        )
    elif method == "hf_prompt_lookup":
        row.update(
            stats.tau_summary(
                tokens, [r["target_forwards"] for r in results], resamples=resamples, seed=seed
            )
        )
        row["tau_note"] = "estimated: new tokens / target forwards (forward hook)"
    row["tokens_per_second"] = stats.median(rates)
    row["tokens_per_second_total"] = stats.ratio_of_sums(tokens, seconds)
    first = [r["first_token_seconds"] for r in results if r.get("first_token_seconds") is not None]
    row["first_token_ms"] = 1000 * stats.median(first) if first else None
    for baseline in BASELINES:
        key = f"speedup_vs_{baseline}"
        summary: dict[str, Any] = {
            "median": None,
            "median_ci": None,
            "total": None,
            "total_ci": None,
        }
        if baseline in methods:
            base = [entry["methods"][baseline] for entry in group]
            summary = stats.speedup_summary(
                tokens,
                seconds,
                [b["new_tokens"] for b in base],
                [b["seconds"] for b in base],
                resamples=resamples,
                seed=seed,
            )
        row[key] = summary["median"]
        row[f"{key}_ci"] = summary["median_ci"]
        row[f"{key}_total"] = summary["total"]
        row[f"{key}_total_ci"] = summary["total_ci"]
    greedy = temperature == 0
    details = [
        {"index": entry["index"], "id": entry["id"], **result["mismatch"]}
        for entry, result in zip(group, results, strict=True)
        if result.get("mismatch")
    ]
    row["mismatches"] = len(details) if greedy else None
    row["mismatch_details"] = details if greedy else None
    divergences = [
        {"index": entry["index"], "id": entry["id"], **result["optimised_divergence"]}
        for entry, result in zip(group, results, strict=True)
        if result.get("optimised_divergence")
    ]
    if any("optimised_divergence" in result for result in results):
        # hf_generate on the default path beside an optimised target (see runner.run_bench)
        row["optimised_divergences"] = len(divergences)
        row["optimised_divergence_details"] = divergences
        row["mismatches"] = row["mismatch_details"] = None
    row["num_prompts"] = len(group)
    row["new_tokens"] = sum(tokens)
    row["seconds"] = sum(seconds)
    if speculative:
        row["verifications"] = sum(r["verifications"] for r in results)
        phases: dict[str, float] = {}
        for result in results:
            for phase, value in (result.get("seconds_by_phase") or {}).items():
                phases[phase] = phases.get(phase, 0.0) + value
        phases["other"] = max(row["seconds"] - sum(phases.values()), 0.0)
        # Where the time goes (everything is charged: drafting, verification, bookkeeping).
        row["time_fraction"] = {
            k: round(v / row["seconds"], 4) if row["seconds"] else None for k, v in phases.items()
        }
        # Milliseconds per verification step by phase: a block drafter's drafting cost should
        # not grow with the tree's depth, an EAGLE head's does.
        steps = row["verifications"]
        row["ms_per_step"] = {
            k: round(1000 * v / steps, 3) if steps else None
            for k, v in phases.items()
            if k in ("draft", "verify", "update")
        }
    return row


def clean_floats(value: Any) -> Any:
    """NaN/inf -> None so the JSON stays strict (json.dumps(allow_nan=False))."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_floats(v) for v in value]
    return value


# ---------------------------------------------------------------------------------- reporting
def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ci(interval: Sequence[float] | None, digits: int = 2) -> str:
    return "" if not interval else f" [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"


def _speedup_cell(row: dict[str, Any], baseline: str) -> str:
    key = f"speedup_vs_{baseline}"
    if row.get(key) is None or row["method"] == baseline:
        return "-"
    return f"{row[key]:.2f}{_ci(row.get(key + '_ci'))} / {_num(row.get(key + '_total'))}"


def to_markdown(result: dict[str, Any]) -> str:
    """The table a results page or a study's log pastes, with its command-independent context."""
    config = result["config"]
    machine = config.get("machine", {})
    lines = [
        f"Target {config.get('target')}, dtype {config.get('dtype')}, tree "
        f"{config.get('tree')}, T={config.get('temperature')}, max new tokens "
        f"{config.get('max_new_tokens')}, drafter(s) {config.get('drafter')}, commit "
        f"{config.get('commit')}.",
        f"Machine: {machine.get('cores')} cores ({machine.get('processor')}), torch threads "
        f"{machine.get('torch_threads')}, load average before {machine.get('load_average')} "
        f"after {machine.get('load_average_end')}"
        + (" -- BUSY: timings not publishable." if machine.get("busy") else "."),
        f"Methods interleaved per prompt ({config.get('order')} order), "
        f"{config.get('warmup')} warm-up prompt(s) discarded.",
        "",
        TAU_NOTE + " alpha_j = P(draft j accepted | drafts 1..j-1 accepted). HF prompt lookup tau "
        "is estimated as new tokens / target forwards.",
        "hf_generate runs the target as loaded (what a user has); hf_generate_optimized, "
        "autoregressive, hf_prompt_lookup and speculative run the optimised target (prepacked "
        "weights) when the run has one (config.prepacked_linears).",
        "Mismatches are counted against the target as it runs; hf_generate on the default "
        "path beside an optimised target instead counts where its greedy output diverges from "
        "the optimised target's (another GEMM order, a near tie; not a losslessness check).",
        "Speedup cells: median of per-prompt tokens/s ratios [95% bootstrap CI over prompts] / "
        "ratio of total tokens/s. Mismatches: prompts whose output differs from the target's own "
        "greedy decode (T=0 only).",
        "",
        "| dataset | category | method | tau [95% CI] | alpha_1.. | tok/s (median) | tok/s (total) "
        "| first token ms (median) | speedup vs autoregressive | vs HF generate "
        "| vs HF generate (optimised target) | vs HF prompt lookup | draft / verify ms per step "
        "| mismatches | prompts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        alpha = row.get("alpha")
        alpha_text = " ".join(_num(a) for a in alpha) if alpha else "-"
        tau = "-" if row.get("tau") is None else f"{row['tau']:.2f}{_ci(row.get('tau_ci'))}"
        if row["method"] == "hf_prompt_lookup" and row.get("tau") is not None:
            tau += " (est.)"
        mismatches = "n/a" if row.get("mismatches") is None else str(row["mismatches"])
        if row.get("optimised_divergences") is not None:
            mismatches = f"{row['optimised_divergences']} diverge (default path)"
        lines.append(
            f"| {row['dataset']} | {row['category'] or 'all'} | {row['method']} | {tau} | "
            f"{alpha_text} | {_num(row.get('tokens_per_second'), 1)} | "
            f"{_num(row.get('tokens_per_second_total'), 1)} | "
            f"{_num(row.get('first_token_ms'), 0)} | "
            f"{_speedup_cell(row, 'autoregressive')} | {_speedup_cell(row, 'hf_generate')} | "
            f"{_speedup_cell(row, 'hf_generate_optimized')} | "
            f"{_speedup_cell(row, 'hf_prompt_lookup')} | {_step_ms(row)} | {mismatches} | "
            f"{row['num_prompts']} |"
        )
    mismatched = [
        (row, d)
        for row in result["rows"]
        if row["category"] is None
        for d in (row.get("mismatch_details") or [])
    ]
    if mismatched:
        lines += ["", "Greedy mismatches (first differing position; target top-2 logit gap):", ""]
        for row, d in mismatched:
            lines.append(
                f"- {row['dataset']} {row['method']} prompt {d['index']} ({d['id']}): position "
                f"{d['position']}, expected {d['expected']} got {d['got']}, top-2 gap "
                f"{d['top2_gap']:.2e}{' (near tie)' if d.get('near_tie') else ''}"
            )
    return "\n".join(lines) + "\n"


def _step_ms(row: dict[str, Any]) -> str:
    per_step = row.get("ms_per_step") or {}
    if per_step.get("draft") is None:
        return "-"
    return f"{per_step['draft']:.1f} / {_num(per_step.get('verify'), 1)}"


def dumps_result(result: dict[str, Any]) -> str:
    """Strict JSON (no NaN): config and rows indented, one line per prompt so the raw file
    stays small enough to commit next to a study's log and diffs line up by prompt."""
    result = clean_floats(result)
    parts = []
    for key, value in result.items():
        if key == "per_prompt":
            lines = ",\n".join("    " + json.dumps(entry, allow_nan=False) for entry in value)
            body = "[\n" + lines + "\n  ]" if value else "[]"
        else:
            body = json.dumps(value, indent=2, allow_nan=False).replace("\n", "\n  ")
        parts.append(f"  {json.dumps(key)}: {body}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_json(path: str | Path, value: Any, *, indent: int = 1) -> Path:
    """A bench script's raw figures as indented JSON, its folder made first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=indent) + "\n")
    return path


def write_outputs(result: dict[str, Any], output: str | Path) -> tuple[Path, Path]:
    """Write the JSON and, next to it, the markdown table (same name, .md)."""
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_result(result))
    markdown = path.with_suffix(".md")
    markdown.write_text(to_markdown(result))
    return path, markdown
