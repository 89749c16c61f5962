"""Where one speculative-decoding step spends its time on this machine, and the physical floor.

Runs real prompts through `SpeculativeDecoder.start(...)` / `DecodeSession.step()` and splits
each step into: drafter model calls (`Drafter.draft_step` / `step`), the rest of drafting (tree
policy, masks, bookkeeping), the target's verification forward (attention, MLP, lm_head, the
rest of the forward: norms, embeddings, cache growth), verification logic plus cache
compaction and record keeping, and Python residue. Timing uses forward hooks on the target's
attention/MLP modules and lm_head and wrappers on the drafter's step methods, so the split adds
a little overhead of its own; the one-token HF forward is timed beside it. A memory-bandwidth
probe (streaming reads of a tensor larger than the caches) gives the machine's floor for one
target token: weight bytes / bandwidth.

    lightning-spec bench profile --drafter DIR [--prepack] [--tree dynamic:6,10,32] \
        [--prompts 6] [--max-new-tokens 64] [--output runs/bench/profile.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from lightning_spec import specs
from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.models.cache import truncate_cache


class _Clock:
    """Accumulates seconds per category; nested categories are subtracted from their parent."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap_method(self, obj: object, name: str, category: str) -> None:
        original = getattr(obj, name)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            tic = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[category] += time.perf_counter() - tic

        setattr(obj, name, timed)

    def hook_module(self, module: torch.nn.Module, category: str) -> None:
        starts: list[float] = []

        def before(*_: object) -> None:
            starts.append(time.perf_counter())

        def after(*_: object) -> None:
            self.seconds[category] += time.perf_counter() - starts.pop()

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)


def bandwidth_gbs(megabytes: int = 1024, repeats: int = 5) -> float:
    """Streaming-read bandwidth (GB/s): the best of `repeats` sums over a large fp32 tensor."""
    data = torch.ones(megabytes * 1024 * 1024 // 4)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - tic)
    return data.numel() * 4 / best / 1e9


def one_token_forward_ms(target: object, prompt: list[int], repeats: int = 7) -> float:
    """Median ms of a one-token target forward after `prompt` (what HF greedy pays a token)."""
    out = target(torch.tensor([prompt]))
    cache, length = out.cache, len(prompt)
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        target(torch.tensor([[prompt[-1]]]), cache=cache, output_features=False)
        times.append(time.perf_counter() - tic)
        truncate_cache(cache, length)
    return sorted(times)[repeats // 2] * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-spec bench profile", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--tree", default="dynamic:6,10,32")
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prepack", action="store_true")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = specs.resolve_target(args.target)
    drafter = specs.resolve_drafter(args.drafter, target)
    if args.prepack:
        from lightning_spec.models.packed import prepack_linears

        prepack_linears(target.model)
        prepack_linears(drafter)
    _, items = specs.load_prompts(args.dataset, target.tokenizer, args.prompts + 1)
    prompts = [ids for ids, _ in items]
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    gbs = bandwidth_gbs()
    one_token = one_token_forward_ms(target, prompts[0])

    clock = _Clock()
    for layer in target.model.model.layers:
        clock.hook_module(layer.self_attn, "target_attention")
        clock.hook_module(layer.mlp, "target_mlp")
    clock.hook_module(target.model.get_output_embeddings(), "target_lm_head")
    clock.wrap_method(drafter, "step", "drafter_model")
    clock.wrap_method(type(target), "forward", "target_forward_total")
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(args.tree))
    decoder.generate(prompts[0], 8)  # warm-up
    clock.seconds.clear()
    phases: dict[str, float] = defaultdict(float)
    steps, committed, wall = 0, 0, 0.0
    stepped: dict[str, float] = defaultdict(float)  # clock seconds inside steps only
    for prompt in prompts[1:]:
        session = decoder.start(prompt, args.max_new_tokens)  # prefill: not part of a step
        snapshot = dict(clock.seconds)
        while not session.done:
            tic = time.perf_counter()
            record = session.step()
            wall += time.perf_counter() - tic
            steps += 1
            committed += len(record.committed)
            for phase, value in record.timings.items():
                phases[phase] += value
        for key, value in clock.seconds.items():
            stepped[key] += value - snapshot.get(key, 0.0)
    forward = stepped["target_forward_total"]
    parts = {k: stepped[k] for k in ("target_attention", "target_mlp", "target_lm_head")}
    ms = {
        "drafter_model": stepped["drafter_model"],
        "drafting_rest (policy, masks, bookkeeping)": phases["draft"] - stepped["drafter_model"],
        **parts,
        "target_forward_rest (norms, embeddings, cache growth)": forward - sum(parts.values()),
        "verification logic + cache compaction + records": phases["verify"]
        + phases["update"]
        - forward,
        "python residue": wall - phases["draft"] - phases["verify"] - phases["update"],
    }
    per_step = {k: round(v / steps * 1000, 2) for k, v in ms.items()}
    result = {
        "config": vars(args),
        "steps": steps,
        "tau": committed / steps,
        "ms_per_step": per_step,
        "ms_per_step_total": round(wall / steps * 1000, 2),
        "ms_per_committed_token": round(wall / committed * 1000, 2),
        "one_token_forward_ms": round(one_token, 2),
        "bandwidth_gb_s": round(gbs, 2),
        "weights_mb": round(weight_bytes / 1e6, 1),
        "floor_ms_per_target_token": round(weight_bytes / (gbs * 1e9) * 1000, 2),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0

