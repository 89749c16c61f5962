"""What every engine bench shares: one prompt's result, the per-mode summary, the chain pick.

llama.cpp (`bench/llamacpp.py`) and vLLM (`bench/vllm.py`) report the same things per prompt
(the reply's tokens, decode seconds, drafted and accepted tokens), so one summary serves both:
tok/s, speedup over the engine's plain decoding (paired bootstrap over prompts), acceptance,
tau and greedy mismatches; and the chain length is picked by the one picker of
`calibrate.rank_policies`, from the engine's measured cost of a verification and our decoder's
per-depth acceptance.

tau is tokens committed per target verification, as everywhere in the project: every
verification commits its accepted drafts plus one token, so over a reply of n tokens (the first
comes from the prompt pass) with A accepted drafts there were n - 1 - A verifications.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_spec.bench.calibrate import chain_acceptance, expected_tokens_per_step, rank_policies
from lightning_spec.bench.runner import first_difference
from lightning_spec.stats import speedup_summary, tau_summary

__all__ = [
    "PromptResult",
    "chain_length",
    "engine_drafter",
    "expected_tau",
    "engine_prompts",
    "ours_tau",
    "ours_tau_interval",
    "pick_chain",
    "reach_per_position",
    "summarize",
    "verifications",
]


@dataclass
class PromptResult:
    """What an engine reported for one prompt in one mode (decode time excludes the prompt
    pass; `meta` holds engine-specific extras such as vLLM's accepted tokens per position)."""

    tokens: list[int]
    seconds: float  # decode time (llama.cpp's predicted_ms), prompt processing excluded
    drafted: int = 0
    accepted: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


ENGINE_DRAFTERS = ("eagle3", "dflash")  # the drafter types vLLM and llama.cpp load


def engine_drafter(path: str | Path, engine: str) -> tuple[Path, dict[str, Any]]:
    """The drafter folder `engine` (vLLM, llama.cpp) will load, as an absolute path, and its
    config: checked before any long work.

    An engine runs in another process, from another folder: a path relative to ours means
    nothing there (vLLM then reads it as a hub repository id and fails). And a folder that is
    not a trained EAGLE-3 or DFlash drafter's (config.json and model.safetensors) fails here,
    not after our decoder's side of a bench has run for minutes."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(f"{engine} loads a drafter folder: {path} ({folder}) is not a folder")
    missing = [name for name in ("config.json", "model.safetensors") if not (folder / name).is_file()]
    if missing:
        raise ValueError(
            f"{engine} loads a drafter folder: {path} ({folder}) has no {' or '.join(missing)}; "
            "give a trained drafter's folder, e.g. runs/quickstart/drafter/last"
        )
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{engine}: {folder / 'config.json'} is not JSON: {error}") from error
    method = config.get("drafter_type", "eagle3")
    if method not in ENGINE_DRAFTERS:
        raise ValueError(f"{engine} serves eagle3 and dflash drafters, not {method}")
    return folder, config


def verifications(result: PromptResult) -> int:
    """Target verifications of one reply (module docstring): n - 1 - accepted."""
    return max(len(result.tokens) - 1 - result.accepted, 0)


def summarize(
    results: dict[str, list[PromptResult]],
    *,
    baseline: str = "plain",
    reference: str | None = None,
    reference_label: str = "self",
    resamples: int = 2000,
) -> dict[str, Any]:
    """Per mode: tok/s, speedup over `baseline` (paired bootstrap over prompts), the engine's
    acceptance, tau, and greedy mismatches against `baseline` and against `reference` (llama.cpp:
    the self-drafting mode; vLLM: ``ngram``), keyed ``mismatches_vs_<reference_label>``; and the
    speedup over `reference` on the same prompts, paired the same way
    (``speedup_vs_<reference_label>``), so "faster than ngram" comes with its own interval."""
    rows: dict[str, Any] = {}
    for name, items in results.items():
        tokens = [len(r.tokens) for r in items]
        seconds = [r.seconds for r in items]
        row: dict[str, Any] = {
            "prompts": len(items),
            "tokens": sum(tokens),
            "tok_per_s": sum(tokens) / sum(seconds) if sum(seconds) > 0 else None,
            "drafted": sum(r.drafted for r in items),
            "accepted": sum(r.accepted for r in items),
        }
        row["acceptance"] = row["accepted"] / row["drafted"] if row["drafted"] else None
        committed = [max(len(r.tokens) - 1, 0) for r in items]
        row.update(tau_summary(committed, [verifications(r) for r in items], resamples=resamples))
        for key, other in (("speedup", baseline), (f"speedup_vs_{reference_label}", reference)):
            if other in results and name not in (other, baseline):
                speed = speedup_summary(
                    tokens, seconds, [len(r.tokens) for r in results[other]],
                    [r.seconds for r in results[other]], resamples=resamples,
                )  # fmt: skip
                row[key], row[f"{key}_ci"] = speed["total"], speed["total_ci"]
        for label, other in (("plain", baseline), (reference_label, reference)):
            if other is None or other == name or other not in results:
                continue
            diffs = [
                first_difference(a.tokens, b.tokens)
                for a, b in zip(items, results[other], strict=True)
            ]
            row[f"mismatches_vs_{label}"] = sum(d is not None for d in diffs)
            row[f"mismatch_prompts_vs_{label}"] = [i for i, d in enumerate(diffs) if d is not None]
        rows[name] = row
    return rows


def expected_tau(alphas: Sequence[float | None], k: int) -> float:
    """E[tau] of a chain of `k` drafts with per-depth acceptance alpha_j (j = 1 .. k):
    1 + sum_j prod_{i <= j} alpha_i; depths never measured count as 0."""
    if k < 1:
        return 1.0
    return expected_tokens_per_step(f"chain:{k}", chain_acceptance(alphas, k))


def chain_length(spec: str) -> int:
    """K of ``chain:K``."""
    return int(spec.split(":", 1)[1])


def pick_chain(
    alphas: Sequence[float | None],
    cost: dict[int, float],
    draft_cost: float,
    *,
    max_k: int | None = None,
) -> dict[str, Any]:
    """The chain length `--n-max auto` picks for llama.cpp (`calibrate.rank_policies` over
    chains): argmax over K of E[tau(K)] / (t(K + 1) + K * draft_cost), with t(b) llama.cpp's
    measured cost of a target forward of b tokens (``llama-bench``), `draft_cost` the seconds
    per drafted token and alpha_j our decoder's per-depth acceptance of the same drafter (a long
    chain's records). Returns the pick and the predicted speedup over plain decoding (t(1) per
    token) per K."""
    limit = min(max_k or len(alphas), len(alphas), max(cost) - 1)
    if limit < 1 or 1 not in cost:
        raise ValueError("need alpha_1 and the cost of 1 and 2 tokens at least")
    chains = [f"chain:{k}" for k in range(1, limit + 1)]
    table = rank_policies(
        chain_acceptance(alphas, limit),
        chains,
        lambda spec: cost[chain_length(spec) + 1] + chain_length(spec) * draft_cost,
        cost[1],
    )
    speedup = {chain_length(row["policy"]): row["expected_speedup"] for row in table}
    return {
        "n_max": chain_length(table[0]["policy"]),
        "predicted_speedup": {chain_length(spec): speedup[chain_length(spec)] for spec in chains},
        "draft_cost": draft_cost,
    }


def ours_tau(
    drafter_dir: Path, target: str, prompts: list[list[int]], n_max: int, max_new_tokens: int
) -> dict[str, Any]:
    """Our decoder, same drafter and prompt ids, chain:K at T = 0: pooled tau and alpha."""
    from lightning_spec.decoding.build import parse_tree_spec
    from lightning_spec.decoding.engine import SpeculativeDecoder
    from lightning_spec.metrics import alpha_from_records, tau_from_records
    from lightning_spec.models.drafters.base import load_drafter
    from lightning_spec.models.target import load_target

    tgt = load_target(target)
    drafter = load_drafter(drafter_dir, target=tgt)
    decoder = SpeculativeDecoder(tgt, drafter, parse_tree_spec(f"chain:{n_max}"))
    records, tokens, accepts = [], [], []
    for prompt in prompts:
        generation = decoder.generate(prompt, max_new_tokens)
        records.extend(generation.records)
        tokens.append(generation.tokens)
        accepts.append([len(r.accepted) for r in generation.records])
    drafted = sum(n_max for _ in records)
    accepted = sum(len(r.accepted) for r in records)
    return {
        "tau": tau_from_records(records),
        "alphas": alpha_from_records(records),
        "acceptance": accepted / drafted if drafted else None,
        "verifications": len(records),
        "tokens": tokens,
        "accepted_lengths": accepts,  # per prompt, per verification: for per-position intervals
    }


def ours_tau_interval(accepted_lengths: Sequence[Sequence[int]], *, resamples: int = 2000) -> dict[str, Any]:
    """Our decoder's tau with its 95% bootstrap interval over prompts, from `ours_tau`'s
    accepted lengths (each verification commits its accepted drafts plus one token): the
    parity check for an engine that reports totals, not positions (llama.cpp)."""
    committed = [sum(lengths) + len(lengths) for lengths in accepted_lengths]
    return tau_summary(committed, [len(lengths) for lengths in accepted_lengths], resamples=resamples)


def reach_per_position(
    accepted_lengths: Sequence[Sequence[int]], depth: int, *, resamples: int = 2000, seed: int = 0
) -> list[dict[str, float]]:
    """The share of verifications whose first j drafts were all accepted, j = 1 .. `depth`,
    pooled over prompts, with a 95% bootstrap interval over prompts: the quantity vLLM's
    accepted-tokens-per-position counters give (count at j / drafts), for engine parity."""
    import torch

    counts = torch.tensor(
        [[sum(1 for a in lengths if a >= j) for j in range(1, depth + 1)] for lengths in accepted_lengths],
        dtype=torch.float64,
    ).reshape(len(accepted_lengths), depth)
    steps = torch.tensor([len(lengths) for lengths in accepted_lengths], dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(accepted_lengths), (resamples, len(accepted_lengths)), generator=generator)
    boot = counts[picks].sum(1) / steps[picks].sum(1, keepdim=True).clamp_min(1)  # [R, depth]
    low, high = torch.quantile(boot, 0.025, dim=0), torch.quantile(boot, 0.975, dim=0)
    point = counts.sum(0) / steps.sum().clamp_min(1)
    return [
        {"reach": float(point[j]), "low": float(low[j]), "high": float(high[j])} for j in range(depth)
    ]


def engine_prompts(target: str, datasets: str, limit: int) -> tuple[list[list[int]], list[str]]:
    """The prompt ids every engine bench serves (the target's chat template, as our own bench
    renders them) and the dataset each came from, for ``datasets`` (comma list) at `limit` each."""
    from lightning_spec.models.target import load_target
    from lightning_spec.specs import load_prompts

    tokenizer = load_target(target).tokenizer
    prompts, origin = [], []
    for spec in (part.strip() for part in datasets.split(",") if part.strip()):
        name, items = load_prompts(spec, tokenizer, limit=limit)
        prompts += [list(ids) for ids, _ in items]
        origin += [name] * len(items)
    return prompts, origin
