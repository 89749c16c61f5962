"""The seams objectives stand on: batched drafting, many trees scored over one sequence cache,
paths re-scored with gradients, the decode session, StepRecord v2 and tiny temperatures."""

from __future__ import annotations

import pytest
import torch

from lightning_spec.decoding.acceptance import branch_values, branch_values_from_factors
from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, StepRecord, autoregressive_generate
from lightning_spec.decoding.score import score_trees_target
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.models.cache import cache_length, truncate_cache
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.proposer import DrafterProposer
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


@pytest.fixture(scope="module")
def models() -> dict:
    target = TargetModel.from_config(tiny_config("llama"), seed=3)
    with torch.no_grad():  # confident predictions, so trees and acceptance are not all ties
        for name, parameter in target.model.named_parameters():
            if "norm" not in name:
                parameter.mul_(4.0)
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=64, token_counts=torch.arange(128))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.requires_grad:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    sequence = torch.randint(0, 128, (1, 40), generator=generator)
    features = target(sequence, use_cache=False).features
    return {"target": target, "drafter": drafter.eval(), "ids": sequence, "features": features}


def _sequence_proposer(models: dict, roots: torch.Tensor) -> DrafterProposer:
    return DrafterProposer.from_sequence(
        models["drafter"], models["ids"], roots, features=models["features"]
    )


def _single_proposer(models: dict, root: int) -> DrafterProposer:
    """The decoder's own B = 1 proposer for a root at `root`: absorb t_1 .. t_root."""
    drafter, ids, features = models["drafter"], models["ids"], models["features"]
    state = drafter.new_state(1)
    out = drafter.step(
        state, ids[:, 1 : root + 1], torch.arange(1, root + 1)[None], features=features[:, :root]
    )
    return drafter.proposer(state, out.logits[0, -1:], out.hidden[0, -1:], torch.tensor([root]))


@pytest.mark.parametrize("spec", ["chain:4", "static:small", "dynamic:4,3,12"])
def test_build_batch_equals_single_builds(models: dict, spec: str) -> None:
    """16 trees from one teacher-forced pass == 16 decoder-style B = 1 builds."""
    policy = parse_tree_spec(spec)
    roots = torch.arange(8, 40, 2)  # 16 prefixes
    with torch.no_grad():
        batch = policy.build_batch(_sequence_proposer(models, roots))
        for root, tree in zip(roots.tolist(), batch, strict=True):
            single_proposer = _single_proposer(models, root)
            single = policy.build(single_proposer)
            single_proposer.finish()
            assert torch.equal(tree.tokens, single.tokens), (spec, root)
            assert torch.equal(tree.parents, single.parents)
            torch.testing.assert_close(tree.logprobs, single.logprobs, atol=1e-5, rtol=1e-5)


def test_path_logprobs_match_build_and_have_gradients(models: dict) -> None:
    policy = parse_tree_spec("dynamic:4,3,12")
    drafter = models["drafter"]
    roots = torch.tensor([5, 11, 17, 30])
    with torch.no_grad():
        trees = policy.build_batch(_sequence_proposer(models, roots))
    paths, lengths, expected = [], [], []
    for tree in trees:  # the deepest branch of each tree
        leaf = int(tree.depth.argmax())
        path = tree.path_to(leaf)
        paths.append(tree.tokens[path])
        lengths.append(len(path))
        expected.append(tree.logprobs[path])
    width = max(lengths)
    padded = torch.stack([torch.nn.functional.pad(p, (0, width - len(p))) for p in paths])
    drafter.zero_grad()
    proposer = _sequence_proposer(models, roots)  # gradients on: a fresh teacher-forced pass
    scored = proposer.path_logprobs(padded, torch.tensor(lengths))
    for row, values in enumerate(expected):
        torch.testing.assert_close(scored[row, : len(values)], values, atol=1e-5, rtol=1e-5)
    assert scored.requires_grad
    scored.sum().backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    assert drafter.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0


def test_score_64_trees_over_one_sequence_equals_single_verifications(models: dict) -> None:
    target, ids = models["target"], models["ids"]
    policy = parse_tree_spec("dynamic:3,3,8")
    roots = torch.cat([torch.arange(4, 36), torch.arange(4, 36)])  # 64 trees
    with torch.no_grad():
        trees = policy.build_batch(_sequence_proposer(models, roots))
        cache = target(ids).cache
        many = score_trees_target(
            target,
            cache,
            trees,
            ids[0, roots],
            roots,
            outputs=("logprobs", "argmax", "topk"),
            top_k=5,
            max_tokens=200,  # 64 x 8 rows: three chunked forwards
        )
        assert cache_length(cache) == ids.shape[1]  # restored
        for tree, root, scores in zip(trees, roots.tolist(), many, strict=True):
            single_cache = target(ids[:, :root]).cache
            single = score_trees_target(
                target, single_cache, [tree], [int(ids[0, root])], [root], outputs=("rows",)
            )[0]
            expected = torch.log_softmax(single.rows, -1)[tree.parents + 1, tree.tokens]
            torch.testing.assert_close(scores.token_logprobs, expected, atol=1e-5, rtol=1e-5)
            assert torch.equal(scores.argmax, single.rows.argmax(-1))
            assert scores.topk_ids.shape == (tree.num_nodes + 1, 5)
            # per-node factors give GTO's branch values without dense rows
            dense = branch_values(tree, torch.softmax(single.rows, -1))
            sparse = branch_values_from_factors(tree, scores.token_logprobs.exp())
            torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)


