"""Reduced draft vocabulary: most frequent ids, forced ids, the d2t offset convention."""

from __future__ import annotations

import pytest
import torch

from lightning_spec.models.vocab import build_draft_vocab, count_tokens, draft_to_target_ids


def test_counts_and_choice() -> None:
    counts = count_tokens([[1, 1, 4, 4, 4], [2, 6]], vocab_size=8)
    assert counts.tolist() == [0, 2, 1, 0, 3, 0, 1, 0]
    d2t, t2d = build_draft_vocab(counts, 3)
    # 4 (3x), 1 (2x), then the tie between 2 and 6 goes to the lower id.
    assert draft_to_target_ids(d2t).tolist() == [1, 2, 4]
    assert d2t.tolist() == [1, 1, 2]  # target = d + d2t[d]
    assert t2d.tolist() == [False, True, True, False, True, False, False, False]


def test_always_include_and_errors() -> None:
    counts = torch.tensor([5, 4, 3, 0, 0])
    d2t, _ = build_draft_vocab(counts, 2, always_include=[4])
    assert draft_to_target_ids(d2t).tolist() == [0, 4]
    with pytest.raises(ValueError):
        build_draft_vocab(counts, 0)
    with pytest.raises(ValueError):
        build_draft_vocab(counts, 1, always_include=[3, 4])
    with pytest.raises(ValueError, match="out of range"):
        count_tokens([[9]], vocab_size=5)
