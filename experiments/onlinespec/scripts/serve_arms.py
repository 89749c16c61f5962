"""Arms of a stream served live by `vllm serve` (our `serve --engine vllm`), one after another,
alone on the cores: each arm starts its own server, `bench load` replays the stream against it,
and the server stops. Everything lands under ``--out`` (put it in the asset cache: a killed run
resumes each arm where its load output ends, and a learning arm's learner from its checkpoint).

Arms: ``frozen`` (the drafter as trained), ``learn=CONFIG`` (the same drafter learning behind the
server from a `serve --learn` config; with ``--in-series`` the client waits for each round's
update, the learner charged to serving), ``ngram`` (vLLM's drafter-free n-gram proposer),
``plain`` (no speculation: the target's own greedy answers under vLLM), ``capture`` (frozen
with the plugin capturing every request into a spool that nothing reads: what capture alone
costs serving; ~6 MB a request on disk, so run it on a prefix with ``--limit``).

    python experiments/onlinespec/scripts/serve_arms.py --drafter D --stream S.jsonl \\
        --limit 1200 --concurrency 1 --out ~/.cache/lightning-spec/serve_arms/c1 \\
        frozen learn=experiments/onlinespec/configs/serve_learn_schedule.yaml ngram
    lightning-spec bench load --compare OUT/frozen/load.jsonl OUT/learn/load.jsonl OUT/ngram/load.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lightning_spec.bench.serve_load import load_stream, replay, summarise
from lightning_spec.io import sha256_file
from lightning_spec.tools.process import wait_healthy


def start(arm: str, args: argparse.Namespace, out: Path) -> subprocess.Popen:
    name, _, config = arm.partition("=")
    command = [str(Path(sys.executable).parent / "lightning-spec"), "serve", "--engine", "vllm",
               "--drafter", args.drafter, "--k", str(args.k), "--port", str(args.port),
               "--out-dir", str(out)]  # fmt: skip
    if name == "ngram":
        command += ["--method", "ngram"]
    elif name == "plain":
        command += ["--method", "plain"]
    elif name == "learn":
        command += ["--learn", config]
    elif name == "capture":
        command += ["--spool", str(out / "spool")]
    log = open(out / "serve.log", "a")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--in-series", type=int, default=40, help="learning arms: round size")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", required=True)
    parser.add_argument("arms", nargs="+")
    args = parser.parse_args()
    args.drafter = str(Path(args.drafter).resolve())
    requests = load_stream(args.stream, args.limit)
    root = Path(args.out).expanduser()
    for arm in args.arms:
        name = arm.partition("=")[0]
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        output = out / "load.jsonl"
        print(f"{time.strftime('%H:%M:%S')} arm {arm}: {len(requests)} requests at "
              f"{args.concurrency} clients -> {output}", flush=True)  # fmt: skip
        process = start(arm, args, out)
        try:
            wait_healthy(process, f"http://127.0.0.1:{args.port}", timeout=900)
            tic = time.perf_counter()
            rows = replay(f"http://127.0.0.1:{args.port}", requests, output,
                          concurrency=args.concurrency, max_tokens=args.max_tokens,
                          in_series=args.in_series if name == "learn" else 0)  # fmt: skip
            wall = time.perf_counter() - tic
        finally:
            stop(process)
        summary = {
            "arm": arm, "concurrency": args.concurrency, "wall_seconds_this_run": wall,
            "drafter_sha256": sha256_file(Path(args.drafter) / "model.safetensors"),
            "stream": args.stream, "stream_sha256": sha256_file(Path(args.stream)),
            "limit": args.limit, **summarise(rows),
        }  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
