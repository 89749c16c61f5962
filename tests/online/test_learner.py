"""online/learner.py on a tiny target, with our decoder standing in for the server: rounds from the
spool are learned from the captured rows (a target pass only where rows are missing), each
update is pushed with its sha256, a refused push leaves the served drafter, a drafter whose
traffic accepts less is rolled back, a learner killed between rounds resumes without learning a
request twice (and pushes the drafter it last served), the update schedule skips rounds as it
settles and learns again on drift, and a strategy that reads no records gets the replay's
features and labels without a replay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import autoregressive_generate
from lightning_spec.io import sha256_file
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.online.capture import CapturedRequest
from lightning_spec.online.engines import PushFailed
from lightning_spec.online.learner import (
    LearnerSettings,
    UpdateSchedule,
    round_feedback,
    run_learner,
)
from lightning_spec.online.spool import SpoolReader, SpoolWriter
from lightning_spec.online.strategies import make_strategy
from tests.conftest import load_module

HELPERS = load_module(
    Path(__file__).parents[1] / "objectives" / "test_sft.py", "sft_helpers_learner"
)
POLICY = parse_tree_spec("chain:3")


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


def _captured(
    target: TargetModel, i: int, accepted: list[int], rows: bool = True
) -> CapturedRequest:
    """A request as the server would capture it: the target's greedy answer and its rows."""
    prompt = torch.randint(3, 128, (6,), generator=torch.Generator().manual_seed(i)).tolist()
    tokens = prompt + autoregressive_generate(target, prompt, 12, stop_on_eos=False)
    with torch.no_grad():
        out = target(torch.tensor([tokens[:-1]]), use_cache=False)
    return CapturedRequest(f"r{i}", len(prompt), tokens, out.features[0], out.last_hidden[0] if rows else None,
                           accepted=accepted, drafted=[3] * len(accepted))  # fmt: skip


class _Server:
    """Pushes recorded; `refuse` makes the next push fail as a server answering 409 does."""

    def __init__(self) -> None:
        self.pushed: list[tuple[Path, str]] = []
        self.refuse = False

    def __call__(self, folder: Path, sha256: str) -> dict:
        if self.refuse:
            self.refuse = False
            raise PushFailed("409: the engine kept its drafter")
        assert sha256_file(folder / "model.safetensors") == sha256
        self.pushed.append((folder, sha256))
        return {"served_sha256": sha256}


def test_rounds_are_learned_from_captured_rows_and_pushed(
    target: TargetModel, tmp_path: Path
) -> None:
    writer = SpoolWriter(tmp_path / "spool")
    for i in range(6):
        writer.put(_captured(target, i, [1, 2, 0, 1], rows=i != 4))
    strategy = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, steps_per_round=2)
    start = {k: v.clone() for k, v in strategy.drafter.state_dict().items()}
    server, settings = (
        _Server(),
        LearnerSettings(
            tmp_path / "learner", round_size=3, max_rounds=2, poll_seconds=0, keep_learned=True
        ),
    )
    rows = run_learner(target, strategy, POLICY, SpoolReader(tmp_path / "spool"), server, settings)
    assert [r["round"] for r in rows] == [0, 1] and [r["learned"] for r in rows] == [3, 3]
    assert rows[0]["captured"] == 3 and rows[1]["captured"] == 2 and rows[1]["fallback"] == 1
    assert len(server.pushed) == 2 and rows[1]["served_sha256"] == server.pushed[1][1]
    assert any(not torch.equal(start[k], v) for k, v in strategy.drafter.state_dict().items())
    assert SpoolReader(tmp_path / "spool").pending() == []
    assert len(list((tmp_path / "spool" / "done").iterdir())) == 6
    assert rows[0]["served_tau"] == pytest.approx(2.0)  # (4 accepted + 4 steps) / 4 steps


