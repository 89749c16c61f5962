"""scripts/online_replay.py: a recorded stream replays offline exactly as the live loop learned."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.online.loop import load_feedback, run_stream
from lightning_spec.online.strategies import make_strategy
from lightning_spec.online.stream import Request


def _helpers():  # noqa: ANN202
    path = Path(__file__).resolve().parents[3] / "tests" / "objectives" / "test_sft.py"
    spec = importlib.util.spec_from_file_location("sft_helpers_replay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replay_scores_each_round_with_the_model_the_live_loop_served(
    study_script, tmp_path: Path
) -> None:
    replay = study_script("online_replay")
    helpers = _helpers()
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)
    drafter = helpers._drafter(target)
    requests = [Request(i, "ab"[i // 2], f"r{i}", [5 + i, 9, 14, 3, 22, 7]) for i in range(4)]
    options = {"lr": 3e-3, "steps_per_round": 2}
    with pytest.raises(FileNotFoundError, match="record_feedback"):
        load_feedback(tmp_path)
    run_stream(
        target, make_strategy("ogd", drafter, **options), parse_tree_spec("dynamic:3,3,8"),
        requests, out_dir=tmp_path, round_size=2, max_new_tokens=10, record_feedback=True,
    )  # fmt: skip
    feedback = load_feedback(tmp_path)
    logged = [json.loads(line) for line in (tmp_path / "requests.jsonl").open()]
    assert [len(g.tokens) for rnd in feedback for g in rnd] == [r["tokens"] for r in logged]
    live = [json.loads(line)["online_loss"] for line in (tmp_path / "rounds.jsonl").open()]
    rows = replay.replay(drafter, feedback, "ogd", options, ttt_steps=2, top_k=3)
    # the replayed ogd scores every round with the very model the live loop served it with
    assert [r["loss"] for r in rows] == pytest.approx(live, rel=1e-4)
    assert all(0.0 <= r["top1_0"] <= r["top3_0"] <= 1.0 and r["labels"] > 0 for r in rows)
    frozen = replay.replay(drafter, feedback, "frozen", {}, ttt_steps=2, top_k=3)
    assert frozen[0]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5)  # same start
    assert rows[1]["loss"] < frozen[1]["loss"]  # it learned from round 0
    domains = replay.round_domains(tmp_path, len(feedback))
    assert domains == ["a", "b"]
    table = replay.summarize({"frozen": frozen, "ogd": rows}, domains, "frozen")
    assert set(table["ogd"]) >= {"loss", "loss@a", "loss@b", "top1_0", "top3_0", "top3_0_gain_ci"}
    assert table["ogd"]["loss@a"] == pytest.approx(table["frozen"]["loss@a"], rel=1e-5)
    assert replay.parse_variant("fast=ogd,lr=1e-3,steps_per_round=4") == (
        "fast", "ogd", {"lr": 1e-3, "steps_per_round": 4}
    )  # fmt: skip
    with pytest.raises(ValueError, match="NAME=STRATEGY"):
        replay.parse_variant("ogd")
