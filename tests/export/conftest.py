"""What the engine tests (llama.cpp, vLLM) share: the real SmolLM2, four MT-Bench prompts and an
EAGLE-3 head fitted on their own greedy continuations (accepted often, not always), so an
engine's acceptance can be compared with our decoder's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def engine_drafter(greedy_fit: Callable[..., None]) -> Callable[[int], dict[str, Any]]:
    """new_tokens -> {"target", "prompts", "drafter"} (built on first use, per length)."""
    built: dict[int, dict[str, Any]] = {}

    def build(new_tokens: int) -> dict[str, Any]:
        if new_tokens not in built:
            from lightning_spec.decoding.engine import autoregressive_generate
            from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
            from lightning_spec.models.target import load_target
            from lightning_spec.specs import load_prompts

            target = load_target("smollm2")
            _, items = load_prompts("mtbench", target.tokenizer, limit=4)
            prompts = [list(ids) for ids, _ in items]
            counts = torch.zeros(target.vocab_size)
            for prompt in prompts:
                text = prompt + autoregressive_generate(target, prompt, new_tokens, stop_on_eos=False)
                counts += torch.bincount(torch.tensor(text), minlength=target.vocab_size).float()
            drafter = Eagle3Drafter.from_target(target, draft_vocab_size=2048, token_counts=counts)
            length = max(len(p) for p in prompts) + new_tokens
            greedy_fit(target, drafter, prompts, length=length, steps=40)
            built[new_tokens] = {"target": target, "prompts": prompts, "drafter": drafter}
        return built[new_tokens]

    return build
