"""`lightning-spec online --config configs/online/ogd_mixed_cpu.yaml`: OnlineSpec over a request stream.

Reads a YAML config (target, drafter folder, tree, the stream's segments and seed, round size,
tokens per request, the strategy and its options, the output folder), builds the stream
(`online.stream`), serves it round by round with the chosen strategy learning in between
(`online.loop`), logs every round to MLflow (`online/*`, SQLite store beside the output
folder unless MLFLOW_TRACKING_URI says otherwise) and prints the prequential summary. Started
again with the same output folder, a killed stream resumes at its round. Strategies here:
`frozen`, `ogd`, `optimistic`, `ensemble`, `osd`, `dpo` (docs/methods/onlinespec.md).

`--stream FILE.jsonl` (or ``stream: FILE.jsonl``) serves a JSONL file of prompts whole and in
file order (``--skip N`` past a warm start's items, ``--limit N``); `data.domain_streams`
builds narrow-domain ones. ``replay: true`` generates the stream's greedy answers once in
batches (cached in ``replay_cache``, default ``OUT_DIR/../continuations.jsonl``, shared by
every strategy served beside it) and serves each request by exact replay: the same tau and
feedback as live decoding at T = 0, at a fraction of the time (tokens/s then comes from a live
run). ``live_check: true`` (with ``replay: false``) decodes live and checks every output
against those cached greedy answers: the live confirmation of a replayed comparison, with
``greedy_mismatches`` per round (any: exit status 1). ``update_beside: true`` runs each update
in a worker thread while the next round is served (`online.beside`; with ``threads: 1`` the
server and the update take one core each), charging only the server's wait for it. ``--hindsight 0.7`` serves nothing
online: it fits the strategy on the first 70% of the replayed stream for
tau on those requests is read against (`online.hindsight`).

``--engine vllm`` (``engine: vllm``, with ``tree: chain:K``): vLLM's CPU build serves the stream
with the drafter folder; after each update the new drafter is pushed into the running engine
(`online.engines`, `online/vllm_draft.py`: checked, all or nothing) and the learner rebuilds
its feedback by replaying each served reply; every update, push and replay second is charged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["check_engine_drafter", "load_config", "main", "parse_value"]

KEYS = {"target", "drafter", "tree", "stream", "seed", "round_size", "max_new_tokens",
        "strategy", "out_dir", "experiment", "threads", "prepack", "guard", "regret_window",
        "record_feedback", "replay", "replay_cache", "replay_batch", "update_every", "live_check",
        "update_beside", "engine",
        "train_data", "allow_overlap", "drop_overlap",
        # read by `serve --engine vllm --learn` (online.learner); this harness has its own rounds
        "rollback_margin", "keep_drafters", "keep_learned", "schedule"}  # fmt: skip


def parse_value(raw: str) -> Any:
    """A command-line option value: a number when it reads as one (``1e-3`` too, which YAML
    1.1 keeps as a string), else YAML (booleans, lists, strings)."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return yaml.safe_load(raw)


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config with defaults, checked before anything is loaded (fields named on error)."""
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read the online config {path}: {error}") from error
    config.update(overrides or {})
    unknown = set(config) - KEYS
    if unknown:
        raise ValueError(f"unknown online config keys {sorted(unknown)}; known: {sorted(KEYS)}")
    if isinstance(config.get("stream"), str):  # a JSONL file, served whole in file order
        config["stream"] = [{"source": config["stream"], "count": 0, "order": "source"}]
    for field in ("drafter", "stream"):
        if field not in config:
            raise ValueError(f"the online config needs {field!r}")
    segments = config["stream"]
    if not isinstance(segments, list) or not all(
        isinstance(s, dict) and {"source", "count"} <= set(s) for s in segments
    ):
        raise ValueError("stream must be a list of {source: ..., count: N} segments")
    config.setdefault("target", "smollm2")
    config.setdefault("tree", "dynamic:6,10,32")
    config.setdefault("seed", 0)
    config.setdefault("round_size", 25)
    config.setdefault("max_new_tokens", 64)
    config.setdefault("strategy", {"name": "frozen"})
    config.setdefault("out_dir", "runs/online")
    config.setdefault("experiment", "online_spec")
    config.setdefault("threads", 2)
    config.setdefault("prepack", False)
    if int(config["round_size"]) < 1 or int(config["max_new_tokens"]) < 1:
        raise ValueError("round_size and max_new_tokens must be >= 1")
    engine = config.setdefault("engine", "ours")
    if engine not in ("ours", "vllm"):
        raise ValueError(f"engine must be 'ours' (our decoder) or 'vllm', got {engine!r}")
    if engine == "vllm":
        tree = str(config["tree"])
        if not tree.startswith("chain:"):
            raise ValueError(
                f"vLLM drafts a chain: set tree: chain:K with engine: vllm (got {tree})"
            )
        if config.get("replay") or config.get("update_beside"):
            raise ValueError(
                "engine: vllm serves every request live: replay and update_beside do not apply"
            )
    if config.get("replay") and config.get("live_check"):
        raise ValueError("live_check decodes live and checks each output against the cached "
                         "greedy answers: set replay: false with it")  # fmt: skip
    train = config.get("train_data")
    if train is not None and not (
        isinstance(train, list) and all(isinstance(t, dict) and "source" in t for t in train)
    ):
        raise ValueError("train_data must be a list of {source: ..., count: N} selections")
    return config


def check_engine_drafter(config: dict[str, Any]) -> None:
    """vLLM loads a drafter folder: checked before anything loads, but not by `load_config`,
    since a config may name the folder a later step trains."""
    folder = Path(str(config["drafter"])).expanduser()
    if config["engine"] == "vllm" and not (folder / "config.json").is_file():
        raise ValueError(f"engine: vllm loads a drafter folder: {config['drafter']} is not one")


def start_vllm_engine(config: dict[str, Any], out: Path) -> Any:
    """vLLM's CPU build serving the config's drafter at the tree's chain depth (installed into
    the asset cache the first time). The worker gets absolute paths: it does not share our
    folder's meaning of a relative one (vLLM then reads it as a hub repository id)."""
    from lightning_spec.bench.vllm import target_folder
    from lightning_spec.online.vllm_engine import VllmOnlineEngine
    from lightning_spec.tools.vllm import ensure_vllm

    out.mkdir(parents=True, exist_ok=True)
    k = int(str(config["tree"]).split(":", 1)[1])
    return VllmOnlineEngine(
        ensure_vllm(), target_folder(str(config["target"])),
        Path(str(config["drafter"])).expanduser().resolve(),
        k=k, log=out / "vllm-engine.log",
    )  # fmt: skip


