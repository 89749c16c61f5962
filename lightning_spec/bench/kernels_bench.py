"""Benchmark the tree kernels on a GPU: Triton tree attention against SDPA with a dense boolean
mask and against the eager reference; Triton tree verification against the Python reference.

Why these baselines: without a tree kernel a Hugging Face target verifies a draft tree by
handing SDPA the full ``[N, P + N]`` mask (the cache part all True), which costs mask traffic
and rules out SDPA's flash backend; the eager reference is what runs when Triton is absent.

The default shape is one Llama-3-8B layer (32 query heads over 8 KV heads, head dim 128, batch
1) over tree sizes N and cache lengths P. Times are medians of ``triton.testing.do_bench``
(CUDA events, L2 flushed between runs). Prints a markdown table, writes JSON with ``--output``.

    lightning-spec bench kernels --output kernels.json
    lightning-spec bench kernels --cpu-check   # no GPU: a tiny interpreter correctness pass

Self-contained on purpose (torch, triton and the kernels package only) so it runs on a bare GPU
image: it imports ``lightning_spec.kernels`` and, when that is not installed, loads the
repository's ``kernels/`` folder by path.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import math
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from lightning_spec.bench.report import write_json

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_kernels() -> tuple[ModuleType, ModuleType]:
    """The tree_attention and tree_verify modules, installed or from the repository's ``kernels/``."""
    try:
        return (
            importlib.import_module("lightning_spec.kernels.tree_attention"),
            importlib.import_module("lightning_spec.kernels.tree_verify"),
        )
    except ImportError:
        folder = Path(__file__).resolve().parents[2] / "kernels"
        spec = importlib.util.spec_from_file_location(
            "lightning_spec_kernels",
            folder / "__init__.py",
            submodule_search_locations=[str(folder)],
        )
        if spec is None or spec.loader is None:
            raise
        package = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = package
        spec.loader.exec_module(package)
        return (
            importlib.import_module(f"{spec.name}.tree_attention"),
            importlib.import_module(f"{spec.name}.tree_verify"),
        )


def random_parents(num_nodes: int, generator: torch.Generator) -> torch.Tensor:
    """A random topologically ordered tree; its shape does not change any kernel's cost."""
    parents = [int(torch.randint(-1, node, (1,), generator=generator)) for node in range(num_nodes)]
    return torch.tensor(parents, dtype=torch.long)


def attention_inputs(
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    num_nodes: int,
    cache_len: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    attention: ModuleType,
) -> dict[str, torch.Tensor]:
    """Tensors as a decoder holds them: the tree's keys/values appended to one KV buffer."""
    generator = torch.Generator().manual_seed(num_nodes * 7919 + cache_len)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    keys = draw(batch, num_kv_heads, cache_len + num_nodes, head_dim)
    values = draw(batch, num_kv_heads, cache_len + num_nodes, head_dim)
    tree_mask = attention.ancestor_mask(random_parents(num_nodes, generator).to(device))
    full_mask = torch.cat(
        [torch.ones(num_nodes, cache_len, dtype=torch.bool, device=device), tree_mask], dim=-1
    )
    return {
        "q": draw(batch, num_q_heads, num_nodes, head_dim),
        "keys": keys,
        "values": values,
        "tree_mask": tree_mask,
        "full_mask": full_mask,
    }


def run_tree_attention(attention: ModuleType, inputs: dict, use_triton: bool) -> torch.Tensor:
    keys, values = inputs["keys"], inputs["values"]
    cache_len = keys.shape[2] - inputs["q"].shape[2]
    return attention.tree_attention(
        inputs["q"],
        keys[:, :, :cache_len],
        values[:, :, :cache_len],
        keys[:, :, cache_len:],
        values[:, :, cache_len:],
        inputs["tree_mask"],
        use_triton=use_triton,
    )


def run_sdpa(inputs: dict) -> torch.Tensor:
    """SDPA over the whole buffer with the dense [N, P + N] boolean mask (GQA fused if torch can)."""
    q, keys, values = inputs["q"], inputs["keys"], inputs["values"]
    group = q.shape[1] // keys.shape[1]
    try:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=inputs["full_mask"], enable_gqa=group > 1
        )
    except TypeError:  # torch < 2.5 has no enable_gqa
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=inputs["full_mask"])


