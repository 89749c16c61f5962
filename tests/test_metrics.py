"""Acceptance metrics on hand-made StepRecords: tau, alpha_j, and shard merging (DDP sums)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_spec import metrics, stats
from lightning_spec.decoding.engine import StepRecord
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.metrics import AcceptanceLength, PerDepthAcceptance, attempted_depth


def _record(parents: list[int], accepted: list[int], committed: list[int]) -> StepRecord:
    n = len(parents)
    tree = DraftTree(
        tokens=torch.arange(10, 10 + n),
        parents=torch.tensor(parents, dtype=torch.long),
        logprobs=torch.zeros(n),
    )
    return StepRecord(
        anchor=5,
        tree=tree,
        target_token_logprobs=torch.zeros(n),
        target_argmax=torch.zeros(n + 1, dtype=torch.long),
        accepted=torch.tensor(accepted, dtype=torch.long),
        committed=committed,
    )


def _chain(k: int, accepted: int) -> StepRecord:
    """A chain of k drafts with the first `accepted` accepted (+ the bonus token)."""
    return _record(list(range(-1, k - 1)), list(range(accepted)), [7] * (accepted + 1))


def test_tau_pools_committed_tokens_over_steps() -> None:
    metric = AcceptanceLength()
    with pytest.warns(UserWarning, match="before the"):  # torchmetrics: compute before update
        assert math.isnan(float(metric.compute()))
    metric.update_from_records([_chain(4, 2), _chain(4, 0), _chain(4, 4)])  # 3, 1, 5 tokens
    assert float(metric.compute()) == pytest.approx(3.0)
    metric.update([1])  # e.g. a step cut by EOS after one token
    assert float(metric.compute()) == pytest.approx(10 / 4)


def test_alpha_on_chains_by_hand() -> None:
    metric = PerDepthAcceptance(max_depth=3)
    metric.update_from_records([_chain(3, a) for a in (0, 1, 3, 2)])
    # attempts: depth 1: all 4; depth 2: steps with >= 1 accepted (3); depth 3: >= 2 (2).
    # accepted: depth 1: 3; depth 2: 2; depth 3: 1.
    torch.testing.assert_close(
        metric.compute(), torch.tensor([3 / 4, 2 / 3, 1 / 2], dtype=torch.float64)
    )


def test_alpha_counts_only_depths_the_accepted_branch_offered() -> None:
    # Root children: node 0 (a leaf) and node 1, whose child is node 2 (depth 2).
    leaf_accepted = _record([-1, -1, 1], accepted=[0], committed=[7, 8])
    branch_accepted = _record([-1, -1, 1], accepted=[1], committed=[7, 8])
    assert attempted_depth(leaf_accepted) == 1  # nothing below node 0: no depth-2 attempt
    assert attempted_depth(branch_accepted) == 2
    assert attempted_depth(_record([], accepted=[], committed=[3])) == 0
    metric = PerDepthAcceptance(max_depth=4)
    metric.update_from_records([leaf_accepted, branch_accepted])
    alpha = metric.compute()
    assert alpha[:2].tolist() == [1.0, 0.0]  # depth 2: one attempt, rejected
    assert all(math.isnan(v) for v in alpha[2:].tolist())  # never attempted


def test_dynamic_tree_that_stops_short_is_not_a_rejection() -> None:
    """The example on which the two old definitions of alpha disagreed.

    One dynamic tree (tree depth 3): root -> node 0 (a leaf) and node 1; node 1 -> node 2;
    node 2 -> node 3. Four steps:
        A accepts [0]     a=1, node 0 has no child: depth 2 not attempted (attempted 1)
        B accepts [1, 2]  a=2, node 2 has a child, rejected at depth 3  (attempted 3)
        C accepts []      a=0, rejected at depth 1                       (attempted 1)
        D accepts [1]     a=1, node 1 has a child, rejected at depth 2  (attempted 2)
    alpha_1 = 3/4 (A, B, D of 4); alpha_2 = 1/2 (B of B, D); alpha_3 = 0/1 (B).
    Bounding each step by the tree's depth (the old `stats.per_depth_acceptance` of
    `tree.max_depth`, used by the bench) counted A as a rejection at depth 2: alpha_2 = 1/3.
    """
    parents = [-1, -1, 1, 2]
    records = [
        _record(parents, accepted=[0], committed=[7, 8]),
        _record(parents, accepted=[1, 2], committed=[7, 8, 9]),
        _record(parents, accepted=[], committed=[7]),
        _record(parents, accepted=[1], committed=[7, 8]),
    ]
    assert [attempted_depth(r) for r in records] == [1, 3, 1, 2]
    expected = [3 / 4, 1 / 2, 0.0]
    assert metrics.alpha_from_records(records) == pytest.approx(expected)
    assert stats.alpha_from_records(records) == pytest.approx(expected)  # the same function
    metric = PerDepthAcceptance(max_depth=3)
    metric.update_from_records(records)
    assert metric.compute().tolist() == pytest.approx(expected)
    # the bench's path: accepted lengths and attempted depths per step, pooled over prompts
    lengths = [metrics.accepted_length(r) for r in records]
    attempted = [attempted_depth(r) for r in records]
    assert stats.per_depth_acceptance(lengths, attempted) == pytest.approx(expected)
    # the old bound (tree depth) on the same steps: A becomes a rejection at depth 2
    tree_depths = [r.tree.max_depth for r in records]
    assert tree_depths == [3, 3, 3, 3]
    assert metrics.per_depth_acceptance(lengths, tree_depths) == pytest.approx([3 / 4, 1 / 3, 0.0])
    # tau is the same everywhere: (2 + 3 + 1 + 2) / 4
    assert metrics.tau_from_records(records) == pytest.approx(2.0)
    tau = AcceptanceLength()
    tau.update_from_records(records)
    assert float(tau.compute()) == pytest.approx(2.0)


def test_a_step_cut_by_the_token_limit_attempted_nothing_past_the_cut() -> None:
    # chain of 4, all accepted by the target, but only 2 tokens fit under the limit: the
    # record keeps 2 accepted drafts and no bonus (StepRecord.cut); depth 3 was not attempted.
    cut = _record(list(range(-1, 3)), accepted=[0, 1], committed=[7, 8])
    assert attempted_depth(cut) == 2
    assert metrics.alpha_from_records([cut, _chain(4, 4)]) == pytest.approx([1.0] * 4)
    eos_first = _record(list(range(-1, 3)), accepted=[0], committed=[2])  # EOS drafted first
    assert attempted_depth(eos_first) == 1


def test_depths_beyond_max_are_ignored_and_bad_input_rejected() -> None:
    metric = PerDepthAcceptance(max_depth=2)
    metric.update([5], [6])
    assert metric.compute().tolist() == [1.0, 1.0]
    with pytest.raises(ValueError):
        metric.update([3], [2])
    with pytest.raises(ValueError):
        PerDepthAcceptance(max_depth=0)


def test_shards_merge_to_the_whole() -> None:
    """States are sums (dist_reduce_fx="sum"): merging rank shards equals one process."""
    records = [_chain(4, a) for a in (0, 4, 2, 1, 3, 3, 0)]
    whole_tau, whole_alpha = AcceptanceLength(), PerDepthAcceptance(4)
    whole_tau.update_from_records(records)
    whole_alpha.update_from_records(records)
    shards = [records[0::2], records[1::2]]
    tau_parts = [AcceptanceLength() for _ in shards]
    alpha_parts = [PerDepthAcceptance(4) for _ in shards]
    for part, tau, alpha in zip(shards, tau_parts, alpha_parts, strict=True):
        tau.update_from_records(part)
        alpha.update_from_records(part)
    tau_parts[0].merge_state(tau_parts[1])
    alpha_parts[0].merge_state(alpha_parts[1])
    torch.testing.assert_close(tau_parts[0].compute(), whole_tau.compute())
    torch.testing.assert_close(alpha_parts[0].compute(), whole_alpha.compute())
    for metric in (whole_tau, whole_alpha):
        assert set(metric._reductions) and all(
            fx is not None and fx.__name__.endswith("sum") for fx in metric._reductions.values()
        )
