"""Regeneration through OpenAI-compatible servers, against small servers made here (the standard
library's ThreadingHTTPServer, answering with a tiny deterministic function of the prompt): the
prompt goes as token ids and the answer's ids are stored as they come; several servers share the
prompts at the set concurrency; a killed run (a real SIGKILL) resumes without losing a written
shard or sending a stored prompt again; garbage, 5xx and timeouts are retried then counted; a
dead server leaves the rotation while the others answer; a 4xx is skipped without a retry; each
later turn's prompt carries the server's earlier answers; llama.cpp's endpoint and text-only
servers give the same records; and the records equal what `regenerate` writes for the same
answers. Then the seam: the data module and `lightning-spec prepare --regenerate-with`."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_spec.data.chat import render_prompt
from lightning_spec.data.regenerate import GenerationSettings, PromptItem, regenerate
from lightning_spec.data.regenerate_served import regenerate_served
from lightning_spec.data.rollouts import RolloutStore
from lightning_spec.data.served_protocol import (
    GarbageReply,
    ServerUnavailable,
    parse_reply,
    parse_server_urls,
)

CONFIG = {"kind": "regenerated", "target": "fake", "max_length": 16}
EOS = 2  # <|im_end|> in tests/data/conftest.py's vocabulary (ids 8..27 are plain words)
OMEGA = 31  # "omega": the dataset's own answers say it, the fake target never does
WORDS = ["what", "is", "the", "sky", "sea", "red", "cat", "dog", "sun", "moon", "tree", "blue"]
SLOW = 1.5  # seconds a "slow" answer takes (the client's timeout is shorter)
SETTINGS = GenerationSettings(max_new_tokens=8)


def answer_of(prompt: Sequence[int], limit: int) -> list[int]:
    """The fake target: 3 to 6 plain words that depend on the prompt, then the end of turn,
    cut to `limit` tokens."""
    start = sum(prompt) % 20
    answer = [8 + (start + 7 * k) % 20 for k in range(3 + len(prompt) % 4)] + [EOS]
    return answer[:limit]


class FakeEngine:
    """A completion server on a free port answering `answer_of` the prompt: OpenAI-style
    (``/v1/completions``, ``/v1/models``) or llama.cpp-style (``/completion``, ``/props``).

    Knobs: ``token_ids`` (return ids, else text only), ``refuse_ids`` (422 for an id prompt),
    ``mangle_text`` (double spaces: text that does not survive tokenization), ``delay`` (seconds
    per request), ``failures`` (one per completion request, in order: ``"500"``, ``"garbage"``
    (not JSON), ``"missing"`` (JSON without a completion), ``"slow"``), ``die_after`` (drop
    the connection of every request after that many answers), ``reject_longer_than`` (400).
    The one-token probe is counted in ``probes``, every other completion body in ``requests``.
    """

    def __init__(self, tokenizer: Any, *, api: str = "openai", token_ids: bool = True,
                 refuse_ids: bool = False, mangle_text: bool = False, delay: float = 0.0,
                 failures: Sequence[str] = (), die_after: int | None = None,
                 reject_longer_than: int | None = None) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.api, self.token_ids, self.refuse_ids = api, token_ids, refuse_ids
        self.mangle_text, self.delay, self.failures = mangle_text, delay, list(failures)
        self.die_after, self.reject_longer_than = die_after, reject_longer_than
        self.requests: list[dict[str, Any]] = []
        self.probes = self.answered = self.inflight = self.peak = 0
        self.lock = threading.Lock()
        self.tokenizer_lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"engine": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def prompts(self) -> list[Any]:
        with self.lock:
            return [body["prompt"] for body in self.requests]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def complete(self, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        """(status, JSON or raw bytes) for one completion request; None: drop the connection."""
        route = "/completion" if self.api == "llamacpp" else "/v1/completions"
        if path != route:
            return 404, {"error": f"no route {path}"}
        limit = int(body["n_predict"] if self.api == "llamacpp" else body["max_tokens"])
        prompt = body["prompt"]
        if isinstance(prompt, str):
            with self.tokenizer_lock:
                ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        elif self.refuse_ids:
            return 422, {"detail": "prompt: input should be a valid string"}
        else:
            ids = list(prompt)
        failure = None
        with self.lock:
            if limit == 1:
                self.probes += 1
            else:
                self.requests.append(body)
                if self.die_after is not None and self.answered >= self.die_after:
                    return None
                failure = self.failures.pop(0) if self.failures else None
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
        try:
            time.sleep(self.delay + (SLOW if failure == "slow" else 0.0))
        finally:
            with self.lock:
                self.inflight -= 1
        if failure == "500":
            return 500, {"error": "the engine crashed"}
        if failure == "garbage":
            return 200, b"<html>502 bad gateway</html>"
        if failure == "missing":
            return 200, {"id": "cmpl-0", "object": "text_completion"}
        if self.reject_longer_than is not None and len(ids) > self.reject_longer_than:
            return 400, {"error": "this prompt is longer than the context"}
        tokens = answer_of(ids, limit)
        with self.lock:
            if limit != 1:
                self.answered += 1
        stopped = bool(tokens) and tokens[-1] == EOS
        words = tokens[:-1] if stopped else tokens
        with self.tokenizer_lock:
            text = self.tokenizer.decode(words, skip_special_tokens=True)
        if self.mangle_text:
            text = text.replace(" ", "  ")
        if self.api == "llamacpp":  # its tokens stop before the end token: the client adds it
            return 200, {"content": text, "tokens": words if self.token_ids else [],
                         "stop_type": "eos" if stopped else "limit", "truncated": False}  # fmt: skip
        choice: dict[str, Any] = {"index": 0, "text": text,
                                  "finish_reason": "stop" if stopped else "length"}  # fmt: skip
        if self.token_ids:
            choice["token_ids"] = tokens
        return 200, {"id": "cmpl-0", "object": "text_completion", "model": "fake-target",
                     "choices": [choice], "usage": {"completion_tokens": len(tokens)}}  # fmt: skip


class _Handler(BaseHTTPRequestHandler):
    engine: FakeEngine

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/props" and self.engine.api == "llamacpp":
            return self._send(200, {"default_generation_settings": {}, "model_alias": "fake"})
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "fake-target"}]})
        self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        answer = self.engine.complete(self.path, body)
        if answer is None:  # a crashed engine: the connection ends without an answer
            self.close_connection = True
            return
        self._send(*answer)

    def _send(self, status: int, payload: Any) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
            pass


@pytest.fixture
def engines(data_helpers: Any) -> Iterator[Any]:
    """Factory: ``engines(**knobs)`` starts a `FakeEngine` with a tokenizer of its own (a fast
    tokenizer is not shared between threads) and closes it after the test."""
    made: list[FakeEngine] = []

    def make(**knobs: Any) -> FakeEngine:
        made.append(FakeEngine(data_helpers.make_chat_tokenizer(), **knobs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def _user(name: str, words: Sequence[str], **meta: Any) -> PromptItem:
    return PromptItem(name, messages=[{"role": "user", "content": " ".join(words)}], meta=meta)


def _prompts(count: int, *, seed: int = 0) -> list[PromptItem]:
    """`count` one-turn prompts of 2 to 9 words (7 to 14 prompt tokens)."""
    rng = random.Random(seed)
    return [
        _user(f"p{index:03d}", rng.choices(WORDS, k=rng.randint(2, 9)), n=index)
        for index in range(count)
    ]


def _records(store: RolloutStore) -> dict[str, dict[str, Any]]:
    return {record.id: record.to_dict() for record in store.iter_records()}


def _served(engine_urls: str | list[str], tokenizer: Any, prompts: list[PromptItem],
            store: RolloutStore, **kwargs: Any) -> Any:  # fmt: skip
    options = {"settings": SETTINGS, "progress": False, "eos_token_ids": [EOS], "backoff": 0.01,
               "timeout": 30.0, **kwargs}  # fmt: skip
    return regenerate_served(engine_urls, tokenizer, prompts, store, **options)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------------------------
# One server: what goes out and what is stored
# --------------------------------------------------------------------------------------------


def test_the_prompt_goes_as_token_ids_and_the_answers_ids_are_stored(
    tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    engine = engines()
    prompts = _prompts(6)
    store = RolloutStore(tmp_path, CONFIG)
    report = _served(engine.url, chat_tokenizer, prompts, store, records_per_shard=4)
    rendered = {p.id: render_prompt(chat_tokenizer, p.messages) for p in prompts}
    assert sorted(map(tuple, engine.prompts())) == sorted(map(tuple, rendered.values()))
    for body in engine.requests:
        assert body["return_token_ids"] is True and body["model"] == "fake-target"
        assert body["temperature"] == 0.0 and "seed" not in body  # greedy
    records = {r.id: r for r in store.iter_records()}
    assert [s.records for s in store.shards()] == [4, 2]
    for item in prompts:
        record, prompt = records[item.id], rendered[item.id]
        answer = answer_of(prompt, SETTINGS.max_new_tokens)
        assert record.input_ids == prompt + answer and record.source == "regenerated"
        assert record.loss_mask == [0] * len(prompt) + [1] * len(answer)
        assert record.meta["finish"] == ("eos" if answer[-1] == EOS else "length")
        assert record.meta["n"] == item.meta["n"]
    assert report.generated == 6 and report.retokenized == 0 and not report.skipped
    assert report.new_tokens == sum(len(r.input_ids) - r.meta["prompt_tokens"]
                                    for r in records.values())  # fmt: skip
    assert report.servers[engine.url].answered == 6 and report.servers[engine.url].requests == 6
    # run again: everything is stored, nothing is sent
    again = _served(engine.url, chat_tokenizer, prompts, store)
    assert again.already_done == 6 and again.generated == 0 and len(engine.requests) == 6


class _AnswersLikeTheServer:
    """A `model` whose ``generate`` answers `answer_of` each (unpadded) prompt: the batched
    loop's view of the same target."""

    config = SimpleNamespace(pad_token_id=0)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 max_new_tokens: int, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        rows = []
        for row, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            prompt = [token for token, keep in zip(row, mask, strict=True) if keep]
            rows.append(row + answer_of(prompt, max_new_tokens))
        width = max(len(row) for row in rows)
        return torch.tensor([row + [0] * (width - len(row)) for row in rows])


