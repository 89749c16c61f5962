"""What does the learner's feedback cost with the features captured from the serving pass,
against today's rebuild with a second target pass? The same served requests, both ways.

    python experiments/onlinespec/scripts/feedback_split.py --drafter runs/quickstart/drafter/last \
        --dataset humaneval --limit 40 --max-new-tokens 128 \
        --output experiments/onlinespec/results/feedback_split.json

The requests are served one at a time by the real ``vllm serve`` (`online.vllm_server`) with
capture on; the server is then stopped, and each captured request's feedback (the replay of the
served text with the drafter that served it: records, features and soft labels) is built twice,
alternating per request: from the captured rows (`online.loop.replay_captured`, no target
forward) and from a teacher-forced target pass (`online.loop.replay_request`, what
``online --engine vllm`` does for every round). Both must give the same records and labels; the
seconds of each are reported per request and per round of 40.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
import urllib.request
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

from lightning_spec.io import atomic_write_json


def split_feedback(
    target: Any, drafter: Any, policy: Any, requests: list[Any], labels: int
) -> dict[str, Any]:
    """Both feedback paths over `requests` (`CapturedRequest`s), alternating which goes first;
    their seconds and how far their labels differ."""
    from lightning_spec.online.loop import replay_captured, replay_request

    captured, target_pass, worst, steps = [], [], 0.0, 0
    for index, request in enumerate(requests):
        tokens = request.computed
        prompt, answer = tokens[: request.prompt_len], tokens[request.prompt_len :]

        def from_rows(request: Any = request) -> Any:
            return replay_captured(target, drafter, policy, request, keep_labels=labels)

        def from_target(prompt: list[int] = prompt, answer: list[int] = answer) -> Any:
            return replay_request(target, drafter, policy, prompt, answer, keep_labels=labels)

        order = [(from_rows, captured), (from_target, target_pass)]
        results = {}
        for run, seconds in order if index % 2 == 0 else order[::-1]:
            tic = time.perf_counter()
            results[run.__name__] = run()
            seconds.append(time.perf_counter() - tic)
        a, b = results["from_rows"], results["from_target"]
        if [r.accept_length for r in a.records] != [r.accept_length for r in b.records]:
            raise AssertionError(f"{request.request_id}: the two feedbacks replay differently")
        worst = max(worst, float((a.label_logprobs - b.label_logprobs).abs().max()))
        steps += len(a.records)
    per_round = 40 / max(1, len(requests))
    return {
        "requests": len(requests), "verify_steps": steps,
        "captured_seconds": sum(captured), "target_pass_seconds": sum(target_pass),
        "captured_seconds_per_round_of_40": sum(captured) * per_round,
        "target_pass_seconds_per_round_of_40": sum(target_pass) * per_round,
        "median_ratio_target_pass_over_captured": statistics.median(
            t / c for t, c in zip(target_pass, captured, strict=True)
        ),
        "max_label_logprob_difference": worst,
    }  # fmt: skip


def _serve_and_capture(args: argparse.Namespace, work: Path) -> list[Any]:
    from lightning_spec.bench.engines import engine_drafter
    from lightning_spec.bench.vllm import target_folder
    from lightning_spec.models.target import load_target
    from lightning_spec.online.spool import SpoolReader
    from lightning_spec.online.vllm_server import VllmServer, serve_command
    from lightning_spec.specs import load_prompts
    from lightning_spec.tools.vllm import ensure_vllm

    drafter = engine_drafter(args.drafter, "vLLM")[0]
    tokenizer = load_target("smollm2").tokenizer
    _, items = load_prompts(args.dataset, tokenizer, limit=args.limit)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = ensure_vllm()
    command = serve_command(env, target_folder("smollm2"), drafter, k=args.k, port=port)
    spool = work / "spool"
    with closing(
        VllmServer(env, command, log=work / "vllm.log", workdir=work, spool=spool)
    ) as server:
        model = server.get("/v1/models")["data"][0]["id"]
        for ids, _ in items:
            body = {"model": model, "prompt": list(ids), "max_tokens": args.max_new_tokens,
                    "temperature": 0}  # fmt: skip
            request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"content-type": "application/json"})  # fmt: skip
            urllib.request.urlopen(request, timeout=600).read()
        deadline = time.monotonic() + 60
        while len(SpoolReader(spool).pending()) < len(items) and time.monotonic() < deadline:
            time.sleep(0.5)
    return [e.request for e in SpoolReader(spool).take()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument(
        "--labels", type=int, default=32, help="soft labels kept (ogd's label_top_k)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prepack", action="store_true", help="the target's fp32 fast path, both ways"
    )
    parser.add_argument("--workdir", default="runs/feedback_split")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    from lightning_spec import specs
    from lightning_spec.bench.machine import machine_info

    work = Path(args.workdir).resolve()
    requests = _serve_and_capture(args, work)
    torch.set_num_threads(args.threads)
    target = specs.resolve_target("smollm2", "fp32")
    if args.prepack:
        from lightning_spec.models.packed import prepack_where_possible

        prepack_where_possible({"target": target.model}, who="feedback_split")
    drafter = specs.resolve_drafter(str(Path(args.drafter).resolve()), target)
    result = split_feedback(
        target, drafter, specs.resolve_tree(f"chain:{args.k}"), requests, args.labels
    )
    result.update(command=" ".join(sys.argv), machine=machine_info(), threads=args.threads,
                  prepack=args.prepack, dataset=args.dataset)  # fmt: skip
    atomic_write_json(args.output, result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
