"""register_drafter -> load_registered_drafter round trip on a SQLite store, lossless decoding
with the loaded drafter, the model card, and the pyfunc model answering prompt strings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.models.drafters.base import load_drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.registry import (
    CARD_NAME,
    drafter_metadata,
    load_registered_drafter,
    register_drafter,
    registry_client,
)
from lightning_spec.registry.register import _fluent_uris


def _store(tracking_uri: str) -> Path:
    return Path(tracking_uri[len("sqlite:///") :]).parent


@pytest.fixture(scope="module")
def registered(folders: dict[str, Path], tracking_uri: str):  # noqa: ANN201
    metadata = drafter_metadata(
        folders["random"], taus={("toy", 0): 1.25}, objective="sft", tree="chain:3"
    )
    return register_drafter(
        folders["random"], "tiny-eagle", tracking_uri=tracking_uri, metadata=metadata
    )


def test_version_carries_the_metadata_and_the_card(registered, tracking_uri: str) -> None:  # noqa: ANN001
    client = registry_client(tracking_uri)
    version = client.get_model_version("tiny-eagle", registered.version)
    assert str(version.version) == "1" and version.status == "READY"
    tags = version.tags
    assert tags["tau/toy/T0"] == "1.25" and tags["tree"] == "chain:3"
    assert tags["drafter_type"] == "eagle3" and tags["target_model"] == "tiny-llama"
    assert tags["objective"] == "sft" and tags["git_commit"]
    assert "# tiny-eagle: a eagle3 drafter" in version.description
    # A new run in the registry experiment, artifacts beside the SQLite file, run finished.
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED"
    store = _store(tracking_uri)
    assert run.info.artifact_uri.startswith((store / "mlartifacts").as_uri())
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == [CARD_NAME]
    card = client.download_artifacts(run.info.run_id, CARD_NAME, str(store))
    assert "| toy | 0 | 1.250 |" in Path(card).read_text()


def test_load_by_alias_decodes_losslessly(
    registered,  # noqa: ANN001
    tracking_uri: str,
    target: TargetModel,
    folders: dict[str, Path],
    prompts: list[list[int]],
    tmp_path: Path,
) -> None:
    client = registry_client(tracking_uri)
    client.set_registered_model_alias("tiny-eagle", "champion", registered.version)
    drafter = load_registered_drafter("models:/tiny-eagle@champion", tracking_uri=tracking_uri)
    reference = load_drafter(folders["random"])
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(drafter.state_dict()[name], tensor)
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec("chain:3"))
    for prompt in prompts:
        expected = autoregressive_generate(target, prompt, 12, stop_on_eos=False)
        assert decoder.generate(prompt, 12, stop_on_eos=False).tokens == expected
    # Name + alias, and a kept download folder holding the drafter files.
    again = load_registered_drafter(
        "tiny-eagle", "champion", tracking_uri=tracking_uri, dst_path=tmp_path / "dl"
    )
    assert type(again).__name__ == "Eagle3Drafter"
    weights = list((tmp_path / "dl").rglob("model.safetensors"))
    assert len(weights) == 1 and weights[0].parent.name == "random"
    with pytest.raises(LookupError, match="challenger"):
        load_registered_drafter("tiny-eagle", "challenger", tracking_uri=tracking_uri)


def test_register_into_an_existing_run_keeps_its_status(
    folders: dict[str, Path], tracking_uri: str
) -> None:
    client = registry_client(tracking_uri)
    experiment = client.create_experiment(
        "training", artifact_location=(_store(tracking_uri) / "training").as_uri()
    )
    run = client.create_run(experiment)  # RUNNING, as a training run is at on_fit_end
    version = register_drafter(
        folders["self"], "tiny-self", tracking_uri=tracking_uri, run_id=run.info.run_id
    )
    assert version.run_id == run.info.run_id
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    assert "tau" not in " ".join(version.tags)  # registered without figures


def test_pyfunc_model_answers_prompt_strings(
    tracking_uri: str,
    tmp_path: Path,
    data_helpers,  # noqa: ANN001
) -> None:
    """The registered pyfunc model loads its target and returns speculative completions that
    equal the target's own greedy answers."""
    import mlflow.pyfunc
    import pandas as pd

    from lightning_spec.data.chat import render_prompt
    from lightning_spec.models.drafters.standalone import StandaloneDrafter

    helpers = data_helpers
    tokenizer = helpers.make_chat_tokenizer()
    target = helpers.make_tiny_target(tokenizer, seed=3)
    target.model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    StandaloneDrafter.from_model(target.model, target_name="tiny").save_pretrained(tmp_path / "d")
    register_drafter(
        tmp_path / "d",
        "tiny-chat",
        tracking_uri=tracking_uri,
        model_config={"target": str(tmp_path / "target"), "tree": "chain:2"},
    )
    with _fluent_uris(tracking_uri):  # mlflow.set_tracking_uri(...), restored afterwards
        model = mlflow.pyfunc.load_model("models:/tiny-chat/1")
    prompts = ["what is the sky ?", "the cat and the dog"]
    output = model.predict(pd.DataFrame({"prompt": prompts}), params={"max_new_tokens": 6})
    assert list(output.columns) == ["completion", "tau"]
    for prompt, completion, tau in zip(prompts, output["completion"], output["tau"], strict=True):
        ids = render_prompt(tokenizer, [{"role": "user", "content": prompt}])
        expected = autoregressive_generate(target, ids, 6)
        assert completion == tokenizer.decode(expected, skip_special_tokens=True).strip()
        assert tau > 1.0 or len(expected) < 3  # the target drafting for itself
    signature = model.metadata.signature
    assert signature.inputs.input_names() == ["prompt"]
    assert [p.name for p in signature.params.params] == ["max_new_tokens", "temperature", "seed"]
