"""`lightning-spec serve`: an OpenAI-style completion endpoint that learns online.

Loads the target and a drafter, wraps them in `online.http.OnlineServer` with an online
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
    return parser


def resolve_paths(args: argparse.Namespace) -> argparse.Namespace:
    """The drafter folder and `--out-dir` as absolute paths, before anything is loaded: the
    folders the server publishes (``drafter_folder`` in its stats) are read by other processes
    (an engine loading the latest drafter), where a relative path means nothing. ``random``,
    ``self`` and ``bigram:...`` are not folders and stay as given."""
    if args.drafter not in ("random", "self") and not args.drafter.startswith("bigram:"):
        args.drafter = str(Path(args.drafter).expanduser().resolve())
    args.out_dir = str(Path(args.out_dir).expanduser().resolve())
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


def main(argv: list[str] | None = None) -> int:
    args = resolve_paths(_parser().parse_args(argv))
    import uvicorn

    from lightning_spec.online.http import make_app

    app = make_app(build_server(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
