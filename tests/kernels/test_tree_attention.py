"""Tree attention: the reference against first principles, the Triton kernel against the reference.

On CPU the kernel runs in Triton's interpreter (see conftest.py), where every program instance
costs milliseconds: shapes stay small and irregular (N not a power of two, P not a multiple of
the block), and the block-size overrides force multi-block and split-cache paths on them.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_spec.kernels import triton_unavailable_reason
from lightning_spec.kernels.tree_attention import (
    TRITON_AVAILABLE,
    ancestor_mask,
    tree_attention,
    tree_attention_reference,
)

# The package re-exports the function under the module's name: fetch the module itself.
tree_attention_module = importlib.import_module("lightning_spec.kernels.tree_attention")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_SKIP_REASON = triton_unavailable_reason(DEVICE)
requires_triton = pytest.mark.skipif(bool(TRITON_SKIP_REASON), reason=TRITON_SKIP_REASON)
# Compiling for a GPU happens in a subprocess: it only needs triton installed.
requires_triton_installed = pytest.mark.skipif(
    not TRITON_AVAILABLE, reason="triton is not importable"
)
skip_without_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
# fp16 keeps 11 bits of mantissa, bf16 8: tolerances sized to one rounding of the output.
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def make_parents(kind: str, num_nodes: int, generator: torch.Generator) -> torch.Tensor:
    """Parent indices of a chain, a star (all children of the root) or a random tree."""
    if kind == "chain":
        return torch.arange(num_nodes) - 1
    if kind == "star":
        return torch.full((num_nodes,), -1)
    parents = [int(torch.randint(-1, node, (1,), generator=generator)) for node in range(num_nodes)]
    return torch.tensor(parents, dtype=torch.long)


def make_inputs(
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    num_nodes: int,
    cache_len: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache, k_tree, v_tree on DEVICE, drawn from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)

    def draw(heads: int, length: int) -> torch.Tensor:
        shape = (batch, heads, length, head_dim)
        return torch.randn(shape, generator=generator).to(device=DEVICE, dtype=dtype)

    return (
        draw(num_q_heads, num_nodes),
        draw(num_kv_heads, cache_len),
        draw(num_kv_heads, cache_len),
        draw(num_kv_heads, num_nodes),
        draw(num_kv_heads, num_nodes),
    )


def naive_ancestor_mask(parents: list[int]) -> torch.Tensor:
    """Walk up from every node: the mask by definition."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        ancestor = node
        while ancestor >= 0:
            mask[node, ancestor] = True
            ancestor = parents[ancestor]
    return mask


# --------------------------------------------------------------------------------------------
# ancestor_mask and the reference
# --------------------------------------------------------------------------------------------


def test_ancestor_mask_of_chain_is_lower_triangular_and_of_star_is_identity() -> None:
    chain = ancestor_mask(torch.arange(7) - 1)
    star = ancestor_mask(torch.full((7,), -1))
    assert torch.equal(chain, torch.ones(7, 7, dtype=torch.bool).tril())
    assert torch.equal(star, torch.eye(7, dtype=torch.bool))


@pytest.mark.parametrize("num_nodes", [1, 2, 3, 5, 17, 64, 100])
def test_ancestor_mask_matches_walking_up(num_nodes: int) -> None:
    generator = torch.Generator().manual_seed(num_nodes)
    for _ in range(5):
        parents = make_parents("random", num_nodes, generator)
        assert torch.equal(ancestor_mask(parents), naive_ancestor_mask(parents.tolist()))
    # Batched parents give one mask per tree; row sums are depths.
    batch = torch.stack([torch.arange(num_nodes) - 1, torch.full((num_nodes,), -1)])
    masks = ancestor_mask(batch)
    assert masks.shape == (2, num_nodes, num_nodes)
    assert masks[0].sum(-1).tolist() == list(range(1, num_nodes + 1))
    assert masks[1].sum(-1).tolist() == [1] * num_nodes


def test_reference_matches_per_query_softmax() -> None:
    """Hand-rolled: each (head, query) softmaxes over the cache plus its allowed tree keys."""
    q, k_cache, v_cache, k_tree, v_tree = make_inputs(1, 4, 2, 5, 3, 8, torch.float64)
    mask = ancestor_mask(torch.tensor([-1, 0, 0, 1, -1]))
    out = tree_attention_reference(q, k_cache, v_cache, k_tree, v_tree, mask.to(DEVICE))
    for head in range(4):
        kv_head = head // 2
        for node in range(5):
            keys = torch.cat([k_cache[0, kv_head], k_tree[0, kv_head, mask[node]]])
            values = torch.cat([v_cache[0, kv_head], v_tree[0, kv_head, mask[node]]])
            weights = torch.softmax(keys @ q[0, head, node] / math.sqrt(8), dim=0)
            torch.testing.assert_close(out[0, head, node], weights @ values)


