"""The frozen target LLM, seen the way drafters and the decoder need it.

One forward returns logits, the fused hidden-state features an EAGLE-3 drafter reads (a low, a
middle and a high layer, concatenated), the last hidden state (Hydra heads read it) and the KV
cache. Tree verification needs explicit position ids and a 4D mask over cache + new tokens, so
both are first-class arguments. The model never has gradients: drafters train against it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_spec.models.cache import cache_kwarg, cache_length

log = logging.getLogger(__name__)

#: Name under which `lightning_spec.decoding.fast_path` registers the Triton tree attention.
TREE_ATTENTION_IMPL = "lightning_spec_tree"

# Cached tokens below which a GPU tree forward takes SDPA with the additive mask rather than the
# Triton tree kernel: below ~1k both take tens of microseconds and SDPA's one launch is cheaper
# (measured on two H200 hosts, experiments/cpu-speed/LOG.md). Under the interpreter (CPU) the kernel
# always runs, so the CPU tests exercise it.
KERNEL_MIN_CACHE_ON_GPU = 1024


def kernel_takes_tree_forward(past: int, on_gpu: bool, cache_all_visible: bool) -> bool:
    """Whether a tree forward goes to the Triton kernel: it assumes every new token sees the
    whole cache, and on a GPU it pays only past `KERNEL_MIN_CACHE_ON_GPU` cached tokens."""
    if not cache_all_visible:
        return False
    return not on_gpu or past >= KERNEL_MIN_CACHE_ON_GPU


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept 'bf16', 'float32', torch.float16, ... and return a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3 feature layers {2, L//2, L-3}, as indices into HF `hidden_states` (0 = embeddings).

    This is the convention SGLang and vLLM write into EAGLE-3 checkpoints; tiny models get the
    ids clamped into range, so a 2-layer test model still works (it may repeat a layer, which
    costs width but nothing else).
    """
    ids = [2, num_layers // 2, num_layers - 3]
    ids = [min(max(i, 1), num_layers) for i in ids]
    return ids


@dataclass
class TargetOutput:
    """What one target forward yields."""

    logits: Tensor  # [B, T, V]
    features: Tensor | None  # [B, T, len(feature_layers) * H] fused EAGLE-3 features
    last_hidden: Tensor  # [B, T, H] final (normed) hidden state
    cache: object | None  # transformers Cache holding past + these tokens


def tree_mask_to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask [B|1, q, k] (True = attend) -> additive float mask [B|1, 1, q, k].

    A bool 4D mask is right for sdpa but wrong for eager attention; the additive
    float form is read correctly by every attention implementation.
    """
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    if mask.dtype != torch.bool:
        raise TypeError("tree masks are boolean (True = may attend)")
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    additive.masked_fill_(~mask, torch.finfo(dtype).min)
    return additive.unsqueeze(1)


class TargetModel(nn.Module):
    """A frozen Hugging Face causal LM plus the feature taps drafters are trained on."""

    def __init__(
        self,
        model: nn.Module,
        feature_layers: Sequence[int] | None = None,
        tokenizer: object | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers: int = int(text_config.num_hidden_layers)
        self.hidden_size: int = int(text_config.hidden_size)
        self.vocab_size: int = int(text_config.vocab_size)
        layers = list(feature_layers) if feature_layers else default_feature_layers(self.num_layers)
        for layer in layers:
            if not 0 <= layer <= self.num_layers:
                raise ValueError(
                    f"feature layer {layer} out of range for a {self.num_layers}-layer target "
                    "(indices count HF hidden_states: 0 = embeddings)"
                )
        self.feature_layers: list[int] = layers
        self.tokenizer = tokenizer
        self.name = name or getattr(config, "_name_or_path", "") or type(model).__name__
        self.train(False)

    def __getstate__(self) -> dict:
        """Pickle without transformers' output-capturing forward hooks (local functions that
        cannot be pickled; installed on the first forward). The copy re-installs them on its own
        first forward; the live model keeps its hooks."""
        state = super().__getstate__()
        if not any(
            getattr(m, "_output_capturing_hooks_installed", False) for m in self.model.modules()
        ):
            return state
        import copy

        model = copy.deepcopy(self.model)
        for module in model.modules():
            stale = [
                key
                for key, hook in module._forward_hooks.items()
                if getattr(hook, "__name__", "") == "output_capturing_hook"
            ]
            for key in stale:
                module._forward_hooks.pop(key, None)
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
            if getattr(module, "_output_capturing_hooks_installed", False):
                module._output_capturing_hooks_installed = False
        state["_modules"] = {**state["_modules"], "model": model}
        return state

    def __setstate__(self, state: dict) -> None:
        """Re-register output capturing after unpickling (ddp_spawn sends modules by pickle).

        transformers 5.x records which outputs (hidden states) a model class can capture in a
        registry filled by the model's __init__; an unpickled copy in a fresh process is not
        in it and would return no hidden states.
        """
        super().__setstate__(state)
        try:
            from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
        except ImportError:  # older or newer transformers without the registry
            return
        for module in self.model.modules():
            can_record = getattr(module, "_can_record_outputs", None)
            if can_record is not None:
                _CAN_RECORD_REGISTRY[module] = can_record

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        gguf_file: str | None = None,
        dtype: str | torch.dtype = "float32",
        feature_layers: Sequence[int] | None = None,
        attn_implementation: str = "sdpa",
        load_tokenizer: bool = True,
    ) -> TargetModel:
        """Load a hub id, a local folder or a GGUF file (`.../model.gguf`).

        `"smollm2"` / `"default"` name the embedded default target, fetched into the asset
        cache on first use.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = str(path)
        if source in {"smollm2", "default"}:
            from lightning_spec.data.assets import default_target_path

            source = str(default_target_path())
        if source.endswith(".gguf") and gguf_file is None:
            gguf_path = Path(source)
            if not gguf_path.is_file():
                raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
            source, gguf_file = str(gguf_path.parent), gguf_path.name
        kwargs: dict[str, object] = {"dtype": resolve_dtype(dtype)}
        if gguf_file:
            kwargs["gguf_file"] = gguf_file
        if not Path(source).expanduser().exists() and _looks_like_a_path(source):
            raise FileNotFoundError(
                f"no model folder at {source} (a target is a hub id `org/name`, a model folder, "
                "a .gguf file, or smollm2)"
            )
        if Path(source).exists() and not (Path(source) / "config.json").exists() and not gguf_file:
            raise FileNotFoundError(f"{source} has no config.json: not a Hugging Face model folder")
        model = AutoModelForCausalLM.from_pretrained(
            source, attn_implementation=attn_implementation, **kwargs
        )
        tokenizer = None
        if load_tokenizer:
            tok_kwargs = {"gguf_file": gguf_file} if gguf_file else {}
            tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
        return cls(model, feature_layers=feature_layers, tokenizer=tokenizer, name=str(path))

    @classmethod
    def from_config(
        cls,
        config: object,
        *,
        seed: int = 0,
        dtype: str | torch.dtype = "float32",
        feature_layers: Sequence[int] | None = None,
        attn_implementation: str = "sdpa",
    ) -> TargetModel:
        """A randomly initialised target from a config built in code (tests, device checks)."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=resolve_dtype(dtype)
        )
        return cls(model, feature_layers=feature_layers, name=f"random-{config.model_type}")

    # ------------------------------------------------------------------ properties
    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def feature_size(self) -> int:
        return len(self.feature_layers) * self.hidden_size

    @property
    def context_length(self) -> int | None:
        """Positions the target was trained for (`max_position_embeddings`), None if unknown."""
        value = getattr(self.model.config, "max_position_embeddings", None)
        return int(value) if value else None

    def check_fits(self, prompt_tokens: int, new_tokens: int) -> None:
        """Refuse a decode that would run past the target's context: beyond it RoPE
        extrapolates silently and the output is not the model's, lossless or not."""
        limit = self.context_length
        if limit is not None and prompt_tokens + new_tokens > limit:
            raise ValueError(
                f"a prompt of {prompt_tokens} tokens + {new_tokens} new tokens exceeds the "
                f"target's context of {limit} positions; shorten the prompt or max_new_tokens"
            )

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends a turn: generation config, model config and tokenizer."""
        ids: set[int] = set()
        sources = [
            getattr(self.model, "generation_config", None),
            self.model.config,
            self.tokenizer,
        ]
        for source in sources:
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if value is None:
                continue
            ids.update([value] if isinstance(value, int) else list(value))
        return ids

    def input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    #: Logits the LM head produces at once where only their argmax is needed: 2^25 (128 MB in
    #: float32), so a 262k vocabulary never materialises [B, T, V] for a batch (4 GB at
    #: 4 x 1024 tokens).
    HEAD_CHUNK_ELEMENTS = 1 << 25

    @torch.no_grad()
    def head_argmax(self, last_hidden: Tensor) -> Tensor:
        """Full-vocabulary argmax [...] of the LM head on final hidden states [..., H], in chunks
        of rows (soft-capping, where a family has it, is monotonic: the argmax ignores it)."""
        head = self.model.get_output_embeddings()
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        rows = max(1, self.HEAD_CHUNK_ELEMENTS // max(1, head.weight.shape[0]))
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for lo in range(0, flat.shape[0], rows):
            out[lo : lo + rows] = head(flat[lo : lo + rows].to(head.weight.dtype)).argmax(-1)
        return out.reshape(last_hidden.shape[:-1])

    @torch.no_grad()
    def head_logits(self, last_hidden: Tensor) -> Tensor:
        """The LM head's logits [..., V] on final hidden states [..., H], soft-capped where the
        family caps them (`final_logit_softcapping`), as the model's own forward does."""
        head = self.model.get_output_embeddings()
        logits = head(last_hidden.to(head.weight.dtype))
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def new_cache(self) -> object:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def train(self, mode: bool = True) -> TargetModel:
        # Frozen: Lightning calls .train() on the whole module tree; dropout must stay off.
        return super().train(False)

    def _kernel_can_take(self, tree_mask: Tensor, past: int) -> bool:
        implementation = getattr(self.model.config, "_attn_implementation", None)
        if implementation != TREE_ATTENTION_IMPL:
            return False
        on_gpu = self.device.type == "cuda"
        return kernel_takes_tree_forward(past, on_gpu, bool(tree_mask[..., :past].all()))

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        tree_mask: Tensor | None = None,
        cache: object | None = None,
        use_cache: bool = True,
        output_features: bool = True,
        logits_to_keep: int = 0,
    ) -> TargetOutput:
        """Run the target on `input_ids` [B, T] after whatever `cache` holds.

        `attention_mask` is the usual 2D padding mask over cache + new tokens; `tree_mask` is a
        bool [B|1, T, past + T] mask (True = attend) for tree verification, which also needs
        explicit `position_ids`. Without them positions continue after the cache.
        """
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}"
            )
        past = cache_length(cache)
        if position_ids is None and attention_mask is None:
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
        mask = attention_mask
        extra: dict[str, object] = {}
        if tree_mask is not None and self._kernel_can_take(tree_mask, past):
            # The Triton kernel reads the block mask over the new tokens; every new token
            # attends the whole cache, which is what the kernel assumes.
            extra["tree_block_mask"] = tree_mask[..., past:].to(input_ids.device)
            tree_mask = None
        if tree_mask is not None:
            if attention_mask is not None:
                raise ValueError("pass either attention_mask or tree_mask, not both")
            expected = past + input_ids.shape[1]
            if tree_mask.shape[-1] != expected or tree_mask.shape[-2] != input_ids.shape[1]:
                raise ValueError(
                    f"tree_mask must be [B, {input_ids.shape[1]}, {expected}], "
                    f"got {tuple(tree_mask.shape)}"
                )
            mask = tree_mask_to_additive(tree_mask.to(input_ids.device), self.dtype)
        if use_cache and cache is None:
            cache = self.new_cache()
        outputs = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=use_cache,
            output_hidden_states=True,
            logits_to_keep=logits_to_keep,
            **extra,
            **(cache_kwarg(self.model, cache) if use_cache else {}),
        )
        hidden_states = outputs.hidden_states
        features = None
        if output_features:
            features = torch.cat([hidden_states[i] for i in self.feature_layers], dim=-1)
        return TargetOutput(
            logits=outputs.logits,
            features=features,
            last_hidden=hidden_states[-1],
            cache=cache if use_cache else None,
        )


_LOADED: dict[tuple, TargetModel] = {}


def _looks_like_a_path(spec: str) -> bool:
    """A spec a hub id cannot be (hub ids are `name` or `org/name`): absolute, relative to
    `.`/`~`, or with more than one `/`. Such a spec that does not exist is a typo'd folder,
    which the hub client would report as a malformed repo id."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or "\\" in spec


def load_target(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    feature_layers: Sequence[int] | None = None,
    attn_implementation: str = "sdpa",
) -> TargetModel:
    """`TargetModel.from_pretrained`, shared within the process.

    The objective, the data module (regeneration) and callbacks all need the same frozen
    target; loading it once keeps memory and start-up time down.
    """
    key = (str(path), str(resolve_dtype(dtype)), tuple(feature_layers or ()), attn_implementation)
    if key not in _LOADED:
        _LOADED[key] = TargetModel.from_pretrained(
            path,
            dtype=dtype,
            feature_layers=feature_layers,
            attn_implementation=attn_implementation,
        )
    return _LOADED[key]
