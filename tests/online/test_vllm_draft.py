"""The drafter push into a running vLLM engine, on our side (vLLM is not needed): a pushed file is
checked before the engine is touched, and a load that fails part-way leaves the engine serving the
previous drafter."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_spec.online.vllm_draft import DraftRejected, push_drafter, read_drafter


def drafter_folder(path: Path, scale: float, **extra: torch.Tensor) -> Path:
    path.mkdir(parents=True)
    tensors = {"fc.weight": torch.full((4, 6), scale), "midlayer.norm.weight": torch.ones(4) * scale}
    tensors.update(extra)
    save_file(tensors, str(path / "model.safetensors"))
    return path


class Engine:
    """Stands in for vLLM's draft model: `load` puts tensors into it one at a time, as vLLM's
    `load_weights` does, and can be told to fail after some of them."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.fail_after: int | None = None

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for index, (name, tensor) in enumerate(tensors):
            if self.fail_after is not None and index == self.fail_after:
                self.fail_after = None  # the failure is the push's, not the restore's
                raise RuntimeError("worker died mid-load")
            self.weights[name] = tensor.clone()


def test_a_push_replaces_the_served_drafter(tmp_path: Path) -> None:
    engine = Engine()
    served = read_drafter(drafter_folder(tmp_path / "a", 1.0))
    engine.load(iter(served.tensors))
    new = read_drafter(drafter_folder(tmp_path / "b", 2.0))
    now = push_drafter(engine.load, new, served)
    assert now is new and now.sha256 != served.sha256
    assert torch.equal(engine.weights["fc.weight"], torch.full((4, 6), 2.0))


def test_a_load_failing_part_way_restores_the_previous_drafter(tmp_path: Path) -> None:
    engine = Engine()
    served = read_drafter(drafter_folder(tmp_path / "a", 1.0))
    engine.load(iter(served.tensors))
    new = read_drafter(drafter_folder(tmp_path / "b", 2.0))
    engine.fail_after = 1  # the first tensor of the new drafter is in, the second is not
    with pytest.raises(RuntimeError, match="mid-load"):
        push_drafter(engine.load, new, served)
    assert all(torch.equal(engine.weights[name], t) for name, t in served.tensors)


def test_a_failed_restore_says_the_engine_must_restart(tmp_path: Path) -> None:
    served = read_drafter(drafter_folder(tmp_path / "a", 1.0))
    new = read_drafter(drafter_folder(tmp_path / "b", 2.0))

    def broken(tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError, match="restart the engine"):
        push_drafter(broken, new, served)


def test_bad_files_are_refused_before_the_engine_is_touched(tmp_path: Path) -> None:
    served = read_drafter(drafter_folder(tmp_path / "a", 1.0))
    good = drafter_folder(tmp_path / "b", 2.0)
    with pytest.raises(DraftRejected, match="sha256"):  # changed since the sender hashed it
        read_drafter(good, sha256="0" * 64)
    weights = good / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-9])  # a writer killed mid-write
    with pytest.raises(DraftRejected, match="safetensors"):
        read_drafter(good)
    with pytest.raises(DraftRejected, match="does not exist"):
        read_drafter(tmp_path / "nowhere")
    nan = drafter_folder(tmp_path / "nan", float("nan"))
    with pytest.raises(DraftRejected, match="NaN"):
        read_drafter(nan)
    engine = Engine()
    engine.load(iter(served.tensors))
    before = dict(engine.weights)
    wider = read_drafter(drafter_folder(tmp_path / "wide", 2.0, **{"d2t": torch.zeros(8, dtype=torch.long)}))
    with pytest.raises(DraftRejected, match="names differ"):
        push_drafter(engine.load, wider, served)
    reshaped = tmp_path / "shape"
    reshaped.mkdir()
    save_file({"fc.weight": torch.ones(8, 6), "midlayer.norm.weight": torch.ones(4)}, str(reshaped / "model.safetensors"))
    with pytest.raises(DraftRejected, match="change shape"):
        push_drafter(engine.load, read_drafter(reshaped), served)
    assert engine.weights.keys() == before.keys()
    assert all(torch.equal(engine.weights[n], before[n]) for n in before)
