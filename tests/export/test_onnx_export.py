"""Drafter step -> ONNX: signatures, dynamic sizes (batch 1, one token, empty past) and parity.

The parity chain: random inputs at several sizes, the decoder's own rollout inputs, and the
`SpeculativeDecoder` itself, run once with the PyTorch drafter and once with the ONNX graphs
(`OnnxEagle3Drafter` + `OnnxTreeVerifier`), for chain and dynamic trees.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from lightning_spec.export import parity
from lightning_spec.export.onnx import (
    FC_FILE,
    STEP_DERIVED_DIMS,
    STEP_FILE,
    STEP_INPUTS,
    STEP_OUTPUTS,
    export_drafter,
    export_step_graph,
    graph_io,
)
from lightning_spec.export.verify_graph import VERIFY_FILE, export_verify_graph
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config

TOL = 1e-4


def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny target, an EAGLE-3 drafter over it and its exported graphs.

    The export folder lives under the session's base temp directory, so modules that need the
    same graphs (this one and test_trt_compat) export once per session.
    """
    target = TargetModel.from_config(tiny_config("llama"), seed=11)
    counts = torch.arange(128).flip(0)  # low ids most frequent: a reduced vocabulary of 48
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=48, token_counts=counts, seed=3)
    folder = tmp_path_factory.getbasetemp() / "tiny-onnx-export"
    if not (folder / ".complete").exists():
        folder.mkdir(parents=True, exist_ok=True)
        drafter.save_pretrained(folder / parity.DRAFTER_FOLDER)
        specs = export_drafter(drafter, folder)
        specs["tree_verify"] = export_verify_graph(folder / VERIFY_FILE, max_nodes=64)
        (folder / ".complete").write_text("\n".join(sorted(specs)))
    return {"target": target, "drafter": drafter, "folder": folder}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Decoding alternates small torch and onnxruntime kernels; on shared, oversubscribed CI
    cores multi-threaded small GEMMs ran ~20x slower than single-threaded ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return tiny_export(tmp_path_factory)


@pytest.fixture(scope="module")
def onnx_drafter(exported: dict) -> parity.OnnxEagle3Drafter:
    return parity.OnnxEagle3Drafter.from_export_dir(exported["folder"], threads=1)


def test_step_graph_signature(exported: dict) -> None:
    path = exported["folder"] / STEP_FILE
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain: o.version for o in model.opset_import}[""] >= 18
    inputs, outputs = graph_io(model)
    assert [t.name for t in inputs] == list(STEP_INPUTS)
    assert [t.name for t in outputs] == list(STEP_OUTPUTS)
    shapes = {t.name: t.shape for t in inputs + outputs}
    config = exported["drafter"].config
    hidden, kv, head = config["hidden_size"], config["num_key_value_heads"], config["head_dim"]
    assert shapes["input_ids"] == ["batch", "tokens"]
    assert shapes["hidden_in"] == ["batch", "tokens", hidden]
    assert shapes["past_keys"] == ["batch", kv, "past", head]
    assert shapes["attention_mask"] == ["batch", "tokens", "kv_length"]
    assert shapes["logits"] == ["batch", "tokens", 48]
    assert shapes["present_values"] == ["batch", kv, "kv_length", head]
    assert {t.name: t.dtype for t in inputs}["attention_mask"] == "bool"
    assert STEP_DERIVED_DIMS == {"kv_length": "past + tokens"}
    # external_data=False: everything in one file, no side files next to it.
    assert not any(p.suffix == ".data" for p in exported["folder"].iterdir())


def test_fc_graph_signature(exported: dict) -> None:
    inputs, outputs = graph_io(exported["folder"] / "fc.onnx")
    assert inputs[0].shape == ["batch", "tokens", exported["drafter"].fc.in_features]
    assert outputs[0].shape == ["batch", "tokens", exported["drafter"].config["hidden_size"]]


def test_random_parity_includes_batch1_token1_empty_past(exported: dict) -> None:
    cases = [(1, 1, 0), (1, 1, 1), (1, 5, 0), (2, 1, 6), (3, 4, 2), (2, 7, 11)]
    result = parity.step_parity(exported["drafter"], exported["folder"], cases=cases)
    assert [(c["batch"], c["tokens"], c["past"]) for c in result["cases"]] == cases
    assert result["max_abs_diff"] < TOL, result
    assert result["argmax_agreement"] == 1.0
    for case in result["cases"]:
        assert set(case["max_abs_diff"]) == {
            "logits",
            "hidden_out",
            "present_keys",
            "present_values",
            "fc_hidden",
        }


