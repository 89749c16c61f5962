"""Shared fixtures for data tests: a word-level chat tokenizer, a tiny random target that speaks
its vocabulary, and small JSONL conversation files. Everything is built in code (no downloads).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Ids 0, 1, 2 match tiny_config's pad, bos and eos ids, so the tiny target stops on <|im_end|>.
SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>"]
ROLES = ["system", "user", "assistant"]
WORDS = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
    "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi",
    "psi", "omega", "red", "green", "blue", "cat", "dog", "bird", "fish", "tree", "house", "car",
    "road", "sun", "moon", "star", "sky", "sea", "what", "why", "how", "is", "the", "a", "of",
    "and", "to", "in", "?", ".", ",",
]  # fmt: skip
VOCAB = SPECIALS + ROLES + WORDS


def make_chat_tokenizer(template: str | None = CHATML):  # noqa: ANN201
    """A fast word-level tokenizer over :data:`VOCAB` with a ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = template
    fast.name_or_path = "tiny-wordlevel"
    return fast


def make_tiny_target(tokenizer, seed: int = 0):  # noqa: ANN001, ANN201
    """A 2-layer random llama over the tokenizer's vocabulary, with the tokenizer attached."""
    from lightning_spec.models.target import TargetModel
    from lightning_spec.models.tiny import tiny_config

    config = tiny_config(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
    )
    target = TargetModel.from_config(config, seed=seed)
    target.tokenizer = tokenizer
    target.name = f"tiny-llama-{seed}"
    return target


def write_chats(path: Path, count: int, *, seed: int = 0, turns: int = 2) -> Path:
    """``count`` conversations of random words (1..``turns`` exchanges, 3..15 words a turn)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for index in range(count):
            messages = []
            for _ in range(rng.randint(1, turns)):
                for role in ("user", "assistant"):
                    words = rng.choices(WORDS[:-3], k=rng.randint(3, 15))
                    messages.append({"role": role, "content": " ".join(words)})
            fh.write(json.dumps({"id": f"conv-{index:04d}", "messages": messages}) + "\n")
    return path


@pytest.fixture(scope="session")
def chat_tokenizer():  # noqa: ANN201
    return make_chat_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(chat_tokenizer):  # noqa: ANN001, ANN201
    return make_tiny_target(chat_tokenizer)


@pytest.fixture()
def chats(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``chats(count, seed=0, turns=2)`` writes a JSONL file under ``tmp_path``."""

    def make(count: int, *, seed: int = 0, turns: int = 2, name: str = "chats.jsonl") -> Path:
        return write_chats(tmp_path / name, count, seed=seed, turns=turns)

    return make
