"""Tiny random configs of the supported target families, built in code.

Tests and GPU device checks cannot download models, so they build these: every family the
decoder claims to support (llama, qwen2, qwen3, mistral, gemma3) at a size that runs in
milliseconds on a CPU.
"""

from __future__ import annotations

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


def tiny_config(
    family: str = "llama",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_positions: int = 1024,
) -> object:
    """A transformers config of `family` small enough for unit tests."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    head_dim = hidden_size // num_heads
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim, **common)
    if family == "mistral":
        # sliding_window=None: full attention, the window would evict tree blocks otherwise.
        return transformers.MistralConfig(sliding_window=None, head_dim=head_dim, **common)
    if family == "gemma3":
        # The window is larger than any test context so sliding layers keep every position.
        return transformers.Gemma3TextConfig(
            head_dim=head_dim,
            sliding_window=max_positions,
            query_pre_attn_scalar=head_dim,
            **common,
        )
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


# ------------------------------------------------------------------------------- stress targets
# The properties real targets of other families have and SmolLM2 lacks: hidden states
# past fp16's range, no chat template (a base model), a 128k-262k vocabulary. Built in code so
# tests and the vocabulary-memory bench reproduce them without a download.

STRESS_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0, 1, 2 = tiny_config's pad/bos/eos


def word_tokenizer(vocab_size: int, *, chat_template: str | None = None) -> object:
    """A fast word-level tokenizer over ``vocab_size`` tokens: the specials, then ``w0``, ``w1``..

    Whitespace-separated text of those words round-trips exactly, so random "documents" over a
    huge vocabulary are cheap to make; ``chat_template=None`` gives a base-model tokenizer.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(STRESS_SPECIALS):
        raise ValueError(f"vocab_size must exceed {len(STRESS_SPECIALS)}, got {vocab_size}")
    words = list(STRESS_SPECIALS) + [f"w{i}" for i in range(vocab_size - len(STRESS_SPECIALS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )  # fmt: skip
    fast.chat_template = chat_template
    return fast


def stress_target(
    family: str,
    *,
    vocab_size: int = 262_144,
    hidden_peak: float = 2.0e5,
    chat_template: str | None = None,
    seed: int = 0,
) -> object:
    """An 8-layer random `family` target with a base-model tokenizer over ``vocab_size`` words
    whose hidden states reach ``hidden_peak`` (fp16 ends at 65,504).

    Every write into the residual stream (the embeddings and each layer's output projections) is
    scaled by one factor, chosen from a probe forward so the largest hidden state reaches
    ``hidden_peak``. Every read of the residual goes through a scale-invariant RMSNorm, so the
    model computes what the unscaled random model does, with the magnitudes of the families
    that have activation outliers. Returns a `TargetModel` with the tokenizer attached.
    """
    import torch

    from lightning_spec.models.target import TargetModel

    config = tiny_config(
        family, vocab_size=vocab_size, hidden_size=32, num_layers=8, num_heads=2, num_kv_heads=1,
        intermediate_size=64,
    )  # fmt: skip
    target = TargetModel.from_config(config, seed=seed)
    probe = torch.arange(4, 36).unsqueeze(0) % vocab_size
    with torch.no_grad():
        peak = float(target(probe, use_cache=False, output_features=True).features.abs().max())
        _scale_residual_writes(target.model, hidden_peak / peak, family)
    target.tokenizer = word_tokenizer(vocab_size, chat_template=chat_template)
    target.name = f"stress-{family}-v{vocab_size}"
    return target


def _scale_residual_writes(model: object, factor: float, family: str) -> None:
    """Multiply everything added to the residual stream by ``factor`` (in place)."""
    model.get_input_embeddings().weight.mul_(factor)
    for layer in model.model.layers:
        if family == "gemma3":  # the outputs pass a post-norm whose weight w acts as (1 + w)
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight.copy_((1.0 + norm.weight) * factor - 1.0)
        else:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)


def write_documents(
    path: object, count: int, *, vocab_size: int, seed: int = 0, words: tuple[int, int] = (20, 60)
) -> object:
    """``count`` JSONL conversations of Zipf-distributed ``w<i>`` words (one user and one
    assistant turn each) for a :func:`word_tokenizer` of ``vocab_size``: data for a stress
    target in the same format as every other conversation source."""
    import json
    import random
    from pathlib import Path

    rng = random.Random(seed)
    top = vocab_size - len(STRESS_SPECIALS)
    weights = [1.0 / (rank + 1) for rank in range(min(top, 5000))]
    path = Path(path)
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(count):
            turns = []
            for role in ("user", "assistant"):
                ids = rng.choices(range(len(weights)), weights=weights, k=rng.randint(*words))
                ids = [i if rng.random() < 0.9 else rng.randrange(top) for i in ids]  # rare words
                turns.append({"role": role, "content": " ".join(f"w{i}" for i in ids)})
            handle.write(json.dumps({"id": f"doc-{index:04d}", "messages": turns}) + "\n")
    return path
