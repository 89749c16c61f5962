"""The llama.cpp bench's bookkeeping on hand-made results (the real engine: test_llamacpp_live)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_spec.bench.engines import PromptResult, summarize, verifications
from lightning_spec.bench.llamacpp import mode_args


def test_mode_arguments() -> None:
    assert mode_args("plain").args == ()
    eagle = mode_args("eagle3", drafter_gguf=Path("d.gguf"), n_max=3, p_min=0.0)
    assert eagle.name == "eagle3@3"
    assert eagle.args == (
        "-md", "d.gguf", "--spec-type", "draft-eagle3",
        "--spec-draft-n-max", "3", "--spec-draft-p-min", "0",
    )
    dflash = mode_args("dflash", drafter_gguf=Path("b.gguf"), n_max=7)
    assert dflash.name == "dflash@7"
    assert dflash.args[:5] == ("-md", "b.gguf", "--spec-type", "draft-dflash", "--spec-draft-n-max")
    selfie = mode_args("self", target_gguf=Path("t.gguf"), n_max=4, p_min=0.5)
    assert selfie.args[:4] == ("-md", "t.gguf", "--spec-type", "draft-simple")
    assert selfie.args[-1] == "0.5"
    assert mode_args("ngram-mod").args == ("--spec-type", "ngram-mod")
    with pytest.raises(ValueError, match="drafter's GGUF"):
        mode_args("eagle3")
    with pytest.raises(ValueError, match="unknown mode"):
        mode_args("medusa")


def test_verifications_count_every_step_once() -> None:
    # 9 tokens: the first from the prompt pass, then steps committing (2 drafts + 1) x 2 and
    # (0 + 1) x 2: 4 verifications, 4 accepted drafts.
    assert verifications(PromptResult(tokens=list(range(9)), seconds=1.0, drafted=8, accepted=4)) == 4
    assert verifications(PromptResult(tokens=[5], seconds=0.1)) == 0


def test_summary_speedup_tau_and_mismatches() -> None:
    plain = [PromptResult([1, 2, 3, 4, 5], 1.0), PromptResult([7, 8, 9], 0.6)]
    fast = [PromptResult([1, 2, 3, 4, 5], 0.5, 6, 2), PromptResult([7, 8, 0], 0.3, 3, 1)]
    same = [PromptResult([1, 2, 3, 4, 5], 0.4, 4, 4), PromptResult([7, 8, 9], 0.2, 2, 2)]
    rows = summarize({"plain": plain, "eagle3@3": fast, "self@3": same}, reference="self@3", resamples=200)
    assert rows["plain"]["tok_per_s"] == pytest.approx(8 / 1.6)
    assert rows["eagle3@3"]["speedup"] == pytest.approx((8 / 0.8) / (8 / 1.6))
    assert rows["eagle3@3"]["acceptance"] == pytest.approx(3 / 9)
    # committed after the first token: 4 + 2; verifications: (4 - 2) + (2 - 1) = 3
    assert rows["eagle3@3"]["tau"] == pytest.approx(6 / 3)
    assert rows["eagle3@3"]["mismatches_vs_plain"] == 1
    assert rows["eagle3@3"]["mismatch_prompts_vs_plain"] == [1]
    assert rows["eagle3@3"]["mismatches_vs_self"] == 1
    assert rows["self@3"]["mismatches_vs_plain"] == 0
    assert "speedup" not in rows["plain"]
    # against the reference mode on the same prompts: pooled rates 10 vs 8 / 0.6
    assert rows["eagle3@3"]["speedup_vs_self"] == pytest.approx((8 / 0.8) / (8 / 0.6))
    low, high = rows["eagle3@3"]["speedup_vs_self_ci"]
    assert low <= rows["eagle3@3"]["speedup_vs_self"] <= high
    assert "speedup_vs_self" not in rows["self@3"] and "speedup_vs_self" not in rows["plain"]


def test_chain_pick_from_the_cost_curve() -> None:
    from lightning_spec.bench.engines import expected_tau, pick_chain

    assert expected_tau([0.5, 0.5, None], 3) == pytest.approx(1 + 0.5 + 0.25)
    cost = {1: 1.0, 2: 1.1, 3: 1.2, 4: 2.0, 5: 2.1}  # a jump after 3 tokens
    pick = pick_chain([0.8, 0.8, 0.8, 0.8], cost, draft_cost=0.05)
    # K=2: (1 + .8 + .64) / (1.2 + .1) = 1.877; K=3: 2.952 / 2.15 = 1.373; K=1: 1.8 / 1.15
    assert pick["n_max"] == 2
    assert pick["predicted_speedup"][2] == pytest.approx(2.44 / 1.3)
    assert pick_chain([0.1, 0.1], {1: 1.0, 2: 1.5, 3: 1.6}, draft_cost=0.0)["n_max"] == 1  # below 1x either way


def test_our_tau_interval_from_accepted_lengths() -> None:
    from lightning_spec.bench.engines import ours_tau_interval

    # prompt 1: 3 verifications accepting 2, 0, 1 -> commits 6; prompt 2: 2 accepting 3, 3 -> 8
    summary = ours_tau_interval([[2, 0, 1], [3, 3]], resamples=200)
    assert summary["tau"] == pytest.approx(14 / 5)
    low, high = summary["tau_ci"]
    assert 2.0 <= low <= summary["tau"] <= high <= 4.0
