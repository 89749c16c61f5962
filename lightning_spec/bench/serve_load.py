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

``--in-series R`` charges a learner behind the server (``serve --engine vllm --learn``) to
serving: after every R requests the client sends nothing until the server's status says the
learner has finished that round (``learner_rounds``), as if serving and learning took turns on
the same cores. The seconds waited are kept beside the output (``*.waits.jsonl``) and charged to
the round's requests when arms are compared.

``--compare BASE ARM [ARM ...]`` pairs the outputs of arms over the requests they all answered:
each arm's prequential acceptance length and tokens per second (the requests' own seconds plus
their share of the learner waits) against BASE's, with 95% bootstrap intervals over requests,
and how many replies differ from BASE's token for token (at T = 0 every lossless arm gives the
same text); ``--slices N`` adds the same for each run of N consecutive requests.

    lightning-spec online --config CONFIG --dump-stream runs/streams/domain.jsonl
    lightning-spec bench load --url http://127.0.0.1:8000 --stream runs/streams/domain.jsonl \\
        --concurrency 4 --max-tokens 128 --output runs/load/ogd.jsonl
    lightning-spec bench load --compare runs/load/frozen.jsonl runs/load/ogd.jsonl

Stream lines hold ``prompt_ids`` (token ids), ``prompt`` (text) or ``messages`` (chat).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning_spec.http_json import RequestFailed, get_json, post_json

__all__ = [
    "compare",
    "load_stream",
    "main",
    "read_rows",
    "replay",
    "request_seconds",
    "send",
    "summarise",
    "wait_for_learner",
]


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
        try:
            reply = post_json(url + path, body, timeout=timeout)
        except RequestFailed as failure:
            error = str(failure)
            if failure.client_error:
                break  # the request itself is wrong: trying again changes nothing
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


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The JSON lines of `path` ([] when it does not exist); a torn last line (a killed writer)
    is dropped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def waits_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.stem + ".waits.jsonl")


def _get_json(url: str, timeout: float = 60.0) -> Any:
    return get_json(url, timeout=timeout)


def wait_for_learner(url: str, rounds: int, *, timeout: float = 1800.0,
                     poll: float = 0.25) -> tuple[float, int, bool]:  # fmt: skip
    """Block until the server's learner has finished `rounds` rounds (``learner_rounds`` of
    ``/lightning-spec/learner``, which does not call the engine: polling the engine would keep
    vLLM's CPU worker spinning on a core the learner needs); (seconds waited, rounds seen,
    timed out)."""
    tic = time.perf_counter()
    seen = 0
    while True:
        try:
            seen = int(_get_json(url + "/lightning-spec/learner").get("learner_rounds", 0))
        except (RequestFailed, ValueError):
            pass  # a busy server answers late: keep waiting until the timeout
        waited = time.perf_counter() - tic
        if seen >= rounds or waited > timeout:
            return waited, seen, seen < rounds
        time.sleep(poll)


