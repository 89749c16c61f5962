"""`bench --replay`: tau of many drafters and trees at T = 0 without decoding each of them.

At T = 0 the text a speculative decode commits is the target's greedy answer, whatever the
drafter; only the verification steps (anchors, accepted drafts) depend on it. So the bench
generates each prompt's greedy answer once, in batches, cut to its batch-1 greedy prefix and
cached (`online.continuations`), runs one teacher-forced target pass per prompt, and replays
every drafter under every tree on it with the decoder's own exact replay
(`decoding.replay.replay_greedy`): the steps, hence tau and per-depth acceptance, are the ones a
live greedy decode makes on that text (tests compare them). Drafting is all that is paid per
drafter, so the 244 MT-Bench + HumanEval prompts cost minutes per drafter instead of an hour.

What it does not measure: time. Tokens per second need a live run (`bench` without
``--replay``); the rows here carry no speeds. The per-prompt entries have the live bench's
fields (``verifications``, ``committed_by_verification``, ``accept_lengths``, ``tokens``), so
`lightning-spec bench paired` pairs drafters of a replay run the same way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_spec import stats
from lightning_spec.bench.report import TAU_NOTE, clean_floats
from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.metrics import attempted_depth

__all__ = ["default_cache", "replay_bench", "replay_markdown"]


def default_cache(
    target: Any, datasets: Mapping[str, Any], limit: int | None, selection: str, max_new_tokens: int
) -> Path:
    """Where `bench --replay` keeps the greedy answers of these prompt sets and flags."""
    from lightning_spec.data.assets import cache_root

    sets = "+".join(sorted(datasets))
    name = f"{sets}-limit{limit}-{selection}-new{max_new_tokens}.jsonl"
    return cache_root() / "bench-replay" / str(getattr(target, "name", "target")) / name


def _requests(datasets: Mapping[str, Sequence[tuple[list[int], dict[str, Any]]]]) -> list[Any]:
    from lightning_spec.online.stream import Request

    requests = []
    for name, items in datasets.items():
        for index, (prompt, meta) in enumerate(items):
            key = f"{name}:{index}:{meta.get('id')}"
            requests.append(Request(index=index, domain=name, id=key, prompt=list(prompt)))
    return requests


@torch.no_grad()
def replay_bench(
    target: Any,
    drafters: Mapping[str, Any],
    trees: Sequence[str],
    datasets: Mapping[str, Sequence[tuple[list[int], dict[str, Any]]]],
    *,
    max_new_tokens: int,
    cache: str | Path,
    batch_size: int = 32,
    resamples: int = 2000,
    seed: int = 0,
    progress: bool = True,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Replayed T = 0 tau of every drafter (label -> drafter) under every tree spec, on the
    prompts of `datasets` (name -> (prompt ids, meta) pairs); ``{"config", "rows",
    "per_prompt"}`` with methods named as the live bench names them (``speculative:<label>``,
    ``@<tree>`` when there are several trees)."""
    from lightning_spec.decoding.replay import replay_greedy, text_pass
    from lightning_spec.online.continuations import stream_continuations

    if not drafters or not trees:
        raise ValueError("replay bench needs at least one drafter and one tree")
    unable = [label for label, d in drafters.items() if not d.drafts_from_sequence]
    if unable:
        raise ValueError(
            f"drafter(s) {', '.join(unable)} cannot be replayed (no drafting of many trees over "
            "one sequence): bench them live, without --replay"
        )
    policies = {spec: parse_tree_spec(spec) for spec in trees}
    methods = {
        f"speculative:{label}" + (f"@{spec}" if len(policies) > 1 else ""): (drafter, policy)
        for label, drafter in drafters.items()
        for spec, policy in policies.items()
    }
    tic = time.perf_counter()
    requests = _requests(datasets)
    answers = stream_continuations(
        target, requests, max_new_tokens=max_new_tokens, cache=cache, batch_size=batch_size,
        progress=progress,
    )  # fmt: skip
    generation_seconds = time.perf_counter() - tic
    features = any(d.needs_features for d in drafters.values())
    per_prompt: list[dict[str, Any]] = []
    replay_seconds = dict.fromkeys(methods, 0.0)
    for done, (request, answer) in enumerate(zip(requests, answers, strict=True)):
        meta = datasets[request.domain][request.index][1]
        entry: dict[str, Any] = {
            "dataset": request.domain, "index": request.index, "id": meta.get("id"),
            "category": meta.get("category"), "prompt_tokens": len(request.prompt),
            "methods": {},
        }  # fmt: skip
        if len(answer) >= 2:
            ids = torch.tensor([request.prompt + answer], device=target.device)
            text = text_pass(target, ids, len(request.prompt), features=features)
            for name, (drafter, policy) in methods.items():
                start = time.perf_counter()
                generation = replay_greedy(
                    target, drafter, policy, request.prompt, answer, text=text
                )
                replay_seconds[name] += time.perf_counter() - start
                records = generation.records
                entry["methods"][name] = {
                    "new_tokens": len(answer),
                    "tokens": list(answer),
                    "verifications": len(records),
                    "committed_by_verification": sum(len(r.committed) for r in records),
                    "accept_lengths": [int(r.accept_length) for r in records],
                    "tree_depths": [attempted_depth(r) for r in records],
                    "mismatch": None,
                }
        per_prompt.append(entry)
        if progress and (done + 1) % 20 == 0:
            print(f"[replay] {done + 1}/{len(requests)} prompts replayed", flush=True)
    run_config = {
        **(config or {}),
        "replay": True,
        "methods": list(methods),
        "tree": " | ".join(policies),
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "stop_on_eos": True,
        "target": str(getattr(target, "name", "")),
        "dtype": str(target.dtype).replace("torch.", ""),
        "datasets": {name: len(items) for name, items in datasets.items()},
        "continuations": str(cache),
        "generation_seconds": round(generation_seconds, 3),
        "replay_seconds": {name: round(s, 3) for name, s in replay_seconds.items()},
        "seconds": round(time.perf_counter() - tic, 3),
    }
    rows = _rows(per_prompt, list(methods), resamples=resamples, seed=seed)
    return clean_floats({"config": run_config, "rows": rows, "per_prompt": per_prompt})


