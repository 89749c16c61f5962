"""OnlineSpec on tiny models: the feedback is the decoder's own features and the target's own
tokens (no second target pass), OGD lowers the round's loss, the loop is prequential, and a
killed stream resumes at its round with the same results as an uninterrupted one."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.online.loop import prequential_summary, run_stream, served_totals
from lightning_spec.online.losses import (
    epoch_minibatches,
    feedback_batch,
    online_loss,
    topk_hits,
)
from lightning_spec.online.strategies import make_strategy, timed_served_loss
from lightning_spec.online.stream import Request
from tests.conftest import load_module

HELPERS = load_module(
    Path(__file__).parents[1] / "objectives" / "test_sft.py", "sft_helpers_online"
)
POLICY = "dynamic:3,3,8"


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


def _requests(count: int = 6) -> list[Request]:
    generator = torch.Generator().manual_seed(4)
    return [
        Request(
            i, "abcd"[i // 3], f"r{i}", torch.randint(3, 128, (6,), generator=generator).tolist()
        )
        for i in range(count)
    ]


def test_feedback_is_the_decoders_features_and_the_targets_tokens(target: TargetModel) -> None:
    drafter = HELPERS._drafter(target)
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(POLICY), keep_features=True)
    prompt = [5, 9, 14, 3, 22]
    generation = decoder.generate(prompt, 12, stop_on_eos=False)
    assert generation.tokens == autoregressive_generate(target, prompt, 12, stop_on_eos=False)
    batch = feedback_batch([generation])
    sequence = prompt + generation.tokens
    assert batch["input_ids"][0].tolist() == sequence
    with torch.no_grad():
        fresh = target(torch.tensor([sequence]), use_cache=False).features[0]
    # the kept features equal a fresh target pass: nothing needs computing twice
    torch.testing.assert_close(batch["features"][0, :-1], fresh[:-1], atol=1e-4, rtol=1e-4)
    assert batch["loss_mask"][0].tolist() == [0] * len(prompt) + [1] * len(generation.tokens)
    loss, labels = online_loss(drafter, batch, ttt_steps=2)
    assert torch.isfinite(loss) and labels > 0


def test_ogd_lowers_the_loss_of_the_round_it_learned_from(target: TargetModel) -> None:
    drafter = HELPERS._drafter(target)
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(POLICY), keep_features=True)
    generations = [decoder.generate(r.prompt, 16, stop_on_eos=False) for r in _requests(3)]
    ogd = make_strategy("ogd", drafter, lr=3e-3, steps_per_round=5)
    first = ogd.update(generations)
    second = ogd.update(generations)
    assert second["online_loss"] < first["online_loss"]
    assert first["update_seconds"] > 0 and first["labels"] > 0
    # the starting drafter is untouched (the strategy trains its own copy)
    frozen = make_strategy("frozen", drafter)
    assert frozen.update(generations)["online_loss"] == pytest.approx(first["online_loss"])
    with pytest.raises(ValueError, match="unknown online strategy"):
        make_strategy("sgd", drafter)


def test_a_killed_stream_resumes_at_its_round(target: TargetModel, tmp_path: Path) -> None:
    policy = parse_tree_spec(POLICY)
    requests = _requests(6)
    options = {"lr": 3e-3, "steps_per_round": 2}
    straight = run_stream(
        target, make_strategy("ogd", HELPERS._drafter(target), **options), policy, requests,
        out_dir=tmp_path / "straight", round_size=2, max_new_tokens=10,
    )  # fmt: skip
    assert [r["request"] for r in straight] == list(range(6))
    # "killed" after two rounds: the first run only had four requests
    run_stream(
        target, make_strategy("ogd", HELPERS._drafter(target), **options), policy, requests[:4],
        out_dir=tmp_path / "resumed", round_size=2, max_new_tokens=10,
    )  # fmt: skip
    with (tmp_path / "resumed" / "requests.jsonl").open("a") as handle:
        handle.write(json.dumps({"round": 2, "request": 4, "tau": 9.0}) + "\n{torn")  # unfinished
    resumed = run_stream(
        target, make_strategy("ogd", HELPERS._drafter(target), **options), policy, requests,
        out_dir=tmp_path / "resumed", round_size=2, max_new_tokens=10,
    )  # fmt: skip
    assert [r["request"] for r in resumed] == list(range(6))
    assert [r["tau"] for r in resumed] == pytest.approx([r["tau"] for r in straight])
    rounds = [json.loads(line) for line in (tmp_path / "resumed" / "rounds.jsonl").open()]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[-1]["served"] == 6.0 and rounds[-1]["net_tokens_per_s"] > 0


def _round(target: TargetModel, drafter, count: int = 2) -> list:  # noqa: ANN001
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(POLICY), keep_features=True)
    return [decoder.generate(r.prompt, 12, stop_on_eos=False) for r in _requests(count)]


def test_optimistic_update_uses_the_last_gradient_as_hint(target: TargetModel) -> None:
    from lightning_spec.online.strategies import _round_gradient, _trainable

    drafter = HELPERS._drafter(target)
    generations = _round(target, drafter)
    batch = feedback_batch(generations)
    lr = 1e-2
    strategy = make_strategy("optimistic", drafter, lr=lr, grad_clip=1e9)
    start = [p.detach().clone() for p in _trainable(strategy.drafter)]
    probe = make_strategy("optimistic", drafter, lr=lr, grad_clip=1e9)  # same start, for g
    _, _, g1 = _round_gradient(probe.drafter, batch, 2, 1e9)
    strategy.update(generations)
    for w, w0, g in zip(_trainable(strategy.drafter), start, g1, strict=True):
        torch.testing.assert_close(w, w0 - 2 * lr * g, atol=1e-6, rtol=1e-5)  # w_hat - eta g
    for hat, w0, g in zip(strategy.secondary, start, g1, strict=True):
        torch.testing.assert_close(hat, w0 - lr * g, atol=1e-6, rtol=1e-5)
    momentum = make_strategy("optimistic", drafter, lr=lr, momentum=0.9)
    assert momentum.update(generations)["online_loss"] > 0
    # the reference's Hydra recipe: one step per shuffled minibatch over the epochs; with one
    # minibatch holding the whole round, the first step is the round's own optimistic step
    whole = make_strategy("optimistic", drafter, lr=lr, grad_clip=1e9, epochs=1, minibatch=8)
    report = whole.update(generations)
    assert report["optimizer_steps"] == 1.0 and report["diagnostic_seconds"] > 0
    for mine, theirs in zip(_trainable(whole.drafter), _trainable(strategy.drafter), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)
    split = make_strategy("optimistic", drafter, lr=lr, epochs=3, minibatch=1)
    # a request whose every label lies outside the 48-token draft vocabulary gives no step
    labelled = sum(
        online_loss(drafter, feedback_batch([g]), ttt_steps=2)[1] > 0 for g in generations
    )
    assert labelled >= 1
    assert split.update(generations)["optimizer_steps"] == 3.0 * labelled
    resumed = make_strategy("optimistic", drafter, lr=lr, epochs=3, minibatch=1)
    resumed.load_state_dict(split.state_dict())
    assert torch.equal(resumed._shuffle.get_state(), split._shuffle.get_state())


def test_ensemble_serves_the_hedge_weighted_average(target: TargetModel) -> None:
    from lightning_spec.online.strategies import _trainable

    drafter = HELPERS._drafter(target)
    generations = _round(target, drafter)
    ensemble = make_strategy("ensemble", drafter, lr=1e-3, learners=3, ratio=4.0, epsilon=0.5)
    metrics = ensemble.update(generations)
    # the served average's loss is timed apart; the learners' updates are charged
    assert metrics["diagnostic_seconds"] > 0 and metrics["update_seconds"] > 0
    weights = ensemble.weights()
    assert float(weights.sum()) == pytest.approx(1.0)
    assert [metrics[f"weight_{i}"] for i in range(3)] == pytest.approx(weights.tolist())
    best = int(ensemble.cumulative.argmin())
    assert int(weights.argmax()) == best  # Hedge favours the lowest cumulative loss
    for index, served in enumerate(_trainable(ensemble.drafter)):
        expected = sum(
            float(w) * _trainable(learner.drafter)[index]
            for w, learner in zip(weights, ensemble.learners, strict=True)
        )
        torch.testing.assert_close(served, expected, atol=1e-6, rtol=1e-5)
    # restored from its state, it serves the very same drafter
    copy = make_strategy("ensemble", drafter, lr=1e-3, learners=3, ratio=4.0, epsilon=0.5)
    copy.load_state_dict(ensemble.state_dict())
    for a, b in zip(_trainable(copy.drafter), _trainable(ensemble.drafter), strict=True):
        assert torch.equal(a, b)
    softmax = make_strategy("ensemble", drafter, learners=2, weighting="softmax")
    softmax.update(generations)
    assert float(softmax.weights().sum()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="weighting"):
        make_strategy("ensemble", drafter, weighting="max")


def test_the_safety_guard_rolls_back_an_update_that_costs_acceptance(
    target: TargetModel, tmp_path: Path
) -> None:
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.objectives.sft import SFT
    from lightning_spec.online.loop import SafetyGuard
    from lightning_spec.online.strategies import _trainable

    policy = parse_tree_spec(POLICY)
    drafter = Eagle3Drafter.from_target(target, intermediate_size=64)  # the full vocabulary
    prompts = [r.prompt for r in _requests(2)]
    texts = torch.tensor([p + autoregressive_generate(target, p, 16, stop_on_eos=False)
                          for p in prompts])  # fmt: skip
    sft = SFT.from_objects(target, drafter, ttt_steps=3)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(60):  # a drafter that accepts on the probe, so there is tau to lose
        optimizer.zero_grad()
        sft._common_step({"input_ids": texts, "loss_mask": torch.ones_like(texts)}).loss.backward()
        optimizer.step()
    strategy = make_strategy("ogd", drafter, lr=5.0, steps_per_round=3)  # wrecks the drafter
    start = [p.detach().clone() for p in _trainable(strategy.drafter)]
    guard = SafetyGuard(prompts=prompts, margin=0.05, max_new_tokens=12)
    run_stream(target, strategy, policy, _requests(2), out_dir=tmp_path, round_size=2,
               max_new_tokens=10, guard=guard)  # fmt: skip
    (summary,) = [json.loads(line) for line in (tmp_path / "rounds.jsonl").open()]
    assert summary["probe_tau_before"] > 1.5
    assert summary["probe_tau_after"] < summary["probe_tau_before"] * 0.95
    assert summary["rolled_back"] == 1.0
    for param, before in zip(_trainable(strategy.drafter), start, strict=True):
        assert torch.equal(param, before)  # restored exactly


def test_rejection_slots_are_where_the_target_chose_otherwise(target: TargetModel) -> None:
    from lightning_spec.online.losses import rejection_slots

    drafter = HELPERS._drafter(target)
    generations = _round(target, drafter, 3)
    slots = [(g, s) for g in generations for s in rejection_slots(g)]
    assert slots
    for generation, (position, token) in slots:
        sequence = generation.prompt + generation.tokens
        assert sequence[position] != token  # at T = 0 a rejected draft is not the target's token


def test_osd_and_dpo_learn_from_the_rejections(target: TargetModel) -> None:
    from lightning_spec.objectives import losses

    drafter = HELPERS._drafter(target)
    generations = _round(target, drafter, 3)
    osd = make_strategy("osd", drafter, lr=3e-3, buffer_rounds=2, steps_per_round=4)
    first = osd.update(generations)
    second = osd.update(generations)
    assert second["online_loss"] < first["online_loss"] and second["buffer_rounds"] == 2.0
    dpo = make_strategy("dpo", drafter, lr=3e-3, steps_per_round=3)
    result = dpo.update(generations)
    assert result["labels"] > 0 and result["online_loss"] == pytest.approx(
        -torch.nn.functional.logsigmoid(torch.tensor(0.0)).item(), abs=1e-6
    )  # the first step compares the drafter with itself: margin 0, loss log 2
    batch, pairs = dpo.pairs(generations)
    from lightning_spec.online.losses import pair_logprobs

    with torch.no_grad():
        chosen, rejected = pair_logprobs(dpo.drafter, batch, pairs)
        chosen0, rejected0 = pair_logprobs(drafter, batch, pairs)
    # after the update the chosen tokens gained on the rejected drafts
    assert float(((chosen - chosen0) - (rejected - rejected0)).mean()) > 0
    by_hand = losses.dpo_loss(
        chosen=torch.tensor([-1.0]), rejected=torch.tensor([-2.0]),
        ref_chosen=torch.tensor([-1.5]), ref_rejected=torch.tensor([-1.5]), beta=0.5,
    )  # fmt: skip
    assert float(by_hand) == pytest.approx(
        -torch.nn.functional.logsigmoid(torch.tensor(0.5)).item()
    )


def test_regret_proxy_is_zero_for_frozen_and_logged_per_window(
    target: TargetModel, tmp_path: Path
) -> None:
    policy = parse_tree_spec(POLICY)
    for name, options in (("frozen", {}), ("ogd", {"lr": 3e-3, "steps_per_round": 3})):
        out = tmp_path / name
        strategy = make_strategy(name, HELPERS._drafter(target), **options)
        run_stream(target, strategy, policy, _requests(4), out_dir=out, round_size=1,
                   max_new_tokens=8, regret_window=2)  # fmt: skip
        rounds = [json.loads(line) for line in (out / "rounds.jsonl").open()]
        values = [r["regret_proxy"] for r in rounds if "regret_proxy" in r]
        assert len(values) == 2  # rounds 2 and 4 close a window
        if name == "frozen":
            assert values == pytest.approx([0.0, 0.0], abs=1e-6)


def test_ogd_replay_buffer_trains_on_recent_rounds_and_resumes_with_them(
    target: TargetModel,
) -> None:
    drafter = HELPERS._drafter(target)
    generations = _round(target, drafter, count=3)
    first, second = generations[:2], generations[2:]
    ogd = make_strategy("ogd", drafter, lr=3e-3, steps_per_round=2, buffer_rounds=2)
    assert ogd.update(first)["buffer_rounds"] == 1.0
    state = copy.deepcopy(ogd.state_dict())  # what the round checkpoint saves
    result = ogd.update(second)
    assert result["buffer_rounds"] == 2.0 and result["labels"] > 0
    resumed = make_strategy("ogd", drafter, lr=3e-3, steps_per_round=2, buffer_rounds=2)
    resumed.load_state_dict(state)
    assert len(resumed.buffer) == 1  # the buffer is part of the round checkpoint
    again = resumed.update(second)
    assert again["online_loss"] == pytest.approx(result["online_loss"], rel=1e-5)
    with pytest.raises(ValueError, match="buffer_rounds"):
        make_strategy("ogd", drafter, buffer_rounds=0)


def test_topk_hits_counts_the_label_among_the_k_most_likely_tokens() -> None:
    log_q = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]]), dim=-1)
    labels = torch.tensor([1, 0])  # row 0: second most likely; row 1: least likely
    assert topk_hits(log_q, labels, 1).tolist() == [0.0, 0.0]
    assert topk_hits(log_q, labels, 2).tolist() == [1.0, 0.0]
    assert topk_hits(log_q, labels, 4).tolist() == [1.0, 1.0]
    assert topk_hits(log_q, labels, 9).tolist() == [1.0, 1.0]  # k beyond the vocabulary: all


def test_a_replayed_stream_equals_the_live_one(
    target: TargetModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Answers generated once in batches and replayed give every request the tau, tokens and
    feedback of live decoding, also after OGD has moved the drafter; the cache resumes."""
    from lightning_spec.data import regenerate
    from lightning_spec.online.continuations import stream_continuations

    policy = parse_tree_spec(POLICY)
    requests = _requests(6)
    options = {"lr": 3e-3, "steps_per_round": 2}
    live = run_stream(
        target, make_strategy("ogd", HELPERS._drafter(target), **options), policy, requests,
        out_dir=tmp_path / "live", round_size=2, max_new_tokens=10,
    )  # fmt: skip
    cache = tmp_path / "answers.jsonl"
    answers = stream_continuations(
        target, requests, max_new_tokens=10, cache=cache, batch_size=4, progress=False
    )
    for request, answer, row in zip(requests, answers, live, strict=True):
        assert answer == autoregressive_generate(target, request.prompt, 10)[: len(answer)]
        assert len(answer) == row["tokens"]  # no near-tie cut on this target
    replayed = run_stream(
        target, make_strategy("ogd", HELPERS._drafter(target), **options), policy, requests,
        out_dir=tmp_path / "replayed", round_size=2, max_new_tokens=10, continuations=answers,
    )  # fmt: skip
    assert [r["tau"] for r in replayed] == pytest.approx([r["tau"] for r in live], abs=1e-9)
    assert [r["verifications"] for r in replayed] == [r["verifications"] for r in live]
    assert all(r["replayed"] and r["tokens_per_s"] is None for r in replayed)
    replayed_rounds = [json.loads(line) for line in (tmp_path / "replayed" / "rounds.jsonl").open()]
    assert all(
        r["replay_seconds"] > 0 and r["net_tokens_per_s"] != r["net_tokens_per_s"]
        for r in replayed_rounds
    )  # fmt: skip  (replay time is not serving time: NaN)
    assert not any(r["replayed"] for r in live)
    # live_check: decoded live, each output checked against its known greedy answer
    wrong = [list(a) for a in answers]
    wrong[3][-1] = (wrong[3][-1] + 1) % target.vocab_size
    checked = run_stream(
        target, make_strategy("ogd", HELPERS._drafter(target), **options), policy, requests,
        out_dir=tmp_path / "checked", round_size=2, max_new_tokens=10, continuations=wrong,
        replay=False,
    )  # fmt: skip
    assert [r["greedy_match"] for r in checked] == [True, True, True, False, True, True]
    assert [r["tau"] for r in checked] == pytest.approx([r["tau"] for r in live], abs=1e-9)
    rounds = [json.loads(line) for line in (tmp_path / "checked" / "rounds.jsonl").open()]
    assert [r["greedy_mismatches"] for r in rounds] == [0.0, 1.0, 0.0]
    # a second call reads the cache and generates nothing; another length is refused
    monkeypatch.setattr(regenerate, "greedy_answers", lambda *a, **k: pytest.fail("generated"))
    assert (
        stream_continuations(target, requests, max_new_tokens=10, cache=cache, progress=False)
        == answers
    )
    with pytest.raises(ValueError, match="another target or length"):
        stream_continuations(target, requests, max_new_tokens=11, cache=cache, progress=False)
    # another stream with the same ids but other prompts gets its own answers from the cache
    monkeypatch.undo()
    other = [Request(r.index, r.domain, r.id, [t + 1 for t in r.prompt]) for r in requests[:2]]
    theirs = stream_continuations(target, other, max_new_tokens=10, cache=cache, progress=False)
    for request, answer in zip(other, theirs, strict=True):
        assert answer == autoregressive_generate(target, request.prompt, 10)[: len(answer)]
    assert theirs != answers[:2]
    # rows written before prompt digests are still found, by id alone, and the run says so
    lines = cache.read_text().splitlines()
    legacy = tmp_path / "legacy.jsonl"
    rows = [json.loads(line) for line in lines[1 : 1 + len(requests)]]
    legacy.write_text("\n".join([lines[0]] + [json.dumps({"id": r["id"], "tokens": r["tokens"]})
                                                for r in rows]) + "\n")  # fmt: skip
    capsys.readouterr()
    monkeypatch.setattr(regenerate, "greedy_answers", lambda *a, **k: pytest.fail("generated"))
    assert stream_continuations(target, requests, max_new_tokens=10, cache=legacy) == answers
    assert f"{len(requests)} of {len(requests)} answers" in capsys.readouterr().out


