"""OnlineSpec's soft labels: the decoder keeps the target's distribution of every token it
serves (no second target pass), replay keeps the same, and the online loss reads it as the
target's distribution renormalised over the draft vocabulary."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.online.loop import replay_request
from lightning_spec.online.losses import feedback_batch, online_loss, soft_targets
from lightning_spec.online.strategies import make_strategy
from tests.conftest import load_module

HELPERS = load_module(Path(__file__).parents[1] / "objectives" / "test_sft.py", "sft_helpers_online_labels")
POLICY = "dynamic:3,3,8"


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


def test_the_kept_rows_are_the_targets_distribution_of_each_served_token(
    target: TargetModel,
) -> None:
    drafter = HELPERS._drafter(target)
    policy = parse_tree_spec(POLICY)
    decoder = SpeculativeDecoder(target, drafter, policy, keep_features=True, keep_labels=8)
    prompt = [5, 9, 14, 3, 22]
    generation = decoder.generate(prompt, 12, stop_on_eos=False)
    n = len(generation.tokens)
    assert generation.label_logprobs.shape == (n, 8) == generation.label_ids.shape
    sequence = prompt + generation.tokens
    with torch.no_grad():
        logits = target(torch.tensor([sequence]), use_cache=False).logits[0].float()
    fresh = torch.log_softmax(logits[len(prompt) - 1 : len(sequence) - 1], dim=-1).topk(8)
    torch.testing.assert_close(generation.label_logprobs, fresh.values, atol=1e-4, rtol=1e-4)
    assert torch.equal(generation.label_ids, fresh.indices)
    assert generation.label_ids[:, 0].tolist() == generation.tokens  # T = 0: the argmax
    replayed = replay_request(target, drafter, policy, prompt, generation.tokens, keep_labels=8)
    torch.testing.assert_close(replayed.label_logprobs, generation.label_logprobs, atol=1e-4, rtol=1e-4)
    assert torch.equal(replayed.label_ids, generation.label_ids)
    assert SpeculativeDecoder(target, drafter, policy).generate(prompt, 4).label_ids is None
    with pytest.raises(ValueError, match="keep_labels"):
        SpeculativeDecoder(target, drafter, policy, keep_labels=-1)


def test_soft_targets_keep_the_draft_vocabulary_and_renormalise(target: TargetModel) -> None:
    drafter = HELPERS._drafter(target)
    ids = torch.arange(target.vocab_size)
    inside = ids[drafter.target_to_draft_ids(ids) >= 0][:2].tolist()
    outside = ids[drafter.target_to_draft_ids(ids) < 0][0].item()
    label_ids = torch.tensor([[inside[0], inside[1], outside], [outside, -1, -1]])
    label_logprobs = torch.tensor(
        [[math.log(0.5), math.log(0.3), math.log(0.2)], [0.0, float("-inf"), float("-inf")]]
    )
    draft, probs = soft_targets(drafter, label_ids, label_logprobs)
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0]))
    assert draft[0, :2].tolist() == drafter.target_to_draft_ids(torch.tensor(inside)).tolist()
    assert probs[1].tolist() == [0.0, 0.0, 0.0]  # nothing draftable: a masked row


def test_soft_labels_are_the_default_and_one_hot_rows_give_the_hard_loss(
    target: TargetModel,
) -> None:
    drafter = HELPERS._drafter(target, noise=0.05)
    policy = parse_tree_spec(POLICY)
    decoder = SpeculativeDecoder(target, drafter, policy, keep_features=True, keep_labels=4)
    generations = [decoder.generate(p, 10, stop_on_eos=False) for p in ([5, 9, 14, 3], [7, 7, 30, 2])]
    soft = feedback_batch(generations)
    assert {"label_ids", "label_logprobs"} <= set(soft)
    hard = {k: v for k, v in soft.items() if not k.startswith("label_")}
    one_hot = dict(soft)  # all the mass on the committed token: the soft loss is the hard one
    one_hot["label_logprobs"] = torch.where(
        soft["label_ids"] == soft["input_ids"].unsqueeze(-1), 0.0, float("-inf")
    )
    with torch.no_grad():
        soft_loss, _ = online_loss(drafter, soft)
        hard_loss, hard_count = online_loss(drafter, hard)
        one_hot_loss, one_hot_count = online_loss(drafter, one_hot)
    torch.testing.assert_close(one_hot_loss, hard_loss)
    assert one_hot_count == hard_count
    assert not torch.isclose(soft_loss, hard_loss)  # the soft rows carry more than the argmax
    assert make_strategy("ogd", drafter).label_top_k == 32
    assert make_strategy("frozen", drafter).label_top_k == 32
    assert make_strategy("ogd", drafter, labels="hard").label_top_k == 0
    assert make_strategy("osd", drafter, label_top_k=8).label_top_k == 8
    with pytest.raises(ValueError, match="labels must be"):
        make_strategy("ogd", drafter, labels="fuzzy")
