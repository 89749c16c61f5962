"""``lightning-spec export`` end to end on a tiny drafter folder, MLflow logging included."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import onnx
import pytest
import torch

from lightning_spec.cli import export as export_cli
from lightning_spec.export import cli
from lightning_spec.export.tensorrt import tensorrt_available
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


@pytest.fixture(scope="module")
def mlflow_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A SQLite MLflow store (never the file store) with one open run."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{(root / 'mlflow.db').resolve()}"  # four slashes: absolute path
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment(
        "export-test", artifact_location=(root / "artifacts").resolve().as_uri()
    )
    run = client.create_run(experiment)
    return {"mlflow": mlflow, "uri": uri, "client": client, "run_id": run.info.run_id}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, mlflow_run: dict) -> dict:
    target = TargetModel.from_config(tiny_config("qwen3"), seed=5)
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=40, token_counts=torch.arange(128))
    root = tmp_path_factory.mktemp("cli")
    drafter.save_pretrained(root / "drafter-in")
    target.model.save_pretrained(root / "target")  # for parity on real target features
    output = root / "export-out"
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_run["uri"])
    try:
        code = export_cli.main(
            [
                "--drafter",
                str(root / "drafter-in"),
                "--output",
                str(output),
                "--tensorrt",
                "--max-tree-nodes",
                "128",
                "--target",
                str(root / "target"),
                "--mlflow-run-id",
                mlflow_run["run_id"],
            ]
        )
    finally:
        monkeypatch.undo()
    manifest = json.loads((output / cli.MANIFEST_NAME).read_text())
    return {
        "code": code,
        "output": output,
        "manifest": manifest,
        "input": root / "drafter-in",
        "drafter": drafter,
    }


def test_exit_code_reflects_tensorrt_availability(exported: dict) -> None:
    available, reason = tensorrt_available()
    if available:
        assert exported["code"] == cli.EXIT_OK
    else:  # the ONNX export is complete; only the engines are missing
        assert exported["code"] == cli.EXIT_NO_TENSORRT
        assert exported["manifest"]["tensorrt"] == {
            "requested": True,
            "available": False,
            "reason": reason,
            "precision": "fp32",
        }


def test_output_files(exported: dict) -> None:
    output = exported["output"]
    for name in (
        "fc.onnx",
        "drafter_step.onnx",
        "tree_verify.onnx",
        "manifest.json",
        "drafter/config.json",
        "drafter/model.safetensors",
    ):
        assert (output / name).is_file(), name
    # The drafter folder is an exact copy (SGLang/vLLM EAGLE-3 names and config keys).
    for name in ("config.json", "model.safetensors"):
        assert (output / "drafter" / name).read_bytes() == (exported["input"] / name).read_bytes()
    config = json.loads((output / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    for name in ("fc.onnx", "drafter_step.onnx", "tree_verify.onnx"):
        onnx.checker.check_model(str(output / name), full_check=True)


def test_manifest_records_files_and_graphs(exported: dict) -> None:
    manifest, output = exported["manifest"], exported["output"]
    assert manifest["format"] == "lightning-spec-export" and manifest["opset"] == 18
    files = {record["path"]: record for record in manifest["files"]}
    assert {
        "fc.onnx",
        "drafter_step.onnx",
        "tree_verify.onnx",
        "drafter/config.json",
        "drafter/model.safetensors",
    } <= set(files)
    for path, record in files.items():
        data = (output / path).read_bytes()
        assert record["sha256"] == hashlib.sha256(data).hexdigest() and record["bytes"] == len(data)
    step = manifest["graphs"]["drafter_step"]
    assert step["dynamic_dims"] == ["batch", "tokens", "past", "kv_length"]
    assert step["derived_dims"] == {"kv_length": "past + tokens"}
    assert [t["name"] for t in step["outputs"]] == [
        "logits",
        "hidden_out",
        "present_keys",
        "present_values",
    ]
    assert manifest["graphs"]["tree_verify"]["max_nodes"] == 128
    assert manifest["drafter"]["config"]["draft_vocab_size"] == 40
    assert all(report["ok"] for report in manifest["trt_compat"].values())
    assert manifest["tolerances"]["atol"] == 1e-4 and manifest["tolerances"]["rtol"] == 1e-5


def test_manifest_parity_numbers(exported: dict) -> None:
    parity = exported["manifest"]["parity"]
    assert exported["manifest"]["passed"]
    assert parity["random"]["max_abs_diff"] < 1e-4
    assert parity["random"]["argmax_agreement"] == 1.0
    sizes = {(c["batch"], c["tokens"], c["past"]) for c in parity["random"]["cases"]}
    assert {(1, 1, 0), (1, 1, 1)} <= sizes  # batch 1, one token, empty past
    assert parity["rollout"]["max_abs_diff"] < 1e-4
    assert parity["rollout"]["argmax_agreement"] == 1.0
    assert parity["tree_verify"]["mismatches"] == 0 and parity["tree_verify"]["trees"] >= 100
    # --target: real target features, and the SpeculativeDecoder end to end
    assert parity["target_features"]["real_features"]
    assert parity["target_features"]["max_abs_diff"] < 1e-4
    decode = parity["decode"]
    assert decode["tokens_equal"] and decode["trees_equal"] and decode["accept_lengths_equal"]
    assert {run["policy"] for run in decode["runs"]} == {"chain:4", "dynamic:4,4,12"}


def test_mlflow_run_holds_the_export(exported: dict, mlflow_run: dict) -> None:
    client, run_id = mlflow_run["client"], mlflow_run["run_id"]
    logged = {Path(a.path).name for a in client.list_artifacts(run_id, cli.MLFLOW_ARTIFACT_PATH)}
    assert {
        "manifest.json",
        "drafter_step.onnx",
        "fc.onnx",
        "tree_verify.onnx",
        "drafter",
    } <= logged
    metrics = client.get_run(run_id).data.metrics
    assert metrics["export/random_argmax_agreement"] == 1.0
    assert metrics["export/tree_verify_mismatches"] == 0.0


def test_no_tracking_configured_logs_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow = pytest.importorskip("mlflow")
    assert mlflow.active_run() is None
    assert cli.log_to_mlflow(tmp_path, {"parity": {}}) is None


def test_tracking_uri_alone_starts_a_run(
    exported: dict, mlflow_run: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_run["uri"])
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "export-auto")
    run_id = cli.log_to_mlflow(exported["output"], exported["manifest"])
    client = mlflow_run["client"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "export-auto"
    # Artifacts sit beside the SQLite database, not under the current directory.
    assert experiment.artifact_location.startswith(
        Path(mlflow_run["uri"][len("sqlite:///") :]).parent.as_uri()
    )
    assert client.list_artifacts(run_id, cli.MLFLOW_ARTIFACT_PATH)


def test_bad_drafter_folder_is_a_usage_error(tmp_path: Path, capsys) -> None:
    code = export_cli.main(
        ["--drafter", str(tmp_path / "missing"), "--output", str(tmp_path / "o")]
    )
    assert code == cli.EXIT_USAGE
    assert "cannot load drafter" in capsys.readouterr().err


def test_dflash_drafter_exports_with_parity_on_the_target(tmp_path: Path) -> None:
    from lightning_spec.export.dflash_onnx import BLOCK_FILE, CONTEXT_FILE
    from lightning_spec.models.drafters.dflash import DFlashDrafter

    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=0)
    target.model.save_pretrained(tmp_path / "target")
    folder = DFlashDrafter.from_target(target, block_size=3).save_pretrained(tmp_path / "d")
    output = tmp_path / "o"
    arguments = ["--drafter", str(folder), "--output", str(output), "--max-tree-nodes", "64"]
    assert export_cli.main([*arguments, "--target", str(tmp_path / "target")]) == cli.EXIT_OK
    manifest = json.loads((output / cli.MANIFEST_NAME).read_text())
    assert set(manifest["graphs"]) == {"dflash_context", "dflash_block", "tree_verify"}
    assert set(manifest["parity"]) == {"random", "sequence", "target_features", "tree_verify"}
    assert manifest["passed"] and all(r["passed"] for r in manifest["parity"].values())
    assert manifest["parity"]["target_features"]["argmax_agreement"] == 1.0
    files = {record["path"] for record in manifest["files"]}
    assert {CONTEXT_FILE, BLOCK_FILE, "drafter/model.safetensors"} <= files


def test_dflash_tensorrt_is_refused_with_the_reason(tmp_path: Path, capsys) -> None:
    from lightning_spec.models.drafters.dflash import DFlashDrafter

    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=0)
    folder = DFlashDrafter.from_target(target, block_size=3).save_pretrained(tmp_path / "d")
    code = export_cli.main(
        ["--drafter", str(folder), "--output", str(tmp_path / "o"), "--tensorrt"]
    )
    assert code == cli.EXIT_USAGE
    message = capsys.readouterr().err
    assert "engine parity" in message and "DFlash graphs" in message
    assert not (tmp_path / "o").exists()  # refused before any work


def test_argparse_errors_return_2(capsys) -> None:
    assert export_cli.main(["--output", "x"]) == 2
    assert export_cli.main(["--drafter", "d", "--output", "o", "--precision", "int8"]) == 2
    assert export_cli.main(["--drafter", "d", "--output", "o", "--opset", "17"]) == 2


def test_a_folder_without_embeddings_needs_its_target(tmp_path: Path, capsys) -> None:
    """EAGLE-3 folders hold no embeddings (they are the target's) while the step graph embeds
    token ids: without --target, and with a recorded target that cannot be loaded, export says
    which flag gives it the table."""
    target = TargetModel.from_config(tiny_config("llama", num_layers=2), seed=0)
    folder = Eagle3Drafter.from_target(target).save_pretrained(tmp_path / "d")
    code = export_cli.main(["--drafter", str(folder), "--output", str(tmp_path / "o")])
    assert code == cli.EXIT_USAGE
    message = capsys.readouterr().err
    assert "shares its target's weights" in message and "pass --target" in message