def test_rollout_parity(exported: dict, onnx_drafter: parity.OnnxEagle3Drafter) -> None:
    result = parity.rollout_parity(exported["drafter"], onnx_drafter, steps=10)
    assert result["max_abs_diff"] < TOL
    assert result["argmax_agreement"] == 1.0


def test_rollout_parity_on_target_features(
    exported: dict, onnx_drafter: parity.OnnxEagle3Drafter
) -> None:
    target = exported["target"]
    ids = torch.arange(3, 15).unsqueeze(0)
    features = target(ids, use_cache=False).features
    result = parity.rollout_parity(
        exported["drafter"], onnx_drafter, features=features[:, :-1], prompt_ids=ids[:, 1:]
    )
    assert result["real_features"] and result["max_abs_diff"] < TOL
    assert result["argmax_agreement"] == 1.0


def test_onnx_drafter_matches_interface(
    exported: dict, onnx_drafter: parity.OnnxEagle3Drafter
) -> None:
    drafter = exported["drafter"]
    assert onnx_drafter.needs_features and onnx_drafter.draft_vocab_size == 48
    assert torch.equal(onnx_drafter.d2t, drafter.d2t)
    logprobs = torch.log_softmax(torch.randn(3, 48), dim=-1)
    assert torch.equal(onnx_drafter.to_target(logprobs), drafter.to_target(logprobs))
    ids = torch.arange(128)
    assert torch.equal(onnx_drafter.target_to_draft_ids(ids), drafter.target_to_draft_ids(ids))
    # Default (causal) mask, then state surgery: same results as the PyTorch drafter.
    features = torch.randn(1, 6, drafter.fc.in_features)
    ids, positions = torch.arange(6).unsqueeze(0) + 5, torch.arange(6).unsqueeze(0)
    torch_state, onnx_state = drafter.new_state(), onnx_drafter.new_state()
    with torch.no_grad():
        expected = drafter.step(torch_state, ids, positions, features=features)
    got = onnx_drafter.step(onnx_state, ids, positions, features=features)
    assert (expected.logits - got.logits).abs().max() < TOL
    drafter.keep_state_entries(torch_state, 4, [0, 2])
    onnx_drafter.keep_state_entries(onnx_state, 4, [0, 2])
    assert onnx_drafter.state_length(onnx_state) == drafter.state_length(torch_state) == 4
    assert (torch_state.keys - onnx_state.keys).abs().max() < TOL
    drafter.truncate_state(torch_state, 3)
    onnx_drafter.truncate_state(onnx_state, 3)
    assert (torch_state.values - onnx_state.values).abs().max() < TOL
    with pytest.raises(ValueError, match="exactly one"):
        onnx_drafter.step(onnx_state, ids, positions)


def test_onnx_drafter_batch_with_shared_tree_mask(
    exported: dict, onnx_drafter: parity.OnnxEagle3Drafter
) -> None:
    """Batch 2 with a [1, T, P + T] mask broadcast over the batch, on the hidden stream."""
    drafter = exported["drafter"]
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 3, drafter.config["hidden_size"], generator=generator)
    ids = torch.randint(0, 128, (2, 3), generator=generator)
    positions = torch.arange(3).unsqueeze(0)  # [1, T]: shared positions
    mask = parity.random_tree_mask(1, 3, 0, generator)
    with torch.no_grad():
        expected = drafter.step(
            drafter.new_state(), ids, positions.expand(2, -1), hidden=hidden, mask=mask
        )
    got = onnx_drafter.step(onnx_drafter.new_state(), ids, positions, hidden=hidden, mask=mask)
    assert (expected.logits - got.logits).abs().max() < TOL
    assert (expected.hidden - got.hidden).abs().max() < TOL


