"""SpeculativeDecoder end to end on tiny random targets: lossless, records, cache bookkeeping."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_spec.decoding.build import ChainPolicy, DynamicTreePolicy, parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.models.cache import cache_length
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.standalone import StandaloneDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config

POLICIES = ["chain:1", "chain:4", "static:tiny", "dynamic:3,3,8", "dynamic:5,4,16"]


def _noisy_copy(target: TargetModel, scale: float, seed: int) -> StandaloneDrafter:
    """The target with perturbed weights: a drafter that is right only part of the time."""
    model = copy.deepcopy(target.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + scale * torch.randn(parameter.shape, generator=generator))
    return StandaloneDrafter.from_model(model)


def _sharpened(target: TargetModel, factor: float = 5.0) -> TargetModel:
    """Scale a random target's weights so its predictions are confident, not near-uniform:
    then a slightly perturbed copy agrees with it part of the time (partial acceptance)."""
    with torch.no_grad():
        for name, parameter in target.model.named_parameters():
            if "norm" not in name:
                parameter.mul_(factor)
    return target


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request: pytest.FixtureRequest) -> dict:
    target = _sharpened(TargetModel.from_config(tiny_config(request.param), seed=11))
    return {
        "target": target,
        "eagle": Eagle3Drafter.from_target(
            target, draft_vocab_size=48, token_counts=torch.arange(128)
        ),
        "noisy": _noisy_copy(target, 0.05, seed=5),
        "self": StandaloneDrafter.from_model(target.model),
    }


@pytest.mark.parametrize("spec", POLICIES)
@pytest.mark.parametrize("drafter", ["eagle", "noisy", "self"])
def test_greedy_output_equals_target(setup: dict, spec: str, drafter: str) -> None:
    target = setup["target"]
    decoder = SpeculativeDecoder(target, setup[drafter], parse_tree_spec(spec))
    generator = torch.Generator().manual_seed(hash((spec, drafter)) % 1000)
    for _ in range(2):
        prompt = torch.randint(3, 128, (7,), generator=generator).tolist()
        expected = autoregressive_generate(target, prompt, 30, stop_on_eos=False)
        result = decoder.generate(prompt, 30, stop_on_eos=False)
        assert result.tokens == expected
        assert len(result.tokens) == 30
        # Every step commits accept_length + 1 tokens (the last may be cut by the limit).
        for record in result.records[:-1]:
            assert len(record.committed) == record.accept_length + 1


def test_partial_acceptance_happens(setup: dict) -> None:
    """The noisy drafter must exercise partial acceptance, so cache compaction is tested."""
    decoder = SpeculativeDecoder(setup["target"], setup["noisy"], ChainPolicy(4))
    result = decoder.generate(list(range(5, 15)), 40, stop_on_eos=False)
    lengths = {record.accept_length for record in result.records}
    assert len(lengths) > 1, f"noisy drafter should give varied acceptance, got {lengths}"


def test_self_drafter_commits_k_plus_one(setup: dict) -> None:
    decoder = SpeculativeDecoder(setup["target"], setup["self"], ChainPolicy(4))
    result = decoder.generate(list(range(3, 12)), 33, stop_on_eos=False)
    committed = [len(r.committed) for r in result.records]
    assert committed[:-1] == [5] * (len(committed) - 1)
    assert 1 <= committed[-1] <= 5
    assert sum(committed) + 1 == 33  # +1: the prefill's token


def test_records_describe_the_steps(setup: dict) -> None:
    target = setup["target"]
    decoder = SpeculativeDecoder(
        target, setup["noisy"], DynamicTreePolicy(3, 3, 8), keep_target_probs=True
    )
    prompt = list(range(20, 29))
    result = decoder.generate(prompt, 20, stop_on_eos=False)
    sequence = prompt + result.tokens
    position = len(prompt)  # the prefill token sits here and is the first root
    for record in result.records:
        assert record.anchor == position
        tree = record.tree
        assert record.target_token_logprobs.shape == (tree.num_nodes,)
        assert record.target_probs.shape == (tree.num_nodes + 1, 128)
        # Accepted tokens are the committed ones, in order, then the bonus (the last step may
        # be cut by the token limit).
        accepted = tree.tokens[record.accepted].tolist()
        assert record.committed[: record.accept_length] == accepted[: len(record.committed)]
        assert sequence[position + 1 : position + 1 + len(record.committed)] == record.committed
        # The recorded target log-prob of each node is read from its parent's row.
        rows = torch.log(record.target_probs[tree.parents + 1, tree.tokens])
        torch.testing.assert_close(rows, record.target_token_logprobs, atol=1e-4, rtol=1e-4)
        assert set(record.timings) == {"draft", "verify", "update"}
        # v2: tried = parent is the root or accepted; rejected = tried and not accepted.
        accepted_set = set(record.accepted.tolist())
        for node, parent in enumerate(tree.parents.tolist()):
            parent_open = parent < 0 or parent in accepted_set
            if not record.bonus_committed:
                last = record.accepted.tolist()[-1] if record.accept_length else -1
                parent_open = parent_open and parent != last
            assert bool(record.tried[node]) == parent_open
            assert (node in record.rejected.tolist()) == (parent_open and node not in accepted_set)
        if record.bonus_committed and record.first_rejected >= 0:
            assert record.first_rejected in record.rejected.tolist()
        position += len(record.committed)


def test_target_cache_tracks_sequence(setup: dict) -> None:
    """After every step the target cache holds all committed tokens but the root."""
    target = setup["target"]
    decoder = SpeculativeDecoder(target, setup["noisy"], ChainPolicy(3))
    seen = []
    session = decoder.start(list(range(30, 36)), 25, stop_on_eos=False)
    while not session.done:
        seen.append((cache_length(session.cache), len(session.sequence)))
        session.step()
    assert seen and all(length == size - 1 for length, size in seen)


def test_eos_stops_and_limits(setup: dict) -> None:
    target = setup["target"]
    prompt = list(range(40, 47))
    free = autoregressive_generate(target, prompt, 12, stop_on_eos=False)
    eos = free[5]
    decoder = SpeculativeDecoder(target, setup["self"], ChainPolicy(4), eos_token_ids=[eos])
    result = decoder.generate(prompt, 12)
    assert result.tokens == free[: free.index(eos) + 1]
    assert result.stopped_on_eos
    assert decoder.generate(prompt, 0).tokens == []
    assert autoregressive_generate(target, prompt, 0) == []  # no token, so no mismatch
    limit = target.context_length
    assert limit is not None
    with pytest.raises(ValueError, match="exceeds the target's context"):
        decoder.generate(prompt, limit)
    with pytest.raises(ValueError, match="exceeds the target's context"):
        autoregressive_generate(target, [5] * (limit - 2), 4)
    with pytest.raises(ValueError):
        decoder.generate([], 4)
    with pytest.raises(ValueError):
        decoder.generate([1000], 4)


def test_vocab_mismatch_is_refused(setup: dict) -> None:
    other = TargetModel.from_config(tiny_config("llama", vocab_size=96))
    with pytest.raises(ValueError, match="tokenizer"):
        SpeculativeDecoder(
            setup["target"], StandaloneDrafter.from_model(other.model), ChainPolicy(2)
        )


def _joint_tv(
    decoder: SpeculativeDecoder, target: TargetModel, prompt: list[int], runs: int
) -> float:
    """Total variation between the sampled and exact joint law of the 2nd and 3rd new tokens."""
    vocab = target.vocab_size
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(vocab, vocab)
    for _ in range(runs):
        tokens = decoder.generate(prompt, 3, generator=generator, stop_on_eos=False).tokens
        counts[tokens[1], tokens[2]] += 1  # tokens[0] is the prefill's; the rest are speculative
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1], -1)
        exact = torch.zeros(vocab, vocab)
        for a in range(vocab):
            p2 = torch.softmax(target(torch.tensor([prompt + [a]])).logits[0, -1], -1)
            for b in range(vocab):
                p3 = torch.softmax(target(torch.tensor([prompt + [a, b]])).logits[0, -1], -1)
                exact[b] += p1[a] * p2[b] * p3
    return float(0.5 * (counts / runs - exact).abs().sum())


@pytest.mark.parametrize("spec", ["chain:2", "dynamic:2,2,4"])
def test_sampling_preserves_target_distribution(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At T=1 the tokens produced by speculative steps follow the target's own law.

    V=3, so the joint of two tokens has 9 cells; with 400 runs the sampling noise in total
    variation is about 0.06. The same test with a verifier that accepts every draft (a classic
    bug) must fail by a wide margin: the check can tell right from wrong.
    """
    target = TargetModel.from_config(
        tiny_config("llama", vocab_size=3, hidden_size=32, num_layers=2), seed=2
    )
    with torch.no_grad():
        target.model.lm_head.weight.mul_(6.0)  # a peaked, far-from-uniform target
    other = TargetModel.from_config(
        tiny_config("llama", vocab_size=3, hidden_size=32, num_layers=1), seed=7
    )
    with torch.no_grad():
        other.model.lm_head.weight.mul_(6.0)
    decoder = SpeculativeDecoder(
        target, StandaloneDrafter.from_model(other.model), parse_tree_spec(spec), temperature=1.0
    )
    prompt = [2, 1, 2, 1]
    assert _joint_tv(decoder, target, prompt, runs=400) < 0.13

    from lightning_spec.decoding import engine, verify

    def accept_all(tree, probs, generator=None):
        path = torch.tensor(tree.path_to(tree.num_nodes - 1)) if tree.num_nodes else torch.zeros(0)
        return verify.Verification(accepted=path.long(), bonus_token=0)

    monkeypatch.setattr(engine, "verify_sample", accept_all)
    assert _joint_tv(decoder, target, prompt, runs=200) > 0.2


