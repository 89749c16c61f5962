"""Seconds per training step of each objective from one drafter, on the same batches.

What "a GTO step costs N SFT steps" in the README and BENCHMARKS.md rests on: the same data
module (the baseline's cached features), the same drafter folder, the same batches, one
objective after the other in one process, each for a few warm-up steps then `--steps` timed
optimizer steps (forward, backward, AdamW). GTO also reports its scoring throughput (trees/s
and tree rows/s through `score_trees_target`).

    python experiments/gto-draft-opd/scripts/objective_step_cost.py --drafter DIR --tree dynamic:2,8,8 --steps 10 \\
        --output experiments/gto-draft-opd/results/smollm2_objective_step_cost.json

``--store CONFIG`` (a fit config whose regenerated store `lightning-spec prepare` built) or
``--greedy-texts N`` times the T = 0 objectives on the target's own greedy answers to N ShareGPT
prompts instead (their features, final hidden states and argmax cached, as the regenerated
store serves them): SFT, GTO with rewards from the cached pass (``cached_rewards``), GTO scoring
every tree through the target, and Draft-OPD's reference form (chain blocks, post-rejection
suffix), reporting steps/s and trained tokens/s of each in one run.

    python experiments/gto-draft-opd/scripts/objective_step_cost.py --drafter DIR --greedy-texts 24 --new-tokens 128 \\
        --steps 8 --output experiments/gto-draft-opd/results/smollm2_objective_step_cost_greedy.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lightning_spec.bench.machine import git_commit, machine_info
from lightning_spec.bench.report import write_json
from lightning_spec.data.datamodule import RolloutDataModule
from lightning_spec.io import sha256_file
from lightning_spec.models.drafters.base import load_drafter
from lightning_spec.models.target import load_target
from lightning_spec.objectives.gto import GTO
from lightning_spec.objectives.sft import SFT


def _batches(args: argparse.Namespace, target: Any) -> list[dict]:
    data = RolloutDataModule(
        target=args.target,
        dataset=args.dataset,
        mode="dataset",
        max_conversations=args.max_conversations,
        max_length=args.max_length,
        batch_size=args.batch_size,
        val_fraction=0.02,
        feature_cache_bytes=args.feature_cache_bytes,
    )
    data.setup("fit")
    batches = []
    for batch in data.train_dataloader():
        batches.append(batch)
        if len(batches) >= args.warmup + args.steps:
            break
    return batches


def _greedy_batches(args: argparse.Namespace, target: Any) -> list[dict]:
    """Batches of the target's greedy answers to ShareGPT prompts, with the cached pass."""
    from lightning_spec.bench.greedy import greedy_text_batches
    from lightning_spec.data.chat import render_prompt
    from lightning_spec.data.sources import load_source

    source = load_source(args.dataset, limit=args.greedy_texts)
    prompts = [render_prompt(target.tokenizer, m)[-args.max_length :] for m in source.prompts()]
    return greedy_text_batches(
        target, prompts, new_tokens=args.new_tokens, batch_size=args.batch_size
    )


def _store_batches(args: argparse.Namespace) -> tuple[Any, list[dict]]:
    """The training batches of a fit config's regenerated store (`--store`)."""
    from lightning_spec.bench.greedy import store_text_batches

    count = (args.warmup + args.steps) * args.batch_size
    return store_text_batches(args.store, count, batch_size=args.batch_size)


def _time_loss(module: Any, batches: list[dict], warmup: int, loss_of: Any) -> dict[str, Any]:
    """Seconds per optimizer step of `loss_of(module, batch)` (any objective's loss)."""
    optimizer = torch.optim.AdamW(
        [p for p in module.drafter.parameters() if p.requires_grad], lr=1e-5, betas=(0.9, 0.95)
    )
    seconds, tokens = [], 0
    for index, batch in enumerate(batches):
        tic = time.perf_counter()
        loss = loss_of(module, batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.drafter.parameters(), 0.5)
        optimizer.step()
        if index >= warmup:
            seconds.append(time.perf_counter() - tic)
            tokens += int(batch["loss_mask"].sum())
    return {
        "steps": len(seconds),
        "seconds_per_step_median": statistics.median(seconds),
        "steps_per_s": len(seconds) / sum(seconds),
        "trained_tokens_per_s": tokens / sum(seconds),
        "seconds_per_step": seconds,
    }