def test_the_reference_round_recipe_and_its_options(target: TargetModel) -> None:
    """Minibatch epochs (the default), OSD at the first rejected position only, the ensemble's
    learners restarted from the average, and the share of served tokens no draft can cover."""
    from lightning_spec.online.losses import draft_vocab_miss, rejection_slots

    drafter = HELPERS._drafter(target)  # a 48-token draft vocabulary of 128
    generations = [_round(target, drafter, 3)[i] for i in range(3)]
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter

    full = Eagle3Drafter.from_target(target, intermediate_size=64)  # every token draftable
    steps = make_strategy("ogd", full, lr=1e-3, epochs=3, minibatch=2).update(generations)
    assert steps["optimizer_steps"] == 3 * 2  # 3 sequences in minibatches of 2, 3 epochs
    assert steps["draft_vocab_miss"] == 0.0
    # the served loss (a diagnostic a frozen drafter computes too) is timed apart from learning
    assert steps["diagnostic_seconds"] > 0 and steps["update_seconds"] > 0
    assert math.isfinite(steps["online_loss"])
    metrics = make_strategy("ogd", drafter, lr=1e-3, epochs=1).update(generations)
    batch = feedback_batch(generations)
    served = (batch["loss_mask"] * batch["attention_mask"]).bool()
    outside = drafter.target_to_draft_ids(batch["input_ids"]) < 0
    expected = float((outside & served).sum()) / float(served.sum())
    assert metrics["draft_vocab_miss"] == pytest.approx(expected) and 0 < expected < 1
    assert draft_vocab_miss(drafter, batch) == pytest.approx(expected)
    every = [rejection_slots(g) for g in generations]
    first = [rejection_slots(g, first_only=True) for g in generations]
    for generation, slots in zip(generations, first, strict=True):
        tried = [r for r in generation.records if r.rejected.numel()]
        assert len(slots) <= len(tried)
        for record, (position, _) in zip(tried, slots, strict=False):
            assert position == record.anchor + len(record.accepted) + 1
    assert sum(map(len, first)) < sum(map(len, every))  # tree siblings no longer count
    ensemble = make_strategy("ensemble", drafter, lr=1e-3, learners=2, restart=True, epochs=1)
    ensemble.update(generations)
    for learner in ensemble.learners:
        for mine, mean in zip(
            learner.drafter.parameters(), ensemble.drafter.parameters(), strict=True
        ):
            assert torch.equal(mine, mean)
        assert not learner.optimizer.state  # each round's learners start a fresh optimizer


