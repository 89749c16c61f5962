"""Small transformer pieces drafters share: RMSNorm, rotary embeddings, cached attention, MLP.

Written here rather than borrowed from a transformers model class so the drafter's cache is a
pair of plain tensors: the decoder can roll it back by slicing, and ONNX export can pass it as
explicit inputs and outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, T, D] for integer `positions` [B, T] (Llama's half-rotation layout)."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [B, 1, T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class CachedAttention(nn.Module):
    """Grouped-query attention whose cache is a (keys, values) pair of tensors."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(input_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, output_size, bias=False)

    def forward(
        self,
        x: Tensor,
        position_ids: Tensor,
        past_keys: Tensor | None,
        past_values: Tensor | None,
        mask: Tensor | None,
        shared: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, In] -> (out [B, T, Out], keys, values) with keys/values = past + new.

        `shared` is an optional (keys, values) prefix of batch 1 that every row may attend
        (under `mask`, whose columns are shared + past + new) without being copied per row:
        B draft trees over one teacher-forced sequence cache (GTO's per-prefix trees).
        """
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary(position_ids, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if past_keys is not None:
            k = torch.cat([past_keys, k], dim=2)
            v = torch.cat([past_values, v], dim=2)
        if shared is not None:
            return self._attend_shared(q, k, v, shared, mask), k, v
        past = k.shape[2] - length
        if mask is None:
            mask = torch.ones(length, past + length, dtype=torch.bool, device=x.device)
            mask[:, past:] = torch.tril(mask[:, past:])
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
        groups = self.num_heads // self.num_kv_heads
        k_rep = k.repeat_interleave(groups, dim=1) if groups > 1 else k
        v_rep = v.repeat_interleave(groups, dim=1) if groups > 1 else v
        out = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask.unsqueeze(1))
        out = out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.o_proj(out), k, v

    def _attend_shared(
        self, q: Tensor, k: Tensor, v: Tensor, shared: tuple[Tensor, Tensor], mask: Tensor | None
    ) -> Tensor:
        """Attention over [shared prefix (batch 1), own keys (batch B)] by broadcasting matmuls."""
        if mask is None:
            raise ValueError("attention over a shared prefix needs an explicit mask")
        batch, _, length, dim = q.shape
        out = attend_blocks(q, [shared, (k, v)], mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * dim))


def attend_blocks(q: Tensor, blocks: list[tuple[Tensor, Tensor]], mask: Tensor) -> Tensor:
    """Grouped-query attention of q [B, Hq, T, D] over key/value blocks [B|1, Hkv, L_i, D].

    Blocks of batch 1 are broadcast to every row without a copy (a shared teacher-forced
    prefix, a drafter's context cache under B block queries). `mask` is bool [B|1, T, sum L_i]
    (True = attend). Returns [B, Hq, T, D].
    """
    batch, heads, length, dim = q.shape
    kv_heads = blocks[0][0].shape[1]
    groups = heads // kv_heads
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    qg = q.view(batch, kv_heads, groups, length, dim)
    scores = torch.cat([_per_head(qg, k.transpose(-1, -2)) for k, _ in blocks], dim=-1)
    scores = (scores * dim**-0.5).masked_fill(~mask[:, None, None], float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [B, Hkv, g, T, sum L]
    out = None
    start = 0
    for _, v in blocks:
        part = _per_head(weights[..., start : start + v.shape[2]], v)
        out = part if out is None else out + part
        start += v.shape[2]
    return out.reshape(batch, heads, length, dim)


def _per_head(x: Tensor, y: Tensor) -> Tensor:
    """x [B, Hkv, g, T, A] @ y [B|1, Hkv, A, C] -> [B, Hkv, g, T, C]. A batch-1 `y` (a shared
    prefix) is multiplied once per head with the B rows stacked, not broadcast: a broadcast
    matmul copies `y` B times (GTO's 128 trees over one 320-token prefix: 140 MB a call)."""
    if y.shape[0] == 1 and x.shape[0] > 1:
        batch, heads, groups, length, inner = x.shape
        rows = x.transpose(0, 1).reshape(heads, batch * groups * length, inner)
        out = torch.bmm(rows, y[0])  # [Hkv, B * g * T, C]
        return out.view(heads, batch, groups, length, -1).transpose(0, 1)
    return x @ y.unsqueeze(2)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
