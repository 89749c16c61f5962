"""Runs inside vLLM's own environment: one engine serving our drafter, which can be replaced
while the engine runs (OnlineSpec inside vLLM).

    python vllm_worker.py                 # JSON lines in on stdin, out on stdout

Imports only the standard library, torch, safetensors and vLLM (it runs under vLLM's interpreter);
`vllm_draft.py` beside it and the benchmark's worker `../bench/vllm_worker.py` are loaded from
their files. vLLM's own output goes to stderr: stdout carries only the protocol.

First line in: the spec (``target``, ``dtype``, ``mode`` as `bench/vllm.py`'s `vllm_mode` writes
it, ``max_model_len``, ``seed``, ``enforce_eager``). Reply: ``{"ready": true, "served": sha256}``.
Then one command a line, one reply a line:
- ``{"op": "serve", "prompts": [[ids]], "max_new_tokens": N}``: every prompt one at a time,
  greedy; per prompt the reply's ids, wall and decode seconds and vLLM's per-step acceptance.
- ``{"op": "push", "folder": DIR, "sha256": HEX}``: the drafter in DIR replaces the served one,
  all or nothing (`vllm_draft.push_drafter`): ``{"ok": true, "served": HEX, "seconds": s}``, or
  ``{"ok": false, "rejected"|"error": why, "served": the sha256 still served}``.
- ``{"op": "quit"}``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


draft = _load("lightning_spec_vllm_draft", _HERE / "vllm_draft.py")
bench_worker = _load("lightning_spec_vllm_bench_worker", _HERE.parent / "bench" / "vllm_worker.py")


def serve(llm: Any, prompts: list[list[int]], max_new_tokens: int) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=int(max_new_tokens), seed=0)
    out = []
    for ids in prompts:
        tic = time.perf_counter()
        output = llm.generate([{"prompt_token_ids": [int(t) for t in ids]}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - tic
        out.append(
            {
                "tokens": list(output.outputs[0].token_ids),
                "seconds": seconds,
                "decode_seconds": bench_worker.decode_seconds(output),
                **bench_worker.request_spec_metrics(output.outputs[0], speculative=True),
            }
        )
    return out


def push(llm: Any, served: Any, command: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    tic = time.perf_counter()
    try:
        new = draft.read_drafter(command["folder"], command.get("sha256"))
    except draft.DraftRejected as error:
        return served, {"ok": False, "rejected": str(error), "served": served.sha256}

    def load(tensors: Any) -> None:
        llm.collective_rpc(draft.reload_draft, args=(list(tensors),))

    try:
        served = draft.push_drafter(load, new, served)
    except draft.DraftRejected as error:
        return served, {"ok": False, "rejected": str(error), "served": served.sha256}
    except Exception as error:  # the previous drafter was loaded back (push_drafter)
        return served, {"ok": False, "error": repr(error), "served": served.sha256}
    return served, {"ok": True, "served": served.sha256, "seconds": time.perf_counter() - tic}


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints and logs go to stderr

    def reply(payload: dict[str, Any]) -> None:
        protocol.write(json.dumps(payload) + "\n")
        protocol.flush()

    spec = json.loads(sys.stdin.readline())
    mode = spec["mode"]
    served = draft.read_drafter(mode["speculative_config"]["model"])
    llm = bench_worker.build_engine(spec, mode)
    reply({"ready": True, "served": served.sha256})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            break
        if op == "serve":
            reply({"ok": True, "results": serve(llm, command["prompts"], command["max_new_tokens"])})
        elif op == "push":
            served, answer = push(llm, served, command)
            reply(answer)
        else:
            reply({"ok": False, "error": f"unknown op {op!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