def time_ms(fn, args: argparse.Namespace) -> float:
    """Median milliseconds of ``fn`` over CUDA events, L2 flushed before each call."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def bench_attention(
    args: argparse.Namespace, attention: ModuleType, device: torch.device
) -> list[dict]:
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for cache_len in args.cache_lens:
            for num_nodes in args.nodes:
                inputs = attention_inputs(
                    args.batch,
                    args.q_heads,
                    args.kv_heads,
                    num_nodes,
                    cache_len,
                    args.head_dim,
                    dtype,
                    device,
                    attention,
                )
                reference = run_tree_attention(attention, inputs, use_triton=False).float()
                triton_out = run_tree_attention(attention, inputs, use_triton=True).float()
                sdpa_out = run_sdpa(inputs).float()
                candidates = {
                    "triton_ms": functools.partial(run_tree_attention, attention, inputs, True),
                    "sdpa_mask_ms": functools.partial(run_sdpa, inputs),
                    "eager_ms": functools.partial(run_tree_attention, attention, inputs, False),
                }
                timings = {name: time_ms(fn, args) for name, fn in candidates.items()}
                row = {
                    "dtype": dtype_name,
                    "P": cache_len,
                    "N": num_nodes,
                    **{name: round(value, 4) for name, value in timings.items()},
                    "speedup_vs_sdpa": round(timings["sdpa_mask_ms"] / timings["triton_ms"], 2),
                    "speedup_vs_eager": round(timings["eager_ms"] / timings["triton_ms"], 2),
                    "max_err_triton": (triton_out - reference).abs().max().item(),
                    "max_err_sdpa": (sdpa_out - reference).abs().max().item(),
                }
                rows.append(row)
                print(
                    f"  {dtype_name} P={cache_len:5d} N={num_nodes:3d}: triton "
                    f"{row['triton_ms']:.4f} ms, sdpa {row['sdpa_mask_ms']:.4f} ms, "
                    f"eager {row['eager_ms']:.4f} ms",
                    file=sys.stderr,
                )
    return rows


def bench_verify(args: argparse.Namespace, verify: ModuleType, device: torch.device) -> list[dict]:
    rows = []
    for batch in args.verify_batches:
        for num_nodes in args.nodes:
            generator = torch.Generator().manual_seed(num_nodes + batch)
            parents = torch.stack([random_parents(num_nodes, generator) for _ in range(batch)])
            tokens = torch.randint(0, 3, (batch, num_nodes), generator=generator)
            target = torch.randint(0, 3, (batch, num_nodes + 1), generator=generator)
            parents, tokens, target = parents.to(device), tokens.to(device), target.to(device)
            triton_result = verify.tree_verify_batched(tokens, parents, target, use_triton=True)
            reference = verify.tree_verify_batched_reference(tokens, parents, target)
            matches = all(torch.equal(a, b) for a, b in zip(triton_result, reference, strict=True))
            triton_ms = time_ms(
                functools.partial(
                    verify.tree_verify_batched, tokens, parents, target, use_triton=True
                ),
                args,
            )
            reference_ms = time_ms(
                functools.partial(verify.tree_verify_batched_reference, tokens, parents, target),
                args,
            )
            rows.append(
                {
                    "B": batch,
                    "N": num_nodes,
                    "triton_ms": round(triton_ms, 4),
                    "reference_ms": round(reference_ms, 4),
                    "speedup": round(reference_ms / triton_ms, 1),
                    "matches_reference": matches,
                }
            )
    return rows


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.2e}" if c.startswith("max_err") else str(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_check(attention: ModuleType, verify: ModuleType) -> int:
    """Tiny shapes through the interpreter: proves the kernels compute the right thing here."""
    if not attention.TRITON_AVAILABLE:
        print("triton is not installed: nothing to check beyond the PyTorch reference.")
        return 0
    failures = 0
    print("| check | shape | max abs error | ok |\n|---|---|---|---|")
    for num_nodes, cache_len, dtype in ((7, 37, torch.float32), (23, 130, torch.float16)):
        inputs = attention_inputs(
            1, 4, 1, num_nodes, cache_len, 64, dtype, torch.device("cpu"), attention
        )
        error = (
            (
                run_tree_attention(attention, inputs, use_triton=True).float()
                - run_tree_attention(attention, inputs, use_triton=False).float()
            )
            .abs()
            .max()
            .item()
        )
        ok = error <= (1e-4 if dtype == torch.float32 else 3e-3)
        failures += not ok
        print(f"| tree_attention | N={num_nodes} P={cache_len} {dtype} | {error:.2e} | {ok} |")
    generator = torch.Generator().manual_seed(0)
    parents = torch.stack([random_parents(23, generator) for _ in range(4)])
    tokens = torch.randint(0, 2, (4, 23), generator=generator)
    target = torch.randint(0, 2, (4, 24), generator=generator)
    got = verify.tree_verify_batched(tokens, parents, target, use_triton=True)
    want = verify.tree_verify_batched_reference(tokens, parents, target)
    ok = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    failures += not ok
    print(f"| tree_verify | B=4 N=23 | - | {ok} |")
    return 1 if failures else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lightning-spec bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--cpu-check",
        action="store_true",
        help="without CUDA, run a tiny correctness pass in Triton's interpreter",
    )
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16"])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--cache-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--verify-batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        if not args.cpu_check:
            print(
                "No CUDA device: the benchmark needs a GPU, so nothing was timed. "
                "Use --cpu-check for a correctness pass in Triton's interpreter."
            )
            return 0
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: set first
        attention, verify = load_kernels()
        return cpu_check(attention, verify)

    attention, verify = load_kernels()
    if not attention.TRITON_AVAILABLE:
        print("triton is not installed: there is no kernel to benchmark.")
        return 0
    import triton

    if args.q_heads % args.kv_heads:
        raise SystemExit("--q-heads must be a multiple of --kv-heads")
    device_name = torch.cuda.get_device_name()
    print(
        f"{device_name}, torch {torch.__version__}, triton {triton.__version__}; B={args.batch}, "
        f"Hq={args.q_heads}, Hkv={args.kv_heads}, D={args.head_dim}",
        file=sys.stderr,
    )
    device = torch.device("cuda")
    attention_rows = bench_attention(args, attention, device)
    verify_rows = bench_verify(args, verify, device)

    print(f"\n## Tree attention ({device_name}, median ms)\n")
    print(markdown_table(attention_rows))
    print(f"\n## Tree verification ({device_name}, median ms)\n")
    print(markdown_table(verify_rows))
    if args.output:
        report = {
            "device": device_name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "shape": {
                "batch": args.batch,
                "q_heads": args.q_heads,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "scale": 1 / math.sqrt(args.head_dim),
            },
            "timing": {
                "method": "triton.testing.do_bench median",
                "warmup_ms": args.warmup,
                "rep_ms": args.rep,
            },
            "tree_attention": attention_rows,
            "tree_verify": verify_rows,
        }
        write_json(args.output, report, indent=2)
        print(f"\nwrote {args.output}", file=sys.stderr)
    return 0

