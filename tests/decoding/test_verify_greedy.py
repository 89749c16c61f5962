"""Greedy tree verification: hand-made cases and agreement with a naive path enumeration."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.decoding.verify import verify_greedy


def make_tree(parents: list[int], tokens: list[int]) -> DraftTree:
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        logprobs=torch.zeros(len(tokens)),
    )


def logits_with_argmax(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    """[len, vocab] logits whose row r has its maximum at argmaxes[r]."""
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return logits


def test_chain_all_accepted() -> None:
    tree = make_tree([-1, 0, 1], [2, 3, 1])
    result = verify_greedy(tree, logits_with_argmax([2, 3, 1, 6]))
    assert result.accepted.tolist() == [0, 1, 2]
    assert result.accept_length == 3
    assert result.bonus_token == 6
    assert result.committed_tokens(tree) == [2, 3, 1, 6]


def test_chain_mismatch_at_depth_two() -> None:
    tree = make_tree([-1, 0, 1], [2, 3, 1])
    # node 2 would match its row, but its parent (node 1) does not: nothing below depth 1 counts
    result = verify_greedy(tree, logits_with_argmax([2, 5, 1, 6]))
    assert result.accepted.tolist() == [0]
    assert result.bonus_token == 5


def test_no_accept_takes_root_argmax() -> None:
    tree = make_tree([-1, -1, 0], [2, 3, 4])
    result = verify_greedy(tree, logits_with_argmax([7, 4, 4, 4]))
    assert result.accepted.tolist() == []
    assert result.accept_length == 0
    assert result.bonus_token == 7


def test_empty_tree() -> None:
    tree = DraftTree.empty()
    result = verify_greedy(tree, logits_with_argmax([3]))
    assert result.accept_length == 0 and result.bonus_token == 3


def test_tie_goes_to_lowest_index() -> None:
    # two root children with the same token, each with a matching child: nodes 2 and 3 tie at
    # depth 2; node 2 wins, so the bonus comes from row 3 (node 2), not row 4 (node 3)
    tree = make_tree([-1, -1, 0, 1], [3, 3, 5, 5])
    result = verify_greedy(tree, logits_with_argmax([3, 5, 5, 1, 2]))
    assert result.accepted.tolist() == [0, 2]
    assert result.bonus_token == 1
    # same shape with the branches' order swapped: node 2 (child of node 1) still wins
    tree = make_tree([-1, -1, 1, 0], [3, 3, 5, 5])
    result = verify_greedy(tree, logits_with_argmax([3, 5, 5, 1, 2]))
    assert result.accepted.tolist() == [1, 2]
    assert result.bonus_token == 1


def test_deeper_branch_beats_lower_index() -> None:
    #  root -> 0 -> 2 ;  root -> 1 -> 3 -> 4 ; tokens chosen so both branches match
    tree = make_tree([-1, -1, 0, 1, 3], [1, 1, 2, 2, 4])
    result = verify_greedy(tree, logits_with_argmax([1, 2, 2, 0, 4, 6]))
    assert result.accepted.tolist() == [1, 3, 4]
    assert result.bonus_token == 6


def test_shape_check() -> None:
    tree = make_tree([-1, 0], [1, 2])
    with pytest.raises(ValueError, match="N \\+ 1"):
        verify_greedy(tree, torch.zeros(2, 4))


def naive_greedy(parents: list[int], tokens: list[int], argmax: list[int]) -> tuple[list, int]:
    """Enumerate root-to-leaf paths, count leading matches, keep the longest (lowest end node)."""
    n = len(parents)
    best_length, best_end = 0, -1
    leaves = [i for i in range(n) if i not in parents]
    for leaf in leaves:
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        length = 0
        for node in path:
            if tokens[node] != argmax[parents[node] + 1]:
                break
            length += 1
        if length == 0:
            continue
        end = path[length - 1]
        if length > best_length or (length == best_length and end < best_end):
            best_length, best_end = length, end
    if best_end < 0:
        return [], argmax[0]
    accepted, node = [], best_end
    while node >= 0:
        accepted.append(node)
        node = parents[node]
    return accepted[::-1], argmax[best_end + 1]


def test_random_trees_match_naive_enumeration() -> None:
    rng = random.Random(1)
    torch.manual_seed(1)
    depths_seen = set()
    for _ in range(400):
        n = rng.randrange(0, 25)
        vocab = rng.randrange(2, 5)  # small vocabularies so that long matches happen
        parents = [rng.randrange(-1, i) for i in range(n)]
        tokens = [rng.randrange(vocab) for _ in range(n)]
        logits = torch.randn(n + 1, vocab)
        tree = make_tree(parents, tokens)
        result = verify_greedy(tree, logits)
        accepted, bonus = naive_greedy(parents, tokens, logits.argmax(-1).tolist())
        assert result.accepted.tolist() == accepted
        assert result.bonus_token == bonus
        depths_seen.add(len(accepted))
    assert {0, 1, 2, 3} <= depths_seen  # the sweep really exercises deep acceptances


# ------------------------------------------------------------------------ end to end with policies
VOCAB = 6


def toy_logits(tag: str, context: tuple[int, ...]) -> torch.Tensor:
    seed = zlib.crc32(repr((tag, context[-3:])).encode())  # a 3-gram model: contexts recur
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.0


class ContextProposer:
    """A drafter that is the target plus context-dependent noise."""

    def __init__(self, context: tuple[int, ...]) -> None:
        self.context = context

    def logprobs(self, context: tuple[int, ...]) -> torch.Tensor:
        noisy = toy_logits("target", context) + 1.5 * toy_logits("noise", context)
        return torch.log_softmax(noisy, dim=-1)

    def root(self) -> torch.Tensor:
        return self.logprobs(self.context)

    def expand(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [
                self.logprobs(self.context + tuple(tree.tokens[tree.path_to(n)].tolist()))
                for n in nodes.tolist()
            ]
        )


@pytest.mark.parametrize("spec", ["chain:3", "static:small", "dynamic:3,3,10", "dynamic:4,2,6"])
def test_speculative_greedy_decode_equals_target_greedy_decode(spec: str) -> None:
    policy = parse_tree_spec(spec)
    prompt, length = (1, 2), 40
    reference = list(prompt)
    while len(reference) < length:
        reference.append(int(toy_logits("target", tuple(reference)).argmax()))
    sequence = list(prompt)
    steps = 0
    accepted_total = 0
    while len(sequence) < length:
        context = tuple(sequence)
        tree = policy.build(ContextProposer(context))
        rows = [toy_logits("target", context)] + [
            toy_logits("target", context + tuple(tree.tokens[tree.path_to(n)].tolist()))
            for n in range(tree.num_nodes)
        ]
        result = verify_greedy(tree, torch.stack(rows))
        sequence += result.committed_tokens(tree)
        accepted_total += result.accept_length
        steps += 1
    assert sequence[:length] == reference
    assert accepted_total > 0 and steps < length - len(prompt)  # drafts did get accepted
