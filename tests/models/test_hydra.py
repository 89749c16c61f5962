"""HydraDrafter: lossless decoding through the one engine, one head per depth, folders that
reload, and training through SFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.models.drafters.base import load_drafter
from lightning_spec.models.drafters.hydra import HydraDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.objectives.sft import SFT


def _hydra(target: TargetModel, heads: int = 3) -> HydraDrafter:
    drafter = HydraDrafter.from_target(target, num_heads=heads, draft_vocab_size=64,
                                       token_counts=torch.arange(128))  # fmt: skip
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return drafter.eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("spec", ["chain:4", "dynamic:3,3,8", "static:small"])
def test_greedy_decoding_with_hydra_equals_the_target(family: str, spec: str) -> None:
    target = TargetModel.from_config(tiny_config(family, num_layers=2), seed=3)
    decoder = SpeculativeDecoder(target, _hydra(target), parse_tree_spec(spec))
    prompt = list(range(7, 19))
    assert decoder.generate(prompt, 20).tokens == autoregressive_generate(target, prompt, 20)


def test_each_depth_has_its_head_and_folders_reload(tmp_path: Path) -> None:
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=3)
    drafter = _hydra(target, heads=3)
    assert len(drafter.heads) == 3 and drafter.config["num_heads"] == 3
    state = drafter.new_state()
    tokens, hidden = torch.tensor([[5, 6]]), torch.randn(1, 2, drafter.fc.out_features)
    positions = torch.tensor([[3, 4]])
    one = drafter.draft_step(state, tokens, positions, depth=torch.tensor([[1, 1]]), hidden=hidden)
    two = drafter.draft_step(state, tokens, positions, depth=torch.tensor([[1, 2]]), hidden=hidden)
    deep = drafter.draft_step(state, tokens, positions, depth=torch.tensor([[1, 9]]), hidden=hidden)
    torch.testing.assert_close(one.hidden[0, 0], two.hidden[0, 0])
    assert not torch.allclose(one.hidden[0, 1], two.hidden[0, 1])  # another head at depth 2
    torch.testing.assert_close(deep.hidden[0, 1], two.hidden[0, 1])  # beyond the last: the last
    assert drafter.state_length(state) == 6
    drafter.truncate_state(state, 2)
    assert drafter.state_length(state) == 2
    drafter.save_pretrained(tmp_path / "hydra")
    reloaded = load_drafter(tmp_path / "hydra")
    assert isinstance(reloaded, HydraDrafter) and len(reloaded.heads) == 3
    for (name, a), b in zip(
        drafter.state_dict().items(), reloaded.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_sft_builds_and_trains_a_hydra_drafter() -> None:
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=3)
    module = SFT.from_objects(target, _hydra(target), ttt_steps=3)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    optimizer = torch.optim.Adam(module.drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        result = module._common_step(batch)
        result.loss.backward()
        optimizer.step()
        losses.append(float(result.loss))
    assert losses[-1] < losses[0]
    assert all(h.proj.weight.grad is not None for h in module.drafter.heads[:3])  # every head
    with pytest.raises(ValueError, match="drafter_type"):
        SFT.from_objects(target, _hydra(target), drafter_type="medusa")


def test_onnx_export_refuses_hydra_with_the_reason() -> None:
    from lightning_spec.export.onnx import export_ready

    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=3)
    with pytest.raises(TypeError, match="hydra"):
        export_ready(_hydra(target))
