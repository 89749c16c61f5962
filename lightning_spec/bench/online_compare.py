"""Every OnlineSpec strategy on the same request stream, one after another, and their table.

One config (configs/online/ogd_mixed_cpu.yaml) gives the stream, the target,
the drafter and the tree; each strategy serves the very same requests in the same rounds from
the same starting drafter (alone on the machine, in turn). Then, per strategy: prequential mean
tau with a 95% bootstrap interval over requests, the paired per-request difference to `frozen`
(interval too), served and net-of-update tokens/s, rollbacks; and one figure of tau over rounds
for every strategy (`tau_over_rounds.png`). Where both a strategy and `frozen` served live
(`engine: vllm`, or `replay: false`), its measured tokens/s gains over frozen, paired over
requests with a bootstrap interval: ``served_gain`` (decoding seconds only) and ``net_gain``
(each round's update charged to its requests). Runs already finished in OUT are reused (resume).

    lightning-spec bench online --config configs/online/ogd_mixed_cpu.yaml --out runs/online_compare \\
        --strategies frozen,ogd,optimistic,ensemble,osd,dpo,hindsight [--seed 1] \\
        [--set optimistic.lr=0.5 --set optimistic.drafter=runs/sft_hydra_cpu/drafter/best]

A replayed run's own seconds are replay time, not serving time (a replayed step skips the
decoding a live step pays for: 22 ms against 152 ms per step measured on SmolLM2), so its table
leaves served tokens/s out; ``--live-steps-from LIVE_FOLDER`` prices each replayed run's
verification steps at a live run's seconds per step and adds its measured update seconds:
``est_live_tokens_per_s``, ``est_live_net_tokens_per_s`` and ``update_share_of_serving``
(an estimate that assumes the strategies' steps cost what the live run's did: same drafter
architecture, same tree). ``--table-only`` recomputes the table without serving.

``hindsight`` (a replayed stream only) is the ceiling: the config's strategy fitted on the first
70% of the stream (``--hindsight-fraction``, ``--hindsight-epochs`` passes) and scored frozen on
the rest; the table gives every strategy's tau on those last requests (``tau@hindsight_tail``)
and the share of the ceiling's gain over frozen it took (``ceiling_share``).

The config's `strategy:` options are shared by every strategy that accepts them; `--set
NAME.KEY=VALUE` overrides one strategy's option (the SGD-style optimistic update needs a learning
rate on another scale than AdamW's) or, for a top-level config key such as `drafter` or `tree`,
that strategy's run (the optimistic strategy on Hydra heads, as in the paper).

    lightning-spec bench online --out FIGURE.png --figure eagle3-frozen=A/frozen \\
        --figure hydra-optimistic=B/optimistic      # one figure across comparisons, no serving
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from lightning_spec import stats
from lightning_spec.online.loop import served_totals


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def live_step_seconds(folder: Path) -> float:
    """Seconds per verification step of a LIVE run (its request log): what one step of this
    drafter architecture and tree costs when decoded, which a replayed run does not measure."""
    rows = [r for r in _rows(folder / "requests.jsonl") if not r.get("replayed")]
    steps = sum(r["verifications"] for r in rows)
    if not steps:
        raise ValueError(f"{folder}: no live (non-replayed) request to time steps on")
    return sum(r["seconds"] for r in rows) / steps


def _live_estimate(requests: list[dict[str, Any]], rounds: list[dict[str, Any]],
                   step: float) -> dict[str, float]:  # fmt: skip
    """Served and net tokens/s of a replayed run at a live step cost: its verification steps
    times `step`, plus its measured update seconds for the net figure."""
    tokens = sum(r["tokens"] for r in requests)
    serving = sum(r["verifications"] for r in requests) * step
    updates = sum(r.get("update_seconds", 0.0) for r in rounds)
    return {"est_live_tokens_per_s": tokens / serving,
            "est_live_net_tokens_per_s": tokens / (serving + updates),
            "update_share_of_serving": updates / serving}  # fmt: skip


def _update_shares(rounds: list[dict[str, Any]]) -> dict[int, float]:
    """{round: update seconds per request}: a round's update spread evenly over its requests."""
    return {r["round"]: r.get("update_seconds", 0.0) / max(1.0, r["requests"]) for r in rounds}


