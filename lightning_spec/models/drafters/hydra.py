"""Hydra: sequentially dependent draft heads (Ankner et al. 2024), as used by OnlineSpec.

Medusa heads guess each future token independently from the target's hidden state; Hydra heads
are sequentially dependent: head k reads what head k-1 produced and the embedding of the token it
drafted, so a tree branch is conditioned on its own earlier tokens. Here:

* head 0 reads the target's fused features of the token before the input (the same features an
  EAGLE-3 head reads, projected by ``fc``) and the input token's embedding: at a committed root it
  predicts the depth-1 draft;
* head k >= 1 reads its parent node's output hidden state and the node token's embedding: a node
  at draft depth k predicts depth k + 1 (`draft_step` picks the head by depth; depths beyond the
  last head reuse it);
* every head is a residual gated MLP over [norm(embedding), norm(hidden)]; no attention, so the
  drafter state is only a length (nothing to cache, truncation is free).

Vocabulary, embeddings (shared with the target, frozen), the reduced draft vocabulary, ``fc``,
the final norm and the LM head are the EAGLE-3 head's (`Eagle3Drafter`), so Hydra folders load,
train (`SFT(drafter_type="hydra")`: the TTT unroll drafts depth k with head k) and decode
through the same code. The folder is ours (no SGLang/vLLM layout exists for these heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_spec.models.drafters.base import DrafterOutput, register_drafter
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.layers import GatedMLP, RMSNorm

__all__ = ["HydraDrafter", "HydraHead", "LengthState"]


@dataclass
class LengthState:
    """A Hydra drafter's state: how many entries it has absorbed (heads keep no cache)."""

    length: int = 0


class HydraHead(nn.Module):
    """hidden + MLP([norm(embedding), norm(hidden)])."""

    def __init__(self, hidden: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.embed_norm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.mlp = GatedMLP(hidden, intermediate)

    def forward(self, embeds: Tensor, hidden: Tensor) -> Tensor:
        mixed = self.proj(torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1))
        return hidden + self.mlp(mixed)


@register_drafter
class HydraDrafter(Eagle3Drafter):
    """Sequentially dependent heads (see the module docstring)."""

    drafter_type = "hydra"
    needs_features = True

    def __init__(self, config: dict[str, Any]) -> None:
        config = dict(config)
        config.setdefault("num_heads", 4)
        super().__init__(config)
        del self.midlayer  # the EAGLE layer: Hydra has heads instead
        hidden = int(config["hidden_size"])
        eps = float(config.get("rms_norm_eps", 1e-6))
        intermediate = int(config["intermediate_size"])
        self.heads = nn.ModuleList(
            HydraHead(hidden, intermediate, eps) for _ in range(int(config["num_heads"]))
        )

    @classmethod
    def from_target(cls, target: Any, *, num_heads: int = 4, **kwargs: Any) -> HydraDrafter:  # type: ignore[override]
        """A fresh Hydra drafter sized like `target` (keyword arguments as `Eagle3Drafter`)."""
        drafter = super().from_target(target, **kwargs)
        if int(drafter.config["num_heads"]) != num_heads:
            config = dict(drafter.config, num_heads=num_heads)
            fresh = cls(config)
            fresh.load_state_dict(
                {k: v for k, v in drafter.state_dict().items() if not k.startswith("heads.")},
                strict=False,
            )
            drafter = fresh.to(target.dtype)
            drafter.bind_target(target)
        return drafter  # type: ignore[return-value]

    # ------------------------------------------------------------------ state
    def new_state(self, batch_size: int = 1) -> LengthState:
        return LengthState()

    def state_length(self, state: LengthState) -> int:
        return state.length

    def truncate_state(self, state: LengthState, length: int) -> None:
        state.length = min(state.length, int(length))

    def keep_state_entries(
        self, state: LengthState, drop_last: int, keep: Tensor | list[int]
    ) -> None:
        state.length = state.length - int(drop_last) + len(keep)

    # ------------------------------------------------------------------ compute
    def _inputs(
        self, input_ids: Tensor, features: Tensor | None, hidden: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        if (features is None) == (hidden is None):
            raise ValueError("HydraDrafter needs exactly one of `features` or `hidden`")
        if features is not None:
            if features.shape[-1] != self.fc.in_features:
                raise ValueError(
                    f"features have width {features.shape[-1]}, this drafter expects "
                    f"{self.fc.in_features} (target layers {self.config['target_layer_ids']})"
                )
            hidden = self.fuse(features)
        assert hidden is not None
        return self.embed(input_ids).to(hidden.dtype), hidden

    def _output(self, state: LengthState, out_hidden: Tensor) -> DrafterOutput:
        state.length += int(out_hidden.shape[1])
        return DrafterOutput(logits=self.lm_head(self.norm(out_hidden)), hidden=out_hidden)

    def step(
        self,
        state: LengthState,
        input_ids: Tensor,
        position_ids: Tensor,
        *,
        features: Tensor | None = None,
        hidden: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> DrafterOutput:
        """Committed tokens (head 0, from target features) or, with `hidden`, depth-1 nodes."""
        del position_ids, mask  # no attention: positions and masks do not matter
        embeds, hidden = self._inputs(input_ids, features, hidden)
        return self._output(state, self.heads[0](embeds, hidden))

    def draft_step(
        self,
        state: LengthState,
        input_ids: Tensor,
        position_ids: Tensor,
        *,
        depth: Tensor | int,
        hidden: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> DrafterOutput:
        """Nodes at draft `depth` [B, T] (or one int): head min(depth, last) for each."""
        del position_ids, mask
        embeds, hidden = self._inputs(input_ids, None, hidden)
        last = len(self.heads) - 1
        depth_t = torch.as_tensor(depth, device=input_ids.device).clamp(0, last)
        depth_t = depth_t.expand(input_ids.shape) if depth_t.dim() == 0 else depth_t
        out = torch.zeros_like(hidden)
        for head in torch.unique(depth_t).tolist():
            rows = depth_t == head
            out[rows] = self.heads[int(head)](embeds[rows], hidden[rows])
        return self._output(state, out)

    # ------------------------------------------------------------------ persistence
    def export_config(self) -> dict[str, Any]:
        return dict(self.config)

    @classmethod
    def from_config_dict(cls, config: dict[str, Any]) -> HydraDrafter:
        base = Eagle3Drafter.from_config_dict(config).config
        base["num_heads"] = int(config.get("num_heads", 4))
        return cls(base)
