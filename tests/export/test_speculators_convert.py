"""Our drafter folders convert with vLLM's `speculators` package (`speculators convert`), weight
for weight. `speculators` is not a dependency (it pins transformers and pulls datasets, openai
and torchvision), so this runs where it is importable and is skipped elsewhere with that reason.
To run it: `pip install --no-deps --target DIR speculators loguru pydantic-settings typer openai
httpx httpcore anyio sniffio distro jiter h11 "datasets<=5.1.0" pyarrow dill multiprocess xxhash
fsspec hs-connectors`, then `PYTHONPATH=DIR pytest tests/export/test_speculators_convert.py`
(docs/export.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

try:  # the package's converters import its training stack too
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
except Exception as error:  # noqa: BLE001 - any import failure means: not usable here
    pytest.skip(
        f"speculators is not importable here ({type(error).__name__}: {error}); see the module "
        "docstring for how to run this check",
        allow_module_level=True,
    )
from safetensors.torch import load_file

from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


def test_an_eagle3_folder_converts_bit_equal(tmp_path: Path) -> None:
    """`speculators convert --algorithm eagle3` takes our folder as it is (no `embed_tokens`:
    vLLM shares the target's), keeps every tensor bit for bit under its own names, and carries
    the trained feature layers when given the folder's vLLM-numbered ids."""
    target = TargetModel.from_config(tiny_config("llama", num_layers=6), seed=0)
    target.model.save_pretrained(tmp_path / "target")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=64, token_counts=torch.arange(128))
    drafter.save_pretrained(tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    layers = config["eagle_aux_hidden_state_layer_ids"]  # vLLM's numbering (layer_ids.py)
    Eagle3Converter().convert(
        tmp_path / "drafter", tmp_path / "out", base_model=str(tmp_path / "target"),
        validate=True, eagle_aux_hidden_state_layer_ids=layers,
    )  # fmt: skip
    ours = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    theirs = {}
    for path in (tmp_path / "out").glob("*.safetensors"):
        theirs.update(load_file(str(path)))
    renamed = {k.replace("midlayer.", "layers.0.", 1): v for k, v in ours.items()}
    assert set(renamed) == set(theirs)
    for name, tensor in renamed.items():
        assert torch.equal(tensor, theirs[name]), name
    converted = json.loads((tmp_path / "out" / "config.json").read_text())
    assert converted["eagle_aux_hidden_state_layer_ids"] == layers
    assert converted["draft_vocab_size"] == 64
    assert converted["speculators_config"]["algorithm"] == "eagle3"
