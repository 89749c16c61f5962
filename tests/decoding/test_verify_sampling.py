"""Lossless sampling verification, checked statistically on a toy target defined by a table.

The committed tokens must follow the target exactly: the first committed token ~ p(x1) and the
first two ~ p(x1) p(x2 | x1), for chains and trees of i.i.d. children (SpecInfer rule) and trees
of deterministic top-k children (EAGLE rule). Each check is a chi-square test with a threshold
whose false-alarm probability is ~1e-9; broken variants (the wrong rule for the tree, no residual
subtraction, no renormalisation) must fail the same test, which proves the test can fail.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from lightning_spec.decoding import verify
from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.decoding.verify import verify_sample

VOCAB = 5
Context = tuple[int, ...]


class ToyModels:
    """Target p(. | context) and draft q(. | context) from seeded tables keyed by the context."""

    def __init__(self, seed: int = 0, mix: float = 0.5) -> None:
        self.seed, self.mix = seed, mix
        self.p_rows: dict[Context, Tensor] = {}
        self.q_rows: dict[Context, Tensor] = {}
        self.q_cumulative: dict[Context, list[float]] = {}

    def _row(self, tag: str, context: Context, scale: float) -> Tensor:
        key = zlib.crc32(repr((self.seed, tag, context)).encode())
        logits = torch.randn(
            VOCAB, generator=torch.Generator().manual_seed(key), dtype=torch.float64
        )
        return torch.softmax(logits * scale, dim=-1)

    def p(self, context: Context) -> Tensor:
        if context not in self.p_rows:
            self.p_rows[context] = self._row("p", context, 1.0).float()
        return self.p_rows[context]

    def q(self, context: Context) -> Tensor:
        """A drafter that is partly right: q = mix p + (1 - mix) r with an unrelated r."""
        if context not in self.q_rows:
            row = self.mix * self.p(context).double() + (1 - self.mix) * self._row(
                "q", context, 1.5
            )
            self.q_rows[context] = row.float()
            self.q_cumulative[context] = torch.cumsum(row, 0).tolist()
        return self.q_rows[context]

    def sample_q(self, context: Context, rng: random.Random) -> int:
        self.q(context)
        return rng.choices(range(VOCAB), cum_weights=self.q_cumulative[context])[0]


def node_contexts(parents: list[int], tokens: list[int], context: Context) -> list[Context]:
    """Context after each node (the prefix + the node's path)."""
    result: list[Context] = []
    for node, parent in enumerate(parents):
        base = context if parent < 0 else result[parent]
        result.append(base + (tokens[node],))
    return result


class TreeMaker:
    """Draft trees of a fixed shape at a given context, with their target rows."""

    def __init__(self, models: ToyModels, parents: list[int], iid: bool, seed: int = 0) -> None:
        self.models, self.parents, self.iid = models, parents, iid
        self.parents_tensor = torch.tensor(parents, dtype=torch.long)
        self.rng = random.Random(seed)
        self.cache: dict[tuple[Context, Context], tuple[DraftTree, Tensor]] = {}
        self.inner = {parent for parent in parents if parent >= 0}

    def __call__(self, context: Context) -> tuple[DraftTree, Tensor]:
        tokens: list[int] = []
        contexts: list[Context] = []
        rank_at: dict[int, int] = {}  # parent -> next child rank (deterministic children)
        for parent in self.parents:
            base = context if parent < 0 else contexts[parent]
            if self.iid:
                token = self.models.sample_q(base, self.rng)
            else:
                rank = rank_at.get(parent, 0)
                rank_at[parent] = rank + 1
                token = int(self.models.q(base).argsort(descending=True)[rank])
            tokens.append(token)
            contexts.append(base + (token,))
        key = (context, tuple(tokens))
        if key not in self.cache:  # trees are immutable: reuse them across draws
            self.cache[key] = self._build(context, tokens, contexts)
        return self.cache[key]

    def _build(
        self, context: Context, tokens: list[int], contexts: list[Context]
    ) -> tuple[DraftTree, Tensor]:
        models, n = self.models, len(self.parents)
        zeros = torch.zeros(VOCAB)
        draft_rows = [models.q(context)] + [
            models.q(contexts[node]) if node in self.inner else zeros for node in range(n)
        ]
        tree = DraftTree(
            tokens=torch.tensor(tokens, dtype=torch.long),
            parents=self.parents_tensor,
            logprobs=torch.zeros(n),
            draft_probs=torch.stack(draft_rows),
            iid_children=self.iid,
        )
        target = torch.stack([models.p(context)] + [models.p(c) for c in contexts])
        return tree, target


def first_two_tokens(
    make: Callable[[Context], tuple[DraftTree, Tensor]],
    generator: torch.Generator,
    lengths: list[int] | None = None,
) -> tuple[int, int]:
    """Run speculative steps from the empty context until two tokens are committed."""
    committed: list[int] = []
    while len(committed) < 2:
        tree, target = make(tuple(committed))
        result = verify_sample(tree, target, generator=generator)
        if lengths is not None and not committed:
            lengths.append(result.accept_length)
        committed += result.committed_tokens(tree)
    return committed[0], committed[1]


def chi_square_threshold(dof: int, z: float = 6.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof) at z sigmas (z = 6: ~1e-9 tail)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def chi_square(counts: Tensor, expected_probs: Tensor) -> tuple[float, int]:
    total = float(counts.sum())
    expected = expected_probs.double() * total
    statistic = float(((counts.double() - expected) ** 2 / expected).sum())
    return statistic, counts.numel() - 1


def joint_target(models: ToyModels) -> Tensor:
    """[V, V] exact law of the first two tokens: p(x1) p(x2 | x1)."""
    p1 = models.p(()).double()
    return torch.stack([p1[x] * models.p((x,)).double() for x in range(VOCAB)])


def run(make: Callable, draws: int, seed: int, lengths: list[int] | None = None) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(draws):
        x1, x2 = first_two_tokens(make, generator, lengths)
        counts[x1, x2] += 1
    return counts


SHAPES = {
    # (parents, iid children)
    "chain_specinfer": ([-1, 0, 1], True),
    "iid_tree_specinfer": ([-1, -1, 0, 0, 1], True),
    "topk_tree_eagle": ([-1, -1, -1, 0, 0, 1, 3], False),
}
DRAWS = 8_000


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_committed_tokens_follow_the_target(shape: str) -> None:
    parents, iid = SHAPES[shape]
    models = ToyModels(seed=0, mix=0.5)  # ~77% per-token acceptance at the root
    lengths: list[int] = []
    counts = run(TreeMaker(models, parents, iid, seed=2), DRAWS, seed=3, lengths=lengths)
    joint = joint_target(models)
    first, dof_first = chi_square(counts.sum(1), joint.sum(1))
    both, dof_both = chi_square(counts.flatten(), joint.flatten())
    assert first < chi_square_threshold(dof_first), (shape, first)
    assert both < chi_square_threshold(dof_both), (shape, both)
    # the draws really exercise rejections at the root and acceptances down to the leaves
    depth = max(len(context) for context in node_contexts(parents, [0] * len(parents), ()))
    assert set(range(depth + 1)) <= set(lengths), sorted(set(lengths))


NEGATIVE_DRAWS = 2_000


def first_token_statistic(make: Callable, models: ToyModels, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB)
    for _ in range(NEGATIVE_DRAWS):
        tree, target = make(())
        counts[verify_sample(tree, target, generator=generator).committed_tokens(tree)[0]] += 1
    statistic, dof = chi_square(counts, models.p(()))
    ratio = statistic / chi_square_threshold(dof)  # > 1 = rejected as "not the target's law"
    print(f"chi-square / threshold = {ratio:.2f}")
    return ratio


def test_negative_specinfer_rule_on_topk_children_is_detected() -> None:
    """Deterministic children verified as if they were drawn from q: biased towards them."""
    models = ToyModels(seed=0, mix=0.0)  # a poor drafter: large biases when broken
    honest = TreeMaker(models, [-1, -1, -1], iid=False)
    assert first_token_statistic(honest, models, seed=4) < 1.0

    def mislabelled(context: Context) -> tuple[DraftTree, Tensor]:
        tree, target = honest(context)
        return DraftTree(tree.tokens, tree.parents, tree.logprobs, tree.draft_probs, True), target

    assert first_token_statistic(mislabelled, models, seed=4) > 3.0


def test_negative_missing_residual_subtraction_is_detected(monkeypatch) -> None:
    """Correcting from p instead of normalize(max(0, p - q)) double-counts accepted mass."""
    models = ToyModels(seed=0, mix=0.0)  # a poor drafter: large biases when broken
    make = TreeMaker(models, [-1, 0], iid=True, seed=5)
    assert first_token_statistic(make, models, seed=6) < 1.0
    monkeypatch.setattr(verify, "_specinfer_residual", lambda p, q: p.clone())
    assert first_token_statistic(make, models, seed=6) > 3.0


def test_negative_missing_renormalisation_is_detected(monkeypatch) -> None:
    """Accepting a later sibling with its raw p(c) instead of p(c) / (1 - rejected mass)."""
    models = ToyModels(seed=0, mix=0.5)  # good top-k children: big rejected mass
    make = TreeMaker(models, [-1, -1, -1], iid=False)
    assert first_token_statistic(make, models, seed=7) < 1.0
    monkeypatch.setattr(verify, "_eagle_accept_probability", lambda p_child, remaining: p_child)
    assert first_token_statistic(make, models, seed=7) > 3.0


def test_iid_children_accepting_with_p_is_still_lossless(monkeypatch) -> None:
    """Worth pinning down: the EAGLE rule never looks at q, so it stays exact even for children
    drawn i.i.d. from q (it only accepts less often than the SpecInfer rule)."""
    models = ToyModels(seed=0, mix=0.0)
    make = TreeMaker(models, [-1, -1, -1], iid=True, seed=8)

    def as_eagle(context: Context) -> tuple[DraftTree, Tensor]:
        tree, target = make(context)
        return DraftTree(tree.tokens, tree.parents, tree.logprobs, None, False), target

    assert first_token_statistic(as_eagle, models, seed=9) < 1.0


# ---------------------------------------------------------------------------- degenerate inputs
def tree_of(parents: list[int], tokens: list[int], draft_probs=None, iid=False) -> DraftTree:
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        torch.zeros(len(tokens)),
        draft_probs=draft_probs,
        iid_children=iid,
    )


