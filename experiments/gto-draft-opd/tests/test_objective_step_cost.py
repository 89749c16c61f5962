"""scripts/objective_step_cost.py --greedy-texts: every T = 0 objective timed on the same cached
greedy batches in one run (tiny target and drafter)."""

from __future__ import annotations

import json
from pathlib import Path


def test_greedy_mode_times_sft_gto_both_paths_and_draft_opd(
    study_script, tiny_cli_assets: dict[str, str], tmp_path: Path  # noqa: ANN001
) -> None:
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.models.target import load_target

    cost = study_script("objective_step_cost")
    target = load_target(tiny_cli_assets["model"])
    drafter = tmp_path / "drafter"
    Eagle3Drafter.from_target(target, draft_vocab_size=target.vocab_size).save_pretrained(drafter)
    out = tmp_path / "cost.json"
    code = cost.main([
        "--drafter", str(drafter), "--target", tiny_cli_assets["model"],
        "--dataset", tiny_cli_assets["chats"], "--greedy-texts", "6", "--new-tokens", "10",
        "--batch-size", "2", "--steps", "2", "--warmup", "1", "--tree", "dynamic:2,2,4",
        "--groups", "1", "--group-size", "2", "--chain", "3", "--threads", "1",
        "--output", str(out),
    ])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    for arm in ("sft", "gto_cached", "gto_scored", "draft_opd_suffix"):
        assert report[arm]["steps"] == 2 and report[arm]["trained_tokens_per_s"] > 0
    assert report["draft_opd_suffix_over_sft"] > 0 and report["chain"] == 3