def test_pipeline_hedge_weighs_restarted_learners_by_training_loss(target: TargetModel) -> None:
    """Restarted from one average, every learner serves the same drafter, so their losses before
    learning are equal; `pipeline_hedge` tells them apart by each one's mean training loss."""
    drafter = HELPERS._drafter(target)
    generations = [_round(target, drafter, 3)[i] for i in range(3)]
    ensemble = make_strategy("ensemble", drafter, lr=1e-4, learners=3, ratio=8.0, restart=True,
                             weighting="softmax", epochs=2, minibatch=1)  # fmt: skip
    metrics = ensemble.update(generations)
    losses = torch.tensor([metrics[f"learner_loss_{i}"] for i in range(3)], dtype=torch.float64)
    assert torch.isfinite(losses).all() and len(set(losses.tolist())) == 3
    assert ensemble.temperature == 0.2  # the reference script's softmax temperature
    expected = torch.softmax(-losses / 0.2, dim=0)
    weights = torch.tensor([metrics[f"weight_{i}"] for i in range(3)], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)
    assert float(weights.max() - weights.min()) > 0  # no longer uniform
    # a learner's train_loss is the mean loss of its minibatches over the round's epochs
    single = make_strategy("ogd", drafter, lr=1e-4, epochs=2, minibatch=1).update(generations)
    assert math.isfinite(single["train_loss"]) and single["optimizer_steps"] > 0


