"""Does an online update beside vLLM's serving pay on this machine? Serving and the update
timed alone and at the same time, on the same requests.

    python experiments/onlinespec/scripts/vllm_beside_probe.py --config experiments/onlinespec/configs/vllm_no_warm_start.yaml \
        --requests 20 --learner-threads 1,2 --output experiments/onlinespec/results/smollm2_online_shift_vllm/beside_probe.json

`online --engine vllm` runs each round's update (the feedback's replay through our decoder and
the strategy's AdamW steps) in series with serving, which cost 41% of the serving seconds on 2
cores (BENCHMARKS.md section 42). Beside serving, the update would run while vLLM serves the next
round, and the server would pay only what it waits for it; on a machine whose cores both serve,
the two slow each other down instead. The probe measures both on one warm engine: round A and
round B served alone, the update of round A's replies alone, then round B served again while
the update of round B's replies runs in a thread of this process (vLLM runs in its own worker
process), once per learner thread count. A round beside costs max(serving, update) at the same
time, in series serving + update alone: beside pays when the first is smaller.
"""

from __future__ import annotations

import argparse
import copy
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from lightning_spec.io import atomic_write_json


def feedback_and_update(target: Any, served: Any, strategy: Any, policy: Any, requests: list[Any],
                        items: list[Any], labels: int) -> float:
    """The learner's whole round, as `online --engine vllm` charges it: the replies replayed
    with the drafter that served them, then the strategy's update; its seconds."""
    from lightning_spec.online.loop import engine_feedback

    tic = time.perf_counter()
    strategy.update(engine_feedback(target, served, policy, requests, items, labels))
    return time.perf_counter() - tic


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="an `online --engine vllm` config")
    parser.add_argument("--requests", type=int, default=20, help="requests per round")
    parser.add_argument("--learner-threads", default="1,2", help="torch threads of the update beside")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)

    from lightning_spec import specs
    from lightning_spec.cli.online import (
        check_engine_drafter,
        load_config,
        start_vllm_engine,
        strategy_options,
        stream_segments,
    )
    from lightning_spec.online.strategies import make_strategy
    from lightning_spec.online.stream import build_stream

    config = load_config(args.config)
    if config["engine"] != "vllm":
        parser.error(f"{args.config}: engine must be vllm")
    check_engine_drafter(config)
    threads = [int(t) for t in args.learner_threads.split(",") if t.strip()]
    torch.set_num_threads(int(config["threads"]))
    target = specs.resolve_target(config["target"], "fp32")
    drafter = specs.resolve_drafter(str(config["drafter"]), target)
    if config["prepack"]:
        from lightning_spec.models.packed import prepack_where_possible

        prepack_where_possible({"target": target.model}, who="probe")
    stream = build_stream(target.tokenizer, stream_segments(config), seed=int(config["seed"]))
    n = args.requests
    if len(stream) < 2 * n + 4:
        parser.error(f"the stream has {len(stream)} requests: --requests {n} needs {2 * n + 4}")
    warm, round_a, round_b = stream[:4], stream[4 : 4 + n], stream[4 + n : 4 + 2 * n]
    options = strategy_options(config, target)
    strategy = make_strategy(str(config["strategy"]["name"]), drafter, **options)
    served = copy.deepcopy(drafter).eval()  # what vLLM serves: the update never touches it
    policy = specs.resolve_tree(str(config["tree"]))
    new_tokens = int(config["max_new_tokens"])
    engine = start_vllm_engine(config, args.output.parent / f"{args.output.stem}-logs")

    def serve(requests: list[Any]) -> tuple[list[Any], float]:
        tic = time.perf_counter()
        items = engine.serve([r.prompt for r in requests], new_tokens)
        return items, time.perf_counter() - tic

    report: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "requests": n,
                              "config": str(args.config), "server_threads": int(config["threads"])}  # fmt: skip
    try:
        serve(warm)
        items_a, report["serve_a_alone"] = serve(round_a)
        items_b, report["serve_b_alone"] = serve(round_b)
        report["update_alone"] = feedback_and_update(
            target, served, strategy, policy, round_a, items_a, strategy.label_top_k
        )
        series = report["serve_b_alone"] + report["update_alone"]
        report["series_seconds"] = series
        report["beside"] = {}
        for count in threads:
            torch.set_num_threads(count)
            seconds: dict[str, float] = {}

            def learn(seconds: dict[str, float] = seconds) -> None:
                seconds["update"] = feedback_and_update(
                    target, served, strategy, policy, round_b, items_b, strategy.label_top_k
                )

            worker = threading.Thread(target=learn)
            tic = time.perf_counter()
            worker.start()
            _, seconds["serve"] = serve(round_b)
            worker.join()
            seconds["round"] = time.perf_counter() - tic  # the server waits for the update
            seconds["over_series"] = seconds["round"] / series
            report["beside"][str(count)] = seconds
            torch.set_num_threads(int(config["threads"]))
            print(f"learner threads {count}: serve {seconds['serve']:.1f} s, update {seconds['update']:.1f} s "
                  f"at once, round {seconds['round']:.1f} s against {series:.1f} s in series "
                  f"({seconds['over_series']:.2f}x)", flush=True)  # fmt: skip
    finally:
        engine.close()
    print(f"alone: serve {report['serve_b_alone']:.1f} s, update {report['update_alone']:.1f} s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.output, report)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
