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