def test_records_equal_the_batched_loops_for_the_same_answers(
    tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    """Same prompts, same answers: `regenerate_served` writes field for field what `regenerate`
    writes, too-long prompts skipped and answers cut at `max_length` alike."""
    # 7 prompt tokens: the whole answer fits (eos); 14: cut after 2 tokens (length); 17: too long
    prompts = [*_prompts(10, seed=3), _user("short", WORDS[:2]), _user("cut", WORDS[:9])]
    prompts.append(_user("long", WORDS))
    target = SimpleNamespace(model=_AnswersLikeTheServer(), device=torch.device("cpu"),
                             eos_token_ids={EOS})  # fmt: skip
    batched = RolloutStore(tmp_path / "batched", CONFIG)
    loop = regenerate(target, chat_tokenizer, prompts, batched, settings=SETTINGS, batch_size=1,
                      max_length=16, records_per_shard=3, progress=False, eos_token_ids=[EOS])  # fmt: skip
    served = RolloutStore(tmp_path / "served", CONFIG)
    report = _served(engines().url, chat_tokenizer, prompts, served, max_length=16,
                     records_per_shard=3)  # fmt: skip
    assert _records(served) == _records(batched)
    assert report.too_long == loop.too_long == 1 and report.generated == loop.generated == 12
    finishes = {r["meta"]["finish"] for r in _records(served).values()}
    assert {"eos", "length"} <= finishes  # both kinds of answer are compared


@pytest.mark.parametrize(
    "knobs",
    [
        {"api": "llamacpp"},
        {"token_ids": False},
        {"refuse_ids": True},
        {"api": "llamacpp", "token_ids": False},
    ],
    ids=["llama-server", "text-only", "text-prompts", "llama-server-text-only"],
)
def test_llama_server_and_text_only_servers_give_the_same_records(
    knobs: dict[str, Any], tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    prompts = _prompts(6, seed=5)
    reference = RolloutStore(tmp_path / "reference", CONFIG)
    _served(engines().url, chat_tokenizer, prompts, reference)
    engine = engines(**knobs)
    store = RolloutStore(tmp_path / "store", CONFIG)
    report = _served(engine.url, chat_tokenizer, prompts, store)
    assert _records(store) == _records(reference)
    text_only = not knobs.get("token_ids", True)
    assert report.retokenized == (6 if text_only else 0) and report.retokenization_failures == 0
    server = report.servers[engine.url]
    assert server.api == knobs.get("api", "openai")
    assert server.prompt_as_text == bool(knobs.get("refuse_ids"))
    if knobs.get("refuse_ids"):  # the prompt went as its text, which the server tokenized
        assert all(isinstance(prompt, str) for prompt in engine.prompts())
    if knobs.get("api") == "llamacpp":
        for body in engine.requests:
            assert body["return_tokens"] is True and body["n_predict"] == SETTINGS.max_new_tokens
            assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["min_p"] == 0.0


def test_text_that_does_not_survive_tokenization_is_counted(
    tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    engine = engines(token_ids=False, mangle_text=True)
    report = _served(engine.url, chat_tokenizer, _prompts(5), RolloutStore(tmp_path, CONFIG))
    assert report.generated == 5 and report.retokenized == 5
    assert report.retokenization_failures == 5


def test_sampling_settings_and_a_seed_per_prompt_go_to_the_server(
    tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    settings = GenerationSettings(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=5, seed=3)
    prompts = _prompts(5)
    seeds = []
    for run in range(2):
        engine = engines()
        _served(engine.url, chat_tokenizer, prompts, RolloutStore(tmp_path / str(run), CONFIG),
                settings=settings)  # fmt: skip
        for body in engine.requests:
            assert (body["temperature"], body["top_p"], body["top_k"]) == (0.8, 0.9, 5)
        seeds.append(sorted(body["seed"] for body in engine.requests))
    assert seeds[0] == seeds[1]  # a rerun asks for the same draws
    assert len(set(seeds[0])) == 5  # each prompt its own


def test_every_turn_is_answered_against_the_servers_own_earlier_replies(
    tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    conversation = [
        {"role": "user", "content": "what is the sky"},
        {"role": "assistant", "content": "omega omega omega"},
        {"role": "user", "content": "why the sea"},
        {"role": "assistant", "content": "omega omega"},
    ]
    engine = engines()
    store = RolloutStore(tmp_path, CONFIG)
    report = _served(engine.url, chat_tokenizer, [PromptItem("c", messages=conversation)], store,
                     max_length=None)  # fmt: skip
    first_prompt, second_prompt = engine.prompts()
    assert first_prompt == render_prompt(chat_tokenizer, conversation[:1])
    first_answer = answer_of(first_prompt, SETTINGS.max_new_tokens)
    starts = [i for i in range(len(second_prompt))
              if second_prompt[i : i + len(first_answer)] == first_answer]  # fmt: skip
    assert len(starts) == 1, "the second prompt carries the server's first answer"
    assert OMEGA not in first_prompt + second_prompt  # the dataset's answers are never sent
    (record,) = list(store.iter_records())
    second_answer = answer_of(second_prompt, SETTINGS.max_new_tokens)
    assert record.input_ids == second_prompt + second_answer
    begin, end = starts[0], starts[0] + len(first_answer)
    expected = [int(begin <= i < end) for i in range(len(second_prompt))] + [1] * len(second_answer)
    assert record.loss_mask == expected  # both answers are trained on, nothing else
    assert record.meta["turns"] == 2
    assert record.meta["turn_new_tokens"] == [len(first_answer), len(second_answer)]
    assert record.meta["prompt_tokens"] == len(second_prompt) and report.generated == 1


# --------------------------------------------------------------------------------------------
# Several servers, failures
# --------------------------------------------------------------------------------------------


def test_several_servers_share_the_prompts_at_the_set_concurrency(
    tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    fleet = [engines(delay=0.1) for _ in range(3)]
    prompts = _prompts(24)
    store = RolloutStore(tmp_path, CONFIG)
    report = _served([e.url for e in fleet], chat_tokenizer, prompts, store, concurrency=2)
    sent = [tuple(prompt) for engine in fleet for prompt in engine.prompts()]
    expected = [tuple(render_prompt(chat_tokenizer, p.messages)) for p in prompts]
    assert sorted(sent) == sorted(expected)  # every prompt sent once, to one server
    assert all(engine.requests for engine in fleet)  # every server took a share
    assert all(engine.peak <= 2 for engine in fleet) and max(e.peak for e in fleet) == 2
    assert report.generated == 24 and len(_records(store)) == 24
    for engine in fleet:
        server = report.servers[engine.url]
        assert server.answered == server.requests == len(engine.requests)
        assert server.in_rotation and server.tokens_per_second > 0


def test_garbage_errors_and_timeouts_are_retried_then_the_prompt_is_counted(
    tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    """One server, one request at a time, two retries: the first prompt meets a 5xx, a body
    that is not JSON and one without a completion (skipped, counted); the second a timeout and
    a 5xx, then an answer (stored)."""
    engine = engines(failures=["500", "garbage", "missing", "slow", "500"])
    store = RolloutStore(tmp_path, CONFIG)
    report = _served(engine.url, chat_tokenizer, _prompts(6), store, concurrency=1, retries=2,
                     timeout=0.5, max_failures=10)  # fmt: skip
    assert report.generated == 5 and report.skipped == {"failed": 1}
    assert len(engine.requests) == 10  # 3 + 3 tries for the first two prompts, 1 for the rest
    server = report.servers[engine.url]
    assert server.requests == 10 and server.failed_requests == 5 and server.in_rotation
    assert len(_records(store)) == 5


def test_a_4xx_is_skipped_without_a_retry(
    tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    engine = engines(reject_longer_than=10)
    # 7 prompt tokens (answered) and 14 (refused)
    prompts = [_user(f"s{i}", WORDS[i : i + 2]) for i in range(5)]
    prompts += [_user(f"l{i}", WORDS[i : i + 9]) for i in range(3)]
    long = {p.id for p in prompts if p.id.startswith("l")}
    store = RolloutStore(tmp_path, CONFIG)
    # one failure would take the server out of the rotation: a 4xx is not one
    report = _served(engine.url, chat_tokenizer, prompts, store, retries=3, max_failures=1)
    assert report.skipped == {"rejected": len(long)}
    assert len(engine.requests) == 8  # each prompt asked once
    assert set(_records(store)) == {p.id for p in prompts} - long
    assert report.servers[engine.url].in_rotation


def test_a_dead_server_leaves_the_rotation_and_the_others_answer(
    tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    dying, healthy = engines(die_after=1), engines(delay=0.1)
    prompts = _prompts(12)
    store = RolloutStore(tmp_path, CONFIG)
    report = _served([dying.url, healthy.url], chat_tokenizer, prompts, store, concurrency=1,
                     retries=1, max_failures=2)  # fmt: skip
    # one answer, then two conversations of two tries each, then out
    assert len(dying.requests) == 5 and dying.answered == 1
    assert not report.servers[dying.url].in_rotation and report.servers[healthy.url].in_rotation
    assert report.generated == 12 and not report.skipped  # the failed ones went to the other
    assert set(_records(store)) == {p.id for p in prompts}
    assert report.servers[dying.url].answered == 1 and report.servers[healthy.url].answered == 11


def test_with_no_server_left_the_rest_is_counted_unanswered(
    tmp_path: Path, engines: Any, chat_tokenizer: Any
) -> None:
    engine = engines(die_after=2)
    store = RolloutStore(tmp_path, CONFIG)
    report = _served(engine.url, chat_tokenizer, _prompts(8), store, concurrency=1, retries=0,
                     max_failures=2)  # fmt: skip
    assert report.generated == 2 and len(_records(store)) == 2
    # the third failed while the server was still in; the fourth took it out; four never sent
    assert report.skipped == {"failed": 1, "no_server": 5}
    assert not report.servers[engine.url].in_rotation


def _regenerate_slowly(
    store_dir: Path, url: str, tokenizer: Any, prompts: list[PromptItem]
) -> None:
    """Child process body: a pause after each shard, so the parent can kill it mid-run."""
    store = RolloutStore(store_dir, CONFIG)
    _served(url, tokenizer, prompts, store, concurrency=1, records_per_shard=2,
            on_shard=lambda info: time.sleep(1.0))  # fmt: skip


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs fork start method"
)
def test_a_killed_run_resumes_without_sending_a_stored_prompt_again(
    tmp_path: Path, engines: Any, chat_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    engine = engines(delay=0.02)
    # twelve different prompts (each starts with its own word): a prompt sent is one prompt
    prompts = [
        _user(f"k{i}", [WORDS[i], WORDS[(i + 1) % 12], WORDS[(i + 3) % 12]]) for i in range(12)
    ]
    store_dir = tmp_path / "store"
    process = multiprocessing.get_context("fork").Process(
        target=_regenerate_slowly, args=(store_dir, engine.url, chat_tokenizer, prompts)
    )
    process.start()
    deadline = time.monotonic() + 120
    store = None
    while time.monotonic() < deadline and process.is_alive():
        if (store_dir / "manifest.json").exists():
            store = store or RolloutStore(store_dir, CONFIG)
            if store.shards():
                break
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    assert process.exitcode == -signal.SIGKILL, "the child finished before it could be killed"
    assert store is not None
    before = store.shards()
    stored = {record_id for info in before for record_id in info.ids}
    assert 1 <= len(before) and len(stored) < 12
    stored_prompts = {tuple(render_prompt(chat_tokenizer, p.messages))
                      for p in prompts if p.id in stored}  # fmt: skip
    with engine.lock:
        engine.requests = []
    report = _served(engine.url, chat_tokenizer, prompts, store, records_per_shard=2)
    assert report.already_done == len(stored)
    assert not stored_prompts & {tuple(p) for p in engine.prompts()}
    ids = [record.id for record in store.iter_records()]
    assert len(ids) == len(set(ids)) == 12
    after = {info.name: info.sha256 for info in store.shards()}
    assert all(after.get(info.name) == info.sha256 for info in before)  # no shard lost


# --------------------------------------------------------------------------------------------
# Small pieces
# --------------------------------------------------------------------------------------------


def test_server_urls_are_checked_for_their_form() -> None:
    assert parse_server_urls("http://a:8000/v1, http://b:8001/,") == [
        "http://a:8000",
        "http://b:8001",
    ]
    assert parse_server_urls(["http://a:1", "https://b"]) == ["http://a:1", "https://b"]
    assert parse_server_urls(None) == [] and parse_server_urls("") == []
    for bad, reason in (("localhost:8000", "not a server URL"), ("http://a:port", "port"),
                        ("http://a:1,http://a:1/v1", "twice"), ("http://a:1?x=1", "query")):  # fmt: skip
        with pytest.raises(ValueError, match=reason):
            parse_server_urls(bad)


def test_answers_without_a_completions_fields_are_garbage() -> None:
    assert parse_reply(
        "openai", {"choices": [{"token_ids": [5, 2], "finish_reason": "stop"}]}
    ).stopped
    for reply in (
        [1, 2],
        {"choices": []},
        {"choices": [{"text": "x", "finish_reason": "abort"}]},
        {"choices": [{"token_ids": ["a"], "finish_reason": "stop"}]},
        {"choices": [{"finish_reason": "length"}]},
    ):
        with pytest.raises(GarbageReply):
            parse_reply("openai", reply)
    old = parse_reply("llamacpp", {"content": "a b", "tokens": [], "stopped_limit": True})
    assert old.tokens is None and old.text == "a b" and not old.stopped
    with pytest.raises(GarbageReply):
        parse_reply("llamacpp", {"content": "a b"})


# --------------------------------------------------------------------------------------------
# The seam: the data module and `lightning-spec prepare`
# --------------------------------------------------------------------------------------------


def _module(data: Path, tmp_path: Path, tokenizer: Any, target: Any, **kwargs: Any) -> Any:
    from lightning_spec.data.datamodule import RolloutDataModule

    options = {"dataset": str(data), "cache_dir": str(tmp_path / "cache"), "mode": "regenerated",
               "max_length": 64, "val_fraction": 0.1, "batch_size": 2,
               "regenerate_max_new_tokens": 8, "prompts_for_eval": str(data), "progress": False,
               **kwargs}  # fmt: skip
    return RolloutDataModule.from_objects(tokenizer=tokenizer, target_model=target, **options)


def test_the_data_module_regenerates_through_servers_into_the_batched_loops_store(
    tmp_path: Path, engines: Any, chats: Any, chat_tokenizer: Any, tiny_target: Any
) -> None:
    data = chats(12, seed=2)
    engine = engines()
    served = _module(data, tmp_path, chat_tokenizer, tiny_target, regenerate_with=engine.url,
                     regenerate_concurrency=2)  # fmt: skip
    plain = _module(data, tmp_path, chat_tokenizer, tiny_target)
    # the engine is not part of the store's key: the same folder, the same config
    assert served.store_config("regenerated") == plain.store_config("regenerated")
    served.prepare_data()
    served.setup("fit")
    assert len(engine.requests) == 12
    shards = [(s.name, s.sha256) for s in served.store("regenerated").shards()]
    assert sum(1 for _ in served.store("regenerated").iter_records()) == 12
    for batch in served.train_dataloader():
        assert set(batch["source"]) == {"regenerated"}
    # a run without servers finds the store complete: nothing is sent or generated
    plain.prepare_data()
    plain.setup("fit")
    assert len(engine.requests) == 12
    assert [(s.name, s.sha256) for s in plain.store("regenerated").shards()] == shards
    every_turn = _module(data, tmp_path, chat_tokenizer, tiny_target, regenerate_with=engine.url,
                         regenerate_turns="all")  # fmt: skip
    assert every_turn.store_config("regenerated")["turns"] == "all"  # other data, another store


def test_a_bad_url_or_a_silent_server_stops_the_data_module_before_any_work(
    tmp_path: Path, chats: Any, chat_tokenizer: Any, tiny_target: Any
) -> None:
    from lightning_spec.data.datamodule import RolloutDataModule

    with pytest.raises(ValueError, match="not a server URL"):
        RolloutDataModule(mode="regenerated", regenerate_with="localhost:8000")
    with pytest.raises(ValueError, match="needs regenerate_with"):
        RolloutDataModule(mode="regenerated", regenerate_turns="all")
    silent = f"http://127.0.0.1:{_free_port()}"
    module = _module(chats(6), tmp_path, chat_tokenizer, tiny_target, mode="mixture",
                     regenerate_with=silent)  # fmt: skip
    with pytest.raises(ServerUnavailable, match=silent):
        module.prepare_data()
    assert not (tmp_path / "cache" / "dataset").exists()  # not even the dataset was rendered
    assert module.store("regenerated").num_records == 0


def test_prepare_turns_its_engine_options_into_the_data_modules(capsys: Any) -> None:
    from lightning_spec.cli.prepare import engine_overrides, main

    args = ["--config", "a.yaml", "--regenerate-with", "http://h:1/v1,http://g:2",
            "--data.init_args.seed=1", "--concurrency", "4"]  # fmt: skip
    assert engine_overrides(args) == [
        "--config", "a.yaml", "--data.init_args.seed=1",
        "--data.init_args.regenerate_with=http://h:1,http://g:2",
        "--data.init_args.regenerate_concurrency=4",
    ]  # fmt: skip
    assert engine_overrides(["--config", "a.yaml"]) == ["--config", "a.yaml"]
    with pytest.raises(ValueError, match="--concurrency applies"):
        engine_overrides(["--concurrency", "2"])
    assert main(["--config", "missing.yaml", "--regenerate-with", "localhost:8000"]) == 2
    assert "not a server URL" in capsys.readouterr().err


def test_prepare_regenerates_a_configs_data_through_a_server(
    tiny_cli_assets: dict[str, str], tmp_path: Path, engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lightning-spec prepare --regenerate-with` on a recipe: every prompt is answered by the
    server; the same command without the server afterwards finds the store complete and
    neither sends nor writes anything."""
    from lightning_spec.cli import main
    from tests.conftest import load_module

    helpers = load_module(Path(__file__).parents[1] / "repo" / "test_configs.py", "served_cfg")
    monkeypatch.chdir(tmp_path)  # the recipe names relative run folders
    engine = engines()
    args = [
        "prepare",
        *helpers.config_args("experiments/gto-draft-opd/configs/control_sft_same_texts.yaml"),
        *helpers._tiny_run_args(tiny_cli_assets, tmp_path, tmp_path / "run"),
        "--data.init_args.max_conversations=12",
        "--data.init_args.regenerate_max_new_tokens=8",
    ]
    assert main([*args, "--regenerate-with", engine.url, "--concurrency", "3"]) == 0
    assert len(engine.requests) == 12 and engine.peak <= 3
    store = tmp_path / "cache" / "regenerated"
    files = {p.name: p.stat().st_mtime_ns for p in store.rglob("*")
             if p.is_file() and not p.name.endswith(".lock")}  # fmt: skip
    assert any(name.endswith(".jsonl") for name in files)
    assert main(args) == 0  # no server named: the store is complete, nothing is redone
    assert len(engine.requests) == 12
    assert {p.name: p.stat().st_mtime_ns for p in store.rglob("*")
            if p.is_file() and not p.name.endswith(".lock")} == files  # fmt: skip
