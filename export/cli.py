"""``lightning-spec export``: ship a trained drafter folder as ONNX (and TensorRT).

The output folder::

    drafter/            the HF-style drafter folder, copied byte for byte (SGLang/vLLM names)
    fc.onnx             EAGLE-3: target features -> drafter hidden
    drafter_step.onnx   EAGLE-3: one drafter step with the KV cache as inputs/outputs
    dflash_context.onnx DFlash: target features -> per-layer context keys/values (export/dflash_onnx.py)
    dflash_block.onnx   DFlash: one block forward, all draft slots in one call
    tree_verify.onnx    greedy tree verification (pointer jumping, no data-dependent shapes)
    manifest.json       files + sha256, graph signatures with dynamic dims, opset, tolerances,
                        parity numbers, TensorRT-compatibility reports, TensorRT build summary
    tensorrt/           (with --tensorrt) engines, engine_manifest.json, timing.cache

Every graph is checked with ``onnx.checker`` (full check), against TensorRT's parser support
matrix (`trt_compat`) and against PyTorch through onnxruntime (`parity`). With ``--target`` the
parity also runs on real target features and (EAGLE-3) through the `SpeculativeDecoder` end to
end; a DFlash export is checked on a sequence absorbed and drafted at several roots the way the
decoder does it. TensorRT engines are built for EAGLE-3 exports (``--tensorrt`` with a DFlash
drafter is refused: no engine parity cases for its graphs yet).
Everything is logged to MLflow as artifacts when ``--mlflow-run-id`` is given, a run is active
or ``MLFLOW_TRACKING_URI`` is set.

Exit codes: 0 success; 1 parity failure (or TensorRT-compatibility errors with
``--strict-compat``); 2 bad arguments or an unusable drafter folder; 3 ``--tensorrt`` asked for
but TensorRT or a CUDA device is missing (the ONNX export is complete and the message names the
missing piece); 4 the TensorRT build or the engine parity failed.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from lightning_spec.io import atomic_path, atomic_write_json, sha256_file

log = logging.getLogger(__name__)

EXIT_OK, EXIT_PARITY, EXIT_USAGE, EXIT_NO_TENSORRT, EXIT_TENSORRT_FAILED = 0, 1, 2, 3, 4
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "lightning-spec-export"
MANIFEST_VERSION = 1
MLFLOW_ARTIFACT_PATH = "export"
DEFAULT_EXPERIMENT = "lightning-spec-export"


class ExportError(RuntimeError):
    """An export step failed; `exit_code` says how the CLI reports it."""

    def __init__(self, message: str, exit_code: int = EXIT_PARITY) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _write_json(path: Path, data: Any) -> None:
    atomic_write_json(path, data, sort_keys=False, default=str)


def _copy_folder(source: Path, destination: Path) -> list[Path]:
    """Copy the regular files of `source` (top level) into `destination`, atomically each."""
    destination.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name.startswith("."):
            continue
        with atomic_path(destination / path.name) as tmp:
            shutil.copy2(path, tmp)
        copied.append(destination / path.name)
    return copied


def _file_records(root: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.name.startswith(".") and path.name != MANIFEST_NAME:
            records.append(
                {
                    "path": path.relative_to(root).as_posix(),
                    "sha256": sha256_file(path),
                    "bytes": path.stat().st_size,
                }
            )
    return records


def _versions() -> dict[str, str]:
    import importlib.metadata as metadata

    versions = {}
    for package in ("lightning-spec", "torch", "onnx", "onnxruntime", "onnxscript", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def _bind_embeddings(drafter: Any, drafter_dir: Path, target: Any) -> None:
    """Give the drafter the target weights its folder does not hold (EAGLE-3's step graph embeds
    token ids, so it carries the input embeddings; DFlash's block graph carries the target's LM
    head rows of the draft vocabulary): from ``--target``, else from the target the drafter
    recorded (``target_model``, e.g. ``smollm2``)."""
    if target is not None:
        drafter.bind_target(target)
        return
    if getattr(drafter, "has_embeddings", False):  # a folder written before sharing: its own copy
        return
    recorded = drafter.config.get("target_model")
    try:
        from lightning_spec.models.target import load_target

        name = str(recorded or "")
        if not (name in ("smollm2", "default") or "/" in name or Path(name).exists()):
            # not the embedded default, a folder or a hub id (a test model's "random-llama")
            raise ValueError("it names no loadable model")
        drafter.bind_target(load_target(str(recorded)))
    except Exception as error:  # noqa: BLE001 - any load failure: the user must name the target
        raise ExportError(
            f"{drafter_dir} shares its target's weights (they are not in the folder, and the "
            "exported graphs need them), and its recorded target {recorded!r} cannot be "
            f"loaded ({error}): pass --target with the model folder, hub id or smollm2 it was "
            "trained for",
            EXIT_USAGE,
        ) from error


def _load_target_inputs(target_spec: str, drafter: Any) -> tuple[Any, Any, Any, list[list[int]]]:
    """The target, real features [1, L, F] with their ids, and prompts for decode parity."""
    import torch

    from lightning_spec.models.target import TargetModel

    layers = drafter.config.get("target_layer_ids")
    try:
        target = TargetModel.from_pretrained(target_spec, feature_layers=layers)
    except (OSError, ValueError, TypeError) as error:
        if "tokenizer" not in str(error).lower() and "vocab" not in str(error).lower():
            raise
        # A model folder without tokenizer files: random prompts still exercise the graphs.
        target = TargetModel.from_pretrained(
            target_spec, feature_layers=layers, load_tokenizer=False
        )
    if target.vocab_size != drafter.target_vocab_size:
        raise ExportError(
            f"--target has a vocabulary of {target.vocab_size}, the drafter maps onto "
            f"{drafter.target_vocab_size}: not the drafter's target",
            EXIT_USAGE,
        )
    texts = [
        "Explain why the sky is blue in two sentences.",
        "Write a haiku about compilers.",
    ]
    prompts = []
    for text in texts:
        ids = target.tokenizer(text)["input_ids"] if target.tokenizer is not None else []
        if len(set(ids)) < 4:  # no (usable) tokenizer in the folder: random ids will do
            generator = torch.Generator().manual_seed(len(prompts))
            ids = torch.randint(3, target.vocab_size, (12,), generator=generator).tolist()
        prompts.append([int(i) for i in ids])
    ids = torch.tensor([prompts[0]])
    output = target(ids, use_cache=False)
    # EAGLE alignment: token t_j is read with the feature of t_{j-1}.
    return target, output.features[:, :-1], ids[:, 1:], prompts


def export_package(
    drafter_dir: str | Path,
    output_dir: str | Path,
    *,
    opset: int = 18,
    max_tree_nodes: int = 1024,
    target: str | None = None,
    tensorrt: bool = False,
    precision: str = "fp32",
    dim_ranges: dict[str, Any] | None = None,
    timing_cache: str | Path | None = None,
    strict_compat: bool = False,
    mlflow_run_id: str | None = None,
    tolerances: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Run the whole export (see the module docstring); return the manifest.

    Raises `ExportError` with the CLI exit code when a step fails; the manifest written so far
    stays on disk for inspection.
    """
    import onnx

    from lightning_spec.export import parity
    from lightning_spec.export.onnx import export_drafter
    from lightning_spec.export.trt_compat import check_trt_compat
    from lightning_spec.export.verify_graph import VERIFY_FILE, export_verify_graph
    from lightning_spec.models.drafters.base import load_drafter
    from lightning_spec.models.drafters.dflash import DFlashDrafter
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter

    drafter_dir, output_dir = Path(drafter_dir), Path(output_dir)
    try:
        drafter = load_drafter(drafter_dir)
    except (FileNotFoundError, ValueError) as error:
        raise ExportError(f"cannot load drafter: {error}", EXIT_USAGE) from error
    block = isinstance(drafter, DFlashDrafter)
    if drafter.drafts_blocks and not block:
        raise ExportError(
            f"{drafter_dir} holds a {drafter.drafter_type!r} block drafter; ONNX export covers "
            "the DFlash block drafter and EAGLE-3 drafters",
            EXIT_USAGE,
        )
    if not block and not isinstance(drafter, Eagle3Drafter):
        raise ExportError(
            f"{drafter_dir} holds a {drafter.drafter_type!r} drafter; ONNX export supports "
            "EAGLE-3 and DFlash drafters",
            EXIT_USAGE,
        )
    if block and tensorrt:
        raise ExportError(
            "--tensorrt builds engines for EAGLE-3 exports only: the engine parity check "
            "(export/tensorrt.py engine_parity) has no cases for the DFlash graphs yet, and an "
            "engine nobody compared is not shipped. Export without --tensorrt (both DFlash "
            "graphs pass onnxruntime parity) and build engines from dflash_context.onnx and "
            "dflash_block.onnx with trtexec.",
            EXIT_USAGE,
        )
    target_inputs = _load_target_inputs(target, drafter) if target is not None else None
    _bind_embeddings(drafter, drafter_dir, target_inputs[0] if target_inputs else None)
    tolerances = dict(tolerances or parity.DEFAULT_TOLERANCES)
    output_dir.mkdir(parents=True, exist_ok=True)
    _copy_folder(drafter_dir, output_dir / parity.DRAFTER_FOLDER)

    if block:
        from lightning_spec.export.dflash_onnx import export_dflash

        specs = export_dflash(drafter, output_dir, opset=opset)
    else:
        specs = export_drafter(drafter, output_dir, opset=opset)
    specs["tree_verify"] = export_verify_graph(
        output_dir / VERIFY_FILE, max_nodes=max_tree_nodes, opset=opset
    )
    graphs = {name: spec.to_dict() for name, spec in specs.items()}
    graphs["tree_verify"]["max_nodes"] = max_tree_nodes
    compat = {}
    for name, spec in specs.items():
        path = output_dir / spec.file
        onnx.checker.check_model(str(path), full_check=True)
        compat[name] = check_trt_compat(path).to_dict()

    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "drafter": {
            "source": str(drafter_dir.resolve()),
            "folder": parity.DRAFTER_FOLDER,
            "drafter_type": drafter.drafter_type,
            "config": drafter.config,
        },
        "opset": opset,
        "graphs": graphs,
        "tolerances": {
            **tolerances,
            "tree_verify": "exact (integer outputs)",
            "rule": "max_abs_diff <= atol + rtol * reference_scale (max |PyTorch output|) and "
            "argmax_agreement >= min_argmax_agreement; float32 onnxruntime vs float32 PyTorch",
        },
        "parity": {},
        "trt_compat": compat,
        "files": [],
    }

    # ---- parity: random inputs, rollouts (real target features when --target), tree verify
    verifier = parity.OnnxTreeVerifier.from_export_dir(output_dir)
    if block:
        manifest["parity"] = _dflash_parity(drafter, output_dir, target_inputs, tolerances)
    else:
        manifest["parity"] = _eagle_parity(drafter, output_dir, verifier, target_inputs, tolerances)
    verify = parity.verify_graph_parity(verifier, max_nodes=min(48, max_tree_nodes))
    verify["passed"] = verify["mismatches"] == 0
    manifest["parity"]["tree_verify"] = verify
    checks = [result["passed"] for result in manifest["parity"].values()]
    manifest["passed"] = all(checks)
    manifest["files"] = _file_records(output_dir)
    _write_json(output_dir / MANIFEST_NAME, manifest)

    failure: ExportError | None = None
    if not manifest["passed"]:
        failed = [name for name, result in manifest["parity"].items() if not result["passed"]]
        failure = ExportError(f"parity failed: {failed} (see {output_dir / MANIFEST_NAME})")
    elif strict_compat and not all(report["ok"] for report in compat.values()):
        failure = ExportError("TensorRT-compatibility errors (see manifest trt_compat)")

    # ---- TensorRT
    if tensorrt and failure is None:
        failure = _tensorrt_step(
            output_dir,
            manifest,
            precision=precision,
            dim_ranges=dim_ranges,
            timing_cache=timing_cache,
        )
        manifest["files"] = _file_records(output_dir)
        _write_json(output_dir / MANIFEST_NAME, manifest)

    log_to_mlflow(output_dir, manifest, run_id=mlflow_run_id)
    if failure is not None:
        raise failure
    return manifest


