"""Greedy verification of a draft tree: which root-to-node path does the target accept?

Tree speculative decoding (SpecInfer, Miao et al. 2023; EAGLE-2, Li et al. 2024) scores every
draft node in one target forward pass; with greedy decoding the target's argmax at each node
then decides, in one pass over the tree, the longest draft path the target would have produced
itself. Doing that in Python costs a host round trip per node; this kernel does it in one launch
per batch with no host synchronisation, so the decoder can keep the whole step on the GPU.

Conventions (the decoder relies on them exactly):

* ``N`` draft nodes in topological order: ``draft_tokens[i]`` is node i's token and
  ``parents[i]`` its parent, ``-1`` for a child of the root, else an index ``< i``.
* ``target_argmax`` has ``N + 1`` entries: index 0 is the target's argmax at the root (it
  predicts depth-1 tokens), index ``i + 1`` the argmax at node i (it predicts i's children).
* Node i is accepted iff its parent is accepted (the root always is) and
  ``draft_tokens[i] == target_argmax[parents[i] + 1]``.
* The accepted path ends at the deepest accepted node, the lowest index among equally deep
  ones; ``path`` lists its nodes from depth 1 down and ``bonus`` is the target's argmax at that
  node (``target_argmax[0]`` when nothing is accepted): the token the target adds for free.

The file reads top to bottom: the PyTorch reference, the Triton kernel, the host wrappers.
"""

from __future__ import annotations

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
    "tree_verify",
    "tree_verify_batched",
    "tree_verify_batched_reference",
    "tree_verify_reference",
]


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def _verify_one(tokens: list[int], parents: list[int], target: list[int]) -> tuple[list[int], int]:
    """One tree in plain Python: (accepted path, bonus token). Validates the tree shape."""
    num_nodes = len(tokens)
    accepted = [False] * num_nodes
    depth = [0] * num_nodes
    best, best_depth = -1, 0
    for node in range(num_nodes):
        parent = parents[node]
        if not -1 <= parent < node:
            raise ValueError(f"parents[{node}] = {parent}: must be -1 or an earlier node index")
        parent_accepted = parent < 0 or accepted[parent]
        depth[node] = 1 if parent < 0 else depth[parent] + 1
        accepted[node] = parent_accepted and tokens[node] == target[parent + 1]
        if accepted[node] and depth[node] > best_depth:  # strict: ties keep the lowest index
            best, best_depth = node, depth[node]
    path = []
    node = best
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    return path, target[best + 1]


def _check_batched(draft_tokens: Tensor, parents: Tensor, target_argmax: Tensor) -> None:
    """Fail early with a readable message instead of an out-of-bounds read in a kernel."""
    if draft_tokens.dim() != 2 or parents.shape != draft_tokens.shape:
        raise ValueError(
            f"draft_tokens and parents must both be [B, N], got {tuple(draft_tokens.shape)} "
            f"and {tuple(parents.shape)}"
        )
    batch, num_nodes = draft_tokens.shape
    if tuple(target_argmax.shape) != (batch, num_nodes + 1):
        raise ValueError(
            f"target_argmax must be [B, N + 1] = {(batch, num_nodes + 1)}, "
            f"got {tuple(target_argmax.shape)}"
        )
    for name, tensor in (("draft_tokens", draft_tokens), ("parents", parents)):
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")