def check_stream_is_new(config: dict[str, Any], requests: list[Any], out: Path) -> str | None:
    """Check the stream against what the drafter trained on (the drafter folder's record, else
    the config's ``train_data``), write ``OUT/overlap.json``, and return an error when a stream
    prompt is a training prompt (unless ``allow_overlap: true``). ``drop_overlap: true`` removes
    those requests from `requests` (in place, listed in overlap.json as ``dropped``) instead: a
    narrow domain repeats itself (a docstring shared by two functions), and the rest of the
    stream is still new."""
    from lightning_spec.online.overlap import check_overlap, drafter_training_data, stream_prompts

    training = drafter_training_data(config["drafter"]) or config.get("train_data")
    if not training:
        print("online: the drafter folder does not record its training data and the config has "
              "no train_data: the stream was NOT checked against the training set",
              file=sys.stderr)  # fmt: skip
        return None
    report = check_overlap(stream_prompts(requests), training)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overlap.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"online: stream vs training set ({', '.join(str(t['source']) for t in training)}): "
          f"{len(report['same_id'])} same ids, {len(report['exact'])} identical prompts, "
          f"{len(report['ngram'])} of {report['requests']} share a {report['n']}-word run "
          f"(overlap.json)")  # fmt: skip
    found = set(report["same_id"] + report["exact"])
    if found and config.get("drop_overlap"):
        requests[:] = [r for r in requests if r.id not in found]
        report["dropped"] = sorted(found)
        (out / "overlap.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"online: dropped the {len(found)} stream requests the drafter trained on "
              f"(drop_overlap); {len(requests)} left", file=sys.stderr)  # fmt: skip
        return None
    if found and not config.get("allow_overlap"):
        first = (report["same_id"] + report["exact"])[:3]
        return (f"{len(set(report['same_id'] + report['exact']))} stream prompts are in the "
                f"drafter's training set (e.g. {first}): skip past them, or set allow_overlap: "
                f"true, or drop them with drop_overlap: true")  # fmt: skip
    return None