@pytest.mark.parametrize("spec", ["chain:2", "dynamic:2,2,4"])
def test_sampling_with_a_block_drafter_preserves_target_distribution(spec: str) -> None:
    """DFlash: every node's q row is its block slot's distribution (one forward per step), and
    sampling verification with those rows keeps the target's law."""
    from lightning_spec.models.drafters.dflash import DFlashDrafter

    target = TargetModel.from_config(
        tiny_config("llama", vocab_size=3, hidden_size=32, num_layers=2), seed=2
    )
    with torch.no_grad():
        target.model.lm_head.weight.mul_(6.0)
    drafter = DFlashDrafter.from_target(target, block_size=3, seed=4)
    with torch.no_grad():
        drafter.mask_embedding.mul_(50.0)  # slot rows far from uniform: a demanding proposal
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(spec), temperature=1.0)
    assert _joint_tv(decoder, target, [2, 1, 2, 1], runs=400) < 0.13


@pytest.mark.parametrize("kernel_min_cache", [0, None])
def test_kernel_fast_path_is_lossless(
    kernel_min_cache: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton tree attention + fused verify give the target's greedy output: compiled on a GPU
    (the target and drafter move there), interpreted on CPU. On a GPU, threshold 0 keeps every
    tree forward on the kernel, the default sends these short caches to SDPA."""
    from lightning_spec.kernels import TRITON_AVAILABLE
    from lightning_spec.models import target as target_module

    if not TRITON_AVAILABLE:
        pytest.skip("triton is not importable")
    if kernel_min_cache is None and not torch.cuda.is_available():
        pytest.skip("the short-cache SDPA dispatch acts on a GPU only")
    if kernel_min_cache is not None:
        monkeypatch.setattr(target_module, "KERNEL_MIN_CACHE_ON_GPU", kernel_min_cache)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = _sharpened(TargetModel.from_config(tiny_config("llama", num_layers=2), seed=4))
    drafter = _noisy_copy(target, 0.05, seed=1)
    target.model.to(device)
    drafter.to(device)
    prompt = list(range(10, 19))
    expected = autoregressive_generate(target, prompt, 12, stop_on_eos=False)
    decoder = SpeculativeDecoder(
        target, drafter, parse_tree_spec("dynamic:3,2,6"), use_kernels=True
    )
    assert target.model.config._attn_implementation == "lightning_spec_tree"
    result = decoder.generate(prompt, 12, stop_on_eos=False)
    assert result.tokens == expected
    assert any(record.accept_length > 0 for record in result.records)