def tree_verify_batched_reference(
    draft_tokens: Tensor,
    parents: Tensor,
    target_argmax: Tensor,
    max_depth: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Eager definition of ``tree_verify_batched`` (a Python loop; it also validates parents).

    Returns ``(accept_length [B], path [B, max_depth] padded with -1, bonus [B])`` as int64 on
    the input's device; ``max_depth`` defaults to N, the deepest any tree of N nodes can be.
    """
    _check_batched(draft_tokens, parents, target_argmax)
    batch, num_nodes = draft_tokens.shape
    width = num_nodes if max_depth is None else max_depth
    device = draft_tokens.device
    accept_length = torch.zeros(batch, dtype=torch.long)
    path = torch.full((batch, width), -1, dtype=torch.long)
    bonus = torch.zeros(batch, dtype=torch.long)
    for row, (tokens, row_parents, target) in enumerate(
        zip(draft_tokens.tolist(), parents.tolist(), target_argmax.tolist(), strict=True)
    ):
        row_path, row_bonus = _verify_one(tokens, row_parents, target)
        if len(row_path) > width:
            raise ValueError(f"accepted path of length {len(row_path)} > max_depth={width}")
        accept_length[row] = len(row_path)
        path[row, : len(row_path)] = torch.tensor(row_path, dtype=torch.long)
        bonus[row] = row_bonus
    return accept_length.to(device), path.to(device), bonus.to(device)


def tree_verify_reference(
    draft_tokens: Tensor, parents: Tensor, target_argmax: Tensor
) -> tuple[int, Tensor, int]:
    """Single-tree reference: ``(accept_length, path [accept_length], bonus_token)``."""
    path, bonus = _verify_one(draft_tokens.tolist(), parents.tolist(), target_argmax.tolist())
    return len(path), torch.tensor(path, dtype=torch.long, device=draft_tokens.device), bonus


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------

if TRITON_AVAILABLE:

    @triton.jit
    def _tree_verify_kernel(
        TOKENS,
        PARENTS,
        TARGET,
        ACCEPT_LENGTH,
        PATH,
        BONUS,
        num_nodes,
        path_width,
        stride_tok_b,
        stride_tok_n,
        stride_par_b,
        stride_par_n,
        stride_tgt_b,
        stride_tgt_n,
        stride_path_b,
        BLOCK_N: tl.constexpr,
        NUM_JUMPS: tl.constexpr,
    ):
        """One program per tree: pointer jumping in registers, then a walk up the winner's path.

        Invariant after round k: ``up[i]`` is the ancestor ``2**k`` steps above node i (-1 past
        the root), and ``mismatches[i]`` / ``depth[i]`` count the mismatching nodes / all nodes
        on the path from i up to, not including, ``up[i]``. ``NUM_JUMPS = log2(BLOCK_N)`` rounds
        reach the root from any node, so a node is accepted iff it has no mismatch on its path.
        """
        row = tl.program_id(0)
        nodes = tl.arange(0, BLOCK_N)
        valid = nodes < num_nodes
        parent_ptrs = PARENTS + row * stride_par_b
        parent = tl.load(parent_ptrs + nodes * stride_par_n, mask=valid, other=-1).to(tl.int32)
        token = tl.load(TOKENS + row * stride_tok_b + nodes * stride_tok_n, mask=valid, other=0)
        # The target's argmax at a node's parent predicts that node: index parent + 1.
        predicted = tl.load(
            TARGET + row * stride_tgt_b + (parent + 1) * stride_tgt_n, mask=valid, other=0
        )
        mismatches = ((token != predicted) | (~valid)).to(tl.int32)  # padding never accepted
        depth = tl.full([BLOCK_N], 1, dtype=tl.int32)
        up = parent
        for _ in tl.static_range(NUM_JUMPS):
            has_up = up >= 0
            safe_up = tl.where(has_up, up, 0)
            mismatches += tl.where(has_up, tl.gather(mismatches, safe_up, axis=0), 0)
            depth += tl.where(has_up, tl.gather(depth, safe_up, axis=0), 0)
            up = tl.where(has_up, tl.gather(up, safe_up, axis=0), -1)

        # Deepest accepted node, lowest index on ties: maximise depth * BLOCK_N + (BLOCK_N-1-i).
        accepted = valid & (mismatches == 0)
        key = tl.where(accepted, depth * BLOCK_N + (BLOCK_N - 1 - nodes), -1)
        best_key = tl.max(key, axis=0)
        length = tl.where(best_key >= 0, best_key // BLOCK_N, 0)
        best = tl.where(best_key >= 0, BLOCK_N - 1 - best_key % BLOCK_N, -1)

        tl.store(ACCEPT_LENGTH + row, length.to(tl.int64))
        tl.store(BONUS + row, tl.load(TARGET + row * stride_tgt_b + (best + 1) * stride_tgt_n))
        # The path is short (the tree's depth): walking up the read-only parents is cheap.
        node = best.to(tl.int64)
        for step in range(0, length):
            slot = length - 1 - step
            tl.store(PATH + row * stride_path_b + slot, node, mask=slot < path_width)
            node = tl.load(parent_ptrs + node * stride_par_n).to(tl.int64)


# --------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------


def _kernels_interpreted() -> bool:
    """True when ``_tree_verify_kernel`` was built by Triton's CPU interpreter.

    ``TRITON_INTERPRET`` is read when ``@triton.jit`` runs (at import of this module), so the
    kernel object itself, not the current environment, is the truth.
    """
    return TRITON_AVAILABLE and type(_tree_verify_kernel).__name__ == "InterpretedFunction"


def _should_use_triton(device: torch.device, use_triton: bool | None) -> bool:
    """``None``: Triton when it can run here; ``True``: Triton or an error; ``False``: reference."""
    runnable = TRITON_AVAILABLE and (device.type == "cuda" or _kernels_interpreted())
    if use_triton is None:
        return runnable
    if use_triton and not runnable:
        reason = (
            "triton is not installed"
            if not TRITON_AVAILABLE
            else "tensors are on CPU and TRITON_INTERPRET=1 was not set before import"
        )
        raise RuntimeError(f"use_triton=True but the Triton kernel cannot run: {reason}")
    return use_triton


def tree_verify_batched(
    draft_tokens: Tensor,
    parents: Tensor,
    target_argmax: Tensor,
    max_depth: int | None = None,
    use_triton: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy acceptance for B trees of N nodes each (conventions in the module docstring).

    Args:
        draft_tokens: ``[B, N]`` integer tokens of the draft nodes.
        parents: ``[B, N]`` parent indices (-1 = child of the root, else ``< i``).
        target_argmax: ``[B, N + 1]`` target argmax at the root then at each node.
        max_depth: width of the returned path; N by default (never too small). The Triton
            path does not check it: a narrower width silently truncates longer paths.
        use_triton: ``None`` picks Triton on CUDA (or under ``TRITON_INTERPRET=1``) and the
            reference otherwise; ``True`` insists on Triton; ``False`` forces the reference.

    Returns:
        ``(accept_length [B], path [B, max_depth] padded with -1, bonus [B])``, int64, on the
        input's device. The Triton path never synchronises with the host and does not validate
        ``parents``; the reference does.
    """
    _check_batched(draft_tokens, parents, target_argmax)
    if not _should_use_triton(draft_tokens.device, use_triton):
        return tree_verify_batched_reference(draft_tokens, parents, target_argmax, max_depth)

    batch, num_nodes = draft_tokens.shape
    width = num_nodes if max_depth is None else max_depth
    device = draft_tokens.device
    accept_length = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.full((batch, width), -1, dtype=torch.long, device=device)
    bonus = torch.zeros(batch, dtype=torch.long, device=device)
    if batch == 0:
        return accept_length, path, bonus
    if num_nodes == 0:
        return accept_length, path, target_argmax[:, 0].to(torch.long)

    target = target_argmax.to(draft_tokens.dtype)  # compare tokens in one integer type
    block_n = max(16, 1 << (num_nodes - 1).bit_length())
    _tree_verify_kernel[(batch,)](
        draft_tokens,
        parents,
        target,
        accept_length,
        path,
        bonus,
        num_nodes,
        width,
        *draft_tokens.stride(),
        *parents.stride(),
        *target.stride(),
        path.stride(0),
        BLOCK_N=block_n,
        NUM_JUMPS=(block_n - 1).bit_length(),
        # One warp holds a tree of up to a few hundred nodes; more only adds cross-warp traffic
        # to every gather.
        num_warps=1 if block_n <= 256 else 4,
    )
    return accept_length, path, bonus


def tree_verify(
    draft_tokens: Tensor,
    parents: Tensor,
    target_argmax: Tensor,
    use_triton: bool | None = None,
) -> tuple[int, Tensor, int]:
    """Greedy acceptance for one tree: ``(accept_length, path [accept_length], bonus_token)``.

    ``draft_tokens`` and ``parents`` are ``[N]``, ``target_argmax`` is ``[N + 1]``; ``path``
    holds node indices from depth 1 down, on the input's device. Reading the two ints back
    synchronises with the host once, which the decoder needs anyway to trim its KV cache.
    """
    accept_length, path, bonus = tree_verify_batched(
        draft_tokens.unsqueeze(0),
        parents.unsqueeze(0),
        target_argmax.unsqueeze(0),
        use_triton=use_triton,
    )
    length = int(accept_length[0])
    return length, path[0, :length], int(bonus[0])
