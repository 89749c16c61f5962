"""lightning-spec bench pace --what regen (lightning_spec/bench/pace.py): the fidelity of batched
answers against one-at-a-time greedy."""

from __future__ import annotations

import pytest


def test_fidelity_counts_identical_answers_and_the_agreed_prefix() -> None:
    from lightning_spec.bench import pace as regen

    reference = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    answers = [[1, 2, 3, 4], [5, 9], [7, 8, 9, 10, 11]]  # one near-tie, one ran past the EOS
    out = regen.fidelity(answers, reference)
    assert out["identical"] == pytest.approx(1 / 3)
    assert out["token_prefix_agreement"] == pytest.approx((4 + 1 + 4) / 10)
    assert regen.fidelity(reference, reference) == {"identical": 1.0, "token_prefix_agreement": 1.0}
