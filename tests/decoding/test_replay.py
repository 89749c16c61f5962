"""Greedy rollouts replayed over a known continuation equal the real decoder's, step by step."""

from __future__ import annotations

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.decoding.replay import (
    ReplayMismatch,
    check_greedy,
    committed_argmax,
    replay_greedy,
)
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


@pytest.fixture(scope="module")
def models(greedy_fit) -> dict:  # noqa: ANN001
    """A tiny target and two EAGLE-3 heads: one trained a little on the target's own greedy
    text (so drafts are accepted part of the time) and an untrained one."""
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)

    def head() -> Eagle3Drafter:
        return Eagle3Drafter.from_target(
            target, draft_vocab_size=48, token_counts=torch.arange(128), intermediate_size=64
        )

    prompts = [[5, 9, 14, 3], [40, 41], [7, 100, 2, 66, 90]]
    trained = head()
    greedy_fit(target, trained, prompts, length=30)
    return {
        "target": target,
        "trained": trained.eval(),
        "untrained": head().eval(),
        "prompts": prompts,
    }


@pytest.mark.parametrize(
    ("kind", "spec"),
    [("trained", "chain:4"), ("trained", "static:small"), ("trained", "dynamic:4,3,12"),
     ("untrained", "dynamic:4,3,12")],
)  # fmt: skip
def test_replay_equals_the_decoder_step_by_step(models: dict, kind: str, spec: str) -> None:
    """Records equal, on a head that gets drafts accepted and on one that does not."""
    target, drafter = models["target"], models[kind]
    policy = parse_tree_spec(spec)
    decoder = SpeculativeDecoder(target, drafter, policy, eos_token_ids=[])
    steps = accepted_total = rejected_total = 0
    for prompt in models["prompts"]:
        real = decoder.generate(prompt, 24)
        replayed = replay_greedy(target, drafter, policy, prompt, real.tokens)
        assert replayed.tokens == real.tokens
        assert len(replayed.records) == len(real.records)
        for mine, theirs in zip(replayed.records, real.records, strict=True):
            assert mine.anchor == theirs.anchor
            assert torch.equal(mine.tree.tokens, theirs.tree.tokens)
            assert torch.equal(mine.tree.parents, theirs.tree.parents)
            assert torch.allclose(mine.tree.logprobs, theirs.tree.logprobs, atol=1e-4)
            assert torch.equal(mine.accepted, theirs.accepted)
            assert mine.committed == theirs.committed
            assert mine.bonus_committed == theirs.bonus_committed
            assert torch.equal(mine.rejected, theirs.rejected)
            tried = mine.tried
            assert torch.allclose(
                mine.target_token_logprobs[tried], theirs.target_token_logprobs[tried], atol=1e-4
            )
            known = mine.target_argmax >= 0
            assert bool(known[0])  # the root's row is always on the committed text
            assert torch.equal(mine.target_argmax[known], theirs.target_argmax[known])
            steps += 1
            accepted_total += mine.accept_length
            rejected_total += int(mine.rejected.numel())
    assert steps > 10
    if kind == "trained":
        assert accepted_total > 0 and rejected_total > 0  # both outcomes were compared


def test_replay_follows_a_new_drafter_without_the_target_loop(models: dict) -> None:
    """The same continuation replayed for another drafter gives that drafter's own rollout."""
    target, drafter, other = models["target"], models["untrained"], models["trained"]
    policy = parse_tree_spec("dynamic:4,3,12")
    prompt = models["prompts"][1]
    first = SpeculativeDecoder(target, drafter, policy).generate(prompt, 20)
    real = SpeculativeDecoder(target, other, policy).generate(prompt, 20)
    assert real.tokens == first.tokens  # lossless: the text does not depend on the drafter
    replayed = replay_greedy(target, other, policy, prompt, first.tokens, drafter_version="v2")
    assert [r.anchor for r in replayed.records] == [r.anchor for r in real.records]
    assert [r.accept_length for r in replayed.records] == [r.accept_length for r in real.records]
    assert {r.drafter_version for r in replayed.records} == {"v2"}


def test_a_non_greedy_continuation_is_refused(models: dict) -> None:
    target, drafter = models["target"], models["trained"]
    policy = parse_tree_spec("chain:4")
    prompt = models["prompts"][0]
    real = SpeculativeDecoder(target, drafter, policy).generate(prompt, 12, stop_on_eos=False)
    forged = list(real.tokens)
    forged[5] = (forged[5] + 1) % 128
    with pytest.raises(ReplayMismatch, match="position"):
        replay_greedy(target, drafter, policy, prompt, forged)


def test_committed_argmax_marks_only_rows_on_the_text() -> None:
    # root -> a(5) -> c(7); root -> b(6); the text after the root is 5, 7, 9
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, 0]), torch.zeros(3))
    argmax, known = committed_argmax(tree, torch.tensor([5, 7, 9]))
    assert argmax.tolist() == [5, 7, -1, 9]
    assert known.tolist() == [True, True, False, True]
    # the text ends after one token: node a's row (the next token) is unknown
    argmax, known = committed_argmax(tree, torch.tensor([5]))
    assert argmax.tolist() == [5, -1, -1, -1]
    argmax, known = committed_argmax(tree, torch.tensor([], dtype=torch.long))
    assert not bool(known.any())


