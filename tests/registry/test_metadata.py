"""Registry metadata: keys, tags, the model card, and clear errors for bad drafter folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.registry import (
    drafter_metadata,
    metadata_tags,
    model_card,
    model_uri,
    prompt_set_label,
    tau_key,
)


def test_keys_and_labels() -> None:
    assert tau_key("mtbench", 0) == "tau/mtbench/T0"
    assert tau_key("mtbench-20", 0.7) == "tau/mtbench-20/T0.7"
    with pytest.raises(ValueError, match="without '/'"):
        tau_key("a/b", 0)
    assert prompt_set_label("mtbench") == "mtbench"
    assert prompt_set_label("mtbench", 20) == "mtbench-20"
    assert prompt_set_label("mtbench", 20, "first") == "mtbench-first20"
    assert prompt_set_label("/data/My Chats.v2.jsonl", 5) == "my-chats-5"
    assert model_uri("m") == "models:/m@champion"
    assert model_uri("m", "challenger") == "models:/m@challenger"
    assert model_uri("m", version=3) == "models:/m/3"
    assert model_uri("models:/m@x") == "models:/m@x"


def test_eagle3_metadata(target: TargetModel, tmp_path: Path) -> None:
    counts = torch.arange(128, dtype=torch.float)
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=40, token_counts=counts)
    folder = drafter.save_pretrained(tmp_path / "best")
    (folder / "training_state.json").write_text(json.dumps({"global_step": 7}))
    metadata = drafter_metadata(
        folder,
        taus={"tau/mtbench/T0": 2.345678912, ("humaneval", 0.7): 1.5, ("x", 0): float("nan")},
        objective="sft",
        tree="chain:4",
        max_new_tokens=64,
        commit="abc123",
    )
    assert metadata == {
        "drafter_type": "eagle3",
        "target_model": "tiny-llama",
        "target_layer_ids": list(target.feature_layers),
        "draft_vocab_size": 40,
        "target_vocab_size": 128,
        "tree": "chain:4",
        "max_new_tokens": 64,
        "objective": "sft",
        "git_commit": "abc123",
        "training_step": 7,
        "tau/mtbench/T0": 2.345679,
        "tau/humaneval/T0.7": 1.5,
    }  # the NaN figure is left out
    tags = metadata_tags(metadata)
    assert tags["target_layer_ids"] == json.dumps(list(target.feature_layers))
    assert tags["tau/mtbench/T0"] == "2.345679" and tags["draft_vocab_size"] == "40"
    card = model_card("tiny-eagle", metadata)
    assert "# tiny-eagle: a eagle3 drafter" in card and "`tiny-llama`" in card
    assert "| mtbench | 0 | 2.346 |" in card and "| humaneval | 0.7 | 1.500 |" in card
    assert 'load_registered_drafter("models:/tiny-eagle@champion")' in card


def test_standalone_metadata_and_defaults(folders: dict[str, Path]) -> None:
    metadata = drafter_metadata(folders["self"], target="override")
    assert metadata["drafter_type"] == "standalone" and metadata["target_model"] == "override"
    assert "target_layer_ids" not in metadata and "tree" not in metadata
    assert metadata["target_vocab_size"] == metadata["draft_vocab_size"] == 128
    assert metadata["git_commit"]  # this repository's HEAD
    assert "Not measured at registration." in model_card("m", metadata)


def test_bad_folders_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        drafter_metadata(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        drafter_metadata(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not valid JSON"):
        drafter_metadata(tmp_path)
    with pytest.raises(ValueError, match="tau keys look like"):
        (tmp_path / "config.json").write_text("{}")
        drafter_metadata(tmp_path, taus={"mtbench": 1.0})


def test_importing_the_registry_imports_no_mlflow() -> None:
    """mlflow costs seconds to import: only the functions that talk to a store import it."""
    import subprocess
    import sys

    code = (
        "import sys, lightning_spec.registry, lightning_spec.registry.promotion\n"
        "print(sorted(m for m in ('mlflow', 'torch') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
