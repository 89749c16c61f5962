"""online/vllm_capture.py and online/vllm_routes.py without vLLM: the runner adapter reads a
batched engine step the way vLLM 0.32's model runner lays it out (requests in batch order,
their scheduled tokens flattened with start offsets, sampled tokens padded with -1, partial
prefills discarded), and the push route refuses what it must. The same code against the real
``vllm serve`` is tests/online/test_vllm_serve_live.py (slow)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_spec.decoding.engine import autoregressive_generate
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.online.spool import SpoolReader
from lightning_spec.online.vllm_capture import RunnerCapture
from lightning_spec.online.vllm_routes import PushRefused, checked_push_folder, push
from lightning_spec.online.vllm_routes import status as route_status

K = 2


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=4), seed=5)


class _Buffer:
    def __init__(self, values: list) -> None:  # noqa: ANN401
        self.cpu = self.gpu = torch.tensor(values)


def _step(target: TargetModel, capture: RunnerCapture, batch: list[dict]) -> None:
    """One batched engine step: each item {id, prefix, scheduled, sampled, discard, params}."""
    inputs, aux, last, starts, sampled = [], [], [], [0], []
    for item in batch:
        with torch.no_grad():
            out = target(torch.tensor([item["prefix"] + item["scheduled"]]), use_cache=False)
        n = len(item["scheduled"])
        inputs += item["scheduled"]
        aux.append(out.features[0, -n:])
        last.append(out.last_hidden[0, -n:])
        starts.append(starts[-1] + n)
        sampled.append(item["sampled"] + [-1] * (K + 1 - len(item["sampled"])))
    width = out.features.shape[-1] // 3
    rows = torch.cat(aux)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=[i["id"] for i in batch]),
        query_start_loc=_Buffer(starts + [starts[-1]] * 3),  # padded past the batch, as vLLM's
        input_ids=_Buffer(inputs + [0] * 5),
        discard_request_mask=_Buffer([i.get("discard", False) for i in batch] + [False] * 3),
        requests={i["id"]: SimpleNamespace(sampling_params=i["params"]) for i in batch},
        max_model_len=512,
    )  # fmt: skip
    split = [rows[:, j * width : (j + 1) * width] for j in range(3)]
    capture.observe(runner, SimpleNamespace(), torch.tensor(sampled), torch.cat(last), split)


def _params(max_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(
        stop_token_ids=[], eos_token_id=None, min_tokens=0, max_tokens=max_tokens
    )


def _wait_written(capture: RunnerCapture, count: int) -> None:
    deadline = time.monotonic() + 10
    while capture.writer.counts["written"] < count and time.monotonic() < deadline:
        time.sleep(0.02)


def test_two_requests_batched_together_each_spooled_with_their_own_rows(
    target: TargetModel, tmp_path: Path
) -> None:
    capture = RunnerCapture(tmp_path / "spool")
    a_prompt, b_prompt = list(range(3, 15)), list(range(20, 28))
    a = autoregressive_generate(target, a_prompt, 8, stop_on_eos=False)
    b = autoregressive_generate(target, b_prompt, 8, stop_on_eos=False)
    # step 1: A's whole prompt, B's first chunk (its sampled token is discarded by the engine)
    _step(target, capture, [
        {"id": "A", "prefix": [], "scheduled": a_prompt, "sampled": [a[0]], "params": _params(5)},
        {"id": "B", "prefix": [], "scheduled": b_prompt[:4], "sampled": [99], "discard": True,
         "params": _params(5)},
    ])  # fmt: skip
    # step 2: A verifies two drafts (one accepted), B ends its prompt
    _step(target, capture, [
        {"id": "A", "prefix": a_prompt, "scheduled": [a[0], a[1], 77], "sampled": [a[1], a[2]],
         "params": _params(5)},
        {"id": "B", "prefix": b_prompt[:4], "scheduled": b_prompt[4:], "sampled": [b[0]],
         "params": _params(5)},
    ])  # fmt: skip
    # step 3: A accepts both drafts and reaches max_tokens = 5 (finished early); B verifies
    _step(target, capture, [
        {"id": "A", "prefix": a_prompt + a[:2], "scheduled": [a[2], a[3], a[4]],
         "sampled": [a[3], a[4], a[5]], "params": _params(5)},
        {"id": "B", "prefix": b_prompt, "scheduled": [b[0], 66, 67], "sampled": [b[1]],
         "params": _params(5)},
    ])  # fmt: skip
    capture.finished(["A", "B"])  # the scheduler names both finished at the next step
    _wait_written(capture, 2)
    entries = {e.request.request_id: e.request for e in SpoolReader(tmp_path / "spool").take()}
    assert set(entries) == {"A", "B"} and capture.status()["enabled"]
    got_a, got_b = entries["A"], entries["B"]
    assert got_a.token_ids == a_prompt + a[:6] and got_a.accepted == [1, 2]
    assert got_b.token_ids == b_prompt + b[:2] and got_b.accepted == [0]
    for got in (got_a, got_b):
        with torch.no_grad():
            out = target(torch.tensor([got.computed]), use_cache=False)
        torch.testing.assert_close(got.aux, out.features[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.last, out.last_hidden[0], rtol=1e-4, atol=1e-5)
    assert capture.status()["capture_finished"] == 2


def test_a_capture_error_turns_capture_off_and_never_raises(tmp_path: Path) -> None:
    capture = RunnerCapture(tmp_path / "spool")
    capture.observe(SimpleNamespace(), SimpleNamespace(), [[1]], torch.zeros(1, 2), None)
    assert not capture.status()["enabled"] and "aux" in capture.status()["error"]
    capture.observe(SimpleNamespace(), SimpleNamespace(), [[1]], torch.zeros(1, 2), None)
    assert capture.status()["capture_errors"] == 1  # off: not even tried again


def _drafter_folder(root: Path) -> Path:
    folder = root / "learner" / "drafters" / "round-0001"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_a_push_names_a_folder_inside_the_learners_output_with_its_weights(tmp_path: Path) -> None:
    folder, sha = _drafter_folder(tmp_path), "a" * 64
    root = tmp_path / "learner"
    assert checked_push_folder({"folder": str(folder), "sha256": sha}, str(root)) == (
        folder.resolve(),
        sha,
    )
    cases = [
        ({"folder": str(folder), "sha256": sha}, None, 403, "pushes are off"),
        ({"folder": str(tmp_path), "sha256": sha}, str(root), 403, "outside"),
        (
            {"folder": str(root / "drafters" / ".." / ".." / "x"), "sha256": sha},
            str(root),
            403,
            "outside",
        ),
        ({"folder": str(root / "drafters"), "sha256": sha}, str(root), 404, "model.safetensors"),
        ({"folder": str(folder), "sha256": "xyz"}, str(root), 400, "sha256"),
        ([1, 2], str(root), 400, "JSON"),
    ]
    for body, push_root, status, words in cases:
        with pytest.raises(PushRefused, match=words) as refused:
            checked_push_folder(body, push_root)
        assert refused.value.status == status


def test_an_engine_that_refuses_a_push_answers_409_and_one_that_takes_it_answers_its_sha(
    tmp_path: Path,
) -> None:
    folder, root = _drafter_folder(tmp_path), str(tmp_path / "learner")

    async def refusing(method: str, args: tuple = ()) -> list:
        raise RuntimeError("DraftRejected: sha256 mismatch")

    async def taking(method: str, args: tuple = ()) -> list:
        assert method == "lightning_spec_push" and args[0] == str(folder.resolve())
        return [{"served_sha256": args[1], "seconds": 0.1}]

    body = {"folder": str(folder), "sha256": "b" * 64}
    with pytest.raises(PushRefused, match="kept its drafter") as refused:
        asyncio.run(push(refusing, body, root))
    assert refused.value.status == 409
    assert asyncio.run(push(taking, body, root))["served_sha256"] == "b" * 64


def test_the_status_says_how_many_rounds_the_learner_has_finished(tmp_path: Path) -> None:
    async def engine(method: str, args: tuple = ()) -> list:
        return [{"served_sha256": "c" * 64, "capture_finished": 3}]

    root = tmp_path / "learner"
    assert asyncio.run(route_status(engine, str(root)))["learner_rounds"] == 0  # no learner yet
    root.mkdir()
    (root / "rounds.jsonl").write_text('{"round": 0}\n{"round": 1}\n')
    answer = asyncio.run(route_status(engine, str(root)))
    assert answer["learner_rounds"] == 2 and answer["capture_finished"] == 3
    assert asyncio.run(route_status(engine))["learner_rounds"] == 0  # pushes off: no learner
