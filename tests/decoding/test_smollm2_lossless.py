"""Slow: the decoder, drafting and verifying only through the public seams, reproduces the real
SmolLM2's own greedy decode on 20 MT-Bench prompts (random EAGLE-3 head: many rejections;
self-drafting: full acceptance)."""

from __future__ import annotations

import pytest

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.standalone import StandaloneDrafter


def _smollm2_and_prompts(count: int):  # noqa: ANN202
    from lightning_spec.data.assets import AssetError, asset_path, default_target_path
    from lightning_spec.data.chat import render_prompt
    from lightning_spec.data.sources import load_source
    from lightning_spec.models.target import load_target

    try:
        default_target_path(fetch_if_missing=False)
        asset_path("mtbench", fetch_if_missing=False)
    except (AssetError, FileNotFoundError) as error:
        pytest.skip(f"SmolLM2 / MT-Bench not cached (run `lightning-spec assets`): {error}")
    target = load_target("smollm2")
    source = load_source("mtbench", limit=count)
    prompts = [render_prompt(target.tokenizer, m) for m in source.prompts()][:count]
    return target, prompts


@pytest.mark.slow
def test_smollm2_greedy_equals_target_on_20_mtbench_prompts() -> None:
    target, prompts = _smollm2_and_prompts(20)
    assert len(prompts) == 20
    decoders = {
        "eagle3-random/dynamic:6,10,32": SpeculativeDecoder(
            target, Eagle3Drafter.from_target(target, seed=0), parse_tree_spec("dynamic:6,10,32")
        ),
        "self/chain:4": SpeculativeDecoder(
            target, StandaloneDrafter.from_model(target.model), parse_tree_spec("chain:4")
        ),
    }
    mismatches = []
    for index, prompt in enumerate(prompts):
        reference = autoregressive_generate(target, prompt, 32)
        for name, decoder in decoders.items():
            if decoder.generate(prompt, 32).tokens != reference:
                mismatches.append((index, name))
    assert not mismatches, f"greedy speculative output differs from the target's: {mismatches}"
