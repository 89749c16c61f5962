"""OnlineSpec with an engine serving (the shape of `online --engine vllm`), run with our own decoder
as the engine: every round is served by the drafter the engine holds, each update is pushed into
it, a failed push leaves it serving the previous drafter, and every output stays greedy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import autoregressive_generate
from lightning_spec.io import sha256_file
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.online.engines import DecoderEngine, engine_tau
from lightning_spec.online.loop import SERVED_DRAFTER, run_stream
from lightning_spec.online.strategies import make_strategy
from lightning_spec.online.stream import Request
from tests.conftest import load_module

HELPERS = load_module(Path(__file__).parents[1] / "objectives" / "test_sft.py", "sft_helpers_engine")
POLICY = "chain:3"


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


def _requests(count: int) -> list[Request]:
    generator = torch.Generator().manual_seed(4)
    return [Request(i, "a", f"r{i}", torch.randint(3, 128, (6,), generator=generator).tolist())
            for i in range(count)]  # fmt: skip


def _engine(target: TargetModel, folder: Path, fail_on_push: int | None = None) -> DecoderEngine:
    drafter = HELPERS._drafter(target)
    drafter.save_pretrained(folder)
    engine = DecoderEngine(target, folder, parse_tree_spec(POLICY))
    if fail_on_push is not None:
        calls = {"n": 0}
        load = engine._load

        def flaky(tensors):  # noqa: ANN001, ANN202 - the engine dies mid-load on that push
            calls["n"] += 1
            if calls["n"] == fail_on_push:
                items = list(tensors)  # half the tensors land, then the engine dies
                engine.drafter.load_state_dict(dict(items[: len(items) // 2]), strict=False)
                raise RuntimeError("engine died mid-load")
            load(tensors)

        engine._load = flaky
    return engine


def test_each_update_is_pushed_into_the_engine_that_serves_the_next_round(
    target: TargetModel, tmp_path: Path
) -> None:
    engine = _engine(target, tmp_path / "start")
    first = engine.served
    requests = _requests(4)
    greedy = [autoregressive_generate(target, r.prompt, 10, stop_on_eos=False) for r in requests]
    strategy = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, steps_per_round=2)
    rows = run_stream(
        target, strategy, parse_tree_spec(POLICY), requests, out_dir=tmp_path / "run",
        round_size=2, max_new_tokens=10, continuations=greedy, replay=False, engine=engine,
    )  # fmt: skip
    assert all(r["greedy_match"] for r in rows)  # the engine's outputs are the target's greedy text
    # our decoder as the engine drafts as the replay does: its tau is the replay's, per request
    assert all(r["tau"] == pytest.approx(r["replay_tau"]) for r in rows)
    assert [r["engine_drafter"] for r in rows[:2]] == [first[:12]] * 2
    served = sha256_file(tmp_path / "run" / SERVED_DRAFTER / "model.safetensors")
    assert engine.served == served != first  # the last update is what the engine serves now
    assert rows[2]["engine_drafter"] == rows[3]["engine_drafter"] != first[:12]
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert all(r["push_failed"] == 0.0 and r["push_seconds"] > 0 for r in rounds)
    # the pushes and the replays that rebuild the feedback are charged to the update
    assert all(r["update_seconds"] >= r["push_seconds"] + r["feedback_seconds"] for r in rounds)


def test_a_frozen_drafter_in_an_engine_is_charged_nothing(target: TargetModel, tmp_path: Path) -> None:
    """Frozen has no learner: its replay only checks our decoder against the engine, so its
    seconds are a diagnostic and its net tokens/s equal its served tokens/s."""
    engine = _engine(target, tmp_path / "start")
    strategy = make_strategy("frozen", HELPERS._drafter(target))
    run_stream(
        target, strategy, parse_tree_spec(POLICY), _requests(4), out_dir=tmp_path / "run",
        round_size=2, max_new_tokens=10, engine=engine,
    )  # fmt: skip
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert all(r["update_seconds"] == 0.0 and r["diagnostic_seconds"] >= r["feedback_seconds"] > 0 for r in rounds)
    assert all(r["net_tokens_per_s"] == pytest.approx(r["tokens_per_s"]) for r in rounds)


def test_a_failed_push_leaves_the_previous_drafter_serving(target: TargetModel, tmp_path: Path) -> None:
    engine = _engine(target, tmp_path / "start", fail_on_push=1)
    first = engine.served
    strategy = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, steps_per_round=2)
    rows = run_stream(
        target, strategy, parse_tree_spec(POLICY), _requests(4), out_dir=tmp_path / "run",
        round_size=2, max_new_tokens=10, engine=engine,
    )  # fmt: skip
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [r["push_failed"] for r in rounds] == [1.0, 0.0]
    # round 1 was served by the drafter from before the failed push, restored whole, and its
    # feedback was replayed with that drafter, not with the update the engine refused
    assert rows[2]["engine_drafter"] == first[:12]
    assert all(r["tau"] == pytest.approx(r["replay_tau"]) for r in rows)
    assert engine.served != first
    with pytest.raises(ValueError, match="an engine serves every request live"):
        run_stream(target, strategy, parse_tree_spec(POLICY), _requests(2), out_dir=tmp_path / "x",
                   engine=engine, update_beside=True)  # fmt: skip


def test_a_push_dying_mid_load_restores_the_served_weights(target: TargetModel, tmp_path: Path) -> None:
    from lightning_spec.online.engines import PushFailed

    engine = _engine(target, tmp_path / "start", fail_on_push=1)
    before = {k: v.clone() for k, v in engine.drafter.state_dict().items()}
    other = HELPERS._drafter(target, noise=0.5)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(PushFailed, match="mid-load"):
        engine.push(tmp_path / "other")
    after = engine.drafter.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.push(tmp_path / "other")  # the next push goes through
    assert engine.served == sha256_file(tmp_path / "other" / "model.safetensors")
    assert not all(torch.equal(before[k], engine.drafter.state_dict()[k]) for k in before)


def test_engine_tau_counts_the_targets_token_at_every_step() -> None:
    from lightning_spec.bench.engines import PromptResult

    # the first token comes from the prefill; then 3 + 1 and 0 + 1 tokens, and 1 + 1
    results = [PromptResult([1, 2, 3, 4, 5, 6], 1.0, meta={"accepted_lengths": [3, 0]}),
               PromptResult([7, 8, 9], 1.0, meta={"accepted_lengths": [1]})]  # fmt: skip
    assert engine_tau(results) == (pytest.approx((5 + 2) / 3), 3)


def test_engine_tau_leaves_out_drafts_the_stop_cut() -> None:
    """vLLM logs a last step's accepted drafts even when max_tokens or EOS cut them: 3 tokens
    served after the prefill's, not the 2 + 2 + 1 accepted-plus-own its steps claim."""
    from lightning_spec.bench.engines import PromptResult

    cut = PromptResult([1, 2, 3, 4], 1.0, meta={"accepted_lengths": [1, 2]})
    assert engine_tau([cut]) == (pytest.approx(3 / 2), 2)


