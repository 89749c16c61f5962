"""A small independent causal LM as drafter (classic speculative decoding).

Any Hugging Face causal-LM config that shares the target's tokenizer works: the drafter reads no
target features and keeps its own KV cache. `from_target(target)` builds "self-drafting"
(the target drafting for itself), which must commit k+1 tokens on every chain step at T=0:
the plumbing check of the decoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_spec.models.cache import (
    cache_kwarg,
    cache_length,
    keep_cache_entries,
    truncate_cache,
)
from lightning_spec.models.drafters.base import Drafter, DrafterOutput, register_drafter
from lightning_spec.models.target import tree_mask_to_additive


@register_drafter
class StandaloneDrafter(Drafter):
    """Wraps `transformers.AutoModelForCausalLM`; config = {"lm_config": {...}, ...}."""

    drafter_type = "standalone"
    needs_features = False
    drafts_from_sequence = False
    """Its HF cache holds one context: B trees over one teacher-forced sequence (replay, GTO,
    Draft-OPD) are not supported; the decoder drafts it one tree at a time."""

    def __init__(self, config: dict[str, Any], model: torch.nn.Module | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = dict(config)
        if model is None:
            lm_config = dict(config["lm_config"])
            model_type = lm_config.pop("model_type")
            hf_config = AutoConfig.for_model(model_type, **lm_config)
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
        config["lm_config"] = model.config.to_diff_dict() | {"model_type": model.config.model_type}
        config.setdefault("target_vocab_size", int(model.config.vocab_size))
        super().__init__(config)
        self.lm = model

    @classmethod
    def from_model(cls, model: torch.nn.Module, target_name: str = "") -> StandaloneDrafter:
        """Use an existing causal LM (e.g. the target itself, or a smaller family member)."""
        return cls({"target_model": target_name}, model=model)

    def new_state(self, batch_size: int = 1) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.lm.config)

    def state_length(self, state: Any) -> int:
        return cache_length(state)

    def truncate_state(self, state: Any, length: int) -> None:
        truncate_cache(state, length)

    def keep_state_entries(self, state: Any, drop_last: int, keep: Tensor | list[int]) -> None:
        keep_cache_entries(state, drop_last, keep)

    def step(
        self,
        state: Any,
        input_ids: Tensor,
        position_ids: Tensor,
        *,
        features: Tensor | None = None,
        hidden: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> DrafterOutput:
        dtype = next(self.lm.parameters()).dtype
        attention = None if mask is None else tree_mask_to_additive(mask, dtype)
        outputs = self.lm(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention,
            use_cache=True,
            output_hidden_states=True,
            **cache_kwarg(self.lm, state),
        )
        return DrafterOutput(logits=outputs.logits, hidden=outputs.hidden_states[-1])

    def export_state_dict(self) -> dict[str, Tensor]:
        # Tied embeddings share storage; safetensors refuses shared tensors, so clone them.
        return {k: v.clone() for k, v in self.lm.state_dict().items()}

    def load_exported_state_dict(self, tensors: dict[str, Tensor]) -> None:
        missing, unexpected = self.lm.load_state_dict(tensors, strict=False)
        tied = getattr(self.lm, "_tied_weights_keys", None) or {}
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(
                f"drafter weights do not match: missing {missing}, unexpected {unexpected}"
            )