def _estimate_columns(
    requests: list[dict[str, Any]], rounds: list[dict[str, Any]], step: float
) -> dict[int, tuple[float, float]]:
    """{request: (tokens, estimated live seconds)}: its verification steps at `step` plus its
    share of its round's update."""
    share = _update_shares(rounds)
    return {r["request"]: (r["tokens"], r["verifications"] * step + share.get(r["round"], 0.0))
            for r in requests}  # fmt: skip


def _measured_columns(
    requests: list[dict[str, Any]], rounds: list[dict[str, Any]], charge_updates: bool
) -> dict[int, tuple[float, float]]:
    """{request: (tokens, measured serving seconds)} of a run's live requests, plus (with
    `charge_updates`) its share of its round's update: the live analogue of `_estimate_columns`."""
    share = _update_shares(rounds) if charge_updates else {}
    return {r["request"]: (r["tokens"], r["seconds"] + share.get(r["round"], 0.0))
            for r in requests if r.get("seconds") and not r.get("replayed")}  # fmt: skip


def _net_gain(
    mine: dict[int, tuple[float, float]], frozen: dict[int, tuple[float, float]],
    key: str = "est_live_net_gain",
) -> dict[str, Any]:
    """A tokens/s gain over frozen (`key`, and `key`_ci), paired over the requests both served,
    with a bootstrap interval: requests (and their update shares) are resampled in pairs."""
    both = [mine[k] + frozen[k] for k in mine if k in frozen]
    if not both:
        return {}
    columns = tuple([row[i] for row in both] for i in range(4))

    def gain(t_a: Any, s_a: Any, t_b: Any, s_b: Any) -> Any:
        return (t_a.sum(-1) / s_a.sum(-1)) / (t_b.sum(-1) / s_b.sum(-1)) - 1

    point = gain(*(torch.tensor(c, dtype=torch.float64) for c in columns))
    return {key: float(point), f"{key}_ci": stats.bootstrap_ci(columns, gain)}


