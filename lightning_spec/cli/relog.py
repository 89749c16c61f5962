"""`lightning-spec relog`: replay a run's MLflow mirror into an MLflow tracking store.

The command line of `lightning_spec.tracking.relog` (which records go to which run, and why
running it twice is harmless, is described there). Exit status: 0 after replaying (or, with
``--dry-run``, saying what would be sent), 1 when the store is unreachable (the mirror is left
unchanged), 2 when there is no mirror.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-spec relog", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", help="run folder holding mlflow_mirror.jsonl (or the file)")
    parser.add_argument(
        "--tracking-uri",
        help="store to write to (default: the URI each session recorded; e.g. the restarted "
        "server, or sqlite:////abs/mlflow.db to write straight into a server's database)",
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--run-id", help="replay into this existing run")
    target.add_argument(
        "--new-run", action="store_true", help="always replay into a new run (the whole session)"
    )
    parser.add_argument(
        "--experiment", help="experiment for new runs (default: the recorded experiment)"
    )
    parser.add_argument(
        "--all",
        dest="replay_all",
        action="store_true",
        help="replay every record, also those MLflow already has or a previous relog sent",
    )
    parser.add_argument("--dry-run", action="store_true", help="only say what would be sent")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lightning_spec.tracking.failures import is_unreachable_error
    from lightning_spec.tracking.relog import relog

    try:
        reports = relog(
            args.run_dir,
            tracking_uri=args.tracking_uri,
            run_id=args.run_id,
            new_run=args.new_run,
            experiment=args.experiment,
            replay_all=args.replay_all,
            dry_run=args.dry_run,
        )
    except FileNotFoundError as exc:
        print(f"lightning-spec relog: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not is_unreachable_error(exc):
            raise
        print(
            f"lightning-spec relog: the tracking store is unreachable ({exc}); nothing was "
            "lost, the mirror is unchanged: start the server or pass --tracking-uri",
            file=sys.stderr,
        )
        return 1
    if not reports:
        print("lightning-spec relog: the mirror holds no logger session")
    for report in reports:
        print(report.line(args.dry_run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
