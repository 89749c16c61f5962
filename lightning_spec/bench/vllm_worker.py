"""Runs inside vLLM's own environment: one engine per mode, every prompt through every mode.

This file imports only the standard library and vLLM (it runs under vLLM's interpreter, which has
none of the project's packages; `bench/vllm.py` starts it and reads its JSON):

    python vllm_worker.py SPEC.json RESULT.json

SPEC: ``target`` (a local HF folder), ``dtype``, ``modes`` ([{name, speculative_config or
null}]), ``prompts`` (token ids), ``max_new_tokens``, ``batched`` (batch sizes to time beside
one-at-a-time; [] for none), ``warmup``, ``enforce_eager``, ``max_model_len``, ``seed``.

RESULT, per mode: per prompt (one at a time, modes rotated per prompt so drift spreads evenly)
the reply's token ids, wall seconds, decode seconds (vLLM's own first-to-last-token time),
time to the first token (vLLM's histogram) and the spec-decode counters it moved (drafts, drafted and accepted tokens,
accepted tokens per draft position); per batch size, the wall seconds and replies of the whole
prompt set submitted at once. Greedy (temperature 0) throughout.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "drafted",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
FIRST_TOKEN = "vllm:time_to_first_token_seconds"  # a histogram: its sum moves by each TTFT


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's cumulative speculative-decoding counters (all zero for a plain engine)."""
    values: dict[str, Any] = {name: 0 for name in COUNTERS.values()}
    values["per_position"] = []
    values["first_token_seconds"] = 0.0
    for metric in llm.get_metrics():
        if metric.name == FIRST_TOKEN:
            values["first_token_seconds"] += float(getattr(metric, "sum", 0.0) or 0.0)
        elif metric.name in COUNTERS:
            values[COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POSITION:  # one vector per engine: summed
            values["per_position"] = _combine(values["per_position"], metric.values, 1)
    return values


def _combine(a: list[int], b: Any, sign: int) -> list[int]:
    """a + sign * b, element by element, the shorter padded with zeros."""
    width = max(len(a), len(b))
    a, b = list(a) + [0] * (width - len(a)), [int(v) for v in b] + [0] * (width - len(b))
    return [x + sign * y for x, y in zip(a, b, strict=True)]


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What one request moved: `after` minus `before` (`spec_counters` of one engine)."""
    delta = {name: after[name] - before[name] for name in COUNTERS.values()}
    delta["per_position"] = _combine(after["per_position"], before["per_position"], -1)
    seconds = after.get("first_token_seconds", 0.0) - before.get("first_token_seconds", 0.0)
    delta["first_token_seconds"] = seconds if seconds > 0 else None
    return delta


def decode_seconds(output: Any) -> float | None:
    """The request's decode time, first token to last, from vLLM's own per-request timestamps
    (engine-core monotonic clock; vLLM 0.32: ``RequestOutput.metrics`` is a RequestStateStats)."""
    metrics = getattr(output, "metrics", None)
    first, last = getattr(metrics, "first_token_ts", None), getattr(metrics, "last_token_ts", None)
    if first and last and last >= first:
        return float(last) - float(first)
    return None


def build_engine(spec: dict[str, Any], mode: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec["target"],
        "dtype": spec.get("dtype", "float32"),
        "max_model_len": int(spec.get("max_model_len", 2048)),
        "enforce_eager": bool(spec.get("enforce_eager", True)),
        "seed": int(spec.get("seed", 0)),
        "disable_log_stats": False,  # the spec-decode counters live in the stats
    }
    if mode.get("speculative_config"):
        kwargs["speculative_config"] = dict(mode["speculative_config"])
    return LLM(**kwargs)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm import __version__ as vllm_version

    params = SamplingParams(
        temperature=0.0, max_tokens=int(spec["max_new_tokens"]), ignore_eos=False, seed=0
    )
    prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in spec["prompts"]]
    modes = spec["modes"]
    engines = []
    for mode in modes:
        tic = time.perf_counter()
        engines.append(build_engine(spec, mode))
        print(f"[vllm worker] {mode['name']}: engine up in {time.perf_counter() - tic:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    warm = SamplingParams(temperature=0.0, max_tokens=min(16, int(spec["max_new_tokens"])))
    for engine in engines:  # the first requests pay for allocations and lazy initialisation
        for _ in range(int(spec.get("warmup", 1))):
            engine.generate(prompts[:1], warm, use_tqdm=False)
    result: dict[str, Any] = {
        "vllm": vllm_version,
        "modes": {m["name"]: {"config": m, "prompts": [], "batched": {}} for m in modes},
    }
    for index, prompt in enumerate(prompts):
        shift = index % len(modes)
        order = list(range(shift, len(modes))) + list(range(shift))
        for i in order:
            engine, name = engines[i], modes[i]["name"]
            before = spec_counters(engine)
            tic = time.perf_counter()
            output = engine.generate([prompt], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - tic
            delta = counter_delta(spec_counters(engine), before)
            result["modes"][name]["prompts"].append(
                {"tokens": list(output.outputs[0].token_ids), "seconds": seconds,
                 "decode_seconds": decode_seconds(output), **delta}
            )  # fmt: skip
        print(f"[vllm worker] prompt {index + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    for size in spec.get("batched", []):
        for i, mode in enumerate(modes):
            chunks = [prompts[b : b + int(size)] for b in range(0, len(prompts), int(size))]
            tic = time.perf_counter()
            replies = []
            for chunk in chunks:
                replies += [list(o.outputs[0].token_ids) for o in engines[i].generate(chunk, params, use_tqdm=False)]
            result["modes"][mode["name"]]["batched"][str(size)] = {
                "seconds": time.perf_counter() - tic, "tokens": replies,
            }  # fmt: skip
        print(f"[vllm worker] batched {size} done", file=sys.stderr, flush=True)
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_worker.py SPEC.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as handle:
        spec = json.load(handle)
    result = run(spec)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(result, handle)
    import os

    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
