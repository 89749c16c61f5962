"""DFlash: a block-parallel drafter that drafts a whole block in one forward (DFlash, 2026).

EAGLE heads draft depth by depth, one drafter forward per tree level, so drafting cost grows with
depth. A DFlash drafter drafts B - 1 tokens at once: its input block is [anchor, MASK x (B - 1)]
at positions R .. R + B - 1 (R the root, the last committed token, whose target row is not yet
computed), attention inside the block is bidirectional, and every layer also attends to the
committed context through the target's own features: the hidden states of K target layers
(`target_layer_ids`, the target's feature layers) are concatenated, projected by ``fc`` and
normalised (``hidden_norm``), and each layer turns them into keys and values at their own
positions (context injection). Block slot i (1 .. B - 1) predicts the token at position R + i,
i.e. the draft at depth i; nothing in a block depends on the tokens drafted in it.

Fitting the one engine. The drafter state caches, per layer, the context keys/values of every
absorbed committed token, with the EAGLE alignment (`models.drafters.proposer`): absorbing token
t_j with the feature f_{j-1} writes context entry j - 1 (the block at root R then sees
f_0 .. f_{R-1}) and remembers t_j (the next block's anchor). `step` only absorbs (its logits are
empty: this drafter predicts from blocks, not from absorbed tokens); `proposer` returns a
`BlockProposer` that runs the block forward once and serves every tree policy from its slot rows,
so chain, static and dynamic trees, verification, GTO and Draft-OPD work unchanged.

Embeddings and the LM head are the frozen target's, shared (not saved): `bind_target` attaches
them (the decoder and the objectives call it). The head is restricted to a draft vocabulary
(``d2t``/``t2d``, as in EAGLE-3) unless ``draft_vocab_size`` equals the target's: on a CPU the
full 49k-row head over B - 1 slots would cost more than the rest of the block forward.

Layout. Parameter names follow the DFlash reference checkpoints (``layers.{i}.self_attn.*`` with
``q_norm``/``k_norm``, ``layers.{i}.mlp.*``, ``fc``, ``hidden_norm``, ``norm``) and the exported
config carries ``dflash_config`` (``block_size``, ``target_layer_ids`` in the reference's
numbering: decoder-layer indices, ours minus one, since ours index HF ``hidden_states`` where 0
is the embedding output). The MASK input is, by default, a learned vector (``mask_embedding``),
which no engine reads; with ``mask_token_id`` it is the frozen target's embedding row of that
token (the reference's choice: a token the target never says), and the folder is then the
layout vLLM (``method: dflash``) and llama.cpp (``draft-dflash``) load: an integer
``dflash_config.mask_token_id``, no ``d2t``/``t2d`` for the full vocabulary, and for a reduced
draft vocabulary its own ``lm_head.weight`` (the target's rows) beside ``d2t``
(`engine_layout_problems` says what keeps a drafter out of it). A further deviation, only with
``anchor_feature`` (no engine has it): ``anchor_fc``
fuses the anchor's embedding with the projected feature of the entry it was absorbed with
(f_{R-1} beside t_R, EAGLE's pairing), so the first slot, where a block drafter loses most
against an EAGLE head, sees the latest context feature in its own residual stream.

Why one file (~630 lines): one drafter, its layers and its block proposer (the decoder's seam);
the proposer reads the drafter's state layout, so they change together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_spec.models.drafters.base import Drafter, DrafterOutput, register_drafter
from lightning_spec.models.drafters.eagle3 import KVState, target_shaped_config
from lightning_spec.models.drafters.layers import (
    GatedMLP,
    RMSNorm,
    apply_rotary,
    attend_blocks,
    rotary,
)
from lightning_spec.models.layer_ids import FEATURE_LAYERS_KEY, engine_layer_keys
from lightning_spec.models.logits import tempered_log_softmax
from lightning_spec.models.vocab import (
    build_draft_vocab,
    draft_to_target_ids,
    draft_to_target_logprobs,
    target_to_draft,
    target_vocab_mask,
)

__all__ = ["BlockProposer", "DFlashDrafter", "DFlashState", "unused_token_id"]


@dataclass
class DFlashState:
    """Per-layer context keys/values of the absorbed tokens, those tokens [B, L], and (with
    ``anchor_feature``) their projected context rows [B, L, H]."""

    layers: list[KVState]
    tokens: Tensor | None = None
    context: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.tokens is None else int(self.tokens.shape[1])


class _TargetWeights:
    """The target's embedding and (draft-vocabulary) head weights, held by reference: never a
    parameter, never saved, never deep-copied (a frozen reference drafter shares them)."""

    def __init__(self, embedding: Tensor, head: Tensor, head_bias: Tensor | None) -> None:
        self.embedding, self.head, self.head_bias = embedding, head, head_bias

    def __deepcopy__(self, memo: dict) -> _TargetWeights:
        return self


class DFlashAttention(nn.Module):
    """Block queries over [context keys (cached), block keys], with per-head q/k norms."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config["num_key_value_heads"])
        self.head_dim = int(config["head_dim"])
        self.rope_theta = float(config.get("rope_theta", 10000.0))
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def keys_values(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated, normed keys and values [B, Hkv, T, D] of inputs x [B, T, H]."""
        batch, length, _ = x.shape
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        cos, sin = rotary(positions, self.head_dim, self.rope_theta, x.dtype)
        return apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward(
        self, x: Tensor, positions: Tensor, context: tuple[Tensor, Tensor] | None, mask: Tensor
    ) -> Tensor:
        """x [B, S, H] block inputs at `positions` [B, S]; mask [B|1, S, C + S]."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        cos, sin = rotary(positions, self.head_dim, self.rope_theta, x.dtype)
        q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)
        block = self.keys_values(x, positions)
        blocks = [block] if context is None else [context, block]
        out = attend_blocks(q, blocks, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer: attention (context-injected, bidirectional in the block) + MLP."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, int(config["intermediate_size"]))

    def forward(
        self, x: Tensor, positions: Tensor, context: tuple[Tensor, Tensor] | None, mask: Tensor
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@register_drafter
class DFlashDrafter(Drafter):
    """Block-parallel drafter over a target; see the module docstring."""

    drafter_type = "dflash"
    needs_features = True
    drafts_blocks = True

    def __init__(self, config: dict[str, Any]) -> None:
        config = dict(config)
        hidden = int(config["hidden_size"])
        config.setdefault("head_dim", hidden // int(config["num_attention_heads"]))
        config.setdefault("target_hidden_size", hidden)
        config.setdefault("draft_vocab_size", config["target_vocab_size"])
        config.setdefault("num_layers", 1)
        config.setdefault("block_size", 8)
        if not 1 <= int(config["num_layers"]) <= 8:
            raise ValueError(f"DFlash num_layers must be 1..8, got {config['num_layers']}")
        if int(config["block_size"]) < 2:
            raise ValueError(f"DFlash block_size must be >= 2, got {config['block_size']}")
        super().__init__(config)
        vocab, draft_vocab = int(config["target_vocab_size"]), int(config["draft_vocab_size"])
        num_features = len(config["target_layer_ids"])
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.fc = nn.Linear(num_features * int(config["target_hidden_size"]), hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)
        # learned MASK input, or (``mask_token_id``) the target's own row of that token, shared
        self.mask_embedding: nn.Parameter | None = None
        if config.get("mask_token_id") is None:
            self.mask_embedding = nn.Parameter(torch.zeros(hidden))
        elif not 0 <= int(config["mask_token_id"]) < vocab:
            raise ValueError(
                f"mask_token_id {config['mask_token_id']} is not a token of the target's "
                f"vocabulary [0, {vocab})"
            )
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(int(config["num_layers"])))
        self.norm = RMSNorm(hidden, eps)
        # ``anchor_feature``: the anchor slot reads the projected feature paired with its token
        # (f_{R-1} with t_R, EAGLE's own pairing) through ``anchor_fc`` on [embedding, context],
        # not only through attention. Initialised [I | 0] without drawing random numbers: it
        # starts as the plain anchor slot, and every other weight gets the init it would get
        # without it (a fair comparison from the same seed).
        self.anchor_fc: nn.Linear | None = None
        if config.get("anchor_feature"):
            self.anchor_fc = nn.utils.skip_init(nn.Linear, 2 * hidden, hidden, bias=False)
            with torch.no_grad():
                self.anchor_fc.weight.zero_()
                self.anchor_fc.weight[:, :hidden].copy_(torch.eye(hidden))
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer(
            "t2d",
            torch.ones(vocab, dtype=torch.bool)
            if draft_vocab == vocab
            else torch.zeros(vocab, dtype=torch.bool),
        )
        self._target: _TargetWeights | None = None

    @property
    def block_size(self) -> int:
        return int(self.config["block_size"])

    @property
    def anchor_feature(self) -> bool:
        return self.anchor_fc is not None

    @property
    def draft_vocab_size(self) -> int:
        return int(self.config["draft_vocab_size"])

    @property
    def mask_token_id(self) -> int | None:
        """The token whose (frozen, target) embedding is the MASK input; None: learned."""
        token = self.config.get("mask_token_id")
        return None if token is None else int(token)

    def engine_layout_problems(self) -> list[str]:
        """Why vLLM and llama.cpp cannot serve this drafter's folder (empty: they can)."""
        problems = []
        if self.mask_token_id is None:
            problems.append(
                "its MASK input is a learned vector, and the engines embed a mask token: train "
                "with mask_token_id (e.g. 'auto') to get the layout they load"
            )
        if self.anchor_fc is not None:
            problems.append("anchor_feature: no engine has the anchor projection (anchor_fc)")
        return problems

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(
        cls,
        target: Any,
        *,
        block_size: int = 8,
        num_layers: int = 1,
        draft_vocab_size: int | None = None,
        token_counts: Tensor | None = None,
        intermediate_size: int | None = None,
        anchor_feature: bool = False,
        mask_token_id: int | str | None = None,
        seed: int = 0,
    ) -> DFlashDrafter:
        """A fresh drafter sized like `target` (a TargetModel), bound to its weights.

        `mask_token_id`: None learns the MASK vector; an id (or ``"auto"``: `unused_token_id`)
        makes the MASK the target's embedding of that token, the layout engines load.
        """
        vocab = target.vocab_size
        config = {
            **target_shaped_config(
                target, draft_vocab_size=draft_vocab_size, intermediate_size=intermediate_size
            ),
            "num_layers": int(num_layers),
            "block_size": int(block_size),
        }
        if anchor_feature:
            config["anchor_feature"] = True
        if mask_token_id is not None:
            config["mask_token_id"] = (
                unused_token_id(target) if mask_token_id == "auto" else int(mask_token_id)
            )
        torch.manual_seed(seed)
        drafter = cls(config)
        with torch.no_grad():
            if drafter.mask_embedding is not None:
                nn.init.normal_(drafter.mask_embedding, std=0.02)
            if drafter.draft_vocab_size < vocab:
                counts = token_counts if token_counts is not None else torch.zeros(vocab)
                d2t, t2d = build_draft_vocab(counts, drafter.draft_vocab_size, target.eos_token_ids)
                drafter.d2t.copy_(d2t)
                drafter.t2d.copy_(t2d)
        drafter = drafter.to(target.dtype)
        drafter.bind_target(target)
        return drafter

    def bind_target(self, target: Any) -> None:
        """Share `target`'s input embeddings and LM head rows of the draft vocabulary."""
        embedding = target.input_embeddings().weight.detach()
        head_module = target.model.get_output_embeddings()
        if head_module is None:
            raise ValueError("DFlash shares the target's LM head, and this target has none")
        if embedding.shape[0] < self.target_vocab_size:
            raise ValueError(
                f"the target embeds {embedding.shape[0]} tokens, the drafter maps onto "
                f"{self.target_vocab_size}: another tokenizer"
            )
        head = head_module.weight.detach()
        bias = getattr(head_module, "bias", None)
        bias = None if bias is None else bias.detach()
        if self.draft_vocab_size < self.target_vocab_size:
            rows = draft_to_target_ids(self.d2t).to(head.device)
            head = head.index_select(0, rows)
            bias = None if bias is None else bias.index_select(0, rows)
        self._target = _TargetWeights(embedding, head, bias)

    def _weights(self) -> _TargetWeights:
        if self._target is None:
            raise RuntimeError(
                "DFlashDrafter shares the target's embeddings and LM head: call "
                "drafter.bind_target(target) first (the decoder and the objectives do)"
            )
        return self._target

    # ------------------------------------------------------------------ state
    def new_state(self, batch_size: int = 1) -> DFlashState:
        return DFlashState([KVState() for _ in self.layers])

    def state_length(self, state: DFlashState) -> int:
        return state.length

    def truncate_state(self, state: DFlashState, length: int) -> None:
        for layer in state.layers:
            layer.truncate(length)
        if state.tokens is not None:
            state.tokens = state.tokens[:, :length]
        if state.context is not None:
            state.context = state.context[:, :length]

    def keep_state_entries(
        self, state: DFlashState, drop_last: int, keep: Tensor | list[int]
    ) -> None:
        for layer in state.layers:
            layer.keep(drop_last, keep)
        if state.tokens is not None and drop_last > 0:
            start = state.length - drop_last
            offsets = torch.as_tensor(keep, dtype=torch.long, device=state.tokens.device)
            state.tokens = torch.cat([state.tokens[:, :start], state.tokens[:, start + offsets]], 1)
            if state.context is not None:
                state.context = torch.cat(
                    [state.context[:, :start], state.context[:, start + offsets]], 1
                )

    # ------------------------------------------------------------------ compute
    def step(
        self,
        state: DFlashState,
        input_ids: Tensor,
        position_ids: Tensor,
        *,
        features: Tensor | None = None,
        hidden: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> DrafterOutput:
        """Absorb committed `input_ids` [B, T] (at `position_ids`) with the target `features`
        [B, T, F] of the token before each: context entries at positions - 1. Returns empty
        logits [B, T, 0] and the projected context [B, T, H] (blocks predict, not this)."""
        del mask
        if features is None or hidden is not None:
            raise ValueError("DFlashDrafter.step absorbs committed tokens: pass `features` only")
        expected = self.fc.in_features
        if features.shape[-1] != expected:
            raise ValueError(
                f"features have width {features.shape[-1]}, this drafter expects {expected} "
                f"(target layers {self.config['target_layer_ids']}): wrong target?"
            )
        context, entries = self.context_entries(features, position_ids)
        for (keys, values), cache in zip(entries, state.layers, strict=True):
            if cache.keys is None:
                cache.keys, cache.values = keys, values
            else:
                cache.keys = torch.cat([cache.keys, keys], dim=2)
                cache.values = torch.cat([cache.values, values], dim=2)
        tokens = input_ids.long()
        state.tokens = tokens if state.tokens is None else torch.cat([state.tokens, tokens], 1)
        if self.anchor_fc is not None:
            state.context = (
                context if state.context is None else torch.cat([state.context, context], 1)
            )
        return DrafterOutput(logits=context.new_zeros(*input_ids.shape, 0), hidden=context)

    def context_entries(
        self, features: Tensor, position_ids: Tensor
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """What absorbing tokens at `position_ids` [B, T] with `features` [B, T, F] adds: the
        projected context rows [B, T, H] and each layer's keys and values [B, Hkv, T, D] at the
        entries' positions (position_ids - 1). `step` and the exported context graph run it."""
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        positions = position_ids - 1
        return context, [layer.self_attn.keys_values(context, positions) for layer in self.layers]

    def draft_block(
        self,
        state: DFlashState,
        root_positions: Tensor,
        *,
        context_lengths: Tensor | None = None,
        batch_size: int | None = None,
    ) -> Tensor:
        """Logits [B, block_size - 1, V_draft] of the draft slots 1 .. B - 1 of B blocks.

        Block b is anchored at its root: the last absorbed token it may see (entry
        ``context_lengths[b] - 1``, or the state's last entry), at ``root_positions[b]``.
        One forward, whatever the block size; the state is not changed.
        """
        if state.tokens is None:
            raise RuntimeError("draft_block needs absorbed tokens (the root is the last one)")
        weights = self._weights()
        roots = root_positions.reshape(-1).long()
        batch = batch_size or int(roots.shape[0])
        device = roots.device
        length = state.length
        if context_lengths is None:
            limits = torch.full((batch,), length, dtype=torch.long, device=device)
            visible = torch.ones(batch, length, dtype=torch.bool, device=device)
        else:
            limits = context_lengths.reshape(-1).long().to(device)
            visible = torch.arange(length, device=device).unsqueeze(0) < limits.unsqueeze(1)
        last = (limits - 1).unsqueeze(1)  # the root's entry: its token t_R and f_{R-1}
        anchors = state.tokens.expand(batch, -1).gather(1, last).squeeze(1)  # batch-1 serves B
        dtype = self.fc.weight.dtype
        anchor = nn.functional.embedding(anchors, weights.embedding).to(dtype)  # [B, H]
        paired = None
        if self.anchor_fc is not None:
            if state.context is None:
                raise RuntimeError("an anchor_feature drafter's state lost its context rows")
            rows = state.context.expand(batch, -1, -1)
            paired = rows.gather(1, last.unsqueeze(-1).expand(-1, 1, rows.shape[-1])).squeeze(1)
        contexts = [None if c.keys is None else (c.keys, c.values) for c in state.layers]
        out = self.block_hidden(self.anchor_input(anchor, paired), roots, contexts, visible)
        return self.head_logits(out)

    def anchor_input(self, embedding: Tensor, paired: Tensor | None) -> Tensor:
        """The anchor slot's input [B, H]: the anchor token's embedding, fused with its paired
        projected context row through ``anchor_fc`` when the drafter has one."""
        if self.anchor_fc is None:
            return embedding
        if paired is None:
            raise ValueError("an anchor_feature drafter needs the anchor's paired context row")
        return self.anchor_fc(torch.cat([embedding, paired.to(embedding.dtype)], dim=-1))

    def block_hidden(
        self,
        anchor: Tensor,
        roots: Tensor,
        contexts: list[tuple[Tensor, Tensor] | None],
        visible: Tensor,
    ) -> Tensor:
        """The block forward: normed hidden states [B, block_size - 1, H] of the draft slots.

        The block [anchor [B, H], MASK x (B - 1)] sits at positions roots [B] .. + B - 1 and
        attends bidirectionally to itself and, in layer i, to ``contexts[i]`` (keys and values
        [B|1, Hkv, C, D], or None for no context) where ``visible`` [B, C] allows. The one copy
        of this computation: `draft_block` and the exported ONNX block graph both run it.
        """
        batch, width = anchor.shape[0], self.block_size  # symbolic under torch.export
        device = anchor.device
        masks = self.mask_vector().to(anchor.dtype).expand(batch, width - 1, -1)
        x = torch.cat([anchor.unsqueeze(1), masks], dim=1)  # [B, width, H]
        positions = roots.unsqueeze(1) + torch.arange(width, device=device)
        block = torch.ones(batch, width, width, dtype=torch.bool, device=device)
        mask = torch.cat([visible.unsqueeze(1).expand(-1, width, -1), block], dim=-1)
        for layer, context in zip(self.layers, contexts, strict=True):
            x = layer(x, positions, context, mask)
        return self.norm(x[:, 1:])

    def mask_vector(self) -> Tensor:
        """The MASK slots' input [H]: the learned vector, or the target's mask-token row."""
        if self.mask_embedding is not None:
            return self.mask_embedding
        return self._weights().embedding[int(self.config["mask_token_id"])]

    def head_logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary logits of slot hidden states, through the target's (shared) head."""
        weights = self._weights()
        return nn.functional.linear(
            hidden, weights.head.to(hidden.dtype), _cast(weights.head_bias, hidden)
        )

    def proposer(
        self,
        state: DFlashState,
        root_logits: Tensor,
        root_hidden: Tensor,
        root_positions: Tensor,
        *,
        temperature: float = 0.0,
        context_lengths: Tensor | None = None,
    ) -> BlockProposer:
        """A `BlockProposer` (one block forward serves the whole tree); the root rows the
        engine passes are unused (a block predicts its own depth-1 slot)."""
        del root_logits, root_hidden
        return BlockProposer(
            self, state, root_positions, temperature=temperature, context_lengths=context_lengths
        )

    def sequence_proposer(
        self,
        input_ids: Tensor,
        root_positions: Tensor,
        *,
        features: Tensor | None = None,
        temperature: float = 0.0,
    ) -> BlockProposer:
        """B blocks rooted at `root_positions` of one teacher-forced sequence (GTO, Draft-OPD,
        block SFT): one absorbing pass, then one block forward for all B roots."""
        return BlockProposer.from_sequence(
            self, input_ids, root_positions, features=features, temperature=temperature
        )

    # ------------------------------------------------------------------ vocabulary
    def to_target(self, logprobs: Tensor) -> Tensor:
        return draft_to_target_logprobs(logprobs, self.d2t, self.target_vocab_size)

    def target_to_draft_ids(self, target_ids: Tensor) -> Tensor:
        return target_to_draft(target_ids, self.d2t, self.target_vocab_size)

    # ------------------------------------------------------------------ persistence
    def export_config(self) -> dict[str, Any]:
        """Our config plus the reference layout's keys (see the module docstring)."""
        config = dict(self.config)
        learned = self.mask_token_id is None
        config.update(
            {
                "architectures": ["DFlashDraftModel"],
                "model_type": "qwen3",
                "vocab_size": self.target_vocab_size,
                "num_hidden_layers": int(self.config["num_layers"]),
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "torch_dtype": str(self.fc.weight.dtype).replace("torch.", ""),
                **{k: v for k, v in engine_layer_keys(self.config["target_layer_ids"]).items()
                   if k in (FEATURE_LAYERS_KEY, "target_layer_ids")},  # fmt: skip
                "layer_types": ["full_attention"] * int(self.config["num_layers"]),
                "dflash_config": {
                    "block_size": self.block_size,
                    "target_layer_ids": [int(i) - 1 for i in self.config["target_layer_ids"]],
                    "mask_token_id": self.mask_token_id,
                    **({"mask_embedding": "learned (mask_embedding)"} if learned else {}),
                },
            }
        )
        return config

    def export_state_dict(self) -> dict[str, Tensor]:
        """The weights in the engines' layout: no vocabulary maps for the full vocabulary (vLLM
        would look for a mapping buffer it does not build), and a reduced vocabulary's own
        ``lm_head.weight`` (the bound target's rows) beside ``d2t``; ``t2d`` is rebuilt on load."""
        tensors = dict(self.state_dict())
        tensors.pop("t2d")
        if self.draft_vocab_size == self.target_vocab_size:
            tensors.pop("d2t")
        elif self._target is not None:
            tensors["lm_head.weight"] = self._target.head
        return tensors

    def load_exported_state_dict(self, tensors: dict[str, Tensor]) -> None:
        """Load `export_state_dict`'s tensors (or an older folder's, which held ``t2d``)."""
        tensors = dict(tensors)
        tensors.pop("lm_head.weight", None)  # the target's rows: bind_target shares them
        if "d2t" not in tensors:
            if self.draft_vocab_size != self.target_vocab_size:
                raise ValueError("a reduced-vocabulary DFlash folder without d2t")
            tensors["d2t"] = torch.zeros_like(self.d2t)
        if "t2d" not in tensors:
            tensors["t2d"] = target_vocab_mask(tensors["d2t"], self.target_vocab_size)
        self.load_state_dict(tensors)

    @classmethod
    def from_config_dict(cls, config: dict[str, Any]) -> DFlashDrafter:
        config = dict(config)
        config.setdefault("target_vocab_size", config.get("vocab_size"))
        dflash = config.get("dflash_config") or {}
        if FEATURE_LAYERS_KEY in config:
            config["target_layer_ids"] = [int(i) for i in config[FEATURE_LAYERS_KEY]]
        elif "target_layer_ids" in dflash:  # the reference layout: decoder-layer numbering
            config["target_layer_ids"] = [int(i) + 1 for i in dflash["target_layer_ids"]]
        config.setdefault("block_size", dflash.get("block_size", 8))
        if dflash.get("mask_token_id") is not None:
            config.setdefault("mask_token_id", int(dflash["mask_token_id"]))
        config.setdefault("num_layers", config.get("num_hidden_layers", 1))
        keep = {
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "target_hidden_size", "target_vocab_size",
            "draft_vocab_size", "target_layer_ids", "target_model", "max_position_embeddings",
            "target_fingerprint", "training", "num_layers", "block_size", "anchor_feature",
            "mask_token_id",
        }  # fmt: skip
        return cls({k: v for k, v in config.items() if k in keep})


def unused_token_id(target: Any) -> int:
    """A token the target never says, whose embedding row can be the MASK input.

    The reference picks a padded embedding row beyond the tokenizer (Qwen3's 151669); without one,
    the highest added special token that is not a begin/end/pad/unknown token (SmolLM2:
    ``<empty_output>``, 16).
    """
    tokenizer = getattr(target, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("mask_token_id 'auto' reads the target's tokenizer; this target has none")
    rows = int(target.input_embeddings().weight.shape[0])
    if len(tokenizer) < min(rows, target.vocab_size):
        return len(tokenizer)  # the first padded row
    reserved = set(tokenizer.all_special_ids)
    added = sorted(
        i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i not in reserved and i < rows
    )
    if not added:
        raise ValueError(
            "mask_token_id 'auto' found no padded embedding row and no spare special token: "
            "pass a token id the target never generates"
        )
    return int(added[-1])


def _cast(tensor: Tensor | None, like: Tensor) -> Tensor | None:
    return None if tensor is None else tensor.to(like.dtype)


class BlockProposer:
    """The drafting seam for block drafters: `root` / `expand` from one block forward.

    A node at depth d gets the log-probs of slot d + 1 whatever its token and parent (the slots
    are conditionally independent given the context), so every tree policy works and the q rows
    the sampling verifier reads are exactly the rows the nodes were drawn from or ranked by.
    Trees deeper than the block (depth > block_size - 1) are refused.
    """

    normalized = True

    def __init__(
        self,
        drafter: DFlashDrafter,
        state: DFlashState,
        root_positions: Tensor,
        *,
        temperature: float = 0.0,
        context_lengths: Tensor | None = None,
    ) -> None:
        self.drafter = drafter
        self.state = state
        self.temperature = float(temperature)
        self.root_positions = root_positions.reshape(-1).long()
        self.batch_size = int(self.root_positions.shape[0])
        self.slot_logits = drafter.draft_block(
            state, self.root_positions, context_lengths=context_lengths
        )  # [B, S, V_draft]
        self.slots = int(self.slot_logits.shape[1])
        self.hidden: Tensor | None = None

    @classmethod
    def from_sequence(
        cls,
        drafter: DFlashDrafter,
        input_ids: Tensor,
        root_positions: Tensor,
        *,
        features: Tensor | None = None,
        temperature: float = 0.0,
    ) -> BlockProposer:
        """B blocks rooted at `root_positions` [B] of ONE sequence `input_ids` [1, L]."""
        from lightning_spec.models.drafters.proposer import absorb

        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError("from_sequence takes one sequence: input_ids [1, L]")
        if features is None:
            raise ValueError("a DFlash drafter needs the target features of the sequence")
        roots = root_positions.reshape(-1).long().to(input_ids.device)
        length = int(input_ids.shape[1])
        if bool((roots < 1).any()) or bool((roots >= length).any()):
            raise ValueError(f"root positions must lie in [1, {length})")
        state = drafter.new_state(1)
        absorb(drafter, state, input_ids[:, 1:], 1, features[:, : length - 1])
        return cls(drafter, state, roots, temperature=temperature, context_lengths=roots)

    # ------------------------------------------------------------------ the policy protocol
    def root(self) -> Tensor:
        """[B, V] log-probs of the depth-1 tokens (slot 1)."""
        return self._logprobs(self.slot_logits[:, 0])

    def expand(self, trees: Any, nodes: Tensor) -> Tensor:
        """[B, k, V] log-probs of the children of `nodes` [B, k]: slot depth + 1 of each."""
        depth = torch.take_along_dim(trees.depth.to(nodes.device), nodes, dim=1)
        return self._logprobs(self._slot_rows(depth))

    def finish(self) -> None:
        """Nothing to roll back: a block forward never writes the drafter state."""

    # ------------------------------------------------------------------ re-scoring
    def path_logprobs(self, paths: Tensor, lengths: Tensor) -> Tensor:
        """[B, l] log q of each path token (0 beyond `lengths` [B]); slot j + 1 scores token j."""
        batch, width = paths.shape
        device = self.slot_logits.device
        if width == 0:
            return torch.zeros(batch, 0, device=device)
        rows = self.path_rows(paths[:, :-1].to(device))
        values = rows.gather(2, paths.to(device).unsqueeze(-1)).squeeze(-1)
        valid = torch.arange(width, device=device).unsqueeze(0) < lengths.to(device).unsqueeze(1)
        return torch.where(valid, values, torch.zeros_like(values))

    def path_rows(self, paths: Tensor, *, draft_space: bool = False) -> Tensor:
        """[B, l + 1, V] the rows along each path (row j = slot j + 1), as
        `DrafterProposer.path_rows`; paths longer than the block are refused."""
        width = int(paths.shape[1])
        depth = torch.arange(width + 1, device=self.slot_logits.device).expand(self.batch_size, -1)
        rows = self._slot_rows(depth)
        return tempered_log_softmax(rows, self.temperature) if draft_space else self._logprobs(rows)

    # ------------------------------------------------------------------ helpers
    def _slot_rows(self, depth: Tensor) -> Tensor:
        """[B, k, V_draft] slot logits of nodes at `depth` [B, k] (predicting depth + 1)."""
        if bool((depth >= self.slots).any()):
            raise ValueError(
                f"the DFlash block drafts {self.slots} tokens: a tree or path deeper than that "
                f"(depth {int(depth.max()) + 1}) cannot be drafted; use a tree of depth <= "
                f"{self.slots}"
            )
        index = depth.long().unsqueeze(-1).expand(-1, -1, self.slot_logits.shape[-1])
        return torch.gather(self.slot_logits, 1, index)

    def _logprobs(self, logits: Tensor) -> Tensor:
        return self.drafter.to_target(tempered_log_softmax(logits, self.temperature))