def _eagle_parity(
    drafter: Any,
    output_dir: Path,
    verifier: Any,
    target_inputs: tuple[Any, Any, Any, list[list[int]]] | None,
    tolerances: dict[str, float],
) -> dict[str, dict[str, Any]]:
    """EAGLE-3 graphs: random inputs, rollouts, and with a target its features and decoding."""
    from lightning_spec.export import parity
    from lightning_spec.export.onnx import export_ready

    onnx_drafter = parity.OnnxEagle3Drafter.from_export_dir(output_dir)
    results = {
        "random": parity.step_parity(drafter, output_dir),
        "rollout": parity.rollout_parity(drafter, onnx_drafter),
    }
    if target_inputs is not None:
        target_model, features, ids, prompts = target_inputs
        results["target_features"] = parity.rollout_parity(
            drafter, onnx_drafter, features=features, prompt_ids=ids
        )
        decode = parity.decode_parity(
            target_model, export_ready(drafter), onnx_drafter, verifier, prompts
        )
        decode["passed"] = decode["tokens_equal"] and decode["trees_equal"]
        results["decode"] = decode
    for name, result in results.items():
        if name != "decode":
            result["passed"] = parity.parity_passed(result, tolerances)
    return results


def _dflash_parity(
    drafter: Any,
    output_dir: Path,
    target_inputs: tuple[Any, Any, Any, list[list[int]]] | None,
    tolerances: dict[str, float],
) -> dict[str, dict[str, Any]]:
    """DFlash graphs: random inputs, a sequence absorbed and drafted at several roots the way
    the decoder does, and with a target the same on its real features."""
    from lightning_spec.export import dflash_onnx, parity

    results = {
        "random": dflash_onnx.random_parity(drafter, output_dir),
        "sequence": dflash_onnx.sequence_parity(drafter, output_dir),
    }
    if target_inputs is not None:
        _, features, ids, _ = target_inputs
        results["target_features"] = dflash_onnx.sequence_parity(
            drafter, output_dir, features=features, absorbed_ids=ids
        )
    for result in results.values():
        result["passed"] = parity.parity_passed(result, tolerances)
    return results


