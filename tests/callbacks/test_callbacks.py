"""Callbacks on a tiny target: acceptance evaluation, drafter folders, plots (no MLflow here;
tests/objectives/test_sft.py reads the same callbacks back from a SQLite MLflow store)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_spec.callbacks.acceptance import AcceptanceEval
from lightning_spec.callbacks.checkpoint import STATE_FILE, DrafterCheckpoint
from lightning_spec.callbacks.plots import AcceptancePlot, draw_acceptance
from lightning_spec.models.drafters.base import load_drafter
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.standalone import StandaloneDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config

PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 42], [7, 8, 9, 10]]


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=4)


class Scripted(LightningModule):
    """A module with a target and drafter whose validation logs a scripted `val/tau`."""

    def __init__(
        self,
        target: TargetModel,
        drafter: nn.Module,
        taus: list[float] | None,
        losses: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.target = target
        self.drafter = drafter
        self.taus = taus
        self.losses = losses
        self.weight = nn.Parameter(torch.zeros(1))
        self.validations = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return (self.weight - 1.0).pow(2).sum()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        pass

    def on_validation_epoch_end(self) -> None:
        if self.taus is not None and not self.trainer.sanity_checking:
            self.log("val/tau", self.taus[self.validations])
            if self.losses is not None:
                self.log("val/loss", self.losses[self.validations])
            self.validations += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.weight], lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(1, 1))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(1, 1))


def _trainer(tmp_path: Path, callbacks: list, epochs: int = 1) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=1,  # the sanity pass must not count as an evaluation
        default_root_dir=str(tmp_path),
        callbacks=callbacks,
    )


# ------------------------------------------------------------------------------ AcceptanceEval


def test_perfect_drafter_scores_k_plus_one(target: TargetModel) -> None:
    """The target as its own drafter accepts every draft: tau = k + 1, alpha_j = 1."""
    evaluator = AcceptanceEval(num_prompts=2, max_new_tokens=21, tree="chain:4")
    module = Scripted(target, StandaloneDrafter.from_model(target.model), None)
    result = evaluator.evaluate(module, PROMPTS[:2])
    # Every verification commits 5 tokens except where EOS or the limit cuts the last one.
    verifications = result["forwards"] - 2  # minus one prefill per prompt
    tau = float(result["tau"].compute())
    assert tau == pytest.approx((result["new_tokens"] - 2) / verifications)
    assert tau > 4.0 and 2 * 1 < verifications <= 2 * 5
    assert result["alpha"].compute().tolist() == [1.0, 1.0, 1.0, 1.0]
    assert module.drafter.training  # restored after decoding in eval mode


def test_eval_logs_every_n_validations_and_skips_sanity(
    target: TargetModel, tmp_path: Path
) -> None:
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=40, token_counts=torch.arange(128))
    evaluator = AcceptanceEval(
        num_prompts=2, max_new_tokens=6, tree="chain:2", every_n_val=2, prompts=PROMPTS
    )
    trainer = _trainer(tmp_path, [evaluator], epochs=3)
    trainer.fit(Scripted(target, drafter, None))
    assert [entry["epoch"] for entry in evaluator.history] == [0, 2]  # 1st and 3rd pass
    metrics = trainer.callback_metrics
    assert {"val/tau", "val/alpha_1", "val/alpha_2", "val/tokens_per_step"} <= set(metrics)
    entry = evaluator.history[-1]
    assert float(metrics["val/tau"]) == pytest.approx(entry["tau"])
    assert 1.0 <= entry["tau"] <= 3.0 and len(entry["per_prompt_tau"]) == 2
    assert 1.0 <= entry["tokens_per_step"] <= 3.0
    restored = AcceptanceEval(prompts=PROMPTS)
    restored.load_state_dict(evaluator.state_dict())
    assert restored.history == evaluator.history


def test_eval_prompts_come_from_the_datamodule(target: TargetModel, tmp_path: Path) -> None:
    from lightning.pytorch import LightningDataModule

    class Data(LightningDataModule):
        asked: list[int] = []

        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.zeros(1, 1))

        def val_dataloader(self) -> DataLoader:
            return DataLoader(torch.zeros(1, 1))

        def eval_prompts(self, n: int) -> list[list[int]]:
            self.asked.append(n)
            return PROMPTS[:n]

    drafter = Eagle3Drafter.from_target(target)
    evaluator = AcceptanceEval(num_prompts=1, max_new_tokens=4, tree="chain:2")
    data = Data()
    trainer = _trainer(tmp_path, [evaluator], epochs=2)
    trainer.fit(Scripted(target, drafter, None), datamodule=data)
    assert data.asked == [1]  # asked once, reused
    assert len(evaluator.history) == 2


def test_eval_without_prompts_explains(target: TargetModel, tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, [AcceptanceEval(num_prompts=1, max_new_tokens=2)])
    with pytest.raises(ValueError, match="eval_prompts"):
        trainer.fit(Scripted(target, Eagle3Drafter.from_target(target), None))


def test_eval_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="tree spec"):
        AcceptanceEval(tree="chain")
    with pytest.raises(ValueError, match="every_n_val"):
        AcceptanceEval(every_n_val=0)
    with pytest.raises(ValueError, match="num_prompts"):
        AcceptanceEval(num_prompts=0)


# --------------------------------------------------------------------------- DrafterCheckpoint


def test_best_and_last_folders_follow_the_metric(target: TargetModel, tmp_path: Path) -> None:
    drafter = Eagle3Drafter.from_target(target)
    checkpoint = DrafterCheckpoint(dirpath=str(tmp_path / "drafter"))
    module = Scripted(target, drafter, taus=[1.5, 2.5, 2.0])
    trainer = _trainer(tmp_path, [checkpoint], epochs=3)
    trainer.fit(module)
    best = json.loads((tmp_path / "drafter" / "best" / STATE_FILE).read_text())
    last = json.loads((tmp_path / "drafter" / "last" / STATE_FILE).read_text())
    assert (best["value"], best["global_step"]) == (2.5, 2)
    assert (last["value"], last["global_step"], last["best_value"]) == (2.0, 3, 2.5)
    assert checkpoint.state_dict() == {"best_value": 2.5, "best_step": 2, "best_tie": None}
    assert not list((tmp_path / "drafter").glob(".tmp-*"))
    torch.testing.assert_close(
        load_drafter(tmp_path / "drafter" / "last").fc.weight, drafter.fc.weight
    )


def test_a_tie_goes_to_the_lower_loss(target: TargetModel, tmp_path: Path) -> None:
    # Tau over a few prompts ties: 1.75 at steps 2, 3 and 4; the loss decides (lower at step 3;
    # at step 4 it is higher, so step 3 stays best). The tie-breaker is saved for a resume.
    checkpoint = DrafterCheckpoint(dirpath=str(tmp_path / "drafter"))
    module = Scripted(
        target,
        Eagle3Drafter.from_target(target),
        taus=[1.5, 1.75, 1.75, 1.75],
        losses=[9.0, 8.5, 8.25, 8.375],  # exact in float32, as logged
    )
    trainer = _trainer(tmp_path, [checkpoint], epochs=4)
    trainer.fit(module)
    best = json.loads((tmp_path / "drafter" / "best" / STATE_FILE).read_text())
    assert (best["value"], best["global_step"], best["best_tie"]) == (1.75, 3, 8.25)
    assert checkpoint.state_dict() == {"best_value": 1.75, "best_step": 3, "best_tie": 8.25}
    restored = DrafterCheckpoint(tie_breaker=None)
    restored.load_state_dict(checkpoint.state_dict())
    assert restored.best_tie == 8.25
    assert not restored._improves(1.75, 7.0)  # no tie-breaker: the earlier drafter stays
    with pytest.raises(ValueError, match="tie_mode"):
        DrafterCheckpoint(tie_mode="lowest")


def test_best_never_regresses_in_a_fresh_run_over_an_old_folder(
    target: TargetModel, tmp_path: Path
) -> None:
    """A second fit in the same folder (no Lightning checkpoint to resume from) keeps the old
    best/ until a drafter beats its recorded value."""
    first = Scripted(target, Eagle3Drafter.from_target(target), taus=[2.5])
    _trainer(tmp_path, [DrafterCheckpoint(dirpath=str(tmp_path / "drafter"))]).fit(first)
    worse = Scripted(target, Eagle3Drafter.from_target(target, seed=7), taus=[1.5, 2.0, 3.0])
    again = DrafterCheckpoint(dirpath=str(tmp_path / "drafter"))
    trainer = _trainer(tmp_path, [again], epochs=3)
    best_path = tmp_path / "drafter" / "best"
    seen: list[float] = []

    class Probe(Callback):
        def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            if not trainer.sanity_checking:
                seen.append(json.loads((best_path / STATE_FILE).read_text())["value"])

    trainer.callbacks.append(Probe())
    trainer.fit(worse)
    assert seen == [2.5, 2.5, 3.0]  # 1.5 and 2.0 did not replace the old 2.5; 3.0 did
    assert json.loads((best_path / STATE_FILE).read_text())["global_step"] == 3


def test_min_mode_missing_metric_and_interrupted_swap(target: TargetModel, tmp_path: Path) -> None:
    root = tmp_path / "drafter"
    # A job killed between the two renames left only the old best folder: it is put back.
    Eagle3Drafter.from_target(target).save_pretrained(root / ".tmp-best-old-1234")
    checkpoint = DrafterCheckpoint(dirpath=str(root), monitor="val/loss", mode="min")
    trainer = _trainer(tmp_path, [checkpoint], epochs=1)
    trainer.fit(Scripted(target, Eagle3Drafter.from_target(target), None))  # logs no val/loss
    assert (root / "last" / "config.json").is_file()
    assert (root / "best" / "config.json").is_file()  # restored, not overwritten
    assert not (root / "best" / STATE_FILE).exists()
    assert not list(root.glob(".tmp-*"))
    with pytest.raises(ValueError, match="mode"):
        DrafterCheckpoint(mode="maximum")


# ------------------------------------------------------------------------------ AcceptancePlot


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_acceptance_writes_a_png(tmp_path: Path) -> None:
    history = [
        {"step": 10, "tau": 1.8, "alpha": [0.6, 0.4, float("nan")], "tree": "chain:3"},
        {"step": 20, "tau": 2.1, "alpha": [0.7, 0.5, 0.3], "tree": "chain:3"},
    ]
    path = draw_acceptance(history, tmp_path / "sub" / "a.png")
    assert _is_png(path) and path.stat().st_size > 5000
    assert _is_png(draw_acceptance(history[:1], tmp_path / "one.png"))


def test_plot_after_each_evaluation_without_mlflow(target: TargetModel, tmp_path: Path) -> None:
    drafter = Eagle3Drafter.from_target(target)
    plot = AcceptancePlot(dirpath=str(tmp_path / "plots"))
    callbacks = [AcceptanceEval(num_prompts=1, max_new_tokens=4, prompts=PROMPTS), plot]
    trainer = _trainer(tmp_path, callbacks, epochs=2)
    trainer.fit(Scripted(target, drafter, None))  # no logger, no DrafterCheckpoint: no errors
    assert plot.last_path == tmp_path / "plots" / "acceptance.png" and _is_png(plot.last_path)
    assert plot._plotted == 2
    with pytest.raises(ValueError, match="png"):
        AcceptancePlot(filename="acceptance.svg")
