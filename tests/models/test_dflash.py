"""DFlash block drafter: lossless through the one engine, one forward per block, round trips."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.models.drafters import load_drafter
from lightning_spec.models.drafters.dflash import BlockProposer, DFlashDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import FAMILIES, tiny_config


def _target(family: str = "llama", seed: int = 11) -> TargetModel:
    target = TargetModel.from_config(tiny_config(family, num_layers=4), seed=seed)
    with torch.no_grad():  # confident predictions, so some random drafts are accepted
        for name, parameter in target.model.named_parameters():
            if "norm" not in name:
                parameter.mul_(4.0)
    return target


@pytest.fixture(scope="module")
def llama() -> TargetModel:
    return _target("llama")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", ["chain:3", "dynamic:3,3,8", "static:[(0,), (1,), (0, 0)]"])
def test_greedy_output_equals_target(family: str, spec: str) -> None:
    target = _target(family)
    drafter = DFlashDrafter.from_target(target, block_size=4, num_layers=2, seed=1)
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(spec))
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        prompt = torch.randint(3, 128, (7,), generator=generator).tolist()
        expected = autoregressive_generate(target, prompt, 24, stop_on_eos=False)
        assert decoder.generate(prompt, 24, stop_on_eos=False).tokens == expected


def test_draft_vocabulary_and_target_self_copy_accept(llama: TargetModel) -> None:
    """A drafter whose slot-1 prediction equals the target's next token is accepted: the
    block's anchor, positions and context alignment match the decoder's."""
    counts = torch.arange(128)
    drafter = DFlashDrafter.from_target(llama, block_size=3, draft_vocab_size=64, token_counts=counts)
    decoder = SpeculativeDecoder(llama, drafter, parse_tree_spec("chain:2"))
    prompt = list(range(10, 20))
    expected = autoregressive_generate(llama, prompt, 20, stop_on_eos=False)
    result = decoder.generate(prompt, 20, stop_on_eos=False)
    assert result.tokens == expected
    assert all(r.tree.tokens.lt(128).all() for r in result.records)
    drafted = torch.cat([r.tree.tokens for r in result.records])
    assert bool(drafter.t2d[drafted].all())  # only draft-vocabulary tokens are proposed


def test_incremental_blocks_equal_teacher_forced_blocks(llama: TargetModel) -> None:
    """The decoder's block at root R (incremental absorbs) equals the block one teacher-forced
    pass gives for the same committed sequence (what GTO, Draft-OPD and block SFT train on)."""
    drafter = DFlashDrafter.from_target(llama, block_size=5, num_layers=2, seed=3)
    live, replay = _live_and_replayed_blocks(llama, drafter, back=3)
    torch.testing.assert_close(replay.slot_logits[1], live.slot_logits[0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(replay.slot_logits[0], replay.slot_logits[1])  # per-root context


def _live_and_replayed_blocks(
    target: TargetModel, drafter: DFlashDrafter, back: int
) -> tuple[BlockProposer, BlockProposer]:
    """The decoder's block after 3 steps (root R), and the teacher-forced blocks at roots
    R - back and R of the same committed sequence."""
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec("chain:4"))
    session = decoder.start(list(range(20, 31)), 16, stop_on_eos=False)
    for _ in range(3):
        session.step()
    sequence = torch.tensor([session.sequence])
    root = len(session.sequence) - 1
    live = drafter.proposer(
        session.state, session.root_logits[None], session.root_hidden[None], torch.tensor([root])
    )
    with torch.no_grad():
        features = target(sequence, output_features=True, use_cache=False).features
        replay = drafter.sequence_proposer(
            sequence, torch.tensor([root - back, root]), features=features
        )
    return live, replay


def test_one_forward_per_block_whatever_the_block_size(llama: TargetModel) -> None:
    """Drafting costs one pass through the layers per verification, for a block of 3 or 9."""
    for block_size in (3, 9):
        drafter = DFlashDrafter.from_target(llama, block_size=block_size, num_layers=2)
        calls: list[int] = []

        def count(*_: object, calls: list[int] = calls) -> None:
            calls.append(1)

        hooks = [layer.register_forward_hook(count) for layer in drafter.layers]
        decoder = SpeculativeDecoder(llama, drafter, parse_tree_spec(f"chain:{block_size - 1}"))
        result = decoder.generate(list(range(5, 12)), 12, stop_on_eos=False)
        for hook in hooks:
            hook.remove()
        assert len(calls) == len(drafter.layers) * len(result.records)


def test_trees_deeper_than_the_block_are_refused(llama: TargetModel) -> None:
    drafter = DFlashDrafter.from_target(llama, block_size=3)
    decoder = SpeculativeDecoder(llama, drafter, parse_tree_spec("chain:3"))
    with pytest.raises(ValueError, match="drafts 2 tokens"):
        decoder.generate(list(range(5, 12)), 8, stop_on_eos=False)


def test_save_and_load_round_trip_without_target_weights(llama: TargetModel, tmp_path) -> None:
    drafter = DFlashDrafter.from_target(llama, block_size=4, num_layers=2, draft_vocab_size=64,
                                        token_counts=torch.arange(128))  # fmt: skip
    folder = drafter.save_pretrained(tmp_path / "dflash")
    from safetensors.torch import load_file

    keys = set(load_file(str(folder / "model.safetensors")))
    assert "mask_embedding" in keys and "fc.weight" in keys and "layers.1.self_attn.q_norm.weight" in keys
    assert not any("embed" in k and k != "mask_embedding" for k in keys)  # shared, not saved
    assert "t2d" not in keys and "d2t" in keys  # t2d is rebuilt from d2t on load
    # a reduced vocabulary's head rows travel for the engines (their loaders need them)
    head = load_file(str(folder / "model.safetensors"))["lm_head.weight"]
    torch.testing.assert_close(head, llama.model.get_output_embeddings().weight[drafter.d2t + torch.arange(64)])
    loaded = load_drafter(folder)
    assert isinstance(loaded, DFlashDrafter)
    with pytest.raises(RuntimeError, match="bind_target"):
        loaded.draft_block(_absorbed(loaded, llama), torch.tensor([9]))
    loaded.bind_target(llama)
    state_a, state_b = _absorbed(drafter, llama), _absorbed(loaded, llama)
    torch.testing.assert_close(
        loaded.draft_block(state_b, torch.tensor([9])), drafter.draft_block(state_a, torch.tensor([9]))
    )
    config = (folder / "config.json").read_text()
    assert '"DFlashDraftModel"' in config and '"dflash_config"' in config


def _absorbed(drafter: DFlashDrafter, target: TargetModel) -> object:
    ids = torch.arange(20, 30).unsqueeze(0)
    with torch.no_grad():
        features = target(ids, output_features=True, use_cache=False).features
    state = drafter.new_state(1)
    drafter.step(state, ids[:, 1:], torch.arange(1, 10).unsqueeze(0), features=features[:, :-1])
    return state


def test_deepcopy_shares_the_target_weights(llama: TargetModel) -> None:
    drafter = DFlashDrafter.from_target(llama, block_size=3)
    clone = copy.deepcopy(drafter)
    assert clone._target is drafter._target
    assert clone.fc.weight.data_ptr() != drafter.fc.weight.data_ptr()


def test_block_proposer_rows_do_not_depend_on_the_parent(llama: TargetModel) -> None:
    drafter = DFlashDrafter.from_target(llama, block_size=4)
    proposer = BlockProposer(drafter, _absorbed(drafter, llama), torch.tensor([9]))
    tree = parse_tree_spec("dynamic:3,3,8").build(proposer)
    rows = proposer.path_rows(torch.tensor([[5, 6]]))
    torch.testing.assert_close(rows, proposer.path_rows(torch.tensor([[7, 8]])))
    torch.testing.assert_close(rows[0, 0], proposer.root()[0])
    assert tree.num_nodes == 7 and tree.max_depth <= 3


@pytest.mark.parametrize("bad", [{"num_layers": 0}, {"block_size": 1}])
def test_bad_sizes_are_refused(llama: TargetModel, bad: dict) -> None:
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "target_vocab_size": 128, "target_layer_ids": [1, 2], **bad}  # fmt: skip
    with pytest.raises(ValueError, match="DFlash"):
        DFlashDrafter(config)


def _randomise_anchor_fc(drafter: DFlashDrafter, seed: int) -> None:
    """A trained-looking anchor fusion (the [I | 0] init would hide a wrong pairing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = drafter.anchor_fc.weight
        weight.copy_(torch.randn(weight.shape, generator=generator) * weight.shape[1] ** -0.5)


@pytest.mark.parametrize("spec", ["chain:3", "dynamic:3,3,8"])
def test_anchor_feature_drafter_is_lossless(llama: TargetModel, spec: str) -> None:
    drafter = DFlashDrafter.from_target(llama, block_size=4, num_layers=2, anchor_feature=True)
    _randomise_anchor_fc(drafter, 2)
    decoder = SpeculativeDecoder(llama, drafter, parse_tree_spec(spec))
    prompt = list(range(30, 41))
    expected = autoregressive_generate(llama, prompt, 24, stop_on_eos=False)
    assert decoder.generate(prompt, 24, stop_on_eos=False).tokens == expected


def test_anchor_feature_starts_as_the_plain_block_and_reads_the_paired_feature(
    llama: TargetModel,
) -> None:
    """At init ([I | 0]) the anchor slot is the plain one, so the logits equal a plain
    drafter's with the same weights; once trained, the incremental block (the decoder's) still
    equals the teacher-forced block at the same root (GTO, Draft-OPD and SFT train on the
    latter), so the anchor reads the same feature, f_{R-1}, on both paths."""
    plain = DFlashDrafter.from_target(llama, block_size=5, num_layers=2, seed=3)
    fused = DFlashDrafter.from_target(llama, block_size=5, num_layers=2, seed=3,
                                      anchor_feature=True)  # fmt: skip
    sequence = torch.tensor([list(range(20, 40))])
    with torch.no_grad():
        features = llama(sequence, output_features=True, use_cache=False).features
    roots = torch.tensor([4, 11, 18])
    before = plain.sequence_proposer(sequence, roots, features=features).slot_logits
    at_init = fused.sequence_proposer(sequence, roots, features=features).slot_logits
    torch.testing.assert_close(at_init, before)
    _randomise_anchor_fc(fused, 4)
    live, replay = _live_and_replayed_blocks(llama, fused, back=3)
    torch.testing.assert_close(replay.slot_logits[1], live.slot_logits[0], atol=1e-4, rtol=1e-4)
    seen: list[torch.Tensor] = []
    hook = fused.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    trained = fused.sequence_proposer(sequence, roots, features=features).slot_logits
    hook.remove()
    assert not torch.allclose(trained, before)  # the fusion changes the blocks
    # the anchor slot of root R is anchor_fc([embed(t_R), hidden_norm(fc(f_{R-1}))])
    with torch.no_grad():
        paired = fused.hidden_norm(fused.fc(features[0, roots - 1]))
        embedded = llama.input_embeddings().weight[sequence[0, roots]]
        expected = fused.anchor_fc(torch.cat([embedded, paired], dim=-1))
    torch.testing.assert_close(seen[0][:, 0], expected)


def test_anchor_feature_round_trips(llama: TargetModel, tmp_path) -> None:
    drafter = DFlashDrafter.from_target(llama, block_size=4, anchor_feature=True)
    _randomise_anchor_fc(drafter, 5)
    loaded = load_drafter(drafter.save_pretrained(tmp_path / "fused"), target=llama)
    assert loaded.anchor_feature and loaded.config["anchor_feature"] is True
    torch.testing.assert_close(loaded.anchor_fc.weight, drafter.anchor_fc.weight)
    assert not DFlashDrafter.from_target(llama, block_size=4).anchor_feature  # off by default
