"""scripts/gto_sign_test.py --tiny: three arms from one start on the same batches, paired results,
and (with the token loss on) each term's gradient norm, so "L_GTO dominates" is measured."""

from __future__ import annotations

import json
from pathlib import Path


def test_tiny_sign_test_pairs_three_arms_and_logs_term_gradients(
    study_script,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    sign = study_script("gto_sign_test")
    out = tmp_path / "sign.json"
    code = sign.main([
        "--tiny", "--prompts", "4", "--held-out", "4", "--new-tokens", "16", "--steps", "2",
        "--eval-every", "1", "--warm-steps", "4", "--token-weight", "1", "--jitter", "0",
        "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    arms = report["arms"]
    assert set(arms) == {"+1", "+0", "-1"}
    starts = {
        json.dumps({k: v for k, v in arm[0].items() if k != "seconds"}) for arm in arms.values()
    }
    assert len(starts) == 1, "every arm starts from the same drafter on the same prefixes"
    assert [row["step"] for row in arms["+1"]] == [0, 1, 2]
    assert "train_pruned" in arms["+1"][0] and "train_pruned" in arms["+1"][-1]
    assert "train_pruned" not in arms["+1"][1], "statistics at the first and last evaluation only"
    # at step 0 the drafter is its own reference: no advantage, no GTO gradient
    first = report["grad_norms"]["+1"][0]
    assert first["step"] == 0 and first["gto"] == 0.0 and first["token"] > 0
    assert set(report["grad_norms"]) == {"+1", "-1"}
    for what in ("train_accept", "heldout_reward"):
        assert report["paired"][what]["plus_minus"]["mean_diff"] is not None


def test_tiny_sign_test_at_temperature_one_samples_texts_and_pairs_the_arms(
    study_script,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """At T = 1 the texts are the target's samples, every tree is scored through the target,
    and the arms still start equal (the sampled accepted paths use the same draws)."""
    sign = study_script("gto_sign_test")
    out = tmp_path / "sign_t1.json"
    assert sign.main([
        "--tiny", "--prompts", "4", "--held-out", "4", "--new-tokens", "12", "--steps", "1",
        "--eval-every", "1", "--warm-steps", "2", "--token-weight", "1", "--jitter", "0",
        "--temperature", "1", "--out", str(out),
    ]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    assert report["args"]["temperature"] == 1.0
    starts = {
        json.dumps({k: v for k, v in arm[0].items() if k != "seconds"})
        for arm in report["arms"].values()
    }
    assert len(starts) == 1, "every arm starts from the same drafter and the same draws"
    assert report["paired"]["heldout_reward"]["plus_zero"]["mean_diff"] is not None
