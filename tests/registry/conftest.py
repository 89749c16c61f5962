"""Shared fixtures for the registry tests: tiny targets and drafter folders built in code, one
SQLite MLflow store per module (creating its tables costs seconds), and a guard that nothing
lands in the current directory (MLflow's defaults would write ./mlflow.db or ./mlruns)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.standalone import StandaloneDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 14, 3, 22, 17], [40, 41, 42, 43], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="session")
def data_helpers():  # noqa: ANN201
    """tests/data/conftest.py: the word-level chat tokenizer and tiny chat targets."""
    spec = importlib.util.spec_from_file_location("data_conftest", ROOT / "tests/data/conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return [list(p) for p in PROMPTS]


@pytest.fixture(autouse=True)
def _nothing_in_the_cwd(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    cwd = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(cwd)
    yield
    assert sorted(p.name for p in cwd.iterdir()) == [], "something was written to the cwd"


@pytest.fixture(scope="session")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the session (each test uses its own model names); experiments
    created by the registry put their artifacts beside it."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def target() -> TargetModel:
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=4)
    target.name = "tiny-llama"
    return target


@pytest.fixture(scope="module")
def folders(target: TargetModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Drafter folders: `random` (an untrained EAGLE-3 head), `random2` (another seed) and
    `self` (the target drafting for itself)."""
    root = tmp_path_factory.mktemp("drafters")
    Eagle3Drafter.from_target(target, seed=1).save_pretrained(root / "random")
    Eagle3Drafter.from_target(target, seed=2).save_pretrained(root / "random2")
    StandaloneDrafter.from_model(target.model, target_name=target.name).save_pretrained(
        root / "self"
    )
    return {name: root / name for name in ("random", "random2", "self")}