def test_check_greedy_tolerates_ties_only() -> None:
    rows = torch.tensor([[0.0, 2.0, 2.0 - 1e-5], [1.0, 0.0, 0.0]])
    check_greedy(rows, torch.tensor([2, 0]), tolerance=1e-3)  # a tie within the tolerance
    with pytest.raises(ReplayMismatch, match="position 7"):
        check_greedy(rows, torch.tensor([1, 1]), tolerance=1e-3, offset=6)


def test_replaying_source_decodes_once_then_replays_from_its_cache(models: dict) -> None:
    from lightning_spec.decoding.source import ReplayingRolloutSource

    target, drafter = models["target"], models["trained"]
    source = ReplayingRolloutSource(target, tree="dynamic:4,3,12", max_new_tokens=16)
    prompts = models["prompts"][:2]

    def steps(generations: list) -> list:
        return [
            [(r.anchor, r.committed, r.accepted.tolist()) for r in g.records] for g in generations
        ]

    decoded = source.generate(drafter, prompts, version="a")
    assert source.last_throughput["rollout_decoded"] == 2
    replayed = source.generate(drafter, prompts, version="b")  # the text passes are computed
    assert source.last_throughput["rollout_replayed"] == 2
    assert (source.cache.misses, source.cache.hits) == (2, 0)
    again = source.generate(drafter, prompts, version="c")  # and now served from the cache
    assert (source.cache.misses, source.cache.hits) == (2, 2)
    assert steps(decoded) == steps(replayed) == steps(again)
    assert [g.tokens for g in again] == [g.tokens for g in decoded]
    restored = ReplayingRolloutSource(target, tree="dynamic:4,3,12", max_new_tokens=16)
    restored.load_state_dict(source.state_dict())
    assert steps(restored.generate(drafter, prompts)) == steps(decoded)
    assert restored.last_throughput["rollout_decoded"] == 0


def _steps(generations: list) -> list:
    return [[(r.anchor, r.committed, r.accepted.tolist()) for r in g.records] for g in generations]


def test_batched_greedy_answers_replay_as_the_decoder_rolls_out(models: dict) -> None:
    """decode_batch_size: new prompts answered by batched generation (prompts of different
    lengths, so left padding), replayed at once: the same rollouts as the real decoder's."""
    from lightning_spec.decoding.source import ReplayingRolloutSource

    target, drafter, prompts = models["target"], models["trained"], models["prompts"]
    live = ReplayingRolloutSource(target, tree="dynamic:4,3,12", max_new_tokens=16)
    batched = ReplayingRolloutSource(
        target, tree="dynamic:4,3,12", max_new_tokens=16, decode_batch_size=2
    )
    decoded = live.generate(drafter, prompts)
    replayed = batched.generate(drafter, prompts)
    assert batched.last_throughput["rollout_decoded"] == len(prompts)
    assert batched.last_throughput["rollout_replayed"] == len(prompts)
    assert [g.tokens for g in replayed] == [g.tokens for g in decoded]
    assert _steps(replayed) == _steps(decoded)
    with pytest.raises(ValueError, match="decode_batch_size"):
        ReplayingRolloutSource(target, decode_batch_size=-1)


@pytest.mark.parametrize("where", ["first", "middle"])
def test_a_continuation_off_the_greedy_text_is_cut_to_its_greedy_prefix(
    models: dict, where: str
) -> None:
    """What a batched near-tie would leave: a token that is not the argmax. The source keeps
    the text up to it (or the argmax alone when the first token is off) and replays that."""
    from lightning_spec.decoding.replay import greedy_prefix, text_pass
    from lightning_spec.decoding.source import ReplayingRolloutSource

    target, drafter = models["target"], models["trained"]
    source = ReplayingRolloutSource(target, tree="dynamic:4,3,12", max_new_tokens=16)
    decoded = max(source.generate(drafter, models["prompts"]), key=lambda g: len(g.tokens))
    prompt = decoded.prompt
    assert len(decoded.tokens) >= 3
    wrong_at = 0 if where == "first" else len(decoded.tokens) // 2
    wrong = list(decoded.tokens)
    wrong[wrong_at] = (wrong[wrong_at] + 1) % 128
    ids = torch.tensor([prompt + wrong])
    text = text_pass(target, ids, len(prompt), features=True)
    assert greedy_prefix(target, text, wrong) == wrong_at
    assert greedy_prefix(target, text, decoded.tokens[:wrong_at]) == wrong_at

    key = tuple(prompt)
    source.continuations[key] = wrong
    (cut,) = source.generate(drafter, [prompt])
    expected = decoded.tokens[: max(wrong_at, 1)]
    assert cut.tokens == expected == source.continuations[key]
    reference = replay_greedy(target, drafter, parse_tree_spec("dynamic:4,3,12"), prompt, expected)
    assert _steps([cut]) == _steps([reference])