def test_the_hindsight_ceiling_fits_on_the_head_and_scores_the_tail(
    target: TargetModel, tmp_path: Path
) -> None:
    """The configured learner fitted on the first 70% of a replayed stream for several epochs,
    then frozen on the rest: its rows are the tail's requests, its fitted drafter is what
    served them (equal to re-serving the tail with that drafter), and a killed run resumes."""
    from lightning_spec.online.continuations import stream_continuations
    from lightning_spec.online.hindsight import (
        FIT_CHECKPOINT,
        SUMMARY,
        hindsight_split,
        run_hindsight,
    )

    policy = parse_tree_spec(POLICY)
    requests = _requests(10)
    answers = stream_continuations(
        target, requests, max_new_tokens=10, cache=tmp_path / "answers.jsonl", batch_size=4,
        progress=False,
    )  # fmt: skip
    assert hindsight_split(10, 0.7) == 7
    strategy = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, epochs=1, minibatch=2)
    start = {k: v.clone() for k, v in strategy.drafter.state_dict().items()}
    rows = run_hindsight(
        target, strategy, policy, requests, answers, out_dir=tmp_path / "h", fraction=0.7,
        epochs=2, round_size=3, max_new_tokens=10,
    )  # fmt: skip
    assert [r["request"] for r in rows] == [7, 8, 9]
    moved = any(not torch.equal(v, start[k]) for k, v in strategy.drafter.state_dict().items())
    assert moved
    again = run_stream(
        target, make_strategy("frozen", strategy.drafter), policy, requests[7:],
        out_dir=tmp_path / "again", round_size=3, max_new_tokens=10, continuations=answers[7:],
    )  # fmt: skip
    assert [r["tau"] for r in again] == pytest.approx([r["tau"] for r in rows], abs=1e-9)
    summary = json.loads((tmp_path / "h" / SUMMARY).read_text())
    assert summary["fit_requests"] == 7 and summary["scored_requests"] == 3
    assert torch.load(tmp_path / "h" / FIT_CHECKPOINT, weights_only=False)["epochs"] == 2
    # resumed after the fit: no epoch is run again, the same rows come back
    fresh = make_strategy("ogd", HELPERS._drafter(target), lr=3e-3, epochs=1, minibatch=2)
    resumed = run_hindsight(
        target, fresh, policy, requests, answers, out_dir=tmp_path / "h", fraction=0.7,
        epochs=2, round_size=3, max_new_tokens=10,
    )  # fmt: skip
    assert [r["tau"] for r in resumed] == pytest.approx([r["tau"] for r in rows], abs=1e-9)
    with pytest.raises(ValueError, match="replay: true"):
        run_hindsight(target, fresh, policy, requests, None, out_dir=tmp_path / "x")
    with pytest.raises(ValueError, match="fraction"):
        hindsight_split(10, 1.0)


