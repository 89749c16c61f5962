"""lightning-spec bench load against a small OpenAI-style server made here: every request sent
once in stream order at the set concurrency, the per-request speculative metrics read, a killed
run resumed without sending an answered request again, a failing request retried then counted."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lightning_spec.bench.serve_load import load_stream, main, replay, summarise


class _Fake(BaseHTTPRequestHandler):
    """Answers with token ids [index, index + 1] and 2 verify steps that accepted `index % 3`."""

    seen: list[int] = []
    inflight = peak = 0
    fail_first: set[int] = set()
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._json(200, {"data": [{"id": "fake"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        index = int(body["prompt"][0]) if "prompt" in body else int(body["messages"][0]["content"])
        with self.lock:
            type(self).inflight += 1
            type(self).peak = max(self.peak, self.inflight)
            type(self).seen.append(index)
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