def stream_segments(config: dict[str, Any]) -> list[Any]:
    """The config's stream as `Segment`s, in order (`load_config` checked their fields)."""
    from lightning_spec.online.stream import Segment

    return [
        Segment(
            str(s["source"]), int(s["count"]), str(s.get("order", "shuffle")), int(s.get("skip", 0))
        )
        for s in config["stream"]
    ]


def dump_stream(requests: list[Any], path: Path) -> None:
    """The stream as `bench load` sends it: the very prompts (chat template applied, token ids)
    the in-process harness serves, so a server's arms and the harness see the same requests."""
    from lightning_spec.io import atomic_path

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w") as handle:
        for request in requests:
            handle.write(json.dumps({"id": request.id, "prompt_ids": request.prompt}) + "\n")
    print(f"online: wrote {len(requests)} requests to {path}", file=sys.stderr)


def strategy_options(config: dict[str, Any], target: Any) -> dict[str, Any]:
    """The strategy's keyword options from the config; with `vocab_swap` the target's end ids
    are protected, so a grown draft vocabulary never evicts the end of an answer."""
    options = {k: v for k, v in config["strategy"].items() if k != "name"}
    if options.get("vocab_swap"):
        options["protected_ids"] = list(target.eos_token_ids)
    return options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-spec online", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--strategy", default=None, help="override strategy.name")
    parser.add_argument("--seed", type=int, default=None, help="override the stream seed")
    parser.add_argument("--out-dir", default=None, help="override out_dir")
    parser.add_argument(
        "--engine", choices=("ours", "vllm"), default=None,
        help="who serves: our decoder (default) or vLLM's CPU build, the drafter pushed into it "
        "after each update (override engine)",
    )  # fmt: skip
    parser.add_argument(
        "--stream",
        default=None,
        metavar="FILE.jsonl",
        help="serve this JSONL file's prompts, all of them, in file order (overrides stream)",
    )
    parser.add_argument(
        "--skip", type=int, default=0, help="with --stream: start after the first N prompts"
    )
    parser.add_argument(
        "--limit", type=int, default=0, help="with --stream: serve at most N prompts"
    )
    parser.add_argument(
        "--hindsight",
        type=float,
        default=None,
        metavar="FRACTION",
        help="serve nothing online: fit the strategy on the first FRACTION of the stream "
        "(replayed, --hindsight-epochs passes), then score the rest frozen (the ceiling)",
    )
    parser.add_argument("--hindsight-epochs", type=int, default=3)
    parser.add_argument(
        "--dump-stream",
        default=None,
        metavar="FILE.jsonl",
        help="serve nothing: write the config's stream (after drop_overlap) as token ids, one "
        "request a line, for `lightning-spec bench load` to send to a server, and stop",
    )
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.stream is not None:
        if not Path(args.stream).is_file():
            print(f"online: no stream file {args.stream}", file=sys.stderr)
            return 2
        overrides["stream"] = [
            {"source": args.stream, "count": args.limit, "order": "source", "skip": args.skip}
        ]
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.engine is not None:
        overrides["engine"] = args.engine
    if args.out_dir is not None:
        overrides["out_dir"] = args.out_dir
    try:
        config = load_config(args.config, overrides)
        check_engine_drafter(config)
    except ValueError as error:
        print(f"online: {error}", file=sys.stderr)
        return 2
    if args.strategy:
        config["strategy"] = {**config["strategy"], "name": args.strategy}
    import torch

    from lightning_spec import specs
    from lightning_spec.online.loop import run_stream
    from lightning_spec.online.strategies import make_strategy
    from lightning_spec.online.stream import build_stream
    from lightning_spec.tracking import make_mlflow_logger

    torch.set_num_threads(int(config["threads"]))
    target = specs.resolve_target(config["target"], "fp32")
    drafter = specs.resolve_drafter(str(config["drafter"]), target)
    if config["prepack"]:
        from lightning_spec.models.packed import prepack_where_possible

        prepack_where_possible({"target": target.model}, who="online")
    guard = None
    exclude: set[tuple[str, str]] = set()
    if config.get("guard"):
        from lightning_spec.online.loop import SafetyGuard

        spec = dict(config["guard"])
        source = str(spec.get("source", "mtbench"))
        _, probe = specs.load_prompts(
            source, target.tokenizer, int(spec.get("prompts", 4)), "first"
        )
        exclude = {(source, str(meta.get("id"))) for _, meta in probe}  # held out of the stream
        guard = SafetyGuard(
            prompts=[ids for ids, _ in probe],
            margin=float(spec.get("margin", 0.05)),
            max_new_tokens=int(spec.get("max_new_tokens", 32)),
        )
    segments = stream_segments(config)
    requests = build_stream(target.tokenizer, segments, seed=int(config["seed"]), exclude=exclude)
    problem = check_stream_is_new(config, requests, Path(config["out_dir"]))
    if problem:
        print(f"online: {problem}", file=sys.stderr)
        return 2
    if args.dump_stream:
        dump_stream(requests, Path(args.dump_stream))
        return 0
    continuations = None
    if config.get("replay") or config.get("live_check"):
        # T = 0: answers generated once in batches; every strategy replays them (replay) or
        # decodes live and is checked against them (live_check)
        from lightning_spec.online.continuations import stream_continuations

        cache = config.get("replay_cache") or Path(config["out_dir"]).parent / "continuations.jsonl"
        continuations = stream_continuations(
            target,
            requests,
            max_new_tokens=int(config["max_new_tokens"]),
            cache=cache,
            batch_size=int(config.get("replay_batch", 32)),
        )
    try:
        options = strategy_options(config, target)
        strategy = make_strategy(str(config["strategy"]["name"]), drafter, **options)
    except (TypeError, ValueError) as error:  # unknown strategy or option: named, no run made
        print(f"online: strategy: {error}", file=sys.stderr)
        return 2
    out = Path(config["out_dir"])
    if args.hindsight is not None and continuations is None:
        print("online: --hindsight replays the stream's greedy answers: set replay: true",
              file=sys.stderr)  # fmt: skip
        return 2
    run_name = strategy.name if args.hindsight is None else f"hindsight-{strategy.name}"
    logger = make_mlflow_logger(str(config["experiment"]), out, run_name=run_name)
    logger.log_hyperparams({k: json.dumps(v) if isinstance(v, (list, dict)) else v
                            for k, v in config.items()})  # fmt: skip
    if args.hindsight is not None:
        from lightning_spec.online.hindsight import run_hindsight

        try:
            rows = run_hindsight(
                target, strategy, specs.resolve_tree(str(config["tree"])), requests,
                continuations, out_dir=out, fraction=args.hindsight,
                epochs=args.hindsight_epochs, round_size=int(config["round_size"]),
                max_new_tokens=int(config["max_new_tokens"]), logger=logger,
            )  # fmt: skip
        except ValueError as error:
            print(f"online: {error}", file=sys.stderr)
            return 2
    else:
        engine = None
        if config["engine"] == "vllm":
            engine = start_vllm_engine(config, out)
        try:
            rows = run_stream(
                target,
                strategy,
                specs.resolve_tree(str(config["tree"])),
                requests,
                out_dir=out,
                round_size=int(config["round_size"]),
                max_new_tokens=int(config["max_new_tokens"]),
                logger=logger,
                guard=guard,
                regret_window=int(config.get("regret_window", 0)),
                record_feedback=bool(config.get("record_feedback", False)),
                continuations=continuations,
                update_every=int(config.get("update_every", 1)),
                replay=bool(config.get("replay")),
                update_beside=bool(config.get("update_beside", False)),
                engine=engine,
            )
        finally:
            if engine is not None:
                engine.close()
    logger.finalize("success")
    taus = [r["tau"] for r in rows if r["tau"] == r["tau"]]
    print(
        f"{run_name}: {len(rows)} requests, prequential tau "
        f"{sum(taus) / max(1, len(taus)):.3f}; rounds in {out / 'rounds.jsonl'}"
    )
    checked = [r["greedy_match"] for r in rows if "greedy_match" in r]
    if checked:
        mismatches = checked.count(False)
        print(f"{run_name}: live check, {mismatches} of {len(checked)} outputs differ from "
              f"the target's greedy answer")  # fmt: skip
        if mismatches:
            return 1
    return 0