def test_committed_feedback_teaches_what_a_replay_teaches(target: TargetModel) -> None:
    """The hindsight fit's feedback without drafting: the same tokens, features and labels as a
    replay, so a learner that reads no records ends up with the very same weights."""
    from lightning_spec.decoding.replay import ReplayMismatch, committed_feedback
    from lightning_spec.online.loop import replay_request

    policy = parse_tree_spec(POLICY)
    drafter = HELPERS._drafter(target)
    prompts = [r.prompt for r in _requests(3)]
    answers = [autoregressive_generate(target, p, 10, stop_on_eos=False) for p in prompts]
    replayed = [replay_request(target, drafter, policy, p, a, keep_labels=8)
                for p, a in zip(prompts, answers, strict=True)]  # fmt: skip
    fixed = [committed_feedback(target, p, a, keep_labels=8)
             for p, a in zip(prompts, answers, strict=True)]  # fmt: skip
    for a, b in zip(replayed, fixed, strict=True):
        assert a.tokens == b.tokens and a.prompt == b.prompt and b.records == []
        torch.testing.assert_close(b.features, a.features)
        torch.testing.assert_close(b.label_logprobs, a.label_logprobs)
        assert torch.equal(b.label_ids, a.label_ids)
    one, two = (make_strategy("ogd", drafter, lr=3e-3, epochs=1, minibatch=2) for _ in range(2))
    assert not one.reads_records and make_strategy("osd", drafter).reads_records
    one.update(replayed)
    two.update(fixed)
    for key, value in one.drafter.state_dict().items():
        torch.testing.assert_close(two.drafter.state_dict()[key], value)
    with pytest.raises(ReplayMismatch, match="greedy"):
        committed_feedback(target, prompts[0], [answers[0][0], (answers[0][1] + 1) % 128])


