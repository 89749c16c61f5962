"""A draft vocabulary that follows the served stream: the swap keeps every kept token's head row
and optimizer moments, starts a new token's row from the target's embedding, keeps the draft ids
ordered; the plan swaps the least-used slots for the most-used missing tokens; OGD with
``vocab_swap`` can then draft what it could not, and resumes with its grown vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import Generation, SpeculativeDecoder
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.models.vocab import draft_to_target_ids
from lightning_spec.online.losses import draft_vocab_miss, feedback_batch
from lightning_spec.online.strategies import make_strategy
from lightning_spec.online.vocab import VocabGrowth, swap_draft_vocab
from tests.conftest import load_module

HELPERS = load_module(Path(__file__).parents[1] / "objectives" / "test_sft.py", "sft_helpers_online_vocab")


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


def _rows(drafter) -> dict[int, torch.Tensor]:  # noqa: ANN001
    ids = draft_to_target_ids(drafter.d2t).tolist()
    return {t: drafter.lm_head.weight[d].detach().clone() for d, t in enumerate(ids)}


def test_swap_keeps_rows_and_moments_and_orders_the_ids(target: TargetModel) -> None:
    drafter = HELPERS._drafter(target)  # draft vocabulary: ids 80..127 (and EOS)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    drafter.lm_head.weight.sum().backward()
    optimizer.step()
    moments = optimizer.state[drafter.lm_head.weight]["exp_avg"]
    before = _rows(drafter)
    before_moments = {t: moments[d].clone() for d, t in enumerate(draft_to_target_ids(drafter.d2t).tolist())}
    old_ids = draft_to_target_ids(drafter.d2t).tolist()
    evict = torch.tensor([old_ids.index(100), old_ids.index(127)])
    add = torch.tensor([5, 60])
    swap_draft_vocab(drafter, evict, add, optimizer)

    ids = draft_to_target_ids(drafter.d2t).tolist()
    assert ids == sorted(ids) and len(ids) == len(old_ids)
    assert set(ids) == (set(old_ids) - {100, 127}) | {5, 60}
    assert drafter.t2d.nonzero().flatten().tolist() == ids
    after = _rows(drafter)
    for token in set(old_ids) - {100, 127}:
        torch.testing.assert_close(after[token], before[token])
        torch.testing.assert_close(moments[ids.index(token)], before_moments[token])
    for token in (5, 60):
        torch.testing.assert_close(after[token], drafter.embed(torch.tensor(token)).float())
        assert torch.count_nonzero(moments[ids.index(token)]) == 0
    with pytest.raises(ValueError, match="new to the draft vocabulary"):
        swap_draft_vocab(drafter, torch.tensor([0]), torch.tensor([60]))


def _generation(tokens: list[int]) -> Generation:
    return Generation(prompt=[1], tokens=tokens, records=[])


def test_plan_swaps_least_used_slots_for_most_used_missing_tokens(target: TargetModel) -> None:
    drafter = HELPERS._drafter(target)
    in_vocab = draft_to_target_ids(drafter.d2t).tolist()
    eos = target.eos_token_ids
    growth = VocabGrowth(target.vocab_size, swaps=3, min_count=2, protected=eos)
    used = [t for t in in_vocab if t not in eos]
    # every kept slot used 3 times except two; token 7 missing 5 times, 9 twice, 11 once
    stream = [t for t in used[2:] for _ in range(3)] + [7] * 5 + [9] * 2 + [11]
    growth.observe([_generation(stream)])
    evict, add = growth.plan(drafter)
    assert add.tolist() == [7, 9]  # 11 is under min_count
    assert sorted(in_vocab[d] for d in evict.tolist()) == sorted(used[:2])
    assert not set(in_vocab[d] for d in evict.tolist()) & set(eos)
    assert growth.step(drafter, [], None) == 2
    assert {7, 9} <= set(draft_to_target_ids(drafter.d2t).tolist())
    assert growth.plan(drafter)[1].numel() == 0  # nothing left that beats a slot


def test_ogd_with_vocab_swap_learns_to_draft_what_it_could_not(target: TargetModel) -> None:
    drafter = HELPERS._drafter(target)
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec("chain:3"), keep_features=True)
    prompts = [[5, 9, 14, 3, 22], [7, 8, 30, 41], [12, 3, 55]]
    generations = [decoder.generate(p, 16, stop_on_eos=False) for p in prompts]
    batch = feedback_batch(generations)
    served_miss = draft_vocab_miss(drafter, batch)
    assert served_miss > 0  # the tiny target says tokens outside ids 80..127
    ogd = make_strategy("ogd", drafter, lr=1e-3, vocab_swap=16, vocab_min_count=1,
                        protected_ids=target.eos_token_ids)  # fmt: skip
    report = ogd.update(generations)
    assert report["draft_vocab_miss"] == pytest.approx(served_miss)  # of the drafter that served
    assert report["vocab_swapped"] > 0
    assert draft_vocab_miss(ogd.drafter, batch) < served_miss
    assert torch.equal(drafter.d2t, HELPERS._drafter(target).d2t)  # the served copy is untouched
    again = make_strategy("ogd", drafter, lr=1e-3, vocab_swap=16, vocab_min_count=1)
    again.load_state_dict(ogd.state_dict())
    assert torch.equal(again.drafter.d2t, ogd.drafter.d2t)
    assert torch.equal(again.growth.counts, ogd.growth.counts)
    from lightning_spec.models.drafters.dflash import DFlashDrafter

    dflash = DFlashDrafter.from_target(  # the target's own head: no rows of its own to swap
        target, block_size=3, draft_vocab_size=64, token_counts=torch.arange(128)
    )
    with pytest.raises(ValueError, match="vocab_swap needs"):
        make_strategy("ogd", dflash, vocab_swap=4)
