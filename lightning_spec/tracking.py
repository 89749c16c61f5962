"""MLflow tracking defaults: a SQLite store beside the run folders, artifacts in a known place.

MLflow 3 refuses its old file store, and an experiment created without `artifact_location`
puts artifacts relative to the current directory (STACK.md). So by default every run folder
`<root>/<run>` shares `<root>/mlflow.db` (SQLite, absolute path) and `<root>/mlartifacts/`;
`MLFLOW_TRACKING_URI`, when set, wins (a server then decides where artifacts go). `mlflow`
itself is imported only when a logger first talks to the store (~5 s import).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger

__all__ = [
    "SpecMLFlowLogger",
    "default_artifact_location",
    "default_tracking_uri",
    "make_mlflow_logger",
]

TRACKING_ENV = "MLFLOW_TRACKING_URI"


def _run_root(run_dir: str | Path) -> Path:
    return Path(run_dir).expanduser().resolve().parent


def default_tracking_uri(run_dir: str | Path) -> str:
    """`$MLFLOW_TRACKING_URI`, else `sqlite:////<abs parent of run_dir>/mlflow.db`."""
    env = os.environ.get(TRACKING_ENV)
    if env:
        return env
    root = _run_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)  # SQLite creates the file, not its folder
    return f"sqlite:///{root / 'mlflow.db'}"


def _is_local(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("sqlite:", "file:")) or "://" not in tracking_uri


def default_artifact_location(
    run_dir: str | Path, experiment_name: str, tracking_uri: str
) -> str | None:
    """`file://<abs parent of run_dir>/mlartifacts/<experiment>` for local stores; None (the
    server's choice) for remote ones."""
    if not _is_local(tracking_uri):
        return None
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment_name).strip("_") or "default"
    return (_run_root(run_dir) / "mlartifacts" / safe).as_uri()


class SpecMLFlowLogger(MLFlowLogger):
    """Lightning's MLFlowLogger with this project's defaults (see the module docstring).

    Usable from a LightningCLI config: `class_path: lightning_spec.tracking.SpecMLFlowLogger`.
    """

    def __init__(
        self,
        experiment_name: str = "lightning-spec",
        run_dir: str = "runs/default",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, Any] | None = None,
        log_model: bool = False,
        run_id: str | None = None,
    ) -> None:
        """
        Args:
            experiment_name: MLflow experiment (created on first use).
            run_dir: This run's folder; the store and artifacts sit in its parent.
            run_name: MLflow run name (default: the run folder's name).
            tracking_uri: Explicit store URI; default `$MLFLOW_TRACKING_URI` or the SQLite file.
            tags: Extra run tags.
            log_model: Log Lightning checkpoints as artifacts (Lightning's option).
            run_id: Continue this existing run (resuming a job) instead of starting one.
        """
        uri = tracking_uri or default_tracking_uri(run_dir)
        super().__init__(
            experiment_name=experiment_name,
            run_name=run_name or Path(run_dir).name,
            tracking_uri=uri,
            tags=tags,
            log_model=log_model,
            artifact_location=default_artifact_location(run_dir, experiment_name, uri),
            run_id=run_id,
        )
        self.run_dir = str(Path(run_dir).expanduser().resolve())

    @property
    def save_dir(self) -> str:
        """The run folder: `trainer.log_dir` reads it, and LightningCLI saves the resolved
        config there (MLflow's own save_dir is None for a database store, which stops the CLI)."""
        return self.run_dir


def make_mlflow_logger(
    experiment_name: str,
    run_dir: str | Path,
    run_name: str | None = None,
    *,
    tracking_uri: str | None = None,
    tags: dict[str, Any] | None = None,
) -> SpecMLFlowLogger:
    """An MLflow logger whose store and artifact location never depend on the cwd."""
    return SpecMLFlowLogger(
        experiment_name=experiment_name,
        run_dir=str(run_dir),
        run_name=run_name,
        tracking_uri=tracking_uri,
        tags=tags,
    )