def test_decoder_with_onnx_drafter_and_verifier_matches_pytorch(
    exported: dict, onnx_drafter: parity.OnnxEagle3Drafter
) -> None:
    pytest.importorskip("lightning_spec.decoding.engine")
    verifier = parity.OnnxTreeVerifier.from_export_dir(exported["folder"])
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (7,), generator=generator).tolist()]
    result = parity.decode_parity(
        exported["target"],
        exported["drafter"],
        onnx_drafter,
        verifier,
        prompts,
        policies=("chain:3", "dynamic:3,3,8"),
        max_new_tokens=16,
    )
    assert result["tokens_equal"] and result["trees_equal"], result["runs"]
    assert result["accept_lengths_equal"]
    assert all(run["new_tokens"] == 16 for run in result["runs"])


def test_export_rejects_other_drafters(tmp_path: Path) -> None:
    from lightning_spec.models.drafters.standalone import StandaloneDrafter

    target = TargetModel.from_config(tiny_config("llama", num_layers=2))
    with pytest.raises(TypeError, match="Eagle3Drafter"):
        export_step_graph(StandaloneDrafter.from_model(target.model), tmp_path / "x.onnx")


def test_export_refuses_old_opsets(exported: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="opset"):
        export_step_graph(exported["drafter"], tmp_path / "x.onnx", opset=17)


# ----------------------------------------------------------------------------- real SmolLM2
def _mtbench_prompts(target: TargetModel, count: int) -> list[list[int]]:
    try:
        from lightning_spec.data.sources import MTBenchSource

        source = MTBenchSource(limit=count)
        conversations = [source[i].messages for i in range(count)]
    except Exception as error:  # MT-Bench asset missing or sources not available yet
        pytest.skip(f"MT-Bench prompts unavailable: {type(error).__name__}: {error}")
    prompts = []
    for messages in conversations:
        ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if not isinstance(ids, list):  # a BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        prompts.append([int(i) for i in ids])
    return prompts


@pytest.mark.slow
def test_smollm2_drafter_onnx_decode_equals_pytorch(tmp_path: Path) -> None:
    try:
        target = TargetModel.from_pretrained("smollm2")
    except Exception as error:
        pytest.skip(f"SmolLM2 target unavailable: {type(error).__name__}: {error}")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=8192).float().eval()
    specs = export_drafter(drafter, tmp_path)
    export_verify_graph(tmp_path / VERIFY_FILE, max_nodes=256)
    drafter.save_pretrained(tmp_path / parity.DRAFTER_FOLDER)
    for spec in specs.values():
        onnx.checker.check_model(str(tmp_path / spec.file), full_check=True)
    random_result = parity.step_parity(drafter, tmp_path, cases=[(1, 1, 0), (1, 8, 16)])
    assert random_result["max_abs_diff"] < 1e-3
    onnx_drafter = parity.OnnxEagle3Drafter.from_export_dir(tmp_path, threads=1)
    verifier = parity.OnnxTreeVerifier.from_export_dir(tmp_path)
    prompts = _mtbench_prompts(target, 5)
    result = parity.decode_parity(
        target,
        drafter,
        onnx_drafter,
        verifier,
        prompts,
        policies=("dynamic:4,4,16",),
        max_new_tokens=32,
    )
    assert result["tokens_equal"], result["runs"]
    assert result["trees_equal"] and result["accept_lengths_equal"], result["runs"]
    assert np.mean([run["new_tokens"] for run in result["runs"]]) == 32


def test_eagle31_feature_norms_are_exported(tmp_path: Path) -> None:
    """An EAGLE-3.1 drafter (per-layer feature norms before `fc`): the feature graph carries
    the norms, and onnxruntime matches PyTorch on fused features of very different scales."""
    target = TargetModel.from_config(tiny_config("llama", num_layers=4), seed=5)
    drafter = Eagle3Drafter.from_target(target, feature_norm=True, seed=1)
    with torch.no_grad():
        for norm in drafter.feature_norms:
            norm.weight.uniform_(0.5, 1.5)
    export_drafter(drafter, tmp_path)
    result = parity.step_parity(drafter, tmp_path, cases=[(1, 1, 0), (2, 3, 4)])
    assert result["max_abs_diff"] < TOL, result
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / FC_FILE), providers=["CPUExecutionProvider"])
    features = torch.randn(1, 4, drafter.fc.in_features)
    features[..., : target.hidden_size] *= 1e3
    (out,) = session.run(None, {"features": features.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), drafter.fuse(features).detach(), atol=1e-4, rtol=1e-4)
