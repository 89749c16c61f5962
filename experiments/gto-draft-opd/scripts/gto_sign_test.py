"""GTO's sign test: does a GTO step raise the tree reward? Three arms, omega = +k, 0, -k.

    python experiments/gto-draft-opd/scripts/gto_sign_test.py --tiny --out experiments/gto-draft-opd/results/gto_sign_tiny.json
    python experiments/gto-draft-opd/scripts/gto_sign_test.py --drafter DIR --tree dynamic:6,10,32 --prompts 96 \
        --held-out 48 --steps 300 --omega 5 --lr 5e-5 --out experiments/gto-draft-opd/results/gto_sign_smollm2.json
    python experiments/gto-draft-opd/scripts/gto_sign_test.py --drafter DIR --store configs/improve/gto_eagle3_cpu.yaml ...  # its texts

Every arm starts from the same drafter (its frozen copy is the reference), sees the same
batches and the same prefixes (the group generator is reset per batch), and trains with
L = token_weight * L_token + omega * L_GTO (token_weight 0 by default: GTO alone, so
only the GTO term can move the reward). At T = 0 on the target's own greedy text, so the cached
path scores every tree without a target forward; with `--temperature 1` on the target's sampled
text, where a T = 1 verification's states leave the greedy text and an on-policy objective may
part from the token loss (every tree scored through the target, the accepted paths sampled with
the same draws in every arm). Every `--eval-every` steps each arm's
accepted length (the T = 0 tree reward's argmax form) and LSE reward are measured on the
training prefixes and on held-out prefixes (fixed, the same for every arm and every
evaluation); the final table pairs the arms prefix by prefix with bootstrap intervals.

If the update pushes toward a higher reward, +k beats -k beyond noise and +k >= 0. With the
reference equal to the start, the advantages are all 0 at step 0 (nothing moves); `--jitter`
moves the start off the reference by a small random perturbation (or pass token_weight > 0, the
paper's setting, where the token loss moves it).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lightning_spec.bench.greedy import greedy_text_batches, store_text_batches
from lightning_spec.io import atomic_write_json
from lightning_spec.stats import bootstrap_ci


def evaluate(
    module: Any, batches: list[dict], seed: int, stats: dict[str, float] | None = None
) -> tuple[list[int], list[float]]:
    """Per-prefix accepted lengths and rewards on fixed prefixes (seed per batch); `stats`
    (optional) gets the misalignment statistics, prefix-weighted over the batches: the share
    of trees whose greedy chain was pruned, and whose accepted path is the greedy chain."""
    lengths: list[int] = []
    rewards: list[float] = []
    sums = {"pruned": 0.0, "follows": 0.0}
    weight = 0
    with torch.no_grad():
        for index, batch in enumerate(batches):
            # at T > 0 the accepted path is sampled: the same draws for every arm
            module._generator.manual_seed(seed + 7919 * (index + 1))
            result = module.gto_term(
                batch, statistics=stats is not None,
                generator=torch.Generator().manual_seed(seed + index),
            )  # fmt: skip
            lengths += result.accept_lengths
            rewards += result.rewards
            if result.pruned is not None and result.follows is not None:
                sums["pruned"] += result.pruned * result.prefixes
                sums["follows"] += result.follows * result.prefixes
                weight += result.prefixes
    if stats is not None and weight:
        stats.update({k: v / weight for k, v in sums.items()})
    return lengths, rewards


def _term_grad_norms(module: Any, terms: dict[str, torch.Tensor]) -> dict[str, float]:
    """The drafter's gradient norm under each loss term alone (graphs kept for the step)."""
    params = [p for p in module.drafter.parameters() if p.requires_grad]
    norms = {}
    for name, term in terms.items():
        if not term.requires_grad:
            norms[name] = 0.0
            continue
        grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
        norms[name] = float(torch.sqrt(sum((g**2).sum() for g in grads if g is not None)))
    return norms


