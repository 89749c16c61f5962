"""Prompt lookup grafted onto drafter trees: the n-gram proposer, the graft, losslessness."""

from __future__ import annotations

import pytest
import torch

from lightning_spec.decoding.build import DynamicTreePolicy, parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.decoding.lookup import (
    LookupPolicy,
    LookupStats,
    PromptLookup,
    graft_chain,
    require_drafter_policy,
)
from lightning_spec.decoding.source import DecoderRolloutSource
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


def _tree(tokens: list[int], parents: list[int]) -> DraftTree:
    return DraftTree(
        torch.tensor(tokens), torch.tensor(parents), torch.full((len(tokens),), -0.5)
    ).validate()


# ------------------------------------------------------------------------------ the proposer
def test_longest_ngram_wins_and_its_latest_occurrence() -> None:
    lookup = PromptLookup(max_ngram=3, num_tokens=3)
    # suffix [7, 8, 9]: the 3-gram occurs once (followed by 1, 2, 3); the 2-gram [8, 9] also
    # occurs later (followed by 5): the longer match wins
    assert lookup.propose([7, 8, 9, 1, 2, 3, 4, 8, 9, 5, 6, 7, 8, 9]) == [1, 2, 3]
    # only 2-grams match: the latest occurrence of [8, 9] is used
    assert lookup.propose([8, 9, 1, 8, 9, 5, 6, 0, 8, 9]) == [5, 6, 0]


def test_falls_back_to_shorter_ngrams_and_to_nothing() -> None:
    lookup = PromptLookup(max_ngram=3, num_tokens=2)
    assert lookup.propose([4, 5, 6, 7, 4]) == [5, 6]  # only the 1-gram [4] matches
    assert lookup.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert PromptLookup(max_ngram=3, min_ngram=2).propose([4, 5, 6, 7, 4]) == []
    assert lookup.propose([3]) == []  # a one-token context has nothing before it


def test_continuation_stops_at_the_committed_end() -> None:
    # the latest match of [1] ends right before the root: its continuation is the root itself
    assert PromptLookup(max_ngram=1, num_tokens=5).propose([1, 1]) == [1]


def test_window_bounds_the_search() -> None:
    sequence = [5, 6, 7] + list(range(10, 40)) + [5]
    assert PromptLookup(max_ngram=1, num_tokens=2).propose(sequence) == [6, 7]
    assert PromptLookup(max_ngram=1, num_tokens=2, window=10).propose(sequence) == []


@pytest.mark.parametrize(
    "kwargs", [{"min_ngram": 0}, {"max_ngram": 1, "min_ngram": 2}, {"num_tokens": 0}, {"window": 2}]
)
def test_bad_lookup_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        PromptLookup(**kwargs)


# ------------------------------------------------------------------------------- the graft
def test_graft_follows_existing_nodes_then_appends() -> None:
    tree = _tree([10, 11, 12, 13], [-1, -1, 0, 1])  # 10 -> 12, 11 -> 13
    grafted = graft_chain(tree, [10, 12, 14, 15])
    assert grafted.validate().num_nodes == 6
    assert grafted.tokens.tolist() == [10, 11, 12, 13, 14, 15]
    assert grafted.parents.tolist() == [-1, -1, 0, 1, 2, 4]
    assert grafted.logprobs[4:].tolist() == [0.0, 0.0]  # the lookup's point mass
    assert grafted.logprobs[:4].tolist() == tree.logprobs.tolist()
    assert grafted.drafter_nodes == 4
    # the depth cached while grafting equals the one derived from the ancestor mask
    recomputed = DraftTree(grafted.tokens, grafted.parents, grafted.logprobs).depth
    assert grafted.depth.tolist() == recomputed.tolist() == [1, 1, 2, 2, 3, 4]
    assert tree.num_nodes == 4  # the input tree is untouched


def test_graft_of_a_new_root_branch_and_of_a_known_path() -> None:
    tree = _tree([10, 12], [-1, 0])
    assert graft_chain(tree, [10, 12]) is tree  # nothing new
    fresh = graft_chain(tree, [20, 21])
    assert fresh.parents.tolist() == [-1, 0, -1, 2]
    empty = graft_chain(DraftTree.empty(), [3, 4])
    assert empty.parents.tolist() == [-1, 0] and empty.drafter_nodes == 0


def test_subtree_of_a_grafted_tree_keeps_the_drafter_prefix() -> None:
    grafted = graft_chain(_tree([10, 11], [-1, -1]), [10, 5, 6])
    assert grafted.drafter_nodes == 2
    sub = grafted.select(torch.tensor([0, 2, 3]))
    assert sub.drafter_nodes == 1 and sub.parents.tolist() == [-1, 0, 1]
    assert grafted.to("cpu").drafter_nodes == 2


def test_policy_grafts_only_greedy_trees() -> None:
    policy = LookupPolicy(DynamicTreePolicy(2, 2, 4), PromptLookup(max_ngram=2, num_tokens=3))
    tree = _tree([10], [-1])
    sequence = [1, 2, 3, 4, 1, 2]
    assert policy.graft(tree, sequence, 0.0).tokens.tolist() == [10, 3, 4, 1]
    assert policy.graft(tree, sequence, 0.7) is tree  # T > 0: the drafter's tree only
    assert policy.max_nodes == 3 + 3 and policy.max_depth == 3  # 3: total_tokens minus the root


