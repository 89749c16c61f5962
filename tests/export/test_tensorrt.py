"""TensorRT: what runs without it (availability reasons, profiles, precision flags, the build
path against a stand-in of the documented API, CLI exit codes) and the real thing where
TensorRT and a GPU exist (`requires_cuda`)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from lightning_spec.export import tensorrt as trt_export
from lightning_spec.export.tensorrt import (
    DimRange,
    TensorRTBuildError,
    TensorRTUnavailable,
    apply_precision,
    build_engine,
    default_dim_ranges,
    derive_profile,
    precision_flags,
    tensorrt_available,
)

STEP_GRAPH = {
    "name": "drafter_step",
    "inputs": [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "tokens"]},
        {"name": "position_ids", "dtype": "int64", "shape": ["batch", "tokens"]},
        {"name": "hidden_in", "dtype": "float32", "shape": ["batch", "tokens", 64]},
        {"name": "past_keys", "dtype": "float32", "shape": ["batch", 2, "past", 16]},
        {"name": "past_values", "dtype": "float32", "shape": ["batch", 2, "past", 16]},
        {"name": "attention_mask", "dtype": "bool", "shape": ["batch", "tokens", "kv_length"]},
    ],
    "derived_dims": {"kv_length": "past + tokens"},
}
VERIFY_GRAPH = {
    "name": "tree_verify",
    "inputs": [
        {"name": "draft_tokens", "dtype": "int64", "shape": ["nodes"]},
        {"name": "parents", "dtype": "int64", "shape": ["nodes"]},
        {"name": "target_logits", "dtype": "float32", "shape": ["nodes_plus_one", "vocab"]},
    ],
    "derived_dims": {"nodes_plus_one": "nodes + 1"},
}


# ------------------------------------------------------------------------------- availability
def test_unavailable_reason_names_the_missing_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    ok, reason = tensorrt_available()
    assert not ok and reason.startswith("python package tensorrt not importable: ")
    with pytest.raises(TensorRTUnavailable, match="tensorrt not importable"):
        trt_export.require_tensorrt()


def test_unavailable_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.15"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tensorrt_available() == (False, "no CUDA device: torch.cuda.is_available() is False")


# ----------------------------------------------------------------------------------- profiles
def test_profile_covers_every_dynamic_input_with_derived_dims() -> None:
    ranges = {
        "batch": DimRange(1, 2, 4),
        "tokens": DimRange(1, 8, 32),
        "past": DimRange(0, 100, 1000),
    }
    profile = derive_profile(STEP_GRAPH, ranges)
    assert set(profile) == {t["name"] for t in STEP_GRAPH["inputs"]}
    assert profile["input_ids"] == ((1, 1), (2, 8), (4, 32))
    assert profile["past_keys"] == ((1, 2, 0, 16), (2, 2, 100, 16), (4, 2, 1000, 16))
    # kv_length = past + tokens at each of min / opt / max
    assert profile["attention_mask"] == ((1, 1, 1), (2, 8, 108), (4, 32, 1032))


def test_profile_needs_a_range_for_each_dynamic_dim() -> None:
    with pytest.raises(ValueError, match="'vocab'.*--trt-dim vocab=MIN:OPT:MAX"):
        derive_profile(VERIFY_GRAPH, default_dim_ranges())
    profile = derive_profile(VERIFY_GRAPH, default_dim_ranges({"target_vocab_size": 128}))
    nodes = trt_export.DEFAULT_DIM_RANGES["nodes"]
    assert profile["target_logits"] == (
        (nodes.min + 1, 128),
        (nodes.opt + 1, 128),
        (nodes.max + 1, 128),
    )


def test_dim_range_parsing() -> None:
    assert DimRange.parse("1:8:64") == DimRange(1, 8, 64)
    assert DimRange.parse("7") == DimRange(7, 7, 7)
    for bad in ("8:1:64", "1:2", "-1:0:1"):
        with pytest.raises(ValueError):
            DimRange.parse(bad)


def test_profile_from_a_real_manifest_graph(tmp_path: Path) -> None:
    """The GraphSpec the exporter writes for tree_verify derives a full profile."""
    from lightning_spec.export.verify_graph import export_verify_graph

    spec = export_verify_graph(tmp_path / "v.onnx", max_nodes=16).to_dict()
    profile = derive_profile(spec, default_dim_ranges({"target_vocab_size": 50}))
    assert set(profile) == {"draft_tokens", "parents", "target_logits"}


# ---------------------------------------------------------------------- precision and building
def test_precision_flag_mapping() -> None:
    assert precision_flags("fp32") == ()
    assert precision_flags("fp16") == ("FP16",)
    assert precision_flags("bf16") == ("BF16",)
    with pytest.raises(ValueError, match="int8"):
        precision_flags("int8")


class _FakeTensorRT:
    """A stand-in for the documented tensorrt API surface `build_engine` uses; it records calls."""

    __version__ = "10.15.0"

    def __init__(self, parse_ok: bool = True, flags: tuple[str, ...] = ("FP16", "BF16")) -> None:
        self.calls: list[tuple] = []
        self.parse_ok = parse_ok
        fake = self
        self.BuilderFlag = types.SimpleNamespace(**{name: name for name in flags})
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
        self.NetworkDefinitionCreationFlag = types.SimpleNamespace(EXPLICIT_BATCH=0)

        class Logger:
            WARNING = "WARNING"

            def __init__(self, level):
                pass

        class Input:
            def __init__(self, name, shape):
                self.name, self.shape = name, shape

        class Network:
            inputs = [Input("input_ids", (-1, -1)), Input("hidden_in", (-1, -1, 64))]
            num_inputs = 2

            def get_input(self, index):
                return self.inputs[index]

        class Error:
            def node(self):
                return 3

            def node_name(self):
                return "node_Foo"

            def desc(self):
                return "unsupported op Foo"

        class Parser:
            def __init__(self, network, logger):
                self.num_errors = 0 if fake.parse_ok else 1

            def parse_from_file(self, path):
                fake.calls.append(("parse", path))
                return fake.parse_ok

            def get_error(self, index):
                return Error()

        class Profile:
            def set_shape(self, name, low, opt, high):
                fake.calls.append(("set_shape", name, low, opt, high))

        class Cache:
            def serialize(self):
                return b"timing-cache-v2"

        class Config:
            def set_memory_pool_limit(self, pool, size):
                fake.calls.append(("workspace", size))

            def set_flag(self, flag):
                fake.calls.append(("flag", flag))

            def add_optimization_profile(self, profile):
                fake.calls.append(("add_profile",))

            def create_timing_cache(self, data):
                fake.calls.append(("create_timing_cache", bytes(data)))
                return Cache()

            def set_timing_cache(self, cache, ignore_mismatch):
                fake.calls.append(("set_timing_cache", ignore_mismatch))

            def get_timing_cache(self):
                return Cache()

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                fake.calls.append(("create_network", flags))
                return Network()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                fake.calls.append(("build",))
                return b"engine-bytes"

        self.Logger, self.Builder, self.OnnxParser = Logger, Builder, Parser


def test_build_engine_follows_the_documented_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeTensorRT()
    monkeypatch.setattr(trt_export, "require_tensorrt", lambda: fake)
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"old-cache")
    profile = {"input_ids": ((1, 1), (1, 8), (4, 64)), "hidden_in": ((1, 1, 64),) * 3}
    record = build_engine(
        tmp_path / "g.onnx",
        tmp_path / "out" / "g.fp16.engine",
        profile,
        precision="fp16",
        timing_cache=cache,
    )
    assert (tmp_path / "out" / "g.fp16.engine").read_bytes() == b"engine-bytes"
    assert cache.read_bytes() == b"timing-cache-v2"  # saved back after the build
    assert ("create_timing_cache", b"old-cache") in fake.calls  # loaded before the build
    assert ("flag", "FP16") in fake.calls
    assert ("create_network", 0) in fake.calls  # explicit batch is implicit in TensorRT 10
    shapes = [call for call in fake.calls if call[0] == "set_shape"]
    assert [call[1] for call in shapes] == ["input_ids", "hidden_in"]
    assert fake.calls.index(("add_profile",)) < fake.calls.index(("build",))
    assert record.flags == ["FP16"] and record.profile["input_ids"]["max"] == [4, 64]
    assert not list((tmp_path / "out").glob(".*.tmp"))  # atomic write left no temp file


def test_build_engine_reports_parser_errors(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(trt_export, "require_tensorrt", lambda: _FakeTensorRT(parse_ok=False))
    with pytest.raises(TensorRTBuildError, match="unsupported op Foo") as info:
        build_engine(tmp_path / "g.onnx", tmp_path / "g.engine", {})
    assert info.value.errors == ["node 3 (node_Foo): unsupported op Foo"]


def test_build_engine_requires_profiles_for_dynamic_inputs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(trt_export, "require_tensorrt", lambda: _FakeTensorRT())
    with pytest.raises(TensorRTBuildError, match="without a profile.*hidden_in"):
        build_engine(
            tmp_path / "g.onnx", tmp_path / "g.engine", {"input_ids": ((1, 1), (1, 1), (1, 1))}
        )


def test_missing_precision_flag_is_explained() -> None:
    fake = _FakeTensorRT(flags=())  # TensorRT 11 removed the weak-typing flags
    with pytest.raises(TensorRTBuildError, match="no BuilderFlag.BF16"):
        apply_precision(types.SimpleNamespace(set_flag=lambda flag: None), fake, "bf16")
    assert apply_precision(None, fake, "fp32") == []


# ------------------------------------------------------------------------------ CLI behaviour
def test_cli_reports_missing_tensorrt_with_exit_code_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_spec.cli import export as export_cli
    from lightning_spec.export import cli

    monkeypatch.setattr(
        trt_export,
        "tensorrt_available",
        lambda: (False, "python package tensorrt not importable: ModuleNotFoundError"),
    )
    manifest: dict = {}
    error = cli._tensorrt_step(
        tmp_path, manifest, precision="fp16", dim_ranges=None, timing_cache=None
    )
    assert error is not None and error.exit_code == cli.EXIT_NO_TENSORRT == 3
    assert "tensorrt not importable" in str(error) and "ONNX export" in str(error)
    assert manifest["tensorrt"] == {
        "requested": True,
        "available": False,
        "precision": "fp16",
        "reason": "python package tensorrt not importable: ModuleNotFoundError",
    }

    # Through main(): the same code reaches the shell.
    def fake_export(*args, **kwargs):
        raise error

    monkeypatch.setattr(export_cli, "export_package", fake_export)
    code = export_cli.main(
        ["--drafter", str(tmp_path), "--output", str(tmp_path / "o"), "--tensorrt"]
    )
    assert code == 3


def test_cli_rejects_bad_trt_dims(tmp_path: Path, capsys) -> None:
    from lightning_spec.cli import export as export_cli
    from lightning_spec.export import cli

    code = export_cli.main(
        ["--drafter", str(tmp_path), "--output", str(tmp_path / "o"), "--trt-dim", "past=9:1:2"]
    )
    assert code == cli.EXIT_USAGE
    assert "--trt-dim" in capsys.readouterr().err


# ---------------------------------------------------------------------- the real thing (GPU)
@pytest.mark.requires_cuda
def test_engines_build_and_match_onnxruntime(tmp_path: Path) -> None:
    available, reason = tensorrt_available()
    if not available:
        pytest.skip(f"TensorRT engine test needs TensorRT and a GPU: {reason}")
    from lightning_spec.cli import export as export_cli
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.models.target import TargetModel
    from lightning_spec.models.tiny import tiny_config

    target = TargetModel.from_config(tiny_config("llama"), seed=2)
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=32, token_counts=torch.arange(128))
    drafter.save_pretrained(tmp_path / "drafter")
    code = export_cli.main(
        [
            "--drafter",
            str(tmp_path / "drafter"),
            "--output",
            str(tmp_path / "out"),
            "--tensorrt",
            "--max-tree-nodes",
            "128",
        ]
    )
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert code == 0, manifest.get("tensorrt")
    engines = manifest["tensorrt"]["engines"]
    assert set(engines) == {"fc", "drafter_step", "tree_verify"}
    assert (tmp_path / "out" / "tensorrt" / "timing.cache").is_file()
    check = manifest["tensorrt"]["parity"]
    assert check["passed"], check
    assert check["tree_verify"]["mismatches"] == 0
    # A second build reuses the timing cache and fp16 stays within its tolerance.
    fp16 = trt_export.build_engines(tmp_path / "out", precision="fp16")
    assert fp16["engines"]["drafter_step"]["flags"] == ["FP16"]
    assert trt_export.engine_parity(tmp_path / "out")["passed"]