def test_the_vllm_engine_config_is_checked_before_anything_loads(tmp_path: Path) -> None:
    from lightning_spec.cli.online import check_engine_drafter, load_config

    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    path = tmp_path / "online.yaml"
    path.write_text(f"drafter: {folder}\nstream: [{{source: mtbench, count: 4}}]\nengine: vllm\n")
    with pytest.raises(ValueError, match="chain:K"):
        load_config(path)
    assert load_config(path, {"tree": "chain:3"})["engine"] == "vllm"
    with pytest.raises(ValueError, match="replay"):
        load_config(path, {"tree": "chain:3", "replay": True})
    missing = load_config(path, {"tree": "chain:3", "drafter": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="drafter folder"):
        check_engine_drafter(missing)  # `online` checks it before loading anything
    check_engine_drafter(load_config(path, {"tree": "chain:3"}))
    with pytest.raises(ValueError, match="engine must be"):
        load_config(path, {"engine": "sglang"})


def test_feedback_is_replayed_with_the_drafter_the_engine_still_serves(
    target: TargetModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every push is refused, so the engine serves its first drafter throughout while the learner
    moves away from it: the feedback must be rebuilt with the served drafter's weights."""
    import lightning_spec.online.loop as online
    from lightning_spec.online.engines import PushFailed

    engine = _engine(target, tmp_path / "start")
    first = engine.served
    start = {k: v.clone() for k, v in engine.drafter.state_dict().items()}

    def refuse(folder: Path) -> None:
        raise PushFailed("refused")

    engine.push = refuse
    replayed_with: list[bool] = []
    real = online.replay_request

    def spy(target, drafter, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        weights = drafter.state_dict()
        replayed_with.append(all(torch.equal(start[k], weights[k]) for k in start))
        return real(target, drafter, *args, **kwargs)

    monkeypatch.setattr(online, "replay_request", spy)
    strategy = make_strategy("ogd", HELPERS._drafter(target), lr=0.1, steps_per_round=2)
    rows = run_stream(
        target, strategy, parse_tree_spec(POLICY), _requests(6), out_dir=tmp_path / "run",
        round_size=2, max_new_tokens=10, engine=engine,
    )  # fmt: skip
    assert {r["engine_drafter"] for r in rows} == {first[:12]}
    assert replayed_with == [True] * 6  # every round, the refused updates included
    learned = strategy.drafter.state_dict()
    assert any(not torch.equal(start[k], learned[k]) for k in start)  # the learner did move
