"""Tracking defaults: the SQLite store and artifact folder sit beside the run, never the cwd."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_spec.tracking import (
    SpecMLFlowLogger,
    default_artifact_location,
    default_tracking_uri,
)


def test_default_uri_is_an_absolute_sqlite_file_beside_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = default_tracking_uri("runs/exp1")  # relative: resolved against the cwd once
    assert uri == f"sqlite:///{tmp_path}/runs/mlflow.db"
    assert uri.startswith("sqlite:////")  # four slashes: an absolute path
    assert (tmp_path / "runs").is_dir()  # SQLite creates the file, not the folder


def test_environment_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert default_tracking_uri(tmp_path / "run") == "http://127.0.0.1:5000"
    # A server chooses where artifacts go.
    assert default_artifact_location(tmp_path / "run", "exp", "http://127.0.0.1:5000") is None


def test_artifact_location_is_under_the_run_parent(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    location = default_artifact_location(tmp_path / "run", "my exp/1", uri)
    assert location == (tmp_path / "mlartifacts" / "my_exp_1").as_uri()


def test_logger_carries_the_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.loggers import MLFlowLogger

    seen: dict = {}
    # Record what reaches Lightning's logger (creating the real one opens the SQLite store).
    monkeypatch.setattr(MLFlowLogger, "__init__", lambda self, **kwargs: seen.update(kwargs))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = SpecMLFlowLogger(experiment_name="e", run_dir=str(tmp_path / "runs" / "r1"))
    assert seen["tracking_uri"] == f"sqlite:///{tmp_path}/runs/mlflow.db"
    assert seen["artifact_location"] == (tmp_path / "runs" / "mlartifacts" / "e").as_uri()
    assert seen["run_name"] == "r1" and seen["experiment_name"] == "e"
    assert logger.run_dir == str(tmp_path / "runs" / "r1")
