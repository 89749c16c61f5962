"""Tree attention: N draft-tree queries over a KV cache of P tokens plus the tree's own N keys.

In tree-based speculative decoding (SpecInfer, Miao et al. 2023; Medusa, Cai et al. 2024;
EAGLE-2, Li et al. 2024) the target model verifies every node of a draft tree in one forward
pass. Each node attends to the whole prefix (the KV cache) and, inside the tree, only to itself
and its ancestors. Handing SDPA a dense ``[N, P + N]`` boolean mask works but materialises a mask
that is almost all True and pushes SDPA off its fused fast paths. This kernel instead streams the
cache with the online softmax of FlashAttention (Dao et al. 2022) with no mask at all, then
applies the ``[N, N]`` ancestor mask to the tree block(s) only. For grouped-query attention it
stacks the query heads that share a KV head into one tile, so each KV block is read once per KV
head rather than once per query head, and when the grid would leave the GPU idle (few heads,
long cache) it splits the cache across programs and merges the partial softmaxes afterwards
(the "flash-decoding" split).

The file reads top to bottom: the PyTorch reference (the definition of the result), the Triton
kernels, the host wrapper that picks block sizes and falls back to the reference, and
``ancestor_mask`` that builds the tree mask from parent indices.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # CPU-only installs, macOS, Windows: the reference path still works.
    triton = None
    tl = None
    TRITON_AVAILABLE = False

__all__ = [
    "TRITON_AVAILABLE",
    "ancestor_mask",
    "tree_attention",
    "tree_attention_reference",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def tree_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_tree: Tensor,
    v_tree: Tensor,
    tree_mask: Tensor,
    scale: float | None = None,
) -> Tensor:
    """Eager definition of tree attention; the Triton kernel is tested against it.

    Args:
        q: queries of the tree nodes, ``[B, Hq, N, D]``.
        k_cache, v_cache: keys/values of the committed prefix, ``[B, Hkv, P, D]`` (P may be 0).
        k_tree, v_tree: keys/values of the tree nodes themselves, ``[B, Hkv, N, D]``.
        tree_mask: bool ``[N, N]`` or ``[B, N, N]``; ``tree_mask[..., i, j]`` is True when query
            ``i`` may attend tree key ``j``. Every query attends every cache key.
        scale: softmax scale, ``1 / sqrt(D)`` by default.

    Returns:
        ``[B, Hq, N, D]`` in the dtype of ``q``. Query head ``h`` reads KV head
        ``h // (Hq // Hkv)`` (grouped-query attention). The maths runs in fp32 (fp64 for fp64
        inputs) so the reference is a fair yardstick for half-precision kernels. A query with no key to attend (P = 0 and
        an all-False mask row) gets zeros rather than NaN.
    """
    _check_inputs(q, k_cache, v_cache, k_tree, v_tree, tree_mask)
    batch, num_q_heads, num_nodes, head_dim = q.shape
    group = num_q_heads // k_cache.shape[1]
    cache_len = k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    compute = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    keys = torch.cat([k_cache, k_tree], dim=2).to(compute).repeat_interleave(group, dim=1)
    values = torch.cat([v_cache, v_tree], dim=2).to(compute).repeat_interleave(group, dim=1)
    scores = torch.matmul(q.to(compute), keys.transpose(-1, -2)) * scale  # [B, Hq, N, P + N]

    tree_allowed = tree_mask.expand(batch, num_nodes, num_nodes)
    cache_allowed = tree_allowed.new_ones(batch, num_nodes, cache_len)
    allowed = torch.cat([cache_allowed, tree_allowed], dim=-1)[:, None]  # [B, 1, N, P + N]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, 0.0)  # empty rows: 0, not NaN
    return torch.matmul(probs, values).to(q.dtype)


def _check_inputs(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_tree: Tensor,
    v_tree: Tensor,
    tree_mask: Tensor,
) -> None:
    """Fail early with a readable message instead of a shape error deep inside a kernel."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, N, D], got shape {tuple(q.shape)}")
    batch, num_q_heads, num_nodes, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache must be [B={batch}, Hkv, P, D={head_dim}], got {tuple(k_cache.shape)}"
        )
    num_kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads}")
    expected = {
        "v_cache": (v_cache, (batch, num_kv_heads, cache_len, head_dim)),
        "k_tree": (k_tree, (batch, num_kv_heads, num_nodes, head_dim)),
        "v_tree": (v_tree, (batch, num_kv_heads, num_nodes, head_dim)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    kv = {"k_cache": k_cache, "v_cache": v_cache, "k_tree": k_tree, "v_tree": v_tree}
    for name, tensor in kv.items():
        if tensor.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {tensor.dtype}, q has {q.dtype}")
    for name, tensor in {**kv, "tree_mask": tree_mask}.items():
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    if tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be bool, got {tree_mask.dtype}")
    if tree_mask.shape[-2:] != (num_nodes, num_nodes) or tree_mask.dim() not in (2, 3):
        raise ValueError(
            f"tree_mask must be [N, N] or [B, N, N] with N={num_nodes}, "
            f"got {tuple(tree_mask.shape)}"
        )
    if tree_mask.dim() == 3 and tree_mask.shape[0] not in (1, batch):
        raise ValueError(f"tree_mask batch {tree_mask.shape[0]} matches neither 1 nor B={batch}")


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

if TRITON_AVAILABLE:

    @triton.jit
    def _dot(a, b, DOT_FP32: tl.constexpr):
        """``a @ b`` with an fp32 accumulator; DOT_FP32 multiplies in true fp32 as well.

        DOT_FP32 serves two cases: the interpreter, whose bf16 dot is wrong, and fp32 inputs on
        a GPU, where the default TF32 would keep only 10 mantissa bits of q and k.
        """
        if DOT_FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a.to(b.dtype), b)

    @triton.jit
    def _online_softmax_step(scores, values, m_i, l_i, acc, DOT_FP32: tl.constexpr):
        """Fold one block of (log2-scaled, already masked) scores into the running softmax.

        ``m_i`` may be -inf for rows that have seen no allowed key yet; subtracting a safe 0 in
        that case keeps exp2 away from ``-inf - -inf = NaN`` without a finite sentinel.
        """
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        probs = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        acc = acc * alpha[:, None] + _dot(probs, values, DOT_FP32)  # probs cast to v's dtype
        return m_new, l_i, acc

    @triton.jit
    def _tree_attention_kernel(
        Q,
        K_CACHE,
        V_CACHE,
        K_TREE,
        V_TREE,
        MASK,
        OUT,
        STAT_M,
        STAT_L,
        stride_qb,
        stride_qh,
        stride_qn,
        stride_qd,
        stride_kcb,
        stride_kch,
        stride_kcp,
        stride_kcd,
        stride_vcb,
        stride_vch,
        stride_vcp,
        stride_vcd,
        stride_ktb,
        stride_kth,
        stride_ktn,
        stride_ktd,
        stride_vtb,
        stride_vth,
        stride_vtn,
        stride_vtd,
        stride_mb,
        stride_mq,
        stride_mk,
        stride_os,
        stride_ob,
        stride_oh,
        stride_on,
        stride_od,
        stat_split_stride,
        num_nodes,
        cache_len,
        num_kv_heads,
        keys_per_split,
        num_splits,
        qk_scale_log2,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SPLIT: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        """One program: BLOCK_M (query head, node) rows of one KV head, one slice of the cache.

        Rows are the ``GROUP * N`` pairs (query head g of this KV head's group, node i), so GQA
        costs no extra KV reads. Split ``s`` covers cache keys ``[s * keys_per_split, ...)``; the
        last split also covers the tree keys. Without SPLIT the normalised result goes straight
        to OUT; with SPLIT, OUT is an fp32 workspace and the running max / sum go to STAT_M /
        STAT_L for ``_combine_splits_kernel``.
        """
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)
        # int64 base offsets: a long cache in a big preallocated buffer passes 2**31 elements.
        batch = (pid_bh // num_kv_heads).to(tl.int64)
        kv_head = (pid_bh % num_kv_heads).to(tl.int64)

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_valid = rows < GROUP * num_nodes
        node = rows % num_nodes
        q_head = kv_head * GROUP + rows // num_nodes
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM  # head dims that are not a power of two are zero-padded

        q_ptrs = (
            Q
            + batch * stride_qb
            + q_head[:, None] * stride_qh
            + node[:, None] * stride_qn
            + offs_d[None, :] * stride_qd
        )
        q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Cache part: no mask beyond the end of this split's slice.
        kc_base = K_CACHE + batch * stride_kcb + kv_head * stride_kch
        vc_base = V_CACHE + batch * stride_vcb + kv_head * stride_vch
        cache_lo = pid_s * keys_per_split
        cache_hi = tl.minimum(cache_lo + keys_per_split, cache_len)
        for start in range(cache_lo, cache_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < cache_hi
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(
                kc_base + offs_n[:, None] * stride_kcp + offs_d[None, :] * stride_kcd,
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                vc_base + offs_n[:, None] * stride_vcp + offs_d[None, :] * stride_vcd,
                mask=kv_mask,
                other=0.0,
            )
            scores = _dot(q, tl.trans(k), DOT_FP32) * qk_scale_log2
            scores = tl.where(n_valid[None, :], scores, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc, DOT_FP32)

        # Tree part (last split only): the ancestor mask decides which tree keys a row sees.
        kt_base = K_TREE + batch * stride_ktb + kv_head * stride_kth
        vt_base = V_TREE + batch * stride_vtb + kv_head * stride_vth
        mask_base = MASK + batch * stride_mb + node[:, None] * stride_mq
        tree_len = tl.where(pid_s == num_splits - 1, num_nodes, 0)
        for start in range(0, tree_len, BLOCK_N):
            offs_t = start + tl.arange(0, BLOCK_N)
            t_valid = offs_t < num_nodes
            kv_mask = t_valid[:, None] & d_valid[None, :]
            k = tl.load(
                kt_base + offs_t[:, None] * stride_ktn + offs_d[None, :] * stride_ktd,
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                vt_base + offs_t[:, None] * stride_vtn + offs_d[None, :] * stride_vtd,
                mask=kv_mask,
                other=0.0,
            )
            allowed = tl.load(
                mask_base + offs_t[None, :] * stride_mk,
                mask=row_valid[:, None] & t_valid[None, :],
                other=0,
            )
            scores = _dot(q, tl.trans(k), DOT_FP32) * qk_scale_log2
            scores = tl.where(allowed != 0, scores, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc, DOT_FP32)

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # rows with no key: zeros
        out_ptrs = (
            OUT
            + pid_s * stride_os
            + batch * stride_ob
            + q_head[:, None] * stride_oh
            + node[:, None] * stride_on
            + offs_d[None, :] * stride_od
        )
        out_mask = row_valid[:, None] & d_valid[None, :]
        if SPLIT:
            tl.store(out_ptrs, out, mask=out_mask)
            stat_offs = (
                pid_s * stat_split_stride
                + (batch * num_kv_heads * GROUP + q_head) * num_nodes
                + node
            )
            tl.store(STAT_M + stat_offs, m_i, mask=row_valid)
            tl.store(STAT_L + stat_offs, l_i, mask=row_valid)
        else:
            tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _combine_splits_kernel(
        PART_OUT,
        STAT_M,
        STAT_L,
        OUT,
        num_rows,
        num_splits,
        HEAD_DIM: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Merge per-split normalised outputs: weight split s by ``exp2(m_s - max_s m) * l_s``.

        ``PART_OUT`` is ``[S, rows, HEAD_DIM]``, ``STAT_*`` are ``[S, rows]`` and ``OUT`` is the
        contiguous ``[rows, HEAD_DIM]`` result; a split that saw no key (``l_s = 0``) weighs 0.
        """
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_valid = rows < num_rows
        offs_d = tl.arange(0, BLOCK_D)
        tile_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
        tile_offs = rows[:, None] * HEAD_DIM + offs_d[None, :]

        m_max = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        for split in range(0, num_splits):
            m = tl.load(STAT_M + split * num_rows + rows, mask=row_valid, other=float("-inf"))
            m_max = tl.maximum(m_max, m)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)

        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        denom = tl.zeros([BLOCK_R], dtype=tl.float32)
        for split in range(0, num_splits):
            m = tl.load(STAT_M + split * num_rows + rows, mask=row_valid, other=float("-inf"))
            l_split = tl.load(STAT_L + split * num_rows + rows, mask=row_valid, other=0.0)
            weight = tl.where(l_split > 0.0, tl.exp2(m - m_safe) * l_split, 0.0)
            part = tl.load(
                PART_OUT + split * num_rows * HEAD_DIM + tile_offs, mask=tile_mask, other=0.0
            )
            acc += weight[:, None] * part
            denom += weight
        out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
        tl.store(OUT + tile_offs, out.to(OUT.dtype.element_ty), mask=tile_mask)


# --------------------------------------------------------------------------------------------
# Host wrapper
# --------------------------------------------------------------------------------------------


def _kernels_interpreted() -> bool:
    """True when the kernels above were built by Triton's CPU interpreter.

    ``TRITON_INTERPRET`` is read when ``@triton.jit`` runs (at import of this module), so the
    kernel object itself, not the current environment, is the truth.
    """
    return TRITON_AVAILABLE and type(_tree_attention_kernel).__name__ == "InterpretedFunction"


def _should_use_triton(device: torch.device, dtype: torch.dtype, use_triton: bool | None) -> bool:
    """Decide between the Triton kernel and the reference (see ``tree_attention``)."""
    if not TRITON_AVAILABLE:
        reason = "triton is not installed"
    elif device.type != "cuda" and not _kernels_interpreted():
        reason = "tensors are on CPU and TRITON_INTERPRET=1 was not set before import"
    elif dtype not in _SUPPORTED_DTYPES:
        reason = f"dtype {dtype} is not one of {_SUPPORTED_DTYPES}"
    else:
        reason = None
    if use_triton and reason is not None:
        raise RuntimeError(f"use_triton=True but the Triton kernel cannot run: {reason}")
    return reason is None if use_triton is None else use_triton


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (cached: the property query is not free)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _next_pow2(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def tree_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_tree: Tensor,
    v_tree: Tensor,
    tree_mask: Tensor,
    scale: float | None = None,
    use_triton: bool | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> Tensor:
    """Tree attention with the Triton kernel when it can run, else the PyTorch reference.

    Shapes and semantics are those of ``tree_attention_reference``. ``use_triton=None`` picks
    Triton for fp16/bf16/fp32 CUDA tensors (or CPU tensors when the module was imported under
    ``TRITON_INTERPRET=1``) and the reference otherwise; ``True`` insists on Triton (error if it
    cannot run), ``False`` forces the reference.

    ``block_m`` / ``block_n`` (query rows / keys per tile, powers of two >= 16) and
    ``num_splits`` (how many programs share one cache) override the heuristics below; tests use
    them to cover multi-block and split paths on small shapes.
    """
    _check_inputs(q, k_cache, v_cache, k_tree, v_tree, tree_mask)
    if not _should_use_triton(q.device, q.dtype, use_triton):
        return tree_attention_reference(q, k_cache, v_cache, k_tree, v_tree, tree_mask, scale)

    batch, num_q_heads, num_nodes, head_dim = q.shape
    num_kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    interpreted = _kernels_interpreted()

    rows_per_kv_head = group * num_nodes
    block_d = max(16, _next_pow2(head_dim))
    if interpreted:
        # Each interpreted program costs milliseconds: few programs, big tiles.
        default_m = min(128, max(16, _next_pow2(rows_per_kv_head)))
        default_n = min(128, max(16, _next_pow2(max(cache_len, num_nodes))))
    else:
        # 64 x 64 tiles with D <= 128 keep q, k, v and the accumulator in registers with 4 warps
        # on Ampere and Hopper; smaller trees shrink the row tile rather than pad it. Wider
        # elements (fp32) or heads (D = 256) halve the key tile so two pipeline stages of K and
        # V still fit in shared memory on GPUs with ~100 KB of it.
        default_m = min(64, max(16, _next_pow2(rows_per_kv_head)))
        default_n = 64 if block_d * q.element_size() <= 256 else 32
    num_warps = 8 if block_d >= 256 else 4
    block_m = block_m or default_m
    block_n = block_n or default_n
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")

    grid_rows = triton.cdiv(rows_per_kv_head, block_m)
    cache_blocks = triton.cdiv(cache_len, block_n)
    if num_splits is None:
        num_splits = 1
        if not interpreted and q.device.type == "cuda":
            # Few heads and a long cache leave most SMs idle: give each program >= 4 cache
            # blocks and aim for two waves of programs.
            programs = grid_rows * batch * num_kv_heads
            wanted = triton.cdiv(2 * _sm_count(q.device), programs)
            num_splits = max(1, min(wanted, cache_blocks // 4, 64))
    num_splits = max(1, min(num_splits, max(cache_blocks, 1)))
    keys_per_split = triton.cdiv(cache_blocks, num_splits) * block_n
    if cache_len > 0:
        num_splits = triton.cdiv(cache_len, keys_per_split)  # drop splits that would be empty
    split = num_splits > 1

    mask = tree_mask.view(torch.uint8)  # same bytes; Triton loads uint8 more portably than i1
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    stride_mb = 0 if mask.shape[0] == 1 else mask.stride(0)

    if split:
        target = torch.empty(
            (num_splits, batch, num_q_heads, num_nodes, head_dim),
            device=q.device,
            dtype=torch.float32,
        )
        stat_m = torch.empty((num_splits, batch * num_q_heads * num_nodes), device=q.device)
        stat_l = torch.empty_like(stat_m)
        out_strides = target.stride()
    else:
        target, stat_m, stat_l = out, out, out  # stats unused without SPLIT
        out_strides = (0, *out.stride())

    grid = (grid_rows, batch * num_kv_heads, num_splits)
    _tree_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_tree,
        v_tree,
        mask,
        target,
        stat_m,
        stat_l,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *k_tree.stride(),
        *v_tree.stride(),
        stride_mb,
        mask.stride(1),
        mask.stride(2),
        *out_strides,
        batch * num_q_heads * num_nodes,
        num_nodes,
        cache_len,
        num_kv_heads,
        keys_per_split,
        num_splits,
        scale * math.log2(math.e),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT=split,
        DOT_FP32=interpreted or q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=2,
    )
    if split:
        num_rows = batch * num_q_heads * num_nodes
        block_r = 64 if interpreted else 16
        _combine_splits_kernel[(triton.cdiv(num_rows, block_r),)](
            target,
            stat_m,
            stat_l,
            out,
            num_rows,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


# --------------------------------------------------------------------------------------------
# Tree mask from parent indices
# --------------------------------------------------------------------------------------------


def ancestor_mask(parents: Tensor) -> Tensor:
    """Bool ``[N, N]`` (or ``[B, N, N]`` for ``[B, N]`` parents): node i sees itself and its ancestors.

    ``parents[i]`` is the index of node i's parent, -1 for a child of the root (the last
    committed token, which lives in the KV cache and is seen by every node anyway). Built by
    doubling the reachability relation ``ceil(log2 N)`` times (matrix products, no host
    synchronisation), so it is cheap on the GPU inside a decoding loop. Its row sums are the node
    depths (1 for children of the root): a node's position id is the root's position + depth.
    """
    if parents.dim() not in (1, 2):
        raise ValueError(f"parents must be [N] or [B, N], got {tuple(parents.shape)}")
    num_nodes = parents.shape[-1]
    nodes = torch.arange(num_nodes, device=parents.device)
    reach = (parents.unsqueeze(-1) == nodes) | torch.eye(
        num_nodes, dtype=torch.bool, device=parents.device
    )
    reach = reach.float()
    # After k squarings, reach[i, j] covers ancestors up to 2**k steps up; depth <= N - 1.
    for _ in range(max(0, num_nodes - 2).bit_length()):
        reach = (torch.matmul(reach, reach) > 0).float()
    return reach > 0