def test_reference_matches_sdpa_with_full_mask() -> None:
    q, k_cache, v_cache, k_tree, v_tree = make_inputs(2, 8, 2, 6, 11, 16, torch.float32)
    mask = ancestor_mask(torch.tensor([-1, 0, 1, 0, -1, 4])).to(DEVICE)
    full_mask = torch.cat([torch.ones(6, 11, dtype=torch.bool, device=DEVICE), mask], dim=-1)
    expected = F.scaled_dot_product_attention(
        q,
        torch.cat([k_cache, k_tree], dim=2).repeat_interleave(4, dim=1),
        torch.cat([v_cache, v_tree], dim=2).repeat_interleave(4, dim=1),
        attn_mask=full_mask,
        scale=0.3,
    )
    out = tree_attention_reference(q, k_cache, v_cache, k_tree, v_tree, mask, scale=0.3)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_reference_gives_zeros_for_a_query_with_nothing_to_attend() -> None:
    q, k_cache, v_cache, k_tree, v_tree = make_inputs(1, 2, 1, 3, 0, 16, torch.float32)
    mask = torch.tensor([[True, False, False], [False, False, False], [True, True, True]])
    out = tree_attention_reference(q, k_cache, v_cache, k_tree, v_tree, mask.to(DEVICE))
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))