def test_a_refused_push_keeps_the_served_drafter_for_the_next_replay(
    target: TargetModel, tmp_path: Path
) -> None:
    writer = SpoolWriter(tmp_path / "spool")
    for i in range(4):
        writer.put(_captured(target, i, [1, 1]))
    strategy = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, steps_per_round=2)
    server = _Server()
    server.refuse = True
    settings = LearnerSettings(tmp_path / "learner", round_size=2, max_rounds=2, poll_seconds=0)
    rows = run_learner(target, strategy, POLICY, SpoolReader(tmp_path / "spool"), server, settings)
    assert rows[0]["push_failed"] == 1.0 and rows[1]["push_failed"] == 0.0
    assert len(server.pushed) == 1


def test_a_drafter_whose_traffic_accepts_less_is_rolled_back(
    target: TargetModel, tmp_path: Path
) -> None:
    writer = SpoolWriter(tmp_path / "spool")
    for i, accepted in enumerate([[2, 2], [2, 2], [2, 2], [2, 2], [0, 0], [0, 0]]):
        writer.put(_captured(target, i, accepted))
    strategy = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, steps_per_round=2)
    server = _Server()
    settings = LearnerSettings(tmp_path / "learner", round_size=2, max_rounds=3, poll_seconds=0)
    rows = run_learner(target, strategy, POLICY, SpoolReader(tmp_path / "spool"), server, settings)
    assert [r.get("rollback", 0.0) for r in rows] == [0.0, 0.0, 1.0]
    assert rows[2]["learned"] == 0
    rolled_to = server.pushed[-1][0]
    assert rolled_to == server.pushed[0][0]  # the drafter served before the bad push


def test_a_killed_learner_resumes_without_learning_a_request_twice(
    target: TargetModel, tmp_path: Path
) -> None:
    writer = SpoolWriter(tmp_path / "spool")
    for i in range(6):
        writer.put(_captured(target, i, [1]))
    settings = LearnerSettings(
        tmp_path / "learner", round_size=2, max_rounds=1, poll_seconds=0, keep_learned=True
    )
    first = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, steps_per_round=2)
    run_learner(target, first, POLICY, SpoolReader(tmp_path / "spool"), _Server(), settings)
    # killed after the checkpoint, before its spool files were marked done
    done = sorted((tmp_path / "spool" / "done").iterdir())
    for path in done:
        path.rename(tmp_path / "spool" / path.name)
    again = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, steps_per_round=2)
    settings.max_rounds = 2
    restarted = _Server()  # a server restarted with its starting drafter
    rows = run_learner(target, again, POLICY, SpoolReader(tmp_path / "spool"), restarted, settings)
    assert [r["round"] for r in rows] == [1, 2]
    assert restarted.pushed[0][0].name == "round-00000"  # the last served drafter, pushed again
    for key, value in first.drafter.state_dict().items():  # resumed from the checkpoint
        assert (
            key in again.drafter.state_dict()
            and value.shape == again.drafter.state_dict()[key].shape
        )
    lines = (tmp_path / "learner" / "rounds.jsonl").read_text().splitlines()
    assert len(lines) == 3


def test_requests_that_cannot_be_learned_from_are_counted(target: TargetModel) -> None:
    from lightning_spec.online.spool import SpoolEntry

    drafter = HELPERS._drafter(target)
    good = _captured(target, 1, [1])
    sampled = _captured(target, 2, [1])
    sampled.token_ids[-3] = (sampled.token_ids[-3] + 1) % 128  # not the target's greedy text
    sampled.last = None
    short = CapturedRequest("s", 6, good.token_ids[:7], good.aux[:6], good.last[:6], [0], [3])
    entries = [SpoolEntry(Path(n), r) for n, r in (("a", good), ("b", sampled), ("c", short))]
    generations, counts = round_feedback(target, drafter, POLICY, entries, 8)
    assert len(generations) == 1
    assert counts == {"captured": 1, "skipped_not_greedy": 1, "skipped_too_short": 1}