def _paired(a: list[float], b: list[float]) -> dict[str, Any]:
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    interval = bootstrap_ci(diffs)
    return {"mean_diff": sum(diffs) / len(diffs), "ci": list(interval) if interval else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_spec.objectives.gto import GTO

    if args.tiny:
        from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
        from lightning_spec.models.target import TargetModel
        from lightning_spec.models.tiny import tiny_config

        target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)
        generator = torch.Generator().manual_seed(4)
        prompts = [
            torch.randint(3, 128, (6,), generator=generator).tolist()
            for _ in range(args.prompts + args.held_out)
        ]
        base = Eagle3Drafter.from_target(target, intermediate_size=64)
        batches = greedy_text_batches(
            target, prompts, new_tokens=args.new_tokens, batch_size=args.batch_size,
            temperature=args.temperature, seed=args.seed,
        )  # fmt: skip
        # a head trained on the texts with the token loss alone: drafts accepted part of the time
        warm = GTO.from_objects(target, base, tree=args.tree, ttt_steps=2)
        optimizer = torch.optim.Adam(warm.drafter.parameters(), lr=3e-3)
        for step in range(args.warm_steps):
            optimizer.zero_grad()
            warm._common_step(batches[step % len(batches)]).loss.backward()
            optimizer.step()
        base = warm.drafter
    elif args.store is not None:
        from lightning_spec.models.drafters.base import load_drafter

        tic = time.perf_counter()
        target, batches = store_text_batches(
            args.store, args.prompts + args.held_out, batch_size=args.batch_size
        )
        base = load_drafter(args.drafter, target=target)
        print(f"store batches: {time.perf_counter() - tic:.0f} s", flush=True)
    else:
        from lightning_spec.models.drafters.base import load_drafter
        from lightning_spec.models.target import load_target
        from lightning_spec.specs import load_prompts

        target = load_target(args.target)
        base = load_drafter(args.drafter, target=target)
        prompts = []
        for spec in args.dataset.split(","):
            _, items = load_prompts(spec, target.tokenizer, limit=None, selection="first")
            prompts += [list(ids) for ids, _ in items]
        generator = torch.Generator().manual_seed(args.seed)
        order = torch.randperm(len(prompts), generator=generator).tolist()
        prompts = [prompts[i] for i in order[: args.prompts + args.held_out]]
        tic = time.perf_counter()
        batches = greedy_text_batches(
            target, prompts, new_tokens=args.new_tokens, batch_size=args.batch_size,
            temperature=args.temperature, seed=args.seed,
        )  # fmt: skip
        seconds = time.perf_counter() - tic
        print(f"target texts (T = {args.temperature:g}), cached passes: {seconds:.0f} s", flush=True)
    split = args.prompts // args.batch_size
    train, held_out = batches[:split], batches[split:]
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "args": vars(args),
        "arms": {},
    }
    finals: dict[float, dict[str, list]] = {}
    for omega in (args.omega, 0.0, -args.omega):
        drafter = copy.deepcopy(base)
        module = GTO.from_objects(
            target,
            drafter,
            tree=args.tree,
            group_size=args.group_size,
            groups=args.groups,
            ttt_steps=2 if args.tiny else 3,
            omega=omega,
            token_weight=args.token_weight,
            debias=not args.no_debias,
            seed=args.seed,
            temperature=args.temperature,
        )
        if args.jitter:
            noise = torch.Generator().manual_seed(args.seed + 17)
            with torch.no_grad():
                for p in module.drafter.parameters():
                    p.add_(args.jitter * torch.randn(p.shape, generator=noise))
        optimizer = torch.optim.AdamW(
            module.drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        curve = []
        norms: list[dict[str, float]] = []
        tic = time.perf_counter()
        for step in range(args.steps + 1):
            if step % args.eval_every == 0 or step == args.steps:
                # the misalignment statistics cost more than the rewards: first and last only
                # unless asked for at every evaluation
                with_stats = args.stats == "every" or step in (0, args.steps)
                train_stats: dict[str, float] = {}
                held_stats: dict[str, float] = {}
                tl, tr = evaluate(module, train, args.seed, train_stats if with_stats else None)
                hl, hr = evaluate(
                    module, held_out, args.seed + 1000, held_stats if with_stats else None
                )
                curve.append(
                    {
                        "step": step,
                        "seconds": time.perf_counter() - tic,
                        "train_accept": sum(tl) / len(tl),
                        "train_reward": sum(tr) / len(tr),
                        "heldout_accept": sum(hl) / len(hl),
                        "heldout_reward": sum(hr) / len(hr),
                        **{f"train_{k}": v for k, v in train_stats.items()},
                        **{f"heldout_{k}": v for k, v in held_stats.items()},
                    }
                )
                print(f"omega {omega:+g} step {step}: {curve[-1]}", flush=True)
                finals[omega] = {
                    "train": tl,
                    "heldout": hl,
                    "train_reward": tr,
                    "heldout_reward": hr,
                }
            if step == args.steps:
                break
            index = step % len(train)
            batch = train[index]
            module._generator.manual_seed(args.seed + index)  # the same prefixes in every arm
            token = module._common_step(batch) if args.token_weight > 0 else None
            gto = module.gto_term(batch)
            if token is not None and omega != 0 and step % args.eval_every == 0:
                # does L_GTO dominate? the two terms' gradient norms, at every evaluation
                norms.append(
                    {"step": step, "advantage_nonzero": float(gto.loss.detach() != 0),
                     **_term_grad_norms(module, {"gto": omega * gto.loss,
                                                 "token": args.token_weight * token.loss})}
                )  # fmt: skip
            loss = omega * gto.loss + (args.token_weight * token.loss if token is not None else 0.0)
            optimizer.zero_grad()
            if loss.requires_grad:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(module.drafter.parameters(), 0.5)
                optimizer.step()
        report["arms"][f"{omega:+g}"] = curve
        if norms:
            report.setdefault("grad_norms", {})[f"{omega:+g}"] = norms
    plus, zero, minus = finals[args.omega], finals[0.0], finals[-args.omega]
    report["paired"] = {
        f"{split}_{what}": {
            "plus_minus": _paired(plus[key], minus[key]),
            "plus_zero": _paired(plus[key], zero[key]),
        }
        for split in ("train", "heldout")
        for what, key in (("accept", split), ("reward", f"{split}_reward"))
    }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random target built in code")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", type=Path, default=None)
    parser.add_argument("--dataset", default="mtbench,humaneval")
    parser.add_argument(
        "--store", type=Path, default=None,
        help="a fit config whose data (a regenerated store with its cached pass) supplies the "
        "texts instead of --dataset: training and held-out texts are distinct store texts",
    )  # fmt: skip
    parser.add_argument("--tree", default="dynamic:3,3,8")
    parser.add_argument("--prompts", type=int, default=16, help="training prompts")
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--omega", type=float, default=1.0)
    parser.add_argument("--token-weight", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--jitter", type=float, default=0.003)
    parser.add_argument("--no-debias", action="store_true")
    parser.add_argument("--warm-steps", type=int, default=40, help="--tiny: token-loss warm start")
    parser.add_argument(
        "--stats", choices=("ends", "every"), default="ends",
        help="misalignment statistics at the first and last evaluation, or at every one",
    )  # fmt: skip
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="T > 0: the texts are the target's samples at T (seeded), the trees are drafted, "
        "verified by sampling and rewarded (expected acceptance, LSE over branches) at T, every "
        "tree scored through the target",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.tiny and args.drafter is None:
        parser.error("--drafter is required unless --tiny")
    if args.store is not None and args.temperature > 0:
        parser.error("--store holds the target's greedy text; at --temperature > 0 the texts are "
                     "sampled from --dataset prompts instead (drop --store)")  # fmt: skip
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, report, default=str)
    print(json.dumps(report["paired"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