def _tensorrt_step(
    output_dir: Path,
    manifest: dict[str, Any],
    *,
    precision: str,
    dim_ranges: dict[str, Any] | None,
    timing_cache: str | Path | None,
) -> ExportError | None:
    from lightning_spec.export import tensorrt as trt_export

    available, reason = trt_export.tensorrt_available()
    manifest["tensorrt"] = {
        "requested": True,
        "available": available,
        "reason": reason,
        "precision": precision,
    }
    if not available:
        return ExportError(
            f"TensorRT engines not built: {reason}. The ONNX export in {output_dir} is "
            "complete; build engines on a machine with TensorRT and a GPU "
            f"(lightning-spec export ... --tensorrt).",
            EXIT_NO_TENSORRT,
        )
    try:
        engines = trt_export.build_engines(
            output_dir, precision=precision, dim_ranges=dim_ranges, timing_cache=timing_cache
        )
        engine_check = trt_export.engine_parity(output_dir)
    except Exception as error:  # report any TensorRT failure with its message
        manifest["tensorrt"]["error"] = f"{type(error).__name__}: {error}"
        return ExportError(f"TensorRT build failed: {error}", EXIT_TENSORRT_FAILED)
    manifest["tensorrt"]["engines"] = engines["engines"]
    manifest["tensorrt"]["parity"] = engine_check
    if not engine_check["passed"]:
        return ExportError("TensorRT engine parity failed (see manifest)", EXIT_TENSORRT_FAILED)
    return None