def test_session_refresh_keeps_output_lossless(models: dict) -> None:
    """Swapping the drafter between steps (re-absorbing the committed tokens) stays lossless,
    and the kept features equal one target pass over the committed sequence."""
    target, drafter = models["target"], models["drafter"]
    other = Eagle3Drafter.from_target(target, draft_vocab_size=64, token_counts=torch.arange(128))
    decoder = SpeculativeDecoder(
        target, drafter, parse_tree_spec("dynamic:3,3,8"), keep_features=True
    )
    prompt = list(range(10, 22))
    session = decoder.start(prompt, 30, stop_on_eos=False)
    steps = 0
    while not session.done:
        session.step()
        steps += 1
        if steps == 2:
            session.refresh(other, version="v2")
    result = session.result()
    assert result.tokens == autoregressive_generate(target, prompt, 30, stop_on_eos=False)
    assert result.records[0].drafter_version is None
    assert result.records[-1].drafter_version == "v2"
    full = torch.tensor([prompt + result.tokens])
    expected = target(full, use_cache=False).features[0, :-1]
    assert result.features.shape == expected.shape
    torch.testing.assert_close(result.features, expected, atol=1e-4, rtol=1e-4)


def test_step_record_cut_and_tried() -> None:
    # root -> 0 -> 1 -> 2 ; root -> 3 ; 0 -> 4
    tree = DraftTree(
        tokens=torch.tensor([5, 6, 7, 8, 9]),
        parents=torch.tensor([-1, 0, 1, -1, 0]),
        logprobs=torch.zeros(5),
    )
    record = StepRecord(
        anchor=3,
        tree=tree,
        target_token_logprobs=torch.zeros(5),
        target_argmax=torch.zeros(6, dtype=torch.long),
        accepted=torch.tensor([0, 1]),
        committed=[5, 6, 11],
    )
    assert record.tried.tolist() == [True, True, True, True, True]
    assert record.rejected.tolist() == [2, 3, 4]
    assert record.first_rejected == 2
    cut = record.cut(1)  # e.g. EOS was the first accepted draft
    assert cut.committed == [5] and cut.accepted.tolist() == [0] and not cut.bonus_committed
    assert cut.tried.tolist() == [True, False, False, True, False]  # 0's children untried
    assert cut.rejected.tolist() == [3] and cut.first_rejected == -1
    assert record.cut(3) is record


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-6])
def test_tiny_temperature_is_greedy_not_nan(models: dict, temperature: float) -> None:
    target, drafter = models["target"], models["drafter"]
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec("chain:3"))
    prompt = list(range(30, 40))
    generator = torch.Generator().manual_seed(0)
    result = decoder.generate(prompt, 16, temperature=temperature, generator=generator)
    assert result.tokens == autoregressive_generate(target, prompt, 16)


def test_sampling_keeps_draft_rows_only_where_verification_reads_them(models: dict) -> None:
    target, drafter = models["target"], models["drafter"]
    generator = torch.Generator().manual_seed(1)
    for spec, kept in [("dynamic:3,3,8", False), ("static:tiny", False), ("chain:3", True)]:
        decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(spec), temperature=0.8)
        result = decoder.generate(list(range(5, 15)), 12, generator=generator, stop_on_eos=False)
        assert all((r.tree.draft_probs is not None) == kept for r in result.records), spec


def test_negative_or_nan_temperature_is_refused(models: dict) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SpeculativeDecoder(
            models["target"], models["drafter"], parse_tree_spec("chain:2"), temperature=-1.0
        )
    with pytest.raises(ValueError, match="temperature"):
        SpeculativeDecoder(
            models["target"], models["drafter"], parse_tree_spec("chain:2"),
            temperature=float("nan"),
        )


def test_score_keep_block_is_for_one_tree(models: dict) -> None:
    target, ids = models["target"], models["ids"]
    cache = target(ids[:, :10]).cache
    tree = DraftTree(torch.tensor([1]), torch.tensor([-1]), torch.zeros(1))
    with pytest.raises(ValueError, match="one tree"):
        score_trees_target(target, cache, [tree, tree], [1, 1], [10, 10], keep_block=True)
    truncate_cache(cache, 10)


@pytest.mark.parametrize("max_new_tokens", [7, 8, 9])
def test_kept_features_match_the_tokens_when_the_budget_cuts_a_step(
    models: dict, max_new_tokens: int
) -> None:
    """The target drafting for itself accepts every draft, so the last step commits more
    tokens than the budget leaves: the kept features are cut with the tokens (one row per
    committed token but the last), which OnlineSpec's feedback batch relies on."""
    from lightning_spec import specs

    target = models["target"]
    drafter = specs.resolve_drafter("self", target)
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec("chain:4"), keep_features=True)
    prompt = list(range(10, 22))
    result = decoder.generate(prompt, max_new_tokens, stop_on_eos=False)
    assert len(result.tokens) == max_new_tokens
    assert result.features.shape[0] == len(prompt) + max_new_tokens - 1
    expected = target(torch.tensor([prompt + result.tokens]), use_cache=False).features[0, :-1]
    torch.testing.assert_close(result.features, expected, atol=1e-4, rtol=1e-4)