def first_requests(
    requests: list[dict[str, Any]], rounds: list[dict[str, Any]], count: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first `count` requests of a run in stream order and the rounds that served them, a
    round cut short keeping its update seconds in proportion to the requests kept: runs stopped
    at different points (or served in rounds of different sizes) compared on the same prefix."""
    kept = sorted(requests, key=lambda r: r["request"])[:count]
    per_round: dict[int, int] = {}
    for row in kept:
        per_round[row["round"]] = per_round.get(row["round"], 0) + 1
    cut = []
    for row in rounds:
        served = per_round.get(row["round"], 0)
        if not served:
            continue
        share = served / max(1.0, float(row.get("requests", served)))
        scaled = {k: row[k] * share for k in ("update_seconds", "diagnostic_seconds") if k in row}
        cut.append({**row, **scaled, "requests": served})
    return kept, cut


def summarize(
    out: Path, strategies: list[str], step: float | None = None, first: int | None = None
) -> dict[str, Any]:
    """The comparison table from each strategy's request and round logs; with `step` (seconds
    per live verification step, `live_step_seconds`) also the live tokens/s each replayed run
    stands for; with `first`, on every run's first that many requests only."""
    requests = {s: _rows(out / s / "requests.jsonl") for s in strategies}
    rounds = {s: _rows(out / s / "rounds.jsonl") for s in strategies}
    if first is not None:
        for s in strategies:
            requests[s], rounds[s] = first_requests(requests[s], rounds[s], first)
    table: dict[str, Any] = {}
    base = {r["request"]: r["tau"] for r in requests.get("frozen", [])}
    for name in strategies:
        taus = [r["tau"] for r in requests[name] if r["tau"] == r["tau"]]
        entry: dict[str, Any] = {
            "requests": len(requests[name]),
            "prequential_tau": sum(taus) / len(taus) if taus else None,
            "prequential_tau_ci": stats.bootstrap_ci(taus),
            **_served(requests[name], rounds[name]),
            "rolled_back": sum(r.get("rolled_back", 0.0) for r in rounds[name]),
        }
        if step and requests[name]:
            entry.update(_live_estimate(requests[name], rounds[name], step))
        for domain in dict.fromkeys(r.get("domain", "?") for r in requests[name]):
            picked = [r["tau"] for r in requests[name]
                      if r.get("domain", "?") == domain and r["tau"] == r["tau"]]  # fmt: skip
            entry[f"tau@{domain}"] = sum(picked) / len(picked) if picked else None
        if base and name != "frozen":
            both = [
                (r["tau"], base[r["request"]])
                for r in requests[name]
                if r["tau"] == r["tau"]
                and base.get(r["request"]) == base.get(r["request"])
                and r["request"] in base
            ]  # fmt: skip  (NaN != NaN drops unfinished requests)
            paired = [a - b for a, b in both]
            entry["paired_gain"] = sum(paired) / len(paired) if paired else None
            entry["paired_gain_ci"] = stats.bootstrap_ci(paired)
            frozen = table.get("frozen", {}).get("prequential_tau")
            if frozen and entry["prequential_tau"]:
                entry["relative_gain"] = entry["prequential_tau"] / frozen - 1
            # the relative gain of the mean over the same requests, resampled in pairs
            entry["relative_gain_ci"] = _relative_ci(both)
            entry.update(_domain_gains(requests[name], base))
            if name != "hindsight":  # both served live: the measured gains, paired
                for key, charge in (("served_gain", False), ("net_gain", True)):
                    entry.update(_net_gain(
                        _measured_columns(requests[name], rounds[name], charge),
                        _measured_columns(requests["frozen"], rounds["frozen"], False), key,
                    ))  # fmt: skip
            if step and requests["frozen"] and name != "hindsight":  # its fit is not charged
                entry.update(_net_gain(
                    _estimate_columns(requests[name], rounds[name], step),
                    _estimate_columns(requests["frozen"], rounds["frozen"], step),
                ))  # fmt: skip
        table[name] = entry
    if "hindsight" in requests:  # the ceiling: every strategy on the requests it was scored on
        tail = {r["request"] for r in requests["hindsight"]}
        for name in strategies:
            picked = [r["tau"] for r in requests[name] if r["request"] in tail and r["tau"] == r["tau"]]
            table[name]["tau@hindsight_tail"] = sum(picked) / len(picked) if picked else None
        frozen = table.get("frozen", {}).get("tau@hindsight_tail")
        ceiling = table["hindsight"]["tau@hindsight_tail"]
        if frozen and ceiling and ceiling != frozen:
            for name in strategies:
                own = table[name]["tau@hindsight_tail"]
                if own is not None:  # the share of the ceiling's gain over frozen taken online
                    table[name]["ceiling_share"] = (own - frozen) / (ceiling - frozen)
    return table


def _relative_ci(pairs: list[tuple[float, float]]) -> stats.Interval | None:
    """Interval of mean(a) / mean(b) - 1 over paired requests, resampled in pairs."""
    return stats.bootstrap_ci(
        ([a for a, _ in pairs], [b for _, b in pairs]),
        lambda a, b: stats.ratio_of_sums_of(a, b) - 1,
    )


def _domain_gains(rows: list[dict[str, Any]], base: dict[int, float]) -> dict[str, Any]:
    """`gain@<domain>` and its paired interval for each domain of a mixed stream: a gain on the
    whole stream can come from one segment alone (the broad stream's code half), which is what
    "when it pays" has to say. Empty for a one-domain stream (the whole-stream gain says it)."""
    by_domain: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        frozen = base.get(r["request"])
        if r["tau"] == r["tau"] and frozen is not None and frozen == frozen:
            by_domain.setdefault(r.get("domain", "?"), []).append((r["tau"], frozen))
    if len(by_domain) < 2:
        return {}
    out: dict[str, Any] = {}
    for domain, pairs in by_domain.items():
        out[f"gain@{domain}"] = sum(a for a, _ in pairs) / sum(b for _, b in pairs) - 1
        out[f"gain@{domain}_ci"] = _relative_ci(pairs)
    return out


