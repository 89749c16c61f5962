"""`lightning-spec assets`: fetch, verify and list the embedded default target and datasets.

The command line of `lightning_spec.data.assets` (the cache layout, the manifests and why a
killed fetch never leaves a half file are described there). Exit status: 0 when every asset
asked for is cached and valid, 1 when one could not be fetched.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lightning_spec.data import assets

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    names = [*assets.ASSETS, assets.MODEL_KEY]
    parser = argparse.ArgumentParser(
        prog="lightning-spec assets",
        description="Fetch, verify and list the embedded default target and datasets.",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help=f"cache root (default: ${assets.CACHE_ENV}, else the user cache dir /lightning-spec)",
    )
    parser.add_argument("--force", action="store_true", help="download and rebuild everything")
    parser.add_argument(
        "--verify", action="store_true", help="re-hash every cached file against its manifest"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        choices=names,
        help=f"only these ({', '.join(names)}); 'model' is the de-quantized "
        "default target and implies smollm2",
    )
    parser.add_argument(
        "--list", action="store_true", help="only list what is cached; fetch nothing"
    )
    return parser


def _dir_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"  # pragma: no cover


def _run_cli(
    names: list[str], root: Path, force: bool, verify: bool, report: Callable[[str], None]
) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    for name in names:
        if name == assets.MODEL_KEY:
            paths[name] = assets._ensure_model(root, force=force, verify=verify)
        else:
            paths[name] = assets.fetch(name, cache_dir=root, force=force, verify=verify)
        report(name)
    return paths


def main(argv: list[str] | None = None) -> int:
    """``lightning-spec assets``: fetch/verify the cached assets and list them with sizes."""
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")

    root = assets.cache_root(args.cache_dir)
    names = list(dict.fromkeys(args.only)) if args.only else [*assets.ASSETS, assets.MODEL_KEY]
    print(f"cache root: {root}")

    def row(name: str) -> None:
        model = name == assets.MODEL_KEY
        path = assets._model_dir(root) if model else assets._asset_dir(root, name)
        manifest = assets._read_manifest(path)
        if manifest is None:
            print(f"  {name:<10} missing")
            return
        target = path if model else path / assets._spec(name).filename
        origin = (
            f"{assets.ASSETS['smollm2'].requirement} (de-quantized)"
            if model
            else f"{manifest.get('package')}=={manifest.get('version')}"
        )
        print(f"  {name:<10} {_human(_dir_size(path)):>9}  {target}  [{origin}]")

    if args.list:
        for name in names:
            row(name)
        return 0
    start = time.perf_counter()
    try:
        _run_cli(names, root, args.force, args.verify, row)
    except assets.AssetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