def _rows(
    per_prompt: list[dict[str, Any]], methods: list[str], *, resamples: int, seed: int
) -> list[dict[str, Any]]:
    """Per dataset (and all prompts pooled) and method: tau [95% CI], alpha_j, counts."""
    groups = {"all": per_prompt}
    for entry in per_prompt:
        groups.setdefault(entry["dataset"], []).append(entry)
    rows = []
    for dataset, entries in groups.items():
        for method in methods:
            results = [e["methods"][method] for e in entries if method in e["methods"]]
            if not results:
                continue
            row: dict[str, Any] = {"method": method, "dataset": dataset, "category": None}
            row.update(
                stats.tau_summary(
                    [r["committed_by_verification"] for r in results],
                    [r["verifications"] for r in results],
                    resamples=resamples,
                    seed=seed,
                )
            )
            row["alpha"] = stats.per_depth_acceptance(
                [a for r in results for a in r["accept_lengths"]],
                [d for r in results for d in r["tree_depths"]],
            )
            row["num_prompts"] = len(results)
            row["skipped_prompts"] = len(entries) - len(results)
            row["new_tokens"] = sum(r["new_tokens"] for r in results)
            row["verifications"] = sum(r["verifications"] for r in results)
            row["mismatches"] = 0  # replayed text is the target's greedy text by construction
            rows.append(row)
    return rows


def replay_markdown(result: Mapping[str, Any]) -> str:
    """The table of a replay run (tau and acceptance only: no speeds were measured)."""
    config = result["config"]
    lines = [
        f"Replayed at T = 0 (no decoding per drafter; speeds not measured): target "
        f"{config.get('target')}, tree(s) {config.get('tree')}, max new tokens "
        f"{config.get('max_new_tokens')}, drafter(s) {config.get('drafter')}, commit "
        f"{config.get('commit')}; greedy answers from {config.get('continuations')}.",
        "",
        TAU_NOTE,
        "",
        "| dataset | method | tau [95% CI] | alpha_1.. | prompts | tokens |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in row.get("alpha") or [])
        ci = row.get("tau_ci")
        interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
        tau = "-" if row.get("tau") is None else f"{row['tau']:.3f}{interval}"
        lines.append(
            f"| {row['dataset']} | {row['method']} | {tau} | {alpha or '-'} | "
            f"{row['num_prompts']} | {row['new_tokens']} |"
        )
    return "\n".join(lines) + "\n"
