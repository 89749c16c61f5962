"""lightning-spec bench load against a small OpenAI-style server made here: every request sent
once in stream order at the set concurrency, the per-request speculative metrics read, a killed
run resumed without sending an answered request again, a failing request retried then counted;
a learner charged in series (the client waits for each round's update); arms paired."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lightning_spec.bench.serve_load import (
    compare,
    load_stream,
    main,
    replay,
    request_seconds,
    summarise,
    waits_path,
)


class _Fake(BaseHTTPRequestHandler):
    """Answers with token ids [index, index + 1] and 2 verify steps that accepted `index % 3`."""

    seen: list[int] = []
    sent_after: list[tuple[int, int]] = []  # (request, learner rounds finished when it came)
    learner_rounds = 0
    round_size = 0  # > 0: a learner behind the server finishing a round once it has served it
    inflight = peak = 0
    fail_first: set[int] = set()
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/lightning-spec/learner":
            cls = type(self)
            with self.lock:  # the learner takes its time: one round per status poll at most
                if cls.round_size and len(cls.seen) >= (cls.learner_rounds + 1) * cls.round_size:
                    cls.learner_rounds += 1
            return self._json(200, {"learner_rounds": cls.learner_rounds})
        self._json(200, {"data": [{"id": "fake"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        index = int(body["prompt"][0]) if "prompt" in body else int(body["messages"][0]["content"])
        with self.lock:
            type(self).inflight += 1
            type(self).peak = max(self.peak, self.inflight)
            type(self).seen.append(index)
            type(self).sent_after.append((index, type(self).learner_rounds))
        time.sleep(0.02)
        with self.lock:
            type(self).inflight -= 1
        if index in self.fail_first:
            self.fail_first.discard(index)
            return self._json(503, {"error": "busy"})
        if index == 99:
            return self._json(400, {"error": "bad request"})
        spec = {
            "num_spec_steps": 2,
            "num_accepted_draft_tokens": index % 3,
            "mean_acceptance_length": 1.5,
        }
        self._json(200, {"choices": [{"token_ids": [index, index + 1]}], "usage": {"completion_tokens": 2},
                         "metrics": {"speculative_decoding": spec}})  # fmt: skip

    def _json(self, code: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():  # noqa: ANN201
    _Fake.seen, _Fake.inflight, _Fake.peak, _Fake.fail_first = [], 0, 0, set()
    _Fake.sent_after, _Fake.learner_rounds, _Fake.round_size = [], 0, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _stream(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"prompt_ids": [i, 7, 8]}) + "\n" for i in range(count)))
    return path


def test_one_client_sends_the_stream_in_order_and_reads_the_metrics(
    server: str, tmp_path: Path
) -> None:
    rows = replay(server, load_stream(_stream(tmp_path / "s.jsonl", 6)), tmp_path / "out.jsonl")
    assert _Fake.seen == list(range(6)) and _Fake.peak == 1
    assert [r["token_ids"] for r in rows] == [[i, i + 1] for i in range(6)]
    summary = summarise(rows)
    assert summary["answered"] == 6 and summary["verify_steps"] == 12
    assert summary["acceptance_length"] == pytest.approx((0 + 1 + 2 + 0 + 1 + 2 + 12) / 12)


def test_four_clients_at_once_and_a_resumed_run_sends_only_what_is_missing(
    server: str, tmp_path: Path
) -> None:
    requests = load_stream(_stream(tmp_path / "s.jsonl", 12))
    out = tmp_path / "out.jsonl"
    replay(server, requests[:5], out, concurrency=4)  # a run killed after five answers
    assert 1 < _Fake.peak <= 4
    _Fake.seen = []
    rows = replay(server, requests, out, concurrency=4)
    assert sorted(_Fake.seen) == list(range(5, 12))
    assert [r["index"] for r in rows] == list(range(12)) and all(r["ok"] for r in rows)


def test_a_failing_request_is_retried_once_then_counted(server: str, tmp_path: Path) -> None:
    _Fake.fail_first = {1}
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": str(i)}]}) + "\n"
                            for i in (0, 1, 99)))  # fmt: skip
    code = main(["--url", server, "--stream", str(path), "--output", str(tmp_path / "o.jsonl")])
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert code == 1  # one request failed
    assert [r["ok"] for r in sorted(rows, key=lambda r: r["index"])] == [True, True, False]
    assert _Fake.seen.count(1) == 2 and _Fake.seen.count(99) == 1  # a 4xx is not retried


def test_a_stream_line_without_a_prompt_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "hi"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_stream(path)


def test_in_series_each_round_waits_for_the_learner_and_the_waits_are_kept(
    server: str, tmp_path: Path
) -> None:
    _Fake.round_size = 3
    requests = load_stream(_stream(tmp_path / "s.jsonl", 7))
    out = tmp_path / "learn.jsonl"
    replay(server, requests, out, concurrency=2, in_series=3)
    # no request of round r is sent before the learner has finished round r - 1
    assert all(rounds >= index // 3 for index, rounds in _Fake.sent_after)
    assert sorted(_Fake.seen) == list(range(7))
    waits = [json.loads(line) for line in waits_path(out).read_text().splitlines()]
    assert [w["round"] for w in waits] == [0, 1]  # the last partial round is not waited for
    assert all(w["round_size"] == 3 and not w["timed_out"] for w in waits)


def test_arms_are_paired_over_requests_with_the_learner_waits_charged(tmp_path: Path) -> None:
    def write(path: Path, accepted: list[int], seconds: float, tokens: list[list[int]]) -> Path:
        rows = [
            {"index": i, "ok": True, "seconds": seconds, "token_ids": t, "completion_tokens": 4,
             "steps": 2, "accepted": a}
            for i, (a, t) in enumerate(zip(accepted, tokens, strict=True))
        ]  # fmt: skip
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    same = [[1, 2, 3, 4]] * 4
    base = write(tmp_path / "frozen.jsonl", [1, 1, 1, 1], 1.0, same)
    arm = write(tmp_path / "learn.jsonl", [2, 2, 2, 2], 0.5, same[:3] + [[9, 9, 9, 9]])
    waits_path(arm).write_text(json.dumps({"round": 0, "round_size": 2, "seconds": 1.0}) + "\n")
    assert request_seconds(
        [json.loads(line) for line in arm.read_text().splitlines()],
        [{"round": 0, "round_size": 2, "seconds": 1.0}],
    ) == {0: 1.0, 1: 1.0, 2: 0.5, 3: 0.5}
    report = compare(base, [arm], resamples=200)
    entry = report["arms"][str(arm)]
    assert report["requests"] == 4 and entry["differing_replies"] == 1
    assert entry["acceptance"] == pytest.approx(2.0) and entry["acceptance_base"] == pytest.approx(
        1.5
    )
    assert entry["acceptance_change"] == pytest.approx(2.0 / 1.5 - 1)
    # 16 tokens in 3 s (two requests carry half a second of learner wait each) against 16 in 4 s
    assert entry["tokens_per_s_change"] == pytest.approx((16 / 3) / (16 / 4) - 1)
    low, high = entry["acceptance_change_ci"]
    assert low == pytest.approx(high) == pytest.approx(2.0 / 1.5 - 1)  # every request alike
    # slices of 2: the first pair carries the whole learner wait, the second none
    sliced = compare(base, [arm], resamples=200, slice_size=2)
    whole = sliced["arms"][str(arm)]
    assert whole["acceptance_change"] == entry["acceptance_change"]
    first, second = (part["arms"][str(arm)] for part in sliced["slices"])
    spans = [(p["first"], p["last"], p["requests"]) for p in sliced["slices"]]
    assert spans == [(0, 1, 2), (2, 3, 2)]
    assert first["tokens_per_s_change"] == pytest.approx((8 / 2) / (8 / 2) - 1)
    assert second["tokens_per_s_change"] == pytest.approx((8 / 1) / (8 / 2) - 1)
    assert first["differing_replies"] == 0 and second["differing_replies"] == 1


def test_an_online_configs_stream_dumped_is_what_the_client_sends(tmp_path: Path) -> None:
    from lightning_spec.cli.online import dump_stream
    from lightning_spec.online.stream import Request

    requests = [Request(i, "d", f"id{i}", [1, 2, 3 + i]) for i in range(3)]
    dump_stream(requests, tmp_path / "s.jsonl")
    assert load_stream(tmp_path / "s.jsonl") == [
        {"id": f"id{i}", "prompt_ids": [1, 2, 3 + i]} for i in range(3)
    ]


def test_compare_from_the_command_line_needs_no_stream(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    row = {"index": 0, "ok": True, "seconds": 1.0, "token_ids": [1], "completion_tokens": 1,
           "steps": 1, "accepted": 0}  # fmt: skip
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text(json.dumps(row) + "\n")
    assert main(["--compare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 0
    assert '"differing_replies": 0' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--output", str(tmp_path / "o.jsonl")])  # sending needs a stream