def test_update_every_k_rounds_learns_from_the_k_rounds_together_and_resumes(
    target: TargetModel, tmp_path: Path
) -> None:
    """`update_every: 2`: the strategy learns after rounds 2 and 4, each time from both rounds'
    requests; a run killed after round 1 keeps round 1's served requests for the next update."""
    from lightning_spec.online.strategies import FrozenStrategy

    class Counting(FrozenStrategy):
        name = "counting"

        def __init__(self, drafter) -> None:  # noqa: ANN001
            super().__init__(drafter)
            self.calls: list[int] = []

        def update(self, generations):  # noqa: ANN001, ANN201
            self.calls.append(len(generations))
            return super().update(generations)

    policy = parse_tree_spec(POLICY)
    requests = _requests(8)
    counting = Counting(HELPERS._drafter(target))
    rows = run_stream(target, counting, policy, requests, out_dir=tmp_path / "a", round_size=2,
                      max_new_tokens=6, update_every=2)  # fmt: skip
    assert counting.calls == [4, 4] and len(rows) == 8
    rounds = [json.loads(line) for line in (tmp_path / "a" / "rounds.jsonl").open()]
    assert [r.get("skipped_update", 0.0) for r in rounds] == [1.0, 0.0, 1.0, 0.0]
    first = Counting(HELPERS._drafter(target))
    run_stream(target, first, policy, requests[:2], out_dir=tmp_path / "b", round_size=2,
               max_new_tokens=6, update_every=2)  # fmt: skip
    assert first.calls == [2]  # the last round of a stream always learns
    # killed after round 1: its checkpoint holds round 1's served requests, and the resumed
    # run's first update learns from them and round 2's
    (tmp_path / "c").mkdir()
    torch.save({"round": 0, "strategy": {}, "pending": ["served-in-round-1"] * 2},
               tmp_path / "c" / "round.pt")  # fmt: skip
    resumed = Counting(HELPERS._drafter(target))
    seen: list[list] = []
    resumed.update = lambda g: (seen.append(list(g)), {"update_seconds": 0.0})[1]  # type: ignore[method-assign]
    run_stream(target, resumed, policy, requests[:4], out_dir=tmp_path / "c", round_size=2,
               max_new_tokens=6, update_every=2)  # fmt: skip
    assert len(seen) == 1 and seen[0][:2] == ["served-in-round-1"] * 2 and len(seen[0]) == 4
    with pytest.raises(ValueError, match="update_every"):
        run_stream(target, resumed, policy, requests, out_dir=tmp_path / "d", update_every=0)