def test_feedback_without_records_is_the_replay_s_features_and_labels(target: TargetModel) -> None:
    from lightning_spec.online.spool import SpoolEntry

    drafter = HELPERS._drafter(target)
    entries = [SpoolEntry(Path(str(i)), _captured(target, i, [1, 0])) for i in range(2)]
    replayed, _ = round_feedback(target, drafter, POLICY, entries, 8)
    direct, counts = round_feedback(target, drafter, POLICY, entries, 8, records=False)
    assert counts == {"captured": 2}
    for a, b in zip(replayed, direct, strict=True):
        assert a.records and not b.records  # no drafting happened
        assert a.prompt == b.prompt and a.tokens == b.tokens
        assert torch.equal(a.features, b.features)
        assert torch.equal(a.label_ids, b.label_ids)
        assert torch.equal(a.label_logprobs, b.label_logprobs)


def test_the_schedule_spaces_updates_out_and_learns_again_on_drift() -> None:
    schedule = UpdateSchedule(growth=1.5, max_gap=4, drift_margin=0.1)
    decisions = [schedule.decide(i, 2.0) for i in range(16)]
    assert [i for i, d in enumerate(decisions) if d == "learn"] == [0, 1, 2, 4, 7, 11, 15]
    assert schedule.decide(16, 1.5) == "drift"  # 25% below the recent mean
    after = [schedule.decide(i, 1.5) for i in range(17, 28)]
    assert "skip" not in after[:3]  # every round again until the new level is the recent mean
    assert after.count("skip") >= 3  # then the gaps grow again
    assert UpdateSchedule().decide(5, 0.1) == "learn"  # growth 1: every round, drift or not
    with pytest.raises(ValueError, match="growth"):
        UpdateSchedule(growth=0.5)


def test_a_scheduled_learner_skips_rounds_but_acknowledges_them(
    target: TargetModel, tmp_path: Path
) -> None:
    writer = SpoolWriter(tmp_path / "spool")
    for i in range(8):
        writer.put(_captured(target, i, [1, 1]))
    strategy = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, steps_per_round=2)
    server = _Server()
    settings = LearnerSettings(tmp_path / "learner", round_size=2, max_rounds=4, poll_seconds=0,
                               update_growth=2.0, max_gap=4)  # fmt: skip
    rows = run_learner(target, strategy, POLICY, SpoolReader(tmp_path / "spool"), server, settings)
    assert [r["learned"] for r in rows] == [2, 2, 0, 2]  # rounds 0, 1, then a gap of 2
    assert len(server.pushed) == 3 and SpoolReader(tmp_path / "spool").pending() == []


def test_a_skipped_round_writes_only_the_light_state_and_a_restart_resumes_after_it(
    target: TargetModel, tmp_path: Path
) -> None:
    import json

    writer = SpoolWriter(tmp_path / "spool")
    for i in range(8):
        writer.put(_captured(target, i, [1, 1]))
    settings = LearnerSettings(tmp_path / "learner", round_size=2, max_rounds=3, poll_seconds=0,
                               update_growth=2.0, max_gap=4)  # fmt: skip
    first = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, steps_per_round=2)
    rows = run_learner(target, first, POLICY, SpoolReader(tmp_path / "spool"), _Server(), settings)
    assert [r["learned"] for r in rows] == [2, 2, 0]  # round 2 skipped
    whole = torch.load(tmp_path / "learner" / "learner.pt", weights_only=False)
    light = json.loads((tmp_path / "learner" / "learner_round.json").read_text())
    assert whole["round"] == 1 and light["round"] == 2  # the skip rewrote only the light state
    assert len(light["learned"]) == 2
    again = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, steps_per_round=2)
    settings.max_rounds = 1
    rows = run_learner(target, again, POLICY, SpoolReader(tmp_path / "spool"), _Server(), settings)
    # resumed after round 2 with its schedule: round 3 learns, as the uninterrupted run does
    assert [(r["round"], r["learned"]) for r in rows] == [(3, 2)]
    assert SpoolReader(tmp_path / "spool").pending() == []
    for key, value in first.drafter.state_dict().items():  # round 1's strategy state, resumed
        assert value.shape == again.drafter.state_dict()[key].shape