def replay(url: str, requests: Sequence[dict[str, Any]], output: str | Path, *,
           concurrency: int = 1, max_tokens: int = 128,
           in_series: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    """Every request of `requests` not yet in `output` (see the module docstring); all rows."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = {row["index"]: row for row in read_rows(output) if "index" in row}
    model = _get_json(url + "/v1/models")["data"][0]["id"]
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
        if in_series <= 0:
            list(pool.map(run, todo))
            return [done[i] for i in sorted(done)]
        # rounds of `in_series` requests, each followed by the learner's turn; the learner's
        # count when this run starts, less the rounds already answered, aligns a resumed run
        finished = len(done) // in_series
        base = int(_get_json(url + "/lightning-spec/learner").get("learner_rounds", 0)) - finished
        for start in range(0, len(requests), in_series):
            chunk = [i for i in range(start, min(start + in_series, len(requests))) if i in todo]
            if not chunk:
                continue
            list(pool.map(run, chunk))
            if start + in_series > len(requests):
                break  # a last partial round: the learner does not learn from it
            round_index = start // in_series
            waited, seen, late = wait_for_learner(url, base + round_index + 1)
            with open(waits_path(output), "a") as handle:
                handle.write(json.dumps({"round": round_index, "round_size": in_series,
                                         "seconds": waited, "learner_rounds": seen,
                                         "timed_out": late}) + "\n")  # fmt: skip
            if late:
                print(f"load: the learner did not finish round {round_index} in time; going on",
                      flush=True)  # fmt: skip
    return [done[i] for i in sorted(done)]


def request_seconds(
    rows: Sequence[dict[str, Any]], waits: Sequence[dict[str, Any]]
) -> dict[int, float]:
    """Each request's seconds plus an equal share of the learner wait after its round."""
    seconds = {r["index"]: float(r["seconds"]) for r in rows if r.get("ok")}
    for wait in waits:
        first = wait["round"] * wait["round_size"]
        members = [i for i in range(first, first + wait["round_size"]) if i in seconds]
        for i in members:
            seconds[i] += float(wait["seconds"]) / len(members)
    return seconds


def compare(
    base: str | Path, arms: Sequence[str | Path], *, resamples: int = 2000,
    slice_size: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Each arm against `base`, paired over the requests all of them answered (module
    docstring): acceptance length and tokens/s ratios with 95% bootstrap intervals. With
    `slice_size`, the same for each run of that many consecutive shared requests too
    (``slices``): whether a learning arm's gain grows, holds or fades along the stream."""
    outputs = [Path(base), *map(Path, arms)]
    rows = [{r["index"]: r for r in read_rows(p) if r.get("ok")} for p in outputs]
    shared = sorted(set.intersection(*(set(r) for r in rows)))
    if not shared:
        raise ValueError("the outputs share no answered request")
    timing = [
        request_seconds(list(kept.values()), read_rows(waits_path(path)))
        for path, kept in zip(outputs, rows, strict=True)
    ]
    report: dict[str, Any] = {"requests": len(shared), "base": str(outputs[0]),
                              "arms": _paired(outputs, rows, timing, shared, resamples)}  # fmt: skip
    if slice_size:
        if slice_size < 1:
            raise ValueError(f"slice_size must be >= 1, got {slice_size}")
        report["slices"] = [
            {"first": part[0], "last": part[-1], "requests": len(part),
             "arms": _paired(outputs, rows, timing, part, resamples)}
            for part in (shared[i : i + slice_size] for i in range(0, len(shared), slice_size))
        ]  # fmt: skip
    return report


def _paired(
    outputs: Sequence[Path], rows: Sequence[dict[int, dict[str, Any]]],
    timing: Sequence[dict[int, float]], shared: Sequence[int], resamples: int,
) -> dict[str, Any]:  # fmt: skip
    """`compare`'s entry of each arm (outputs[1:]) against outputs[0] over the `shared` ids."""
    from lightning_spec.stats import bootstrap_ci, ratio_of_sums_of

    def columns(k: int) -> dict[str, list[float]]:
        return {
            "committed": [rows[k][i]["accepted"] + rows[k][i]["steps"] for i in shared],
            "steps": [rows[k][i]["steps"] for i in shared],
            "tokens": [rows[k][i]["completion_tokens"] for i in shared],
            "seconds": [timing[k][i] for i in shared],
        }

    def relative(a: Any, b: Any, c: Any, d: Any) -> Any:  # (a/b) / (c/d) - 1, batched
        return ratio_of_sums_of(a, b) / ratio_of_sums_of(c, d) - 1.0

    reference = columns(0)
    entries: dict[str, Any] = {}
    for k, path in enumerate(outputs[1:], 1):
        arm = columns(k)
        pairs = {
            "acceptance": ("committed", "steps"),
            "tokens_per_s": ("tokens", "seconds"),
        }
        entry: dict[str, Any] = {
            "differing_replies": sum(
                rows[k][i].get("token_ids") != rows[0][i].get("token_ids") for i in shared
            )
        }
        for name, (num, den) in pairs.items():
            a, b, c, d = arm[num], arm[den], reference[num], reference[den]
            entry[name] = sum(a) / sum(b) if sum(b) else float("nan")
            entry[f"{name}_base"] = sum(c) / sum(d) if sum(d) else float("nan")
            entry[f"{name}_change"] = entry[name] / entry[f"{name}_base"] - 1.0
            entry[f"{name}_change_ci"] = bootstrap_ci((a, b, c, d), relative, resamples=resamples)
        entry["seconds"], entry["seconds_base"] = sum(arm["seconds"]), sum(reference["seconds"])
        entries[str(path)] = entry
    return entries


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
    parser.add_argument("--stream", help="JSONL: prompt_ids, prompt or messages")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--output", help="JSONL of per-request rows (resumed)")
    parser.add_argument("--in-series", type=int, default=0, metavar="R",
                        help="after every R requests wait for the server's learner to finish "
                        "the round (the learner charged to serving)")  # fmt: skip
    parser.add_argument("--compare", nargs="+", metavar="OUTPUT",
                        help="pair outputs: BASE ARM [ARM ...] (no requests sent)")  # fmt: skip
    parser.add_argument("--slices", type=int, default=None, metavar="N",
                        help="with --compare: also each run of N consecutive shared requests")  # fmt: skip
    args = parser.parse_args(argv)
    if args.compare:
        if len(args.compare) < 2:
            parser.error("--compare needs a base output and at least one arm")
        try:
            report = compare(args.compare[0], args.compare[1:], slice_size=args.slices)
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"--compare: {error}")
        text = json.dumps(report, indent=1)
        if args.output:
            Path(args.output).write_text(text + "\n")
        print(text)
        return 0
    if not args.output or not args.stream:
        parser.error("--stream and --output are required to send a stream")
    if args.concurrency < 1 or args.in_series < 0:
        parser.error("--concurrency must be >= 1 and --in-series >= 0")
    try:
        requests = load_stream(args.stream, args.limit)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    tic = time.perf_counter()
    rows = replay(args.url.rstrip("/"), requests, args.output, concurrency=args.concurrency,
                  max_tokens=args.max_tokens, in_series=args.in_series)  # fmt: skip
    print(json.dumps(summarise(rows, time.perf_counter() - tic), indent=1))
    return 0 if all(r.get("ok") for r in rows) else 1