def test_inputs_are_checked() -> None:
    q, k_cache, v_cache, k_tree, v_tree = make_inputs(1, 3, 2, 4, 5, 16, torch.float32)
    mask = torch.ones(4, 4, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        tree_attention(q, k_cache, v_cache, k_tree, v_tree, mask)
    q, k_cache, v_cache, k_tree, v_tree = make_inputs(1, 4, 2, 4, 5, 16, torch.float32)
    with pytest.raises(ValueError, match="bool"):
        tree_attention(q, k_cache, v_cache, k_tree, v_tree, mask.float())
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention(q, k_cache, v_cache, k_tree, v_tree, mask[:3, :3])
    with pytest.raises(ValueError, match="dtype"):
        tree_attention(q, k_cache.half(), v_cache, k_tree, v_tree, mask)
    if not TRITON_SKIP_REASON:
        as_double = [t.double() for t in (q, k_cache, v_cache, k_tree, v_tree)]
        with pytest.raises(RuntimeError, match="float64"):
            tree_attention(*as_double, mask, use_triton=True)
    with pytest.raises(ValueError, match="k_tree"):
        tree_attention(q, k_cache, v_cache, k_tree[:, :, :3], v_tree, mask)


# --------------------------------------------------------------------------------------------
# Triton against the reference
# --------------------------------------------------------------------------------------------

# (N, P, Hq, Hkv, D, dtype, tree): N and P irregular, GQA ratios 1 and 4, every head dim.
CASES = [
    (7, 0, 4, 1, 32, torch.float32, "chain"),
    (7, 1, 4, 4, 64, torch.float16, "star"),
    (23, 37, 4, 1, 16, torch.float32, "random"),
    (23, 130, 8, 2, 128, torch.float16, "random"),
    (60, 37, 4, 1, 64, torch.float32, "random"),
    (60, 130, 2, 2, 32, torch.float16, "chain"),
    (5, 9, 2, 1, 80, torch.float32, "random"),  # head dim padded to 128 inside the kernel
]


@requires_triton
@pytest.mark.parametrize(
    ("num_nodes", "cache_len", "hq", "hkv", "head_dim", "dtype", "tree"), CASES
)
def test_triton_matches_reference(
    num_nodes: int,
    cache_len: int,
    hq: int,
    hkv: int,
    head_dim: int,
    dtype: torch.dtype,
    tree: str,
) -> None:
    generator = torch.Generator().manual_seed(num_nodes * 1000 + cache_len)
    inputs = make_inputs(1, hq, hkv, num_nodes, cache_len, head_dim, dtype, seed=cache_len)
    mask = ancestor_mask(make_parents(tree, num_nodes, generator)).to(DEVICE)
    out = tree_attention(*inputs, mask, use_triton=True)
    expected = tree_attention_reference(*inputs, mask)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@requires_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_small_blocks_and_split_cache(num_splits: int) -> None:
    """16 x 16 tiles: several row blocks, cache blocks and tree blocks, with a ragged tail;
    with 3 splits the partial softmaxes are merged by the combine kernel."""
    generator = torch.Generator().manual_seed(7)
    inputs = make_inputs(1, 4, 1, 19, 37, 16, torch.float32, seed=3)
    mask = ancestor_mask(make_parents("random", 19, generator)).to(DEVICE)
    out = tree_attention(
        *inputs, mask, use_triton=True, block_m=16, block_n=16, num_splits=num_splits
    )
    expected = tree_attention_reference(*inputs, mask)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@requires_triton
def test_triton_per_sequence_masks_non_contiguous_inputs_and_scale() -> None:
    """[B, N, N] masks, a cache that is a slice of a longer buffer, and queries in the
    [B, N, H, D] -> [B, H, N, D] transposed layout Hugging Face attention produces."""
    batch, hq, hkv, num_nodes, cache_len, head_dim = 2, 4, 2, 9, 21, 32
    generator = torch.Generator().manual_seed(11)
    q, _, _, k_tree, v_tree = make_inputs(batch, hq, hkv, num_nodes, 0, head_dim, torch.float16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strides of a [B, N, H, D] buffer
    buffer = torch.randn(batch, hkv, 40, head_dim, generator=generator).to(DEVICE, torch.float16)
    k_cache, v_cache = buffer[:, :, :cache_len], buffer.flip(2)[:, :, :cache_len]
    masks = torch.stack(
        [ancestor_mask(make_parents("random", num_nodes, generator)) for _ in range(batch)]
    ).to(DEVICE)
    args = (q, k_cache, v_cache, k_tree, v_tree, masks)
    out = tree_attention(*args, scale=0.05, use_triton=True)
    torch.testing.assert_close(
        out, tree_attention_reference(*args, scale=0.05), **TOLERANCE[torch.float16]
    )


@requires_triton
def test_triton_gives_zeros_for_a_query_with_nothing_to_attend() -> None:
    inputs = make_inputs(1, 2, 1, 3, 0, 16, torch.float32)
    mask = torch.tensor([[True, False, False], [False, False, False], [True, True, True]])
    out = tree_attention(*inputs, mask.to(DEVICE), use_triton=True)
    torch.testing.assert_close(out, tree_attention_reference(*inputs, mask.to(DEVICE)))


@requires_triton
def test_triton_bf16_with_fp32_dot() -> None:
    """bf16 loads and stores; the interpreter's bf16 dot is avoided by upcasting before it."""
    generator = torch.Generator().manual_seed(5)
    inputs = make_inputs(1, 4, 1, 7, 37, 32, torch.bfloat16)
    mask = ancestor_mask(make_parents("random", 7, generator)).to(DEVICE)
    out = tree_attention(*inputs, mask, use_triton=True)
    expected = tree_attention_reference(*inputs, mask)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])


@pytest.mark.requires_cuda
@skip_without_cuda
@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_nodes", "cache_len"), [(7, 1), (60, 130), (128, 2049)])
@pytest.mark.parametrize("tree", ["chain", "random"])
def test_triton_on_gpu(num_nodes: int, cache_len: int, dtype: torch.dtype, tree: str) -> None:
    """GPU-only sweep at a Llama-8B head layout (32 query heads over 8 KV heads, D = 128),
    default block sizes and the automatic split of long caches."""
    generator = torch.Generator().manual_seed(num_nodes)
    inputs = make_inputs(2, 32, 8, num_nodes, cache_len, 128, dtype)
    mask = ancestor_mask(make_parents(tree, num_nodes, generator)).to(DEVICE)
    out = tree_attention(*inputs, mask)
    torch.testing.assert_close(out, tree_attention_reference(*inputs, mask), **TOLERANCE[dtype])


# --------------------------------------------------------------------------------------------
# Falling back to the reference
# --------------------------------------------------------------------------------------------


def test_use_triton_false_is_the_reference() -> None:
    inputs = make_inputs(1, 2, 1, 4, 3, 16, torch.float32)
    mask = ancestor_mask(torch.tensor([-1, 0, 0, 2])).to(DEVICE)
    assert torch.equal(
        tree_attention(*inputs, mask, use_triton=False), tree_attention_reference(*inputs, mask)
    )


