"""scripts/rollout_replay.py on a tiny target: decoded, replayed and batched-then-replayed rollouts
timed, records equal."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel


def test_rollout_replay_bench_times_four_runs_of_equal_rollouts(
    study_script, tiny_cli_assets: dict, tmp_path: Path
) -> None:
    bench = study_script("rollout_replay")
    target = TargetModel.from_pretrained(tiny_cli_assets["model"])
    Eagle3Drafter.from_target(target).save_pretrained(tmp_path / "drafter")
    output = tmp_path / "out.json"
    code = bench.main(
        ["--drafter", str(tmp_path / "drafter"), "--target", tiny_cli_assets["model"],
         "--dataset", tiny_cli_assets["chats"], "--prompts", "3", "--max-new-tokens", "8",
         "--tree", "dynamic:3,2,6", "--decode-batch", "2", "--output", str(output)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(output.read_text())
    assert result["prompts"] == 3 and result["records_equal"]
    assert set(result["runs"]) == {"decoded", "replayed", "replayed_cached", "batched_replayed"}
    assert result["cut_prompts"] == 0  # the tiny target breaks no tie differently in a batch
    for run in result["runs"].values():
        assert run["seconds"] > 0 and run["tokens_per_s"] > 0
    assert result["runs"]["decoded"]["speedup_vs_decoded"] == 1.0
