"""Paired tau comparisons between the drafters of one bench run (same prompts, same run).

For every pair (method A vs method B) and every dataset plus the pooled set: the pooled tau of
each (committed tokens / verifications), the relative gain A/B - 1 with a 95% bootstrap interval
resampling prompts (the same prompts for both: a paired bootstrap), and the mean per-prompt tau
difference with its interval. A gain counts only when its interval excludes 0.

    python bench/paired_tau.py RESULT.json --pair speculative:gto/drafter,speculative:sft_control/drafter
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from lightning_spec import stats


def _gain_of(
    a_num: torch.Tensor, a_den: torch.Tensor, b_num: torch.Tensor, b_den: torch.Tensor
) -> torch.Tensor:
    return (a_num.sum(-1) / a_den.sum(-1)) / (b_num.sum(-1) / b_den.sum(-1)) - 1


def compare(result: dict[str, Any], a: str, b: str, resamples: int = 2000) -> dict[str, Any]:
    """The paired comparison of methods `a` and `b` (see the module docstring)."""
    groups: dict[str, list[dict[str, Any]]] = {"pooled": list(result["per_prompt"])}
    for entry in result["per_prompt"]:
        groups.setdefault(entry["dataset"], []).append(entry)
    out: dict[str, Any] = {}
    for name, entries in groups.items():
        rows = [
            (e["methods"][a], e["methods"][b])
            for e in entries
            if a in e["methods"] and b in e["methods"]
        ]
        rows = [(x, y) for x, y in rows if x.get("verifications") and y.get("verifications")]
        if not rows:
            continue
        a_num = [float(x["committed_by_verification"]) for x, _ in rows]
        a_den = [float(x["verifications"]) for x, _ in rows]
        b_num = [float(y["committed_by_verification"]) for _, y in rows]
        b_den = [float(y["verifications"]) for _, y in rows]
        tau_a, tau_b = sum(a_num) / sum(a_den), sum(b_num) / sum(b_den)
        per_prompt = [
            n1 / d1 - n2 / d2 for n1, d1, n2, d2 in zip(a_num, a_den, b_num, b_den, strict=True)
        ]
        out[name] = {
            "prompts": len(rows),
            "tau_a": tau_a,
            "tau_b": tau_b,
            "gain": tau_a / tau_b - 1,
            "gain_ci": stats.bootstrap_ci(
                (a_num, a_den, b_num, b_den), _gain_of, resamples=resamples
            ),
            "mean_difference": sum(per_prompt) / len(per_prompt),
            "mean_difference_ci": stats.bootstrap_ci(per_prompt, resamples=resamples),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--pair", action="append", required=True, help="METHOD_A,METHOD_B")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    report = {}
    for pair in args.pair:
        a, b = pair.split(",")
        report[f"{a} vs {b}"] = compare(result, a, b)
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
