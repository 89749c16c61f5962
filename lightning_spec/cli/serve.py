"""`lightning-spec serve`: serve a drafter over HTTP, in our decoder or behind `vllm serve`.

``--engine vllm`` starts the real ``vllm serve`` (the OpenAI chat and completions API, streaming,
concurrent clients) with the drafter as its speculative model and our plugin
(`online.vllm_server`): ``--spool DIR`` keeps the target's features of every finished request
there for a learner, ``--push-root DIR`` accepts drafter pushes from that folder
(``POST /lightning-spec/push``). It binds 127.0.0.1 unless ``--host`` says otherwise.

    lightning-spec serve --engine vllm --drafter runs/quickstart/drafter/best --port 8000

The default engine (``decoder``) loads the target and a drafter, wraps them in `online.http.OnlineServer` with an online
strategy (`online.strategies`: frozen, ogd, optimistic, ensemble, osd, dpo) and serves it with
uvicorn. Every `--round-size` greedy requests the drafter is updated (charged to serving: the
next request waits) and published as a drafter folder under `--out-dir/drafters/`.

    lightning-spec serve --drafter DIR --strategy ogd --port 8000
    curl -s localhost:8000/v1/completions -d '{"prompt": "def add(a, b):", "max_tokens": 32}' \\
        -H 'content-type: application/json'
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["build_server", "main", "resolve_paths"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-spec serve", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", required=True, help="drafter folder (or random/self)")
    parser.add_argument("--tree", default="dynamic:6,10,32")
    parser.add_argument("--strategy", default="frozen")
    parser.add_argument("--strategy-options", default="{}", help='JSON, e.g. {"lr": 1e-4}')
    parser.add_argument("--round-size", type=int, default=25)
    parser.add_argument("--out-dir", default="runs/serve")
    parser.add_argument("--prepack", action="store_true", help="CPU fp32 fast path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    vllm = parser.add_argument_group("--engine vllm")
    parser.add_argument("--engine", choices=("decoder", "vllm"), default="decoder",
                        help="decoder: our decoder, learning online (--strategy); vllm: vllm serve")  # fmt: skip
    vllm.add_argument("--k", type=int, default=3, help="drafts per step")
    vllm.add_argument("--method", default="eagle3", choices=("eagle3", "dflash", "ngram", "plain"),
                      help="ngram: vLLM's drafter-free proposer; plain: no speculation (the "
                      "drafter is then not read)")  # fmt: skip
    vllm.add_argument("--learn", default=None, metavar="CONFIG",
                      help="keep the drafter learning from what it serves: an online config "
                      "(configs/online/; its strategy and round_size)")  # fmt: skip
    vllm.add_argument("--spool", default=None, help="capture served requests' features here")
    vllm.add_argument("--push-root", default=None, help="accept pushes of drafters under here")
    vllm.add_argument("--max-model-len", type=int, default=2048)
    vllm.add_argument(
        "--vllm-python", default=None, help="another vLLM's interpreter (a GPU build)"
    )
    return parser


def resolve_paths(args: argparse.Namespace) -> argparse.Namespace:
    """The drafter folder and `--out-dir` as absolute paths, before anything is loaded: the
    folders the server publishes (``drafter_folder`` in its stats) are read by other processes
    (an engine loading the latest drafter), where a relative path means nothing. ``random``,
    ``self`` and ``bigram:...`` are not folders and stay as given."""
    if args.drafter not in ("random", "self") and not args.drafter.startswith("bigram:"):
        args.drafter = str(Path(args.drafter).expanduser().resolve())
    args.out_dir = str(Path(args.out_dir).expanduser().resolve())
    for name in ("spool", "push_root"):
        if getattr(args, name, None):
            setattr(args, name, str(Path(getattr(args, name)).expanduser().resolve()))
    return args


def build_server(args: argparse.Namespace):  # noqa: ANN201 - OnlineServer (lazy import)
    import torch

    from lightning_spec import specs
    from lightning_spec.online.http import OnlineServer
    from lightning_spec.online.strategies import make_strategy

    torch.set_num_threads(args.threads)
    target = specs.resolve_target(args.target, "fp32")
    drafter = specs.resolve_drafter(args.drafter, target)
    if args.prepack:
        from lightning_spec.models.packed import prepack_where_possible

        prepack_where_possible({"target": target.model}, who="serve")
    strategy = make_strategy(args.strategy, drafter, **json.loads(args.strategy_options))
    return OnlineServer(
        target,
        strategy,
        specs.resolve_tree(args.tree),
        round_size=args.round_size,
        out_dir=args.out_dir,
        model_name=str(target.name),
    )


def serve_vllm(args: argparse.Namespace) -> int:
    """``vllm serve`` with the drafter and our plugin, until interrupted (Ctrl-C or SIGTERM)."""
    import signal
    import time
    from contextlib import closing

    from lightning_spec.bench.engines import engine_drafter
    from lightning_spec.bench.vllm import target_folder
    from lightning_spec.online.vllm_server import VllmServer, serve_command
    from lightning_spec.tools.vllm import VllmEnv, ensure_vllm

    drafter = None if args.method in ("ngram", "plain") else engine_drafter(args.drafter, "vLLM")[0]
    env = VllmEnv.external(args.vllm_python) if args.vllm_python else ensure_vllm()
    command = serve_command(
        env, target_folder(args.target), drafter, method=args.method, k=args.k, host=args.host,
        port=args.port, max_model_len=args.max_model_len,
    )  # fmt: skip
    out = Path(args.out_dir)
    if args.learn and drafter is None:
        raise ValueError(f"--learn needs a drafter to learn: --method {args.method} has none")
    learn = _learn_config(args.learn) if args.learn else None
    if learn is not None:  # the learner reads the spool and pushes from its own folder
        args.spool = args.spool or str(out / "spool")
        args.push_root = str(out / "learner")
    # the learner's models load before the server starts: loading them beside the first
    # requests would slow those requests down
    learner = _make_learner(args, learn, drafter) if learn is not None else None
    print(f"starting vllm serve on {args.host}:{args.port} (log: {out / 'vllm.log'})", flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    with closing(VllmServer(env, command, log=out / "vllm.log", workdir=out, spool=args.spool,
                    push_root=args.push_root)) as server:  # fmt: skip
        print(f"ready: {server.url}/v1 (status: {server.url}/lightning-spec/status)", flush=True)

        def done() -> bool:
            return stop["now"] or server.process.poll() is not None

        try:
            if learner is not None:
                learner(server.url, done)
            while not done():
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
        code = server.process.poll()
    return 0 if code is None else int(code or 1)


LEARN_KEYS = {"strategy", "round_size", "rollback_margin", "keep_drafters", "keep_learned",
              "schedule"}  # fmt: skip
SCHEDULE_KEYS = {"growth", "max_gap", "drift_margin"}


def _learn_config(path: str) -> dict:
    """The learner's config, checked before the server starts (fields named on error): an
    `online` config (configs/online/) whose strategy and round_size it takes, plus
    rollback_margin, keep_drafters, keep_learned and ``schedule: {growth, max_gap,
    drift_margin}`` (`online.learner.UpdateSchedule`). The replay drafts the server's chain of
    --k; the stream, tree and engine fields are the server's business here."""
    import yaml

    from lightning_spec.cli.online import KEYS
    from lightning_spec.online.learner import UpdateSchedule

    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read the learner config {path}: {error}") from error
    known = LEARN_KEYS | KEYS
    if not isinstance(config, dict) or set(config) - known:
        raise ValueError(
            f"{path}: unknown keys {sorted(set(config) - known)}; known: {sorted(known)}"
        )
    strategy = config.get("strategy")
    if not isinstance(strategy, dict) or not isinstance(strategy.get("name"), str):
        raise ValueError(
            f"{path}: strategy must be a mapping with a name (e.g. {{name: ogd, lr: 2.0e-4}})"
        )
    if int(config.get("round_size", 40)) < 1:
        raise ValueError(f"{path}: round_size must be >= 1")
    schedule = config.get("schedule", {})
    if not isinstance(schedule, dict) or set(schedule) - SCHEDULE_KEYS:
        raise ValueError(f"{path}: schedule must be a mapping of {sorted(SCHEDULE_KEYS)}")
    try:
        UpdateSchedule(**schedule)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: schedule: {error}") from error
    return config


