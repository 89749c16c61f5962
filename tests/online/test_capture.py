"""online/capture.py: a request's features assembled from an engine's steps equal one target
prefill of the served text, and a replay from them equals the replay from a target pass.

The engine here is simulated on a tiny target built in code: a prompt served in chunks, then
verification steps whose drafts are the target's greedy tokens up to a chosen point and wrong
after it; every step's rows are the target's own hidden states of what it scheduled (computed on
the committed prefix, as an engine with a KV cache computes them).
"""

from __future__ import annotations

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import autoregressive_generate
from lightning_spec.decoding.replay import replay_greedy, text_pass
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.online.capture import CaptureBroken, RequestCapture, StepCapture
from lightning_spec.online.loop import replay_captured

K = 3
ACCEPTS = [3, 0, 1, 2, 0, 3, 1]


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=4), seed=2)


def _rows(target: TargetModel, prefix: list[int], scheduled: list[int]):  # noqa: ANN202
    """The target's rows of `scheduled` after the committed `prefix` (features, final hidden)."""
    with torch.no_grad():
        out = target(torch.tensor([prefix + scheduled]), use_cache=False)
    n = len(scheduled)
    return out.features[0, -n:], out.last_hidden[0, -n:]


def _serve(target: TargetModel, capture: StepCapture, rid: str, prompt: list[int], new: int,
           chunks: int = 2) -> list[int]:  # fmt: skip
    """Feed `capture` the steps an engine would take to serve `prompt` greedily; returns the
    committed continuation."""
    answer = autoregressive_generate(target, prompt, new + K + 1, stop_on_eos=False)
    cut = len(prompt) // chunks
    bounds = [0, *[cut * (i + 1) for i in range(chunks - 1)], len(prompt)]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        aux, last = _rows(target, prompt[:lo], prompt[lo:hi])
        sampled = [answer[0]] if i == chunks - 1 else []
        capture.add_step(rid, prompt[lo:hi], aux, sampled, last=last)
    committed, step = 1, 0
    while committed < new:
        accept = ACCEPTS[step % len(ACCEPTS)]
        true = answer[committed : committed + K]
        drafts = true[:accept] + [(t + 1) % 128 for t in true[accept:]]
        scheduled = [answer[committed - 1], *drafts]
        aux, last = _rows(target, prompt + answer[: committed - 1], scheduled)
        capture.add_step(rid, scheduled, aux, answer[committed : committed + accept + 1], last=last)
        committed += accept + 1
        step += 1
    return answer[:committed]


def test_served_rows_equal_one_prefill_of_the_served_text(target: TargetModel) -> None:
    capture = StepCapture()
    prompt = list(range(5, 30))
    answer = _serve(target, capture, "r1", prompt, 20, chunks=3)
    got = capture.finish("r1")
    assert got is not None and got.prompt_len == len(prompt)
    assert got.token_ids == prompt + answer
    assert got.accepted == [ACCEPTS[i % len(ACCEPTS)] for i in range(len(got.accepted))] and set(
        got.drafted
    ) == {K}
    full = text_pass(target, torch.tensor([got.computed]), len(prompt), features=True)
    with torch.no_grad():
        whole = target(torch.tensor([got.computed]), use_cache=False)
    assert got.aux.shape == full.features[0].shape
    torch.testing.assert_close(got.aux, full.features[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.last, whole.last_hidden[0], rtol=1e-4, atol=1e-5)
    assert got.tau == pytest.approx((sum(got.accepted) + len(got.accepted)) / len(got.accepted))


def test_a_replay_from_the_served_rows_equals_a_replay_from_a_target_pass(
    target: TargetModel,
) -> None:
    """The learner's path without a second target pass gives the same records, features and
    labels as the path with one."""
    capture = StepCapture()
    prompt = list(range(40, 60))
    _serve(target, capture, "r2", prompt, 16)
    got = capture.finish("r2")
    drafter = Eagle3Drafter.from_target(target, seed=3)
    policy = parse_tree_spec("chain:3")
    mine = replay_captured(target, drafter, policy, got, keep_labels=4)
    tokens = got.computed
    theirs = replay_greedy(target, drafter, policy, tokens[: len(prompt)], tokens[len(prompt) :],
                           keep_labels=4)  # fmt: skip
    assert [r.accept_length for r in mine.records] == [r.accept_length for r in theirs.records]
    assert mine.tokens == theirs.tokens
    torch.testing.assert_close(mine.label_logprobs, theirs.label_logprobs, rtol=1e-4, atol=1e-4)
    assert torch.equal(mine.label_ids, theirs.label_ids)
    assert mine.features.shape[0] == len(tokens) - 1


def test_a_step_that_does_not_continue_the_capture_drops_the_request(target: TargetModel) -> None:
    capture = StepCapture()
    prompt = list(range(5, 15))
    aux, last = _rows(target, [], prompt)
    capture.add_step("r3", prompt, aux, [7], last=last)
    aux, last = _rows(target, prompt, [8, 9])  # starts at 8, but 7 was committed: recomputed?
    capture.add_step("r3", [8, 9], aux, [9], last=last)
    capture.add_step("r3", [9], aux[:1], [10], last=last[:1])  # ignored after the break
    assert capture.finish("r3") is None and capture.skipped["broken"] == 1
    assert "r3" not in capture.running and "r3" not in capture.broken


def test_requests_that_end_before_a_token_or_were_never_seen_are_counted(
    target: TargetModel,
) -> None:
    capture = StepCapture()
    prompt = list(range(5, 15))
    aux, last = _rows(target, [], prompt[:5])
    capture.add_step("aborted", prompt[:5], aux, [], last=last)  # a first chunk, then aborted
    assert capture.finish("aborted") is None and capture.skipped["no_tokens"] == 1
    assert capture.finish("never") is None and capture.skipped["unseen"] == 1


def test_malformed_steps_are_refused() -> None:
    request = RequestCapture("x")
    with pytest.raises(CaptureBroken, match="rows"):
        request.add_step([1, 2, 3], torch.zeros(2, 4), [])
    request.add_step([1, 2, 3], torch.zeros(3, 4), [5])
    with pytest.raises(CaptureBroken, match="prefix of the drafts"):
        request.add_step([5, 6, 7], torch.zeros(3, 4), [9, 7, 8])  # 9 was never drafted
    with pytest.raises(CaptureBroken, match="before its first token"):
        RequestCapture("y").finish()