def _served(requests: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> dict[str, float | None]:
    """Served and net tokens/s of a live run as ratios of sums: every live request's tokens over
    its decoding seconds, and over those plus the rounds' update seconds (a frozen run's two are
    equal). None for a replayed run, whose seconds are not serving seconds."""
    tokens, seconds = served_totals(requests)
    if not seconds:
        return {"tokens_per_s": None, "net_tokens_per_s": None}
    updates = sum(r.get("update_seconds", 0.0) for r in rounds)
    return {"tokens_per_s": tokens / seconds, "net_tokens_per_s": tokens / (seconds + updates)}


def plot(out: Path, strategies: list[str]) -> Path:
    """Tau over rounds of every strategy of one comparison, as ``OUT/tau_over_rounds.png``."""
    return plot_rounds([(name, out / name) for name in strategies], out / "tau_over_rounds.png")


def plot_rounds(runs: list[tuple[str, Path]], path: Path) -> Path:
    """Tau over rounds of labelled stream runs (folders with a ``rounds.jsonl``) in one figure:
    also runs of different comparisons, such as two drafters served the same stream."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.2), dpi=100)
    for label, folder in runs:
        rows = _rows(folder / "rounds.jsonl")
        axis.plot(_round_starts(folder, rows), [r["tau"] for r in rows], label=label, marker=".")
    axis.set_xlabel("stream position of the round's first request")
    axis.set_ylabel("tau (tokens per verification)")
    axis.legend(fontsize=7, ncol=2)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def _round_starts(folder: Path, rounds: list[dict[str, Any]]) -> list[int]:
    """Where each round starts in the stream (its first request's index), so that a run served
    on part of the stream (the hindsight ceiling's tail) sits above the same requests as the
    others; the round number times its size where the request log is missing."""
    first: dict[int, int] = {}
    log = folder / "requests.jsonl"
    for row in _rows(log) if log.is_file() else []:
        first[row["round"]] = min(first.get(row["round"], row["request"]), row["request"])
    size = max((int(r.get("requests", 1)) for r in rounds), default=1)
    return [first.get(r["round"], r["round"] * size) for r in rounds]


def parse_figure_runs(items: list[str]) -> list[tuple[str, Path]]:
    """``LABEL=FOLDER`` items -> [(label, folder)]; a folder without ``rounds.jsonl`` is an
    error that names it."""
    runs = []
    for item in items:
        label, sep, folder = item.partition("=")
        if not (sep and label and folder):
            raise ValueError(f"--figure {item!r}: expected LABEL=FOLDER")
        if not (Path(folder) / "rounds.jsonl").is_file():
            raise ValueError(f"--figure {item!r}: {folder} has no rounds.jsonl")
        runs.append((label, Path(folder)))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-spec bench online", description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategies", default="frozen,ogd,optimistic,ensemble,osd,dpo")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="one strategy's option or config key (repeatable; module doc)",
    )
    parser.add_argument(
        "--figure",
        action="append",
        default=[],
        metavar="LABEL=FOLDER",
        help="serve nothing: draw these runs' tau over rounds into the PNG --out (repeatable)",
    )
    parser.add_argument("--hindsight-fraction", type=float, default=0.7,
                        help="with 'hindsight' in --strategies: the share of the stream it is "
                        "fitted on (the rest is where every strategy is compared to it)")  # fmt: skip
    parser.add_argument("--hindsight-epochs", type=int, default=3)
    parser.add_argument("--live-steps-from", type=Path, default=None, metavar="FOLDER",
                        help="a live run of the same drafter architecture and tree: its seconds "
                        "per verification step turn each replayed run's steps and update "
                        "seconds into estimated live served and net tokens/s")  # fmt: skip
    parser.add_argument("--table-only", action="store_true",
                        help="serve nothing: the table of the runs already in --out")
    parser.add_argument("--first-requests", type=int, default=None, metavar="N",
                        help="the table on every run's first N requests in stream order (runs "
                        "stopped at different rounds compared on the same requests)")
    args = parser.parse_args(argv)
    if args.figure:
        try:
            runs = parse_figure_runs(args.figure)
        except ValueError as error:
            parser.error(str(error))
        print(f"figure: {plot_rounds(runs, args.out)}")
        return 0
    strategies = [s for s in args.strategies.split(",") if s]
    try:
        step = live_step_seconds(args.live_steps_from) if args.live_steps_from else None
    except (OSError, ValueError) as error:
        parser.error(str(error))
    if args.first_requests is not None and args.first_requests < 1:
        parser.error("--first-requests must be >= 1")
    if args.table_only:
        return _write_table(args.out, strategies, step, args.first_requests)
    if args.config is None:
        parser.error("--config is required (unless --figure or --table-only)")
    try:
        overrides = parse_overrides(args.set, strategies)
    except ValueError as error:
        parser.error(str(error))
    base = yaml.safe_load(Path(args.config).read_text())
    options = dict(base.get("strategy") or {})
    options.pop("name", None)
    executable = Path(sys.executable).with_name("lightning-spec")
    for name in strategies:
        folder = args.out / name
        top, own = overrides.get(name, ({}, {}))
        strategy = {"name": name, **_options(name, options), **own}
        config = dict(base, **top, out_dir=str(folder), strategy=strategy)
        if args.seed is not None:
            config["seed"] = args.seed
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [str(executable), "online", "--config", str(path)]
        if name == "hindsight":  # the configured learner, fitted with hindsight (the ceiling)
            strategy["name"] = str((base.get("strategy") or {}).get("name", "ogd"))
            path.write_text(yaml.safe_dump(dict(config, strategy=strategy)))
            command += ["--hindsight", str(args.hindsight_fraction),
                        "--hindsight-epochs", str(args.hindsight_epochs)]  # fmt: skip
        code = run_child(command)
        if code != 0:
            print(f"{name}: online exited {code}", file=sys.stderr)
            return code
    return _write_table(args.out, strategies, step, args.first_requests)


def run_child(command: list[str]) -> int:
    """Run one strategy's `lightning-spec online` and take it down with us.

    ``subprocess.call`` leaves the child running when this wrapper is killed: an orphaned
    stream then keeps writing its folder beside whatever runs next (it happened: an OSD run
    went on beside CI and beside its own resumed copy). SIGTERM and SIGINT are passed on to the
    child, and a child still alive when we leave, by any path, is terminated, then killed.
    """
    child = subprocess.Popen(command)

    def forward(signum: int, _frame: Any) -> None:
        child.send_signal(signum)
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _write_table(out: Path, strategies: list[str], step: float | None, first: int | None) -> int:
    table = summarize(out, strategies, step, first)
    if step:
        table["live_step_seconds"] = step
    name = "summary.json" if first is None else f"summary_first{first}.json"
    (out / name).write_text(json.dumps(table, indent=1))
    print(json.dumps(table, indent=1))
    print(f"figure: {plot(out, strategies)}")
    return 0


def parse_overrides(
    items: list[str], strategies: list[str]
) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """{strategy: (config keys, strategy options)} from ``NAME.KEY=VALUE`` items (values as
    `parse_value` reads them); a strategy not in the run or a malformed item is an error."""
    from lightning_spec.cli.online import KEYS, parse_value

    parsed: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for item in items:
        head, sep, raw = item.partition("=")
        name, dot, key = head.partition(".")
        if not (sep and dot and name and key):
            raise ValueError(f"--set {item!r}: expected NAME.KEY=VALUE")
        if name not in strategies:
            raise ValueError(f"--set {item!r}: {name!r} is not among --strategies {strategies}")
        if key in ("name", "out_dir", "strategy"):
            raise ValueError(f"--set {item!r}: {key!r} is fixed by the comparison")
        top, own = parsed.setdefault(name, ({}, {}))
        (top if key in KEYS else own)[key] = parse_value(raw)
    return parsed


def _options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The shared options each strategy accepts, read from its constructor's signature (frozen:
    ttt_steps and the labels; ``hindsight`` fits the config's own strategy, so it takes them all)."""
    import inspect

    from lightning_spec.online.strategies import STRATEGIES

    if name == "hindsight":
        return dict(options)
    if name == "frozen":
        accepted = {"ttt_steps", "labels", "label_top_k"}
    else:
        accepted = set(inspect.signature(STRATEGIES[name]).parameters) - {"drafter"}
    return {k: v for k, v in options.items() if k in accepted}

