"""`lightning-spec promote`: measure a drafter, register it in MLflow, apply the promotion rule.

    lightning-spec promote --drafter runs/sft/drafter/best --model-name smollm2-eagle3 \\
        --dataset mtbench --limit 20 --tree chain:4 --temperature 0

The candidate's tau is measured with `run_bench` on the prompt set (named `mtbench-20`: dataset,
limit and selection), the folder is registered as a new version with its metadata and model
card, and the `champion` alias moves to it only when it beats the champion by more than
`--margin` under the same conditions; otherwise it becomes `challenger`. When the champion's
stored figures are for other conditions, both drafters are measured again side by side (the
candidate is then not measured on its own first). Exit status: 0 after a decision (either
outcome), 2 on a usage error (missing or invalid drafter folder, unreachable tracking server,
target that cannot be loaded, drafter built for another tokenizer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "smollm2"


class UsageError(Exception):
    """A problem the user can fix; printed without a traceback, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-spec promote",
        description=__doc__.splitlines()[0],
        epilog="The promotion rule, the metadata keys and the server setup: docs/registry.md.",
    )
    parser.add_argument("--drafter", required=True, help="drafter folder (config.json + weights)")
    parser.add_argument("--model-name", required=True, help="registered model name")
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow store: http://host:port or sqlite:////abs/mlflow.db (default "
        "$MLFLOW_TRACKING_URI, else sqlite beside ./runs)",
    )
    parser.add_argument("--margin", type=float, default=0.05, help="tau margin to take champion")
    parser.add_argument("--dataset", default="mtbench", help="mtbench, humaneval or a .jsonl")
    parser.add_argument("--limit", type=int, default=20, help="prompts (0: all)")
    parser.add_argument("--selection", default="stratified", choices=["stratified", "first"])
    parser.add_argument("--tree", default="chain:4", help="chain:K | static:NAME | dynamic:D,K,T")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--target",
        default=None,
        help="target (hub id, folder, smollm2); default the drafter config's target_model",
    )
    parser.add_argument("--objective", default=None, help="training objective, for the metadata")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experiment", default="lightning-spec-registry")
    parser.add_argument("--json", action="store_true", help="print the decision as JSON")
    return parser


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, before minutes of measuring, when the store cannot be reached."""
    if uri.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        health = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=timeout) as response:
                if response.status != 200:
                    raise UsageError(
                        f"MLflow server at {uri} answered {response.status} on /health"
                    )
        except (urllib.error.URLError, OSError) as error:
            raise UsageError(
                f"cannot reach the MLflow tracking server at {uri} ({error}). Start one "
                "(docs/registry.md) or pass --tracking-uri sqlite:////abs/path/mlflow.db"
            ) from error
    elif uri.startswith("sqlite:///"):
        folder = Path(uri[len("sqlite:///") :]).expanduser().resolve().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(
                f"cannot create the folder of the SQLite store {uri}: {error}"
            ) from error


def run(args: argparse.Namespace) -> Any:
    """The whole command; raises UsageError for problems the user can fix."""
    from lightning_spec.registry import read_drafter_config, resolve_tracking_uri

    folder = Path(args.drafter).expanduser().resolve()
    try:
        config = read_drafter_config(folder)
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(str(error)) from error
    if args.margin < 0:
        raise UsageError(f"--margin must be >= 0, got {args.margin}")
    uri = resolve_tracking_uri(args.tracking_uri)
    check_tracking_uri(uri)

    import torch
    from mlflow.exceptions import MlflowException

    from lightning_spec import specs
    from lightning_spec.registry import (
        CHAMPION,
        alias_version,
        bench_measure,
        drafter_metadata,
        promote,
        prompt_set_label,
        register_drafter,
        registry_client,
        stored_tau,
        tau_key,
    )

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target_spec = args.target or config.get("target_model") or DEFAULT_TARGET
    try:
        target = specs.resolve_target(target_spec, args.dtype)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load the target {target_spec!r}: {error}") from error
    limit = args.limit or None
    try:
        name, items = specs.load_prompts(args.dataset, target.tokenizer, limit, args.selection)
        drafter = specs.resolve_drafter(str(folder), target)
    except (OSError, ValueError) as error:
        raise UsageError(str(error)) from error
    if drafter.target_vocab_size != target.vocab_size:
        raise UsageError(
            f"{folder} drafts into a vocabulary of {drafter.target_vocab_size} tokens but the "
            f"target {target_spec!r} has {target.vocab_size}: built for another tokenizer"
        )
    prompt_set = prompt_set_label(name, limit, args.selection)
    key = tau_key(prompt_set, args.temperature)
    measure = bench_measure(
        target,
        items,
        prompt_set=prompt_set,
        tree=args.tree,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    try:
        client = registry_client(uri)
        champion = alias_version(client, args.model_name, CHAMPION)
        champion_tau = None
        if champion is not None:
            champion_tau, _ = stored_tau(champion.tags, key, args.tree, args.max_new_tokens)
        taus = None
        if champion is None or champion_tau is not None:
            # Otherwise promote() measures both side by side: no need to measure twice.
            print(f"promote: measuring {folder} on {prompt_set} ...", file=sys.stderr)
            taus = {key: measure({"candidate": drafter})["candidate"]}
        metadata = drafter_metadata(
            folder,
            taus=taus,
            objective=args.objective,
            tree=args.tree,
            max_new_tokens=args.max_new_tokens,
            target=target_spec,
            extra={"prompt_set": prompt_set, "num_prompts": len(items)},
        )
        version = register_drafter(
            folder,
            args.model_name,
            tracking_uri=uri,
            metadata=metadata,
            experiment_name=args.experiment,
        )
        decision = promote(
            args.model_name,
            version.version,
            prompt_set=prompt_set,
            temperature=args.temperature,
            tree=args.tree,
            margin=args.margin,
            max_new_tokens=args.max_new_tokens,
            tracking_uri=uri,
            run_id=version.run_id,
            measure=measure,
            target=target,
        )
        registered = client.get_registered_model(args.model_name)
        aliases = {alias: str(v) for alias, v in registered.aliases.items()}
    except MlflowException as error:
        raise UsageError(f"MLflow error at {uri}: {error}") from error
    return decision, aliases, uri


def format_decision(decision: Any, aliases: dict[str, str], uri: str) -> str:
    def tau(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    alias_text = ", ".join(f"{a} -> version {v}" for a, v in sorted(aliases.items())) or "none"
    return "\n".join(
        [
            f"{decision.model_name} version {decision.candidate_version}: {decision.outcome}",
            f"  candidate tau {tau(decision.candidate_tau)} (version {decision.candidate_version})",
            f"  champion  tau {tau(decision.champion_tau)} (version "
            f"{decision.champion_version or 'none'})",
            f"  conditions: {decision.prompt_set}, T={decision.temperature:g}, tree "
            f"{decision.tree}, margin {decision.margin:g}",
            f"  stored figures comparable: {'yes' if decision.comparable else 'no'}; "
            f"re-measured side by side: {'yes' if decision.remeasured else 'no'}",
            f"  reason: {decision.reason}",
            f"  aliases: {alias_text}",
            f"  store: {uri}",
            f"  load: load_registered_drafter('models:/{decision.model_name}@champion')",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        decision, aliases, uri = run(args)
    except UsageError as error:
        print(f"promote: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**decision.to_dict(), "aliases": aliases, "tracking_uri": uri}, indent=2))
    else:
        print(format_decision(decision, aliases, uri))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
