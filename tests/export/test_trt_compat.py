"""Static TensorRT-parser compatibility: our graphs pass, known-bad patterns fail."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from lightning_spec.export.onnx import export_drafter
from lightning_spec.export.trt_compat import (
    SUPPORTED_OPS,
    TrtCompatError,
    check_trt_compat,
    main,
)
from lightning_spec.export.verify_graph import VERIFY_FILE, export_verify_graph
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny export of test_onnx_export (same folder and content: it is reused when that
    module already ran in this session, so the session exports once)."""
    folder = tmp_path_factory.getbasetemp() / "tiny-onnx-export"
    if not (folder / ".complete").exists():
        target = TargetModel.from_config(tiny_config("llama"), seed=11)
        drafter = Eagle3Drafter.from_target(
            target, draft_vocab_size=48, token_counts=torch.arange(128).flip(0), seed=3
        )
        folder.mkdir(parents=True, exist_ok=True)
        drafter.save_pretrained(folder / "drafter")
        specs = export_drafter(drafter, folder)
        specs["tree_verify"] = export_verify_graph(folder / VERIFY_FILE, max_nodes=64)
        (folder / ".complete").write_text("\n".join(sorted(specs)))
    return {"folder": folder}


def _model(nodes, inputs, outputs, initializers=(), opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _codes(report) -> set[str]:
    return {issue.code for issue in report.errors}


@pytest.mark.parametrize("name", ["fc.onnx", "drafter_step.onnx", "tree_verify.onnx"])
def test_every_exported_graph_passes(exported: dict, name: str) -> None:
    report = check_trt_compat(exported["folder"] / name, strict=True)
    assert report.ok and not report.issues, [str(i) for i in report.issues]
    assert report.opset == 18
    assert set(report.operators) <= set(SUPPORTED_OPS)
    assert report.to_dict()["checked_against"].startswith("TensorRT 10.")


def test_command_line(exported: dict, capsys: pytest.CaptureFixture) -> None:
    assert main([str(p) for p in sorted(exported["folder"].glob("*.onnx"))]) == 0
    assert "drafter_step.onnx: ok" in capsys.readouterr().out


def test_nonzero_is_flagged_and_strict_raises(tmp_path) -> None:
    model = _model(
        [helper.make_node("NonZero", ["x"], ["y"], name="nz")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [1, "k"])],
    )
    path = tmp_path / "nonzero.onnx"
    onnx.save(model, str(path))
    report = check_trt_compat(path)
    assert not report.ok and "data-dependent-shape" in _codes(report)
    with pytest.raises(TrtCompatError, match="NonZero"):
        check_trt_compat(path, strict=True)
    assert main([str(path)]) == 1


def test_unsupported_operator_and_custom_domain() -> None:
    model = _model(
        [
            helper.make_node("Det", ["x"], ["d"]),
            helper.make_node("FusedThing", ["x"], ["y"], domain="com.example"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [
            helper.make_tensor_value_info("d", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3]),
        ],
    )
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    report = check_trt_compat(model)
    assert {"unsupported-operator", "custom-domain"} <= _codes(report)


def test_reshape_to_a_value_computed_shape_is_flagged() -> None:
    """A shape read from tensor *values* (not from tensor shapes) is data-dependent."""
    model = _model(
        [
            helper.make_node("Cast", ["n"], ["n64"], to=TensorProto.INT64),
            helper.make_node("Reshape", ["x", "n64"], ["y"]),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a"]),
            helper.make_tensor_value_info("n", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "c"])],
    )
    assert "data-dependent-shape" in _codes(check_trt_compat(model))


def test_shape_computed_from_input_shapes_is_fine() -> None:
    model = _model(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Reshape", ["x", "s"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", 4])],
    )
    assert check_trt_compat(model).ok


def test_types_opsets_and_constant_operands() -> None:
    # double graph input, Equal on bool (TensorRT compares numbers only), opset too new,
    # ReduceSum axes from a graph input (must be a build-time constant), unnamed dynamic dim.
    axes = numpy_helper.from_array(np.array([0], dtype=np.int64), "axes")
    model = _model(
        [
            helper.make_node("Equal", ["b", "b"], ["eq"]),
            helper.make_node("ReduceSum", ["x", "dynamic_axes"], ["r"]),
            helper.make_node("ReduceSum", ["x", "axes"], ["r2"]),
        ],
        [
            helper.make_tensor_value_info("b", TensorProto.BOOL, [4]),
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [None, 4]),
            helper.make_tensor_value_info("dynamic_axes", TensorProto.INT64, [1]),
        ],
        [
            helper.make_tensor_value_info("eq", TensorProto.BOOL, [4]),
            helper.make_tensor_value_info("r", TensorProto.DOUBLE, None),
            helper.make_tensor_value_info("r2", TensorProto.DOUBLE, None),
        ],
        initializers=[axes],
        opset=25,
    )
    report = check_trt_compat(model)
    codes = _codes(report)
    assert {"io-type", "unsupported-type", "opset", "non-constant-operand"} <= codes
    assert {issue.code for issue in report.warnings} >= {"double", "unnamed-dynamic-dim"}
    # The constant-axes ReduceSum is not flagged for its axes.
    flagged = [i.node for i in report.errors if i.code == "non-constant-operand"]
    assert flagged == ["r"]