def test_updates_beside_serving_are_served_a_round_later_and_resume(
    target: TargetModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`update_beside`: round r's update runs while round r+1 is served, so round r+2 is the
    first served by it; the last round is not learned from (nothing is left to serve); a run
    killed mid-stream relaunches the update it had in flight and ends where an unbroken one
    does."""
    import lightning_spec.online.loop as online
    from lightning_spec.online.strategies import FrozenStrategy

    policy = parse_tree_spec(POLICY)
    requests = _requests(6)
    options = {"lr": 3e-3, "steps_per_round": 2, "epochs": 0}

    def serve(strategy, folder: str, chosen=requests, **kwargs):  # noqa: ANN001, ANN202
        return run_stream(target, strategy, policy, chosen, out_dir=tmp_path / folder,
                          round_size=2, max_new_tokens=10, **kwargs)  # fmt: skip

    frozen = serve(make_strategy("frozen", HELPERS._drafter(target)), "frozen")
    beside = make_strategy("ogd", HELPERS._drafter(target), **options)
    rows = serve(beside, "beside", update_beside=True)
    taus = [r["tau"] for r in rows]
    assert taus[:4] == pytest.approx([r["tau"] for r in frozen[:4]], abs=1e-9)
    after_round_0 = make_strategy("ogd", HELPERS._drafter(target), **options)
    serve(after_round_0, "serial0", requests[:2])  # learns round 0 (a stream's last round)
    third = serve(FrozenStrategy(after_round_0.drafter), "third", requests[4:])
    assert taus[4:] == pytest.approx([r["tau"] for r in third], abs=1e-9)
    after_rounds_01 = make_strategy("ogd", HELPERS._drafter(target), **options)
    serve(after_rounds_01, "serial01", requests[:4])

    def same(a, b) -> None:  # noqa: ANN001
        for x, y in zip(a.drafter.parameters(), b.drafter.parameters(), strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)

    same(beside, after_rounds_01)
    rounds = [json.loads(line) for line in (tmp_path / "beside" / "rounds.jsonl").open()]
    assert "beside_update_seconds" not in rounds[0] and "beside_update_seconds" in rounds[1]

    class Killed(Exception):
        pass

    real = online.SpeculativeDecoder.generate
    calls = {"n": 0}

    def dies_in_round_2(self, *args, **kwargs):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 5:
            raise Killed
        return real(self, *args, **kwargs)

    monkeypatch.setattr(online.SpeculativeDecoder, "generate", dies_in_round_2)
    with pytest.raises(Killed):
        serve(make_strategy("ogd", HELPERS._drafter(target), **options), "killed",
              update_beside=True)  # fmt: skip
    monkeypatch.setattr(online.SpeculativeDecoder, "generate", real)
    resumed = make_strategy("ogd", HELPERS._drafter(target), **options)
    again = serve(resumed, "killed", update_beside=True)
    assert [r["tau"] for r in again] == pytest.approx(taus, abs=1e-9)
    same(resumed, beside)
    with pytest.raises(ValueError, match="update_beside"):
        serve(beside, "bad", update_beside=True, regret_window=2)


def test_epoch_minibatches_visit_every_row_once_an_epoch_in_a_fresh_order() -> None:
    first = {"input_ids": torch.arange(5).unsqueeze(1)}
    second = {"input_ids": torch.arange(10, 13).unsqueeze(1)}
    parts = list(epoch_minibatches([first, second], 2, 2, torch.Generator().manual_seed(0)))
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 1, 2, 1] * 2  # per batch, per epoch
    rows = [p["input_ids"].flatten().tolist() for p in parts]
    epochs = [sum(rows[:5], []), sum(rows[5:], [])]
    assert all(sorted(e) == [0, 1, 2, 3, 4, 10, 11, 12] for e in epochs)
    assert sum(rows[:3], []) != sum(rows[5:8], [])  # each epoch reshuffles (seed 0)
    assert list(epoch_minibatches([first], 0, 2, torch.Generator())) == []


def test_timed_served_loss_is_the_no_grad_loss_with_its_own_seconds(target: TargetModel) -> None:
    drafter = HELPERS._drafter(target)
    batch = feedback_batch(_round(target, drafter))
    loss, labels, seconds = timed_served_loss(drafter, batch, 2)
    expected, count = online_loss(drafter, batch, ttt_steps=2)
    assert loss == pytest.approx(float(expected)) and labels == count > 0 and seconds > 0
    nan, zero, none = timed_served_loss(drafter, None, 2)
    assert math.isnan(nan) and zero == 0 and none == 0.0


def test_served_totals_sum_live_requests_only() -> None:
    rows = [
        {"tau": 2.0, "tokens": 10, "seconds": 1.0, "tokens_per_s": 10.0},
        {"tau": 3.0, "tokens": 30, "seconds": 0.5, "tokens_per_s": 60.0},
        {"tau": 4.0, "tokens": 50, "seconds": 9.0, "tokens_per_s": None},  # replayed: no time
    ]
    assert served_totals(rows) == (40.0, 1.5)
    summary = prequential_summary(rows)
    assert summary["prequential_tokens_per_s"] == pytest.approx(40 / 1.5)  # not the mean rate 35
    assert summary["prequential_tau"] == 3.0


def test_ogd_under_bf16_autocast_learns_and_keeps_fp32_weights(target: TargetModel) -> None:
    from lightning_spec.online.strategies import bf16_autocast_wanted

    drafter = HELPERS._drafter(target)
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(POLICY), keep_features=True)
    generations = [decoder.generate(r.prompt, 16, stop_on_eos=False) for r in _requests(3)]
    ogd = make_strategy("ogd", drafter, lr=3e-3, epochs=3, minibatch=1, autocast=True)
    first, second = ogd.update(generations), ogd.update(generations)
    assert math.isfinite(first["train_loss"]) and second["online_loss"] < first["online_loss"]
    assert all(p.dtype == torch.float32 for p in ogd.drafter.parameters())  # AdamW's master copy
    assert bf16_autocast_wanted(False) is False and isinstance(bf16_autocast_wanted("auto"), bool)
    with pytest.raises(ValueError, match="autocast"):
        make_strategy("ogd", drafter, autocast="bf16")


def test_online_lk_losses_against_closed_forms() -> None:
    """Hand-made log-probs and kept targets: the LK terms of the online loss, by hand."""
    from lightning_spec.online.losses import OnlineLoss, _ttt_loss, dense_targets

    q = torch.tensor([[[0.5, 0.3, 0.2, 0.0]]]).clamp_min(1e-12)  # [B=1, T=1, V'=4]
    log_q = torch.log(q / q.sum(-1, keepdim=True))
    ids = torch.tensor([[[1, 2, 0]]])  # kept rows: p(1) = 0.6, p(2) = 0.4, a padded slot
    probs = torch.tensor([[[0.6, 0.4, 0.0]]])
    dense = dense_targets(ids, probs, 4)
    torch.testing.assert_close(dense, torch.tensor([[[0.0, 0.6, 0.4, 0.0]]]))
    masks = torch.ones(1, 1, 1)
    alpha = min(0.6, 0.3) + min(0.4, 0.2)  # sum_v min(p, q)
    lk = _ttt_loss([log_q], ids, probs, masks, 0.8, OnlineLoss("lk_alpha"))
    assert float(lk) == pytest.approx(-math.log(alpha), rel=1e-5)
    ce = _ttt_loss([log_q], ids, probs, masks, 0.8)
    assert float(ce) == pytest.approx(-(0.6 * math.log(0.3) + 0.4 * math.log(0.2)), rel=1e-5)
    kl = 0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.2)
    weight = math.exp(-3.0 * alpha)
    blend = _ttt_loss([log_q], ids, probs, masks, 0.8, OnlineLoss("lk_lambda"))
    assert float(blend) == pytest.approx(weight * kl + (1 - weight) * (1 - alpha), rel=1e-5)
    # a one-hot target: -log alpha is the cross-entropy of the label
    hard = _ttt_loss([log_q], ids[..., :1], torch.ones(1, 1, 1), masks, 0.8, OnlineLoss("lk_alpha"))
    assert float(hard) == pytest.approx(-math.log(0.3), rel=1e-5)
    with pytest.raises(ValueError, match="online loss"):
        OnlineLoss("tv")


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda"])
def test_ogd_with_an_lk_loss_lowers_it_on_the_round(target: TargetModel, loss: str) -> None:
    drafter = HELPERS._drafter(target)
    decoder = SpeculativeDecoder(
        target, drafter, parse_tree_spec(POLICY), keep_features=True, keep_labels=8
    )
    generations = [decoder.generate(r.prompt, 16, stop_on_eos=False) for r in _requests(3)]
    ogd = make_strategy("ogd", drafter, lr=3e-3, epochs=3, minibatch=1, loss=loss)
    first, second = ogd.update(generations), ogd.update(generations)
    assert math.isfinite(first["online_loss"]) and second["online_loss"] < first["online_loss"]
    # the served loss it reports is the LK loss, not the cross-entropy
    soft = make_strategy("ogd", drafter, lr=3e-3, epochs=3, minibatch=1).update(generations)
    assert soft["online_loss"] != pytest.approx(first["online_loss"])
    with pytest.raises(ValueError, match="online loss"):
        make_strategy("ogd", drafter, loss="lk")
