"""Real text for the step and throughput benches: ShareGPT conversations cut to one length.

A forward's speed on a CPU depends on the shape, not the words, but the accuracy checks beside
the timings (features against fp32, labels) should read real text; one helper serves the benches.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sharegpt_rows"]


def sharegpt_rows(tokenizer: Any, count: int, length: int) -> torch.Tensor:
    """[count, length] token ids: the first ShareGPT conversations (turns joined by newlines)
    that reach `length` tokens, cut there."""
    from lightning_spec.data.sources import load_source

    rows: list[list[int]] = []
    for conversation in load_source("sharegpt", limit=50 * count):
        text = "\n".join(str(message["content"]) for message in conversation.messages)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == count:
            return torch.tensor(rows)
    raise RuntimeError(f"only {len(rows)} ShareGPT texts reach {length} tokens")