def _make_learner(args: argparse.Namespace, config: dict, drafter: Path):  # noqa: ANN202
    """The learner beside the server (`online.learner`), loaded: call it with the server's URL
    and a `done()` to learn until `done()`."""
    import torch

    from lightning_spec import specs
    from lightning_spec.cli.online import strategy_options
    from lightning_spec.online.learner import LearnerSettings, http_push, run_learner
    from lightning_spec.online.spool import SpoolReader
    from lightning_spec.online.strategies import make_strategy

    torch.set_num_threads(args.threads)
    target = specs.resolve_target(args.target, "fp32")
    strategy = make_strategy(config["strategy"]["name"], specs.resolve_drafter(str(drafter), target),
                             **strategy_options(config, target))  # fmt: skip
    settings = LearnerSettings(
        Path(args.push_root), round_size=int(config.get("round_size", 40)),
        rollback_margin=float(config.get("rollback_margin", 0.1)),
        keep_drafters=int(config.get("keep_drafters", 3)),
        keep_learned=bool(config.get("keep_learned", False)),
        update_growth=float(config.get("schedule", {}).get("growth", 1.0)),
        max_gap=int(config.get("schedule", {}).get("max_gap", 8)),
        drift_margin=float(config.get("schedule", {}).get("drift_margin", 0.1)),
    )  # fmt: skip
    # the replay must draft as the server does: vLLM drafts a chain of --k, whatever the config says
    policy = specs.resolve_tree(f"chain:{args.k}")

    def learn(url: str, done) -> None:  # noqa: ANN001
        print(f"learning: {strategy.name}, rounds of {settings.round_size} served requests",
              flush=True)  # fmt: skip
        run_learner(
            target, strategy, policy, SpoolReader(args.spool), http_push(url), settings, stop=done
        )

    return learn


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = resolve_paths(parser.parse_args(argv))
    if args.engine == "vllm":
        try:
            return serve_vllm(args)
        except ValueError as error:  # a bad drafter or target folder, before vLLM starts
            parser.error(str(error))
    import uvicorn

    from lightning_spec.online.http import make_app

    app = make_app(build_server(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