# -------------------------------------------------------------------------------------- mlflow
def _mlflow_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    metrics = {}
    for name, result in manifest.get("parity", {}).items():
        for key in ("max_abs_diff", "argmax_agreement", "mismatches"):
            if isinstance(result.get(key), (int, float)):
                metrics[f"export/{name}_{key}"] = float(result[key])
        metrics[f"export/{name}_passed"] = float(bool(result.get("passed")))
    return metrics


def _ensure_experiment(mlflow: Any) -> str:
    """An experiment for runs this command starts itself, with an explicit artifact location
    beside a SQLite store (MLflow would otherwise put artifacts under the current directory)."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///"):
        database = Path(uri[len("sqlite:///") :])
        location = (database.parent / "mlartifacts" / name).resolve().as_uri()
    return mlflow.create_experiment(name, artifact_location=location)


def log_to_mlflow(
    output_dir: str | Path, manifest: dict[str, Any], *, run_id: str | None = None
) -> str | None:
    """Log the export folder as artifacts (under ``export/``) and parity metrics.

    Target run: `run_id`, else the active run, else a new run when ``MLFLOW_TRACKING_URI`` is
    set; otherwise nothing is logged and None is returned. mlflow is imported only here.
    """
    if run_id is None and "MLFLOW_TRACKING_URI" not in os.environ:
        mlflow_module = sys.modules.get("mlflow")  # an active run implies mlflow is imported
        if mlflow_module is None or mlflow_module.active_run() is None:
            return None
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    if run_id is None and mlflow.active_run() is not None:
        run_id = mlflow.active_run().info.run_id
    created = False
    if run_id is None:
        run = client.create_run(_ensure_experiment(mlflow), run_name="export")
        run_id, created = run.info.run_id, True
    client.log_artifacts(run_id, str(output_dir), artifact_path=MLFLOW_ARTIFACT_PATH)
    for key, value in _mlflow_metrics(manifest).items():
        client.log_metric(run_id, key, value)
    client.set_tag(run_id, "export.passed", str(bool(manifest.get("passed"))))
    if created:
        client.set_terminated(run_id)
    return run_id