def _greedy_arms(args: argparse.Namespace, target: Any, drafter: Any, batches: list[dict]) -> dict:
    """SFT, GTO cached, GTO scored and Draft-OPD (suffix), one after the other."""
    from lightning_spec.objectives.draft_opd import DraftOPD

    def gto(cached: bool) -> GTO:
        return GTO.from_objects(
            target, copy.deepcopy(drafter), tree=args.tree, groups=args.groups,
            group_size=args.group_size, ttt_steps=args.ttt_steps, prepack_target=True,
            cached_rewards=cached,
        )  # fmt: skip

    def gto_loss(module: Any, batch: dict) -> Any:
        return (
            module._common_step(batch).loss
            + float(module.hparams.omega) * module.gto_term(batch).loss
        )

    arms: dict[str, Any] = {}
    sft = SFT.from_objects(target, copy.deepcopy(drafter), ttt_steps=args.ttt_steps)
    arms["sft"] = _time_loss(sft, batches, args.warmup, lambda m, b: m._common_step(b).loss)
    arms["gto_cached"] = _time_loss(gto(True), batches, args.warmup, gto_loss)
    arms["gto_scored"] = _time_loss(gto(False), batches, args.warmup, gto_loss)
    opd = DraftOPD.from_objects(
        target, copy.deepcopy(drafter), ttt_steps=args.ttt_steps, chain=args.chain,
        prepack_target=True,
    )  # fmt: skip
    arms["draft_opd_suffix"] = _time_loss(
        opd, batches, args.warmup, lambda m, b: m.opd_loss(b)["loss"]
    )
    for name in ("gto_cached", "gto_scored", "draft_opd_suffix"):
        arms[f"{name}_over_sft"] = (
            arms[name]["seconds_per_step_median"] / arms["sft"]["seconds_per_step_median"]
        )
    return arms


def _time(module: Any, batches: list[dict], warmup: int, gto: bool) -> dict[str, Any]:
    """`_time_loss` of SFT's token loss, plus GTO's term (and its scoring throughput)."""
    extra: dict[str, list[float]] = {"trees_per_s": [], "rows_per_s": []}

    def loss_of(module: Any, batch: dict) -> Any:
        loss = module._common_step(batch).loss
        if gto:
            term = module.gto_term(batch)
            loss = loss + float(module.hparams.omega) * term.loss
            if term.score_seconds > 0:
                extra["trees_per_s"].append(term.trees_scored / term.score_seconds)
                extra["rows_per_s"].append(term.rows_scored / term.score_seconds)
        return loss

    out = _time_loss(module, batches, warmup, loss_of)
    if gto and extra["trees_per_s"]:
        out["score_trees_per_s_median"] = statistics.median(extra["trees_per_s"][warmup:])
        out["score_rows_per_s_median"] = statistics.median(extra["rows_per_s"][warmup:])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--max-conversations", type=int, default=4500)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--feature-cache-bytes", type=int, default=7_000_000_000)
    parser.add_argument("--tree", default="dynamic:6,10,32")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--greedy-texts", type=int, default=0,
                        help="N > 0: time the T = 0 objectives on N greedy answers (module doc)")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--store", type=Path, default=None,
        help="time the T = 0 objectives on a fit config's regenerated store (the batches that "
        "config trains on, built by `lightning-spec prepare`) instead of --greedy-texts",
    )  # fmt: skip
    parser.add_argument("--chain", type=int, default=6, help="Draft-OPD's drafts per block")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info("fp32")
    if args.store is not None:
        target, batches = _store_batches(args)
    else:
        target = load_target(args.target)
    if args.store is None and args.greedy_texts > 0:
        batches = _greedy_batches(args, target)[: args.warmup + args.steps]
    if args.store is not None or args.greedy_texts > 0:
        results_greedy: dict[str, Any] = {
            "command": "python experiments/gto-draft-opd/scripts/objective_step_cost.py " + " ".join(argv or sys.argv[1:]),
            "commit": git_commit(), "machine": machine, "drafter": str(args.drafter),
            "drafter_sha256": sha256_file(args.drafter / "model.safetensors"),
            "tree": args.tree, "chain": args.chain, "batch_size": args.batch_size,
            "greedy_texts": args.greedy_texts, "new_tokens": args.new_tokens,
            "store": str(args.store) if args.store else None, "groups": args.groups,
            "group_size": args.group_size,
            **_greedy_arms(args, target, load_drafter(args.drafter, target=target), batches),
        }  # fmt: skip
        print(json.dumps({k: v for k, v in results_greedy.items() if k != "machine"}, indent=1))
        if args.output:
            write_json(args.output, results_greedy)
        return 0
    batches = _batches(args, target)
    results: dict[str, Any] = {
        "command": "python experiments/gto-draft-opd/scripts/objective_step_cost.py " + " ".join(argv or []),
        "commit": git_commit(),
        "machine": machine,
        "drafter": str(args.drafter),
        "drafter_sha256": sha256_file(args.drafter / "model.safetensors"),
        "tree": args.tree,
        "batch_size": args.batch_size,
        "groups": args.groups,
        "group_size": args.group_size,
    }
    drafter = load_drafter(args.drafter)
    sft = SFT.from_objects(target, copy.deepcopy(drafter), ttt_steps=args.ttt_steps)
    results["sft"] = _time(sft, batches, args.warmup, gto=False)
    gto = GTO.from_objects(
        target,
        copy.deepcopy(drafter),
        tree=args.tree,
        groups=args.groups,
        group_size=args.group_size,
        ttt_steps=args.ttt_steps,
        prepack_target=True,
    )
    results["gto"] = _time(gto, batches, args.warmup, gto=True)
    ratio = results["gto"]["seconds_per_step_median"] / results["sft"]["seconds_per_step_median"]
    results["gto_over_sft"] = ratio
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=1))
    if args.output:
        write_json(args.output, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