def test_cpu_tensors_without_interpreter_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled (non-interpreted) kernels cannot take CPU tensors: None falls back, True raises."""
    monkeypatch.setattr(tree_attention_module, "_kernels_interpreted", lambda: False)
    calls = []
    real_reference = tree_attention_module.tree_attention_reference

    def spy(*args, **kwargs):
        calls.append(1)
        return real_reference(*args, **kwargs)

    monkeypatch.setattr(tree_attention_module, "tree_attention_reference", spy)
    cpu = [tensor.cpu() for tensor in make_inputs(1, 2, 1, 4, 3, 16, torch.float32)]
    mask = ancestor_mask(torch.tensor([-1, 0, 0, 2]))
    tree_attention(*cpu, mask)
    assert calls == [1]
    with pytest.raises(RuntimeError, match="cannot run"):
        tree_attention(*cpu, mask, use_triton=True)


def test_package_imports_and_falls_back_without_triton() -> None:
    """With triton unimportable the package still imports and both wrappers use the reference."""
    kernels_dir = Path(__file__).resolve().parents[2] / "kernels"
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        import torch
        sys.modules["triton"] = None  # makes "import triton" raise ImportError
        spec = importlib.util.spec_from_file_location(
            "kernels_without_triton", {str(kernels_dir / "__init__.py")!r},
            submodule_search_locations=[{str(kernels_dir)!r}],
        )
        kernels = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = kernels
        spec.loader.exec_module(kernels)
        assert kernels.TRITON_AVAILABLE is False
        q = torch.randn(1, 2, 3, 16)
        kv = torch.randn(1, 1, 4, 16)
        tree = torch.randn(1, 1, 3, 16)
        mask = kernels.ancestor_mask(torch.tensor([-1, 0, 1]))
        out = kernels.tree_attention(q, kv, kv, tree, tree, mask)
        assert torch.equal(out, kernels.tree_attention_reference(q, kv, kv, tree, tree, mask))
        length, path, bonus = kernels.tree_verify(
            torch.tensor([5, 6, 9]), torch.tensor([-1, 0, 1]), torch.tensor([5, 6, 7, 8])
        )
        assert (length, path.tolist(), bonus) == (2, [0, 1], 7)
        try:
            kernels.tree_verify(torch.tensor([5]), torch.tensor([-1]), torch.tensor([5, 6]),
                                use_triton=True)
        except RuntimeError as error:
            assert "triton is not installed" in str(error)
        else:
            raise AssertionError("use_triton=True without triton must raise")
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script benchmarks for minutes")
def test_bench_script_runs_its_cpu_check_from_outside_the_repository(tmp_path: Path) -> None:
    """The benchmark (`lightning-spec bench kernels`) must work on a bare image: without CUDA it
    exits 0, and --cpu-check loads the kernels by path when lightning_spec is not importable and
    checks them."""
    script = ["-m", "lightning_spec.cli", "bench", "kernels"]
    plain = subprocess.run(
        [sys.executable, *script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert plain.returncode == 0 and "No CUDA device" in plain.stdout
    check = subprocess.run(
        [sys.executable, *script, "--cpu-check"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")},
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "False" not in check.stdout


@requires_triton_installed
def test_kernels_compile_for_hopper(compile_for_gpu) -> None:
    """bf16, D = 128, default GPU tiles: the builds the benchmark runs on an H100/H200."""
    inputs = {arg: "*bf16" for arg in ("Q", "K_CACHE", "V_CACHE", "K_TREE", "V_TREE")}
    stats = {"STAT_M": "*fp32", "STAT_L": "*fp32"}
    tiles = dict(GROUP=4, HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, DOT_FP32=False)
    launch = dict(num_warps=4, num_stages=2)
    builds = [
        {
            "kernel": "_tree_attention_kernel",
            "signature": {**inputs, **stats, "MASK": "*u8", "OUT": out, "qk_scale_log2": "fp32"},
            "constexprs": {**tiles, "SPLIT": split},
            "options": launch,
        }
        for out, split in (("*bf16", False), ("*fp32", True))
    ]
    builds.append(
        {
            "kernel": "_combine_splits_kernel",
            "signature": {**stats, "PART_OUT": "*fp32", "OUT": "*bf16"},
            "constexprs": dict(HEAD_DIM=128, BLOCK_R=16, BLOCK_D=128),
            "options": dict(num_warps=4),
        }
    )
    output = compile_for_gpu("lightning_spec.kernels.tree_attention", builds)
    assert output.count("shared memory bytes") == 3
