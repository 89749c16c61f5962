"""Runs inside vLLM's own environment: one engine per mode, every prompt through every mode.

This file imports only the standard library and vLLM (it runs under vLLM's interpreter, which has
none of the project's packages; `bench/vllm.py` starts it and reads its JSON):

    python vllm_worker.py SPEC.json RESULT.json

SPEC: ``target`` (a local HF folder), ``dtype``, ``modes`` ([{name, speculative_config or
null}]), ``prompts`` (token ids), ``max_new_tokens``, ``batched`` (batch sizes to time beside
one-at-a-time; [] for none), ``warmup``, ``enforce_eager``, ``max_model_len``, ``seed``.

RESULT, per mode: per prompt (one at a time, modes rotated per prompt so drift spreads evenly)
the reply's token ids, wall seconds, decode seconds (vLLM's own first-to-last-token time) and
vLLM's per-request drafting record (drafted and accepted tokens of every verify step); per
batch size, the wall seconds and replies of the whole prompt set submitted in chunks of that
size. Greedy (temperature 0) throughout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# run as a script, this file's folder leads sys.path, and its neighbour `vllm.py` (the project's
# driver) would shadow the real vLLM package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

def request_spec_metrics(completion: Any, *, speculative: bool) -> dict[str, Any]:
    """One reply's drafting as vLLM recorded it (``per_request_spec_decode_metrics``
    "detailed": the accepted and drafted count of every verify step).

    vLLM's Prometheus counters cannot serve here: the registry is process-wide and each new
    engine replaces the previous engine's collectors, so with one engine per mode only the last
    engine's counters move.
    """
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is None:
        if speculative:
            raise RuntimeError(
                "vLLM returned no per-request speculative metrics; this worker needs vLLM with "
                "per_request_spec_decode_metrics (0.32 has it)"
            )
        return {"drafts": 0, "drafted": 0, "accepted": 0, "accepted_lengths": []}
    accepted = [int(a) for a in metrics.per_step_accepted]
    drafted = [int(d) for d in metrics.per_step_drafted]
    return {
        "drafts": len(accepted),
        "drafted": sum(drafted),
        "accepted": sum(accepted),
        "accepted_lengths": accepted,
        "drafted_per_step": drafted,
        "histogram": [int(h) for h in metrics.histogram],
    }


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
        "disable_log_stats": True,
    }
    if mode.get("speculative_config"):
        kwargs["speculative_config"] = dict(mode["speculative_config"])
        kwargs["per_request_spec_decode_metrics"] = "detailed"  # every verify step, per request
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
            tic = time.perf_counter()
            output = engine.generate([prompt], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - tic
            drafting = request_spec_metrics(
                output.outputs[0], speculative=bool(modes[i].get("speculative_config"))
            )
            result["modes"][name]["prompts"].append(
                {"tokens": list(output.outputs[0].token_ids), "seconds": seconds,
                 "decode_seconds": decode_seconds(output), **drafting}
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
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