def test_stats_learn_how_deep_branches_are_accepted() -> None:
    stats = LookupStats(max_ngram=2, depth=4)
    torch.testing.assert_close(stats.reach(2), torch.ones(4))  # unseen: propose it all
    for _ in range(9):  # 2-gram branches whose first token is right and second wrong
        stats.pending = ([5, 6, 7, 8], 2)
        stats.observe([5, 9, 1])
    cond = torch.tensor([10 / 10, 1 / 10, 1.0, 1.0])  # depths 3, 4 were never reached
    torch.testing.assert_close(stats.reach(2), torch.cumprod(cond, 0))
    stats.observe([5])  # nothing pending: no change
    torch.testing.assert_close(stats.tried[2], torch.tensor([9.0, 9.0, 0.0, 0.0]))
    torch.testing.assert_close(stats.reach(1), torch.ones(4))  # other n-grams are apart


def test_min_reach_cuts_branches_the_decoder_learnt_are_rejected() -> None:
    policy = LookupPolicy(DynamicTreePolicy(2, 2, 4), PromptLookup(2, 4), min_reach=0.3)
    sequence = [1, 2, 3, 4, 5, 6, 1, 2]
    tree = _tree([10], [-1])
    assert policy.graft(tree, sequence, 0.0).num_nodes == 1 + 4  # nothing learnt yet
    for _ in range(5):
        policy.graft(tree, sequence, 0.0)
        policy.observe([3, 9])  # the target takes the first copied token only
    assert policy.graft(tree, sequence, 0.0).tokens.tolist() == [10, 3]
    with pytest.raises(ValueError, match="min_reach"):
        LookupPolicy(DynamicTreePolicy(2, 2, 4), PromptLookup(), min_reach=1.5)


# ------------------------------------------------------------------------------- tree specs
def test_tree_spec_with_a_lookup_branch() -> None:
    policy = parse_tree_spec("dynamic:2,3,6+lookup:2,5")
    assert isinstance(policy, LookupPolicy)
    assert policy.base == DynamicTreePolicy(2, 3, 6)
    assert policy.lookup == PromptLookup(max_ngram=2, num_tokens=5)
    assert parse_tree_spec("chain:2 + lookup").lookup == PromptLookup()  # type: ignore[attr-defined]
    assert parse_tree_spec("chain:2+lookup:3,8,0.05").min_reach == 0.05  # type: ignore[attr-defined]
    bad_specs = ("chain:2+lookahead:2,5", "chain:2+lookup:2", "chain:2+lookup:0,4", "x:1+lookup",
                 "chain:2+lookup:2,4,1.5", "chain:2+lookup:2,4,0.1,3")  # fmt: skip
    for bad in bad_specs:
        with pytest.raises(ValueError, match="bad tree spec"):
            parse_tree_spec(bad)


def test_training_and_rollouts_refuse_a_lookup_tree() -> None:
    require_drafter_policy(parse_tree_spec("chain:2"), "rollouts")  # the drafter's own: fine
    with pytest.raises(ValueError, match="drafter's own trees"):
        require_drafter_policy(parse_tree_spec("chain:2+lookup"), "rollouts")
    target = TargetModel.from_config(tiny_config("llama"), seed=1)
    with pytest.raises(ValueError, match="drafter's own trees"):
        DecoderRolloutSource(target, tree="chain:2+lookup")


# --------------------------------------------------------------------------- losslessness
@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request: pytest.FixtureRequest) -> dict:
    target = TargetModel.from_config(tiny_config(request.param), seed=11)
    with torch.no_grad():  # confident predictions: greedy text repeats itself, lookup hits
        for name, parameter in target.model.named_parameters():
            if "norm" not in name:
                parameter.mul_(5.0)
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=48, token_counts=torch.arange(128))
    return {"target": target, "drafter": drafter}


@pytest.mark.parametrize(
    "spec", ["chain:1+lookup:3,6", "dynamic:2,3,6+lookup:2,8", "dynamic:2,3,6+lookup:2,8,0.2"]
)
def test_greedy_output_with_lookup_equals_target(setup: dict, spec: str) -> None:
    target = setup["target"]
    decoder = SpeculativeDecoder(target, setup["drafter"], parse_tree_spec(spec))
    generator = torch.Generator().manual_seed(3)
    grafted_accepted = 0
    for _ in range(3):
        prompt = torch.randint(3, 128, (6,), generator=generator).tolist()
        prompt = prompt + prompt  # a prompt that quotes itself
        expected = autoregressive_generate(target, prompt, 40, stop_on_eos=False)
        result = decoder.generate(prompt, 40, stop_on_eos=False)
        assert result.tokens == expected
        for record in result.records:
            drafter_nodes = record.tree.drafter_nodes
            if drafter_nodes is not None:
                grafted_accepted += int((record.accepted >= drafter_nodes).sum())
    # the random drafter is almost never right: accepted grafted nodes prove the lookup
    # branch was verified, accepted and committed through the cache bookkeeping
    assert grafted_accepted > 0


def test_sampling_with_lookup_drafts_the_drafter_tree_only(setup: dict) -> None:
    decoder = SpeculativeDecoder(
        setup["target"], setup["drafter"], parse_tree_spec("chain:2+lookup:2,4"), temperature=1.0
    )
    result = decoder.generate([5, 6, 7, 5, 6, 7], 12, generator=torch.Generator().manual_seed(0))
    assert all(r.tree.drafter_nodes is None and r.tree.num_nodes == 2 for r in result.records)
