"""BigramDrafter: counts, most-frequent successor, state bookkeeping, persistence, decoding."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.models.drafters import bigram as bigram_module
from lightning_spec.models.drafters.base import load_drafter
from lightning_spec.models.drafters.bigram import BigramDrafter, count_bigrams
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config

VOCAB = 16
CORPUS = [
    [1, 5, 6, 5, 6, 5, 7],  # 5 -> 6 twice, 5 -> 7 once
    [5, 6, 9],  # 5 -> 6 again
    [3, 4, 3, 4, 3, 8],  # 3 -> 4 twice, 3 -> 8 once
]


@pytest.fixture(scope="module")
def drafter() -> BigramDrafter:
    return BigramDrafter.from_sequences(CORPUS, VOCAB, top_successors=2)


def test_counts_match_a_naive_count() -> None:
    codes, counts, unigrams = count_bigrams(CORPUS, VOCAB)
    naive = Counter((a, b) for seq in CORPUS for a, b in zip(seq, seq[1:], strict=False))
    got = {(int(c) // VOCAB, int(c) % VOCAB): int(n) for c, n in zip(codes, counts, strict=True)}
    assert got == dict(naive)
    assert (
        unigrams.tolist() == torch.bincount(torch.tensor(sum(CORPUS, [])), minlength=VOCAB).tolist()
    )


def test_merging_in_chunks_gives_the_same_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, VOCAB, (40,), generator=generator).tolist() for _ in range(30)]
    expected = count_bigrams(sequences, VOCAB)
    monkeypatch.setattr(bigram_module, "_COMPACT_EVERY", 7)
    chunked = count_bigrams(sequences, VOCAB)
    for a, b in zip(expected, chunked, strict=True):
        assert torch.equal(a, b)


def test_predicts_the_most_frequent_successor(drafter: BigramDrafter) -> None:
    assert drafter.most_likely_successor(5) == 6
    assert drafter.most_likely_successor(3) == 4
    assert drafter.most_likely_successor(6) == 5  # 6 -> 5 twice, 6 -> 9 once
    # top_successors=2 keeps 6 and 7 after 5, in count order
    assert drafter.successor_ids[5].tolist() == [6, 7]
    assert drafter.successor_counts[5].tolist() == [3, 1]
    # 9 is never followed by anything: the unigram argmax (5, seen 4 times)
    assert drafter.most_likely_successor(9) == 5


def test_logits_are_log_counts_with_unigram_backoff(drafter: BigramDrafter) -> None:
    state = drafter.new_state(1)
    ids = torch.tensor([[5]])
    logits = drafter.step(state, ids, ids).logits[0, 0]
    assert torch.isfinite(logits).all()
    total = float(drafter.unigram_counts.sum()) + VOCAB
    p_uni = (drafter.unigram_counts.double() + 1) / total
    backoff = float(drafter.config["backoff"])
    assert math.isclose(float(logits[6]), math.log(3 + backoff * float(p_uni[6])), rel_tol=1e-5)
    assert math.isclose(float(logits[0]), math.log(backoff * float(p_uni[0])), rel_tol=1e-5)


def test_state_tracks_tokens_and_rolls_back(drafter: BigramDrafter) -> None:
    state = drafter.new_state(1)
    ids = torch.tensor([[1, 5, 6, 7]])
    drafter.step(state, ids, torch.arange(4).unsqueeze(0))
    assert drafter.state_length(state) == 4 and state.tokens[0][-1] == 7
    drafter.truncate_state(state, 2)
    assert state.tokens == [[1, 5]]
    drafter.step(state, torch.tensor([[9, 10, 11]]), torch.tensor([[2, 3, 4]]))
    drafter.keep_state_entries(state, 3, [0, 2])
    assert state.tokens == [[1, 5, 9, 11]]
    with pytest.raises(ValueError):
        drafter.truncate_state(state, 10)


def test_save_load_round_trip(drafter: BigramDrafter, tmp_path) -> None:
    drafter.save_pretrained(tmp_path / "bigram")
    loaded = load_drafter(tmp_path / "bigram")
    assert isinstance(loaded, BigramDrafter)
    for name in ("successor_ids", "successor_counts", "unigram_counts"):
        assert torch.equal(getattr(loaded, name), getattr(drafter, name))
    ids = torch.tensor([[3, 5, 9]])
    torch.testing.assert_close(
        loaded.step(loaded.new_state(1), ids, ids).logits,
        drafter.step(drafter.new_state(1), ids, ids).logits,
    )


def test_low_precision_cast_keeps_counts_exact() -> None:
    sequences = [[1, 2] * 300]  # 1 -> 2 counted 300 times: not representable in bf16
    drafter = BigramDrafter.from_sequences(sequences, VOCAB).to(torch.bfloat16)
    assert int(drafter.successor_counts[1, 0]) == 300


def test_rejects_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match="out of range"):
        BigramDrafter.from_sequences([[1, VOCAB]], VOCAB)


@pytest.mark.parametrize("spec", ["chain:4", "static:tiny", "dynamic:3,3,8"])
def test_lossless_in_the_decoder(spec: str) -> None:
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=11)
    prompts = [list(range(3 + i, 12 + i)) for i in range(3)]
    corpus = [
        prompt + autoregressive_generate(target, prompt, 40, stop_on_eos=False)
        for prompt in prompts
    ]
    drafter = BigramDrafter.from_sequences(corpus, target.vocab_size)
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(spec))
    committed = steps = 0
    for prompt, sequence in zip(prompts, corpus, strict=True):
        result = decoder.generate(prompt, 40, stop_on_eos=False)
        assert result.tokens == sequence[len(prompt) :]
        committed += sum(len(r.committed) for r in result.records)
        steps += len(result.records)
    # The corpus is the target's own output on these prompts: the bigram must hit sometimes.
    assert committed / steps > 1.1
