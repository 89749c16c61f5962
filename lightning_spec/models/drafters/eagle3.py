"""EAGLE-3 drafter: fused target features + one decoder layer + a reduced draft vocabulary.

The target's hidden states of a low, a middle and a high layer are concatenated and mapped by a
bias-free `fc` to the hidden size. The single decoder layer (`midlayer`) reads
concat(norm(embedding(token)), norm(feature)); its output hidden state is fed back as the
feature of the next draft step (training-time test at training, tree expansion at decoding).
Parameter names and config keys follow the convention SGLang and vLLM load
(`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, `eagle_aux_hidden_state_layer_ids`).
Paper: EAGLE-3 (Li et al., 2025).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_spec.models.drafters.base import Drafter, DrafterOutput, register_drafter
from lightning_spec.models.drafters.layers import CachedAttention, GatedMLP, RMSNorm
from lightning_spec.models.fingerprint import cached_target_fingerprint
from lightning_spec.models.layer_ids import engine_layer_keys, feature_layers_of
from lightning_spec.models.vocab import (
    build_draft_vocab,
    draft_to_target_ids,
    draft_to_target_logprobs,
    target_to_draft,
)


@dataclass
class KVState:
    """A single-layer drafter cache: plain tensors, sliced to roll back.

    `keys`/`values` hold the cache of the state's own batch. When B > 1 rows are fed on top of
    a batch-1 cache (B draft trees over one teacher-forced sequence), the batch-1 part becomes
    a `shared` prefix every row attends without a copy, and the rows' own entries grow in
    `keys`/`values` (batch B); `truncate` to the shared length drops them again.
    """

    keys: Tensor | None = None  # [B, H_kv, L, D]
    values: Tensor | None = None
    shared: tuple[Tensor, Tensor] | None = None  # [1, H_kv, S, D] each

    @property
    def shared_length(self) -> int:
        return 0 if self.shared is None else int(self.shared[0].shape[2])

    @property
    def length(self) -> int:
        own = 0 if self.keys is None else int(self.keys.shape[2])
        return self.shared_length + own

    def share_for(self, batch: int) -> None:
        """Before feeding `batch` rows: a batch-1 cache becomes the shared prefix."""
        if self.keys is None or self.shared is not None or batch == self.keys.shape[0]:
            return
        if self.keys.shape[0] != 1:
            raise ValueError(
                f"the drafter state holds {self.keys.shape[0]} rows, the input {batch}: only a "
                "batch-1 state can be shared by several rows"
            )
        self.shared = (self.keys, self.values)
        self.keys = self.values = None

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions (roll back drafted entries)."""
        if self.shared is not None and length <= self.shared_length:
            keys, values = self.shared
            self.shared = None
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            return
        if self.keys is not None:
            own = length - self.shared_length
            self.keys = self.keys[:, :, :own]
            self.values = self.values[:, :, :own]

    def keep(self, drop_last: int, keep: Tensor | list[int]) -> None:
        """Drop the last `drop_last` positions except the offsets in `keep` (see models.cache)."""
        if self.keys is None or drop_last <= 0:
            return
        if self.shared is not None:
            raise ValueError("keep() on a shared drafter state: truncate it first")
        start = self.length - drop_last
        offsets = torch.as_tensor(keep, dtype=torch.long).cpu()
        index = torch.cat([torch.arange(start), start + offsets]).to(self.keys.device)
        self.keys = self.keys.index_select(2, index)
        self.values = self.values.index_select(2, index)


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer: attention over 2H inputs, residual on the feature stream."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = CachedAttention(
            input_size=2 * hidden,
            output_size=hidden,
            num_heads=int(config["num_attention_heads"]),
            num_kv_heads=int(config["num_key_value_heads"]),
            head_dim=int(config["head_dim"]),
            rope_theta=float(config.get("rope_theta", 10000.0)),
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, int(config["intermediate_size"]))

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        state: KVState,
        mask: Tensor | None,
    ) -> Tensor:
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        state.share_for(x.shape[0])
        attended, state.keys, state.values = self.self_attn(
            x, position_ids, state.keys, state.values, mask, shared=state.shared
        )
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@register_drafter
class Eagle3Drafter(Drafter):
    """EAGLE-3 head over a target; see the module docstring."""

    drafter_type = "eagle3"
    needs_features = True

    def __init__(self, config: dict[str, Any]) -> None:
        config = dict(config)
        hidden = int(config["hidden_size"])
        config.setdefault("head_dim", hidden // int(config["num_attention_heads"]))
        config.setdefault("target_hidden_size", hidden)
        config.setdefault("draft_vocab_size", config["target_vocab_size"])
        config.setdefault("target_layer_ids", [2, 2, 2])
        super().__init__(config)
        vocab = int(config["target_vocab_size"])
        draft_vocab = int(config["draft_vocab_size"])
        num_features = len(config["target_layer_ids"])
        # The target's input embeddings, shared (not saved): `bind_target` attaches them. A
        # folder written before sharing carries its own copy, kept here until bound.
        self._embedding: Tensor | None = None
        self.fc = nn.Linear(num_features * int(config["target_hidden_size"]), hidden, bias=False)
        # EAGLE-3.1: each target layer's hidden state normalised before the fusion layer, so
        # the scales of low, middle and high layers (up to 1e5 on some families) meet evenly
        self.feature_norms = (
            nn.ModuleList(
                RMSNorm(int(config["target_hidden_size"]), float(config.get("rms_norm_eps", 1e-6)))
                for _ in range(num_features)
            )
            if config.get("feature_norm")
            else None
        )
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(hidden, float(config.get("rms_norm_eps", 1e-6)))
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer(
            "t2d",
            torch.ones(vocab, dtype=torch.bool)
            if draft_vocab == vocab
            else torch.zeros(vocab, dtype=torch.bool),
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(
        cls,
        target: Any,
        *,
        draft_vocab_size: int | None = None,
        token_counts: Tensor | None = None,
        intermediate_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        seed: int = 0,
        feature_norm: bool = False,
    ) -> Eagle3Drafter:
        """A fresh head sized like `target` (a TargetModel), sharing its input embeddings.
        `feature_norm` gives the EAGLE-3.1 variant (per-layer norms before ``fc``).

        With `token_counts` the draft vocabulary keeps the most frequent ids (EOS always); the
        LM head starts from the target's own output rows for those ids, which gives an untrained
        head a sensible vocabulary prior.
        """
        config = {
            **target_shaped_config(
                target,
                draft_vocab_size=draft_vocab_size,
                intermediate_size=intermediate_size,
                num_attention_heads=num_attention_heads,
                num_key_value_heads=num_key_value_heads,
            ),
            "feature_norm": bool(feature_norm),
        }
        torch.manual_seed(seed)
        drafter = cls(config)
        vocab, draft_vocab = target.vocab_size, int(config["draft_vocab_size"])
        with torch.no_grad():
            if draft_vocab < vocab:
                counts = token_counts if token_counts is not None else torch.zeros(vocab)
                d2t, t2d = build_draft_vocab(counts, draft_vocab, target.eos_token_ids)
                drafter.d2t.copy_(d2t)
                drafter.t2d.copy_(t2d)
            head = target.model.get_output_embeddings()
            if head is not None:
                rows = draft_to_target_ids(drafter.d2t)
                drafter.lm_head.weight.copy_(head.weight[rows].float())
        drafter = drafter.to(target.dtype)
        drafter.bind_target(target)
        return drafter

    def bind_target(self, target: Any) -> None:
        """Share `target`'s input embeddings (frozen, never saved: a 262k-token vocabulary
        would otherwise put more parameters in every drafter folder than its layers hold)."""
        # The parameter itself (detached per use): when the target moves device, its `.data`
        # is swapped and the drafter follows.
        weight = target.input_embeddings().weight
        hidden = int(self.config["hidden_size"])
        if weight.shape[0] < self.target_vocab_size or weight.shape[1] != hidden:
            raise ValueError(
                f"the target embeds {weight.shape[0]} tokens of width {weight.shape[1]}, this "
                f"drafter maps onto {self.target_vocab_size} of width {hidden}: another target"
            )
        object.__setattr__(self, "_embedding", weight)  # not registered: never a parameter

    @property
    def has_embeddings(self) -> bool:
        """Whether `embed` can run: bound to a target, or an older folder's own copy."""
        return self._embedding is not None

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings [..., H] from the shared (target's) table."""
        if self._embedding is None:
            raise RuntimeError(
                f"{type(self).__name__} shares the target's input embeddings: call "
                "drafter.bind_target(target) first (the decoder, the objectives and export do)"
            )
        weight = self._embedding.detach()
        if weight.device != input_ids.device:
            weight = weight.to(input_ids.device)
        return torch.nn.functional.embedding(input_ids, weight)

    # ------------------------------------------------------------------ state
    def new_state(self, batch_size: int = 1) -> KVState:
        return KVState()

    def state_length(self, state: KVState) -> int:
        return state.length

    def truncate_state(self, state: KVState, length: int) -> None:
        state.truncate(length)

    def keep_state_entries(self, state: KVState, drop_last: int, keep: Tensor | list[int]) -> None:
        state.keep(drop_last, keep)

    # ------------------------------------------------------------------ compute
    def step(
        self,
        state: KVState,
        input_ids: Tensor,
        position_ids: Tensor,
        *,
        features: Tensor | None = None,
        hidden: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> DrafterOutput:
        if (features is None) == (hidden is None):
            raise ValueError("Eagle3Drafter.step needs exactly one of `features` or `hidden`")
        if features is not None:
            expected = self.fc.in_features
            if features.shape[-1] != expected:
                raise ValueError(
                    f"features have width {features.shape[-1]}, this drafter expects {expected} "
                    f"(target layers {self.config['target_layer_ids']}): wrong target?"
                )
            hidden = self.fuse(features)
        embeds = self.embed(input_ids).to(hidden.dtype)
        out_hidden = self.midlayer(embeds, hidden, position_ids, state, mask)
        logits = self.lm_head(self.norm(out_hidden))
        return DrafterOutput(logits=logits, hidden=out_hidden)

    def fuse(self, features: Tensor) -> Tensor:
        """Fused target features [..., K * H_target] -> drafter hidden [..., H]: ``fc``, after
        a per-layer RMSNorm of each layer's part when the drafter has ``feature_norm``."""
        features = features.to(self.fc.weight.dtype)
        if self.feature_norms is not None:
            parts = features.split(int(self.config["target_hidden_size"]), dim=-1)
            features = torch.cat([norm(x) for norm, x in zip(self.feature_norms, parts, strict=True)], -1)
        return self.fc(features)

    # ------------------------------------------------------------------ vocabulary
    @property
    def draft_vocab_size(self) -> int:
        return int(self.config["draft_vocab_size"])

    def to_target(self, logprobs: Tensor) -> Tensor:
        return draft_to_target_logprobs(logprobs, self.d2t, self.target_vocab_size)

    def target_to_draft_ids(self, target_ids: Tensor) -> Tensor:
        return target_to_draft(target_ids, self.d2t, self.target_vocab_size)

    # ------------------------------------------------------------------ persistence
    def export_config(self) -> dict[str, Any]:
        """Our config plus the keys SGLang/vLLM read from an EAGLE-3 folder."""
        config = dict(self.config)
        config.update(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "model_type": "llama",
                "vocab_size": self.target_vocab_size,
                "num_hidden_layers": 1,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "torch_dtype": str(self.fc.weight.dtype).replace("torch.", ""),
                # the trained feature layers, in each engine's numbering (layer_ids.py)
                **engine_layer_keys(self.config["target_layer_ids"]),
            }
        )
        return config

    def load_exported_state_dict(self, tensors: dict[str, Tensor]) -> None:
        """Load a folder's weights; an older folder's own ``embed_tokens`` copy is kept as the
        embedding table until `bind_target` shares the target's (the same frozen values)."""
        tensors = dict(tensors)
        own = tensors.pop("embed_tokens.weight", None)
        self.load_state_dict(tensors)
        if own is not None:
            self._embedding = own.to(self.fc.weight.device)

    @classmethod
    def from_config_dict(cls, config: dict[str, Any]) -> Eagle3Drafter:
        config = dict(config)
        config.setdefault("target_vocab_size", config.get("vocab_size"))
        layers = feature_layers_of(config)
        if layers is not None:
            config["target_layer_ids"] = layers
        keep = {
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "target_hidden_size",
            "target_vocab_size",
            "draft_vocab_size",
            "target_layer_ids",
            "target_model",
            "max_position_embeddings",
            "target_fingerprint",
            "training",
            "feature_norm",
        }
        return cls({k: v for k, v in config.items() if k in keep})


def target_shaped_config(
    target: Any,
    *,
    draft_vocab_size: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
) -> dict[str, Any]:
    """The config keys every feature-reading drafter takes from its target (a TargetModel):
    sizes, norms and rotary settings of its layers, vocabularies, feature layers, identity."""
    text = target.model.config
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    hidden = target.hidden_size
    heads = int(num_attention_heads or text.num_attention_heads)
    return {
        "hidden_size": hidden,
        "intermediate_size": int(intermediate_size or text.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(num_key_value_heads or text.num_key_value_heads),
        "head_dim": int(getattr(text, "head_dim", None) or hidden // heads),
        "rms_norm_eps": float(getattr(text, "rms_norm_eps", 1e-6)),
        "rope_theta": float(_rope_theta(text)),
        "target_hidden_size": hidden,
        "target_vocab_size": target.vocab_size,
        "draft_vocab_size": int(draft_vocab_size or target.vocab_size),
        "target_layer_ids": list(target.feature_layers),
        "target_model": target.name,
        "max_position_embeddings": int(getattr(text, "max_position_embeddings", 4096)),
        "target_fingerprint": cached_target_fingerprint(target),
    }


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        if isinstance(params, dict):
            theta = params.get("rope_theta") or (params.get("full_attention") or {}).get(
                "rope_theta"
            )
    return float(theta or 10000.0)