def test_zero_draft_probability_and_zero_target_mass() -> None:
    # the child has q = 0 (impossible under q, but it must not produce NaNs) and p = 0
    q = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
    p = torch.tensor([[0.0, 0.0, 0.3, 0.7], [0.25] * 4])
    generator = torch.Generator().manual_seed(0)
    tree = tree_of([-1], [0], q, iid=True)
    for _ in range(50):
        result = verify_sample(tree, p, generator=generator)
        assert result.accept_length == 0 and result.bonus_token in (2, 3)
    # q = 0 but p > 0: always accepted, then the bonus comes from the leaf's row
    tree = tree_of([-1], [3], q, iid=True)
    for _ in range(50):
        assert verify_sample(tree, p, generator=generator).accept_length == 1


def test_target_equal_to_draft_always_accepts() -> None:
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25] * 4, [0.25] * 4])
    generator = torch.Generator().manual_seed(0)
    tree = tree_of([-1, 0], [1, 2], q, iid=True)
    for _ in range(100):
        result = verify_sample(tree, q.clone(), generator=generator)
        assert result.accept_length == 2


def test_duplicate_and_exhaustive_deterministic_children() -> None:
    # all target mass sits on the children; the duplicate (node 2) can never be accepted
    p = torch.tensor([[0.6, 0.4, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    tree = tree_of([-1, -1, -1], [0, 1, 0])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(2000):
        result = verify_sample(tree, p, generator=generator)
        assert result.accept_length == 1 and int(result.accepted[0]) in (0, 1)
        counts[result.committed_tokens(tree)[0]] += 1
    assert abs(float(counts[0]) / 2000 - 0.6) < 0.05 and counts[2] == 0


def test_unnormalised_rows_and_empty_tree() -> None:
    generator = torch.Generator().manual_seed(0)
    tree = DraftTree.empty()
    result = verify_sample(tree, torch.tensor([[0.0, 3.0, 0.0]]), generator=generator)
    assert result.accept_length == 0 and result.bonus_token == 1


def test_sample_helper_falls_back_and_refuses_empty_rows() -> None:
    fallback = torch.tensor([0.0, 0.0, 1.0])
    assert verify.inverse_cdf_sample(torch.zeros(3), 0.5, fallback=fallback) == 2
    assert (
        verify.inverse_cdf_sample(torch.tensor([0.0, 1.0, 0.0]), 0.999999, fallback=fallback) == 1
    )
    with pytest.raises(ValueError, match="no probability mass"):
        verify.inverse_cdf_sample(torch.zeros(3), 0.5)


def test_iid_tree_needs_draft_probs() -> None:
    tree = tree_of([-1], [0], None, iid=True)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sample(tree, torch.full((2, 3), 1 / 3))


def test_seeded_generator_reproduces() -> None:
    models = ToyModels(seed=2)
    make = TreeMaker(models, [-1, -1, 0, 1], iid=False)
    tree, target = make(())
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(123)
        runs.append([verify_sample(tree, target, generator=generator) for _ in range(30)])
    for a, b in zip(*runs, strict=True):
        assert a.accepted.tolist() == b.accepted.tolist() and a.bonus_token == b.bonus_token


# ------------------------------------------------------------------ policies end to end at T > 0
class ToyProposer:
    """The toy drafter q behind the tree policies' `Proposer` interface, at the empty context."""

    def __init__(self, models: ToyModels) -> None:
        self.models = models

    def root(self) -> Tensor:
        return self.models.q(()).log()

    def expand(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        paths = [tuple(tree.tokens[tree.path_to(node)].tolist()) for node in nodes.tolist()]
        return torch.stack([self.models.q(path).log() for path in paths])


@pytest.mark.parametrize(("spec", "draws"), [("chain:2", 2_000), ("static:tiny", 4_000)])
def test_policy_trees_verify_losslessly(spec: str, draws: int) -> None:
    """Trees exactly as the policies build them at T > 0 (sampled chains keep q rows, top-k
    trees do not need them) commit a first token distributed as the target's."""
    models = ToyModels(seed=0, mix=0.5)
    policy = parse_tree_spec(spec)
    proposer = ToyProposer(models)
    generator = torch.Generator().manual_seed(10)
    counts = torch.zeros(VOCAB)
    tree, target = None, None
    for _ in range(draws):
        if tree is None or tree.iid_children:  # top-k trees are the same at every draw
            tree = policy.build(
                proposer, temperature=1.0, generator=generator, keep_draft_probs=True
            )
            rows = [models.p(())] + [
                models.p(tuple(tree.tokens[tree.path_to(node)].tolist()))
                for node in range(tree.num_nodes)
            ]
            target = torch.stack(rows)
        result = verify_sample(tree, target, generator=generator)
        counts[result.committed_tokens(tree)[0]] += 1
    statistic, dof = chi_square(counts, models.p(()))
    assert statistic < chi_square_threshold(dof), statistic
