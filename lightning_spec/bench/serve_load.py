"""``lightning-spec bench load``: replay a request stream against an OpenAI-compatible server.

The same requests in the same order for every arm (a frozen drafter, a learning one, vLLM's
``ngram``), `--concurrency` clients at once: each client takes the next request of the stream
when it is free, so at 1 client the stream is served strictly in order. Each reply's token ids
(``return_token_ids``) and the server's per-request speculative metrics
(``metrics.speculative_decoding``, from ``vllm serve --per-request-spec-decode-metrics``) are
written as one JSON line per request, appended and flushed as it finishes, so a killed run
resumes with the requests not yet answered. A request the server refuses or fails is retried
once, then recorded as failed and counted; it never stops the run.

The summary is prequential: acceptance length = (accepted drafts + verification steps) /
verification steps over every answered request, each scored by the drafter that served it.

    lightning-spec bench load --url http://127.0.0.1:8000 --stream runs/streams/domain.jsonl \\
        --concurrency 4 --max-tokens 128 --output runs/load/ogd.jsonl

Stream lines hold ``prompt_ids`` (token ids), ``prompt`` (text) or ``messages`` (chat).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["load_stream", "main", "replay", "send", "summarise"]


def load_stream(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The stream's requests, in file order; a line without a prompt is a clear error."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not any(key in item for key in ("prompt_ids", "prompt", "messages")):
            raise ValueError(f"{path}:{number}: a request needs prompt_ids, prompt or messages")
        requests.append(item)
        if limit is not None and len(requests) >= limit:
            break
    return requests


def _body(model: str, item: dict[str, Any], max_tokens: int) -> tuple[str, dict[str, Any]]:
    common = {
        "model": model,
        "max_tokens": int(item.get("max_tokens", max_tokens)),
        "temperature": 0,
    }
    if "messages" in item:
        return "/v1/chat/completions", {
            **common,
            "messages": item["messages"],
            "return_token_ids": True,
        }
    prompt = item["prompt_ids"] if "prompt_ids" in item else item["prompt"]
    return "/v1/completions", {**common, "prompt": prompt, "return_token_ids": True}


def send(url: str, model: str, index: int, item: dict[str, Any], max_tokens: int,
         timeout: float = 600.0, retries: int = 1) -> dict[str, Any]:  # fmt: skip
    """One request; its row (``ok`` False with the error after `retries` failed tries)."""
    path, body = _body(model, item, max_tokens)
    error = ""
    for _ in range(retries + 1):
        tic = time.perf_counter()
        request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                reply = json.loads(answer.read())
        except urllib.error.HTTPError as failure:
            error = f"{failure.code}: {failure.read()[:300].decode(errors='replace')}"
            if failure.code < 500:
                break  # the request itself is wrong: trying again changes nothing
            continue
        except (urllib.error.URLError, OSError, ValueError) as failure:
            error = repr(failure)
            continue
        choice = reply["choices"][0]
        spec = ((reply.get("metrics") or {}).get("speculative_decoding")) or {}
        return {
            "index": index, "ok": True, "seconds": time.perf_counter() - tic,
            "token_ids": choice.get("token_ids") or [],
            "completion_tokens": (reply.get("usage") or {}).get("completion_tokens", 0),
            "steps": int(spec.get("num_spec_steps", 0)),
            "accepted": int(spec.get("num_accepted_draft_tokens", 0)),
            "mean_acceptance_length": spec.get("mean_acceptance_length"),
        }  # fmt: skip
    return {"index": index, "ok": False, "error": error}


def replay(url: str, requests: Sequence[dict[str, Any]], output: str | Path, *,
           concurrency: int = 1, max_tokens: int = 128) -> list[dict[str, Any]]:  # fmt: skip
    """Every request of `requests` not yet in `output` (see the module docstring); all rows."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if output.is_file():
        for line in output.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["index"]] = row
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as answer:
        model = json.loads(answer.read())["data"][0]["id"]
    lock = threading.Lock()
    todo = [i for i in range(len(requests)) if i not in done]
    tic = time.perf_counter()

    def run(index: int) -> None:
        row = send(url, model, index, requests[index], max_tokens)
        with lock:
            with open(output, "a") as handle:
                handle.write(json.dumps(row) + "\n")
                handle.flush()
            done[index] = row
            count = len(done)
            if count % 10 == 0 or count == len(requests):
                rate = (len(done) - (len(requests) - len(todo))) / max(
                    time.perf_counter() - tic, 1e-9
                )
                print(f"load: {count}/{len(requests)} answered, {rate:.2f} requests/s", flush=True)

    with ThreadPoolExecutor(max(1, int(concurrency))) as pool:
        list(pool.map(run, todo))
    return [done[i] for i in sorted(done)]


def summarise(rows: Sequence[dict[str, Any]], wall_seconds: float | None = None) -> dict[str, Any]:
    """Prequential acceptance length over every answered request, counts and tokens/s."""
    ok = [r for r in rows if r.get("ok")]
    steps = sum(r["steps"] for r in ok)
    accepted = sum(r["accepted"] for r in ok)
    tokens = sum(r["completion_tokens"] for r in ok)
    summary = {
        "requests": len(rows), "answered": len(ok), "failed": len(rows) - len(ok),
        "verify_steps": steps, "completion_tokens": tokens,
        "acceptance_length": (accepted + steps) / steps if steps else float("nan"),
    }  # fmt: skip
    if wall_seconds:
        summary["tokens_per_s"] = tokens / wall_seconds
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-spec bench load", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--stream", required=True, help="JSONL: prompt_ids, prompt or messages")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--output", required=True, help="JSONL of per-request rows (resumed)")
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    try:
        requests = load_stream(args.stream, args.limit)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    tic = time.perf_counter()
    rows = replay(args.url.rstrip("/"), requests, args.output, concurrency=args.concurrency,
                  max_tokens=args.max_tokens)  # fmt: skip
    print(json.dumps(summarise(rows, time.perf_counter() - tic), indent=1))
    return 0 if all(r.get("ok") for r in rows) else 1
