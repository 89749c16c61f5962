"""Replay a recorded request stream through OnlineSpec strategies offline, to choose one.

Serving a stream costs minutes per strategy on this CPU, almost all of it the target. At T = 0
the committed tokens and the target features a round leaves behind do not depend on the drafter
(lossless decoding commits the target's greedy tokens whatever was drafted), so one served run
with ``record_feedback: true`` holds the feedback of every strategy on that stream, except the
rejected-draft slots that `osd` and `dpo` read, which are the recording drafter's own. Each
variant here starts from the same drafter and, round by round, is first scored on the round
(prequential: the online loss and the top-1 agreement of each TTT step with the committed
tokens, `online.losses.online_metrics`), then updates on it exactly as the live loop would
(`strategy.update`). The winner is then confirmed by serving it live (`lightning-spec online`);
top1_0 is the chain's first-token acceptance, a proxy of tau, not tau; top4_0 (``--top-k``) is
the first level of a tree with 4 root children, closer to what `dynamic:2,4,8` accepts (on
Hydra a +1.1-point top1_0 gain came with an unchanged live tau: BENCHMARKS.md section 17).

    python experiments/onlinespec/scripts/online_replay.py --feedback runs/online_dev/frozen --drafter D \\
        --variant frozen=frozen --variant ogd=ogd,lr=3e-4,steps_per_round=4 \\
        --output runs/online_dev/replay.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from lightning_spec import stats
from lightning_spec.bench.report import write_json
from lightning_spec.cli.online import parse_value


def parse_variant(text: str) -> tuple[str, str, dict[str, Any]]:
    """``NAME=STRATEGY[,key=value...]`` -> (name, strategy, options; values as `parse_value`
    reads them)."""
    name, sep, spec = text.partition("=")
    parts = [p for p in spec.split(",") if p]
    if not (sep and name and parts):
        raise ValueError(f"--variant {text!r}: expected NAME=STRATEGY[,key=value...]")
    options: dict[str, Any] = {}
    for part in parts[1:]:
        key, eq, raw = part.partition("=")
        if not (eq and key):
            raise ValueError(f"--variant {text!r}: option {part!r} is not key=value")
        options[key] = parse_value(raw)
    return name, parts[0], options


def round_domains(stream_folder: Path, rounds: int) -> list[str]:
    """The most common request domain of each round (from the stream's requests.jsonl), or
    ``?`` when the log is missing."""
    path = stream_folder / "requests.jsonl"
    if not path.is_file():
        return ["?"] * rounds
    counts: list[Counter] = [Counter() for _ in range(rounds)]
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row["round"] < rounds:
                counts[row["round"]][row["domain"]] += 1
    return [c.most_common(1)[0][0] if c else "?" for c in counts]


def replay(
    drafter: Any,
    feedback: list[list[Any]],
    strategy_name: str,
    options: dict[str, Any],
    *,
    ttt_steps: int = 3,
    top_k: int = 1,
) -> list[dict[str, float]]:
    """Per round: the served model's metrics on the round, then the update's metrics."""
    from lightning_spec.online.losses import feedback_batch, online_metrics
    from lightning_spec.online.strategies import make_strategy

    # every learning strategy trains its own copy and frozen never writes: `drafter` stays as given
    strategy = make_strategy(strategy_name, drafter, **options)
    rows = []
    for generations in feedback:
        batch = feedback_batch(generations)
        if batch is None:
            continue
        row = online_metrics(strategy.drafter, batch, ttt_steps=ttt_steps, top_k=top_k)
        tic = time.perf_counter()
        update = strategy.update(generations)
        row["update_seconds"] = time.perf_counter() - tic
        row["labels"] = float(update.get("labels", 0.0))
        rows.append(row)
    return rows


def summarize(
    per_variant: dict[str, list[dict[str, float]]], domains: list[str], reference: str | None
) -> dict[str, Any]:
    """Prequential means (label-weighted over rounds) overall and per domain, and each metric's
    paired per-round difference to `reference` with a 95% bootstrap interval."""
    table: dict[str, Any] = {}
    for name, rows in per_variant.items():
        metrics = [k for k in rows[0] if k.startswith(("loss", "top"))]
        entry: dict[str, Any] = {"update_seconds": sum(r["update_seconds"] for r in rows)}
        for key in metrics:
            entry[key] = _weighted(rows, key)
            for domain in dict.fromkeys(domains):
                picked = [r for r, d in zip(rows, domains, strict=False) if d == domain]
                if picked:
                    entry[f"{key}@{domain}"] = _weighted(picked, key)
            if reference and name != reference and reference in per_variant:
                base = per_variant[reference]
                paired = [r[key] - b[key] for r, b in zip(rows, base, strict=True)]
                entry[f"{key}_gain_ci"] = stats.bootstrap_ci(paired)
        table[name] = entry
    return table


def _weighted(rows: list[dict[str, float]], key: str) -> float:
    total = sum(r["labels"] for r in rows)
    return sum(r[key] * r["labels"] for r in rows) / total if total else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--feedback", type=Path, required=True, help="a stream's out_dir")
    parser.add_argument(
        "--drafter", required=True, help="the drafter folder every variant starts from"
    )
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=STRATEGY,...")
    parser.add_argument("--ttt-steps", type=int, default=3, help="TTT steps scored per round")
    parser.add_argument(
        "--top-k",
        type=int,
        default=4,
        help="also score top-k agreement (the first level of a tree with k root children; "
        "4 for dynamic:2,4,8), a closer proxy of tau than the argmax",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as error:
        parser.error(str(error))
    import torch

    from lightning_spec import specs
    from lightning_spec.online.loop import load_feedback

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    try:
        feedback = load_feedback(args.feedback)
    except FileNotFoundError as error:
        print(f"online_replay: {error}", file=sys.stderr)
        return 2
    target = specs.resolve_target(args.target, "fp32")
    drafter = specs.resolve_drafter(args.drafter, target)
    domains = round_domains(args.feedback, len(feedback))
    per_variant: dict[str, list[dict[str, float]]] = {}
    reference = variants[0][0]
    for name, strategy, options in variants:
        tic = time.perf_counter()
        per_variant[name] = replay(
            drafter, feedback, strategy, options, ttt_steps=args.ttt_steps, top_k=args.top_k
        )
        print(f"{name}: {len(per_variant[name])} rounds in {time.perf_counter() - tic:.0f} s",
              file=sys.stderr)  # fmt: skip
        table = summarize(per_variant, domains, reference)
        if args.output:  # after every variant: a long sweep stopped early keeps what it measured
            result = {"feedback": str(args.feedback), "drafter": args.drafter, "domains": domains,
                      "reference": reference, "table": table, "rounds": per_variant,
                      "variants": {n: {"strategy": s, **o} for n, s, o in variants}}  # fmt: skip
            write_json(args.output, result)
    print(json.dumps(summarize(per_variant, domains, reference), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
