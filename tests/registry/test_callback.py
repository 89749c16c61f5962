"""RegisterDrafter on tiny fits: the best drafter is registered in the trainer's MLflow run
with the tau AcceptanceEval logged for it and promoted; a second run on other prompts makes
the callback measure both drafters; the callback instantiates from a LightningCLI-style config."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_spec.callbacks.acceptance import AcceptanceEval
from lightning_spec.callbacks.checkpoint import DrafterCheckpoint
from lightning_spec.callbacks.registry import RegisterDrafter, prompt_set_digest
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.registry import registry_client
from lightning_spec.tracking import SpecMLFlowLogger


class Tiny(LightningModule):
    """A target and a drafter; training moves one dummy weight (the drafter stays as built)."""

    def __init__(self, target: TargetModel, drafter: nn.Module) -> None:
        super().__init__()
        self.target = target
        self.drafter = drafter
        self.weight = nn.Parameter(torch.zeros(1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return (self.weight - 1.0).pow(2).sum()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.weight], lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(2, 1))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(1, 1))


def _fit(target: TargetModel, run_dir: Path, tracking_uri: str, callbacks: list[Callback]):  # noqa: ANN202
    logger = SpecMLFlowLogger(
        experiment_name="fit", run_dir=str(run_dir), tracking_uri=tracking_uri
    )
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        log_every_n_steps=1,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=str(run_dir),
        callbacks=callbacks,
    )
    trainer.fit(Tiny(target, Eagle3Drafter.from_target(target, seed=1)))
    return logger


def test_registers_the_best_drafter_with_its_logged_tau(
    target: TargetModel, prompts: list[list[int]], tracking_uri: str, tmp_path: Path
) -> None:
    client = registry_client(tracking_uri)
    evaluator = AcceptanceEval(num_prompts=3, max_new_tokens=6, tree="chain:2", prompts=prompts)
    register = RegisterDrafter(model_name="fit-drafter", strict=True)
    logger = _fit(
        target, tmp_path / "runs" / "a", tracking_uri, [evaluator, DrafterCheckpoint(), register]
    )
    label = prompt_set_digest(prompts)
    version = client.get_model_version("fit-drafter", register.version.version)
    assert version.run_id == logger.run_id  # the training run itself
    tags = version.tags
    assert float(tags[f"tau/{label}/T0"]) == pytest.approx(evaluator.history[-1]["tau"], abs=1e-6)
    assert (tags["tree"], tags["max_new_tokens"], tags["prompt_set"]) == ("chain:2", "6", label)
    assert tags["objective"] == "Tiny" and tags["training_step"] == "2"
    assert register.decision.outcome == "champion" and not register.decision.remeasured
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"  # Lightning finalized the run after registration
    assert run.data.params["promotion/outcome"] == "champion"
    assert run.data.metrics["promotion/candidate_tau"] == pytest.approx(
        evaluator.history[-1]["tau"]
    )
    assert "val/tau" in run.data.metrics

    # Another run, evaluated on other prompts: the champion has no figure for them, so both
    # drafters are measured side by side (same weights: same tau, within the margin).
    other = [p[::-1] for p in prompts]
    evaluator = AcceptanceEval(num_prompts=3, max_new_tokens=6, tree="chain:2", prompts=other)
    register = RegisterDrafter(model_name="fit-drafter", strict=True)
    _fit(target, tmp_path / "runs" / "b", tracking_uri, [evaluator, DrafterCheckpoint(), register])
    decision = register.decision
    assert decision.remeasured and not decision.comparable
    assert decision.candidate_tau == pytest.approx(decision.champion_tau)
    assert decision.candidate_tau == pytest.approx(evaluator.history[-1]["tau"])
    assert decision.outcome == "challenger"
    aliases = client.get_registered_model("fit-drafter").aliases
    assert {k: str(v) for k, v in aliases.items()} == {"champion": "1", "challenger": "2"}


def test_failures_are_logged_unless_strict(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = SimpleNamespace(
        is_global_zero=True,
        callbacks=[],
        loggers=[],
        default_root_dir=str(tmp_path / "run"),
        datamodule=None,
    )
    module = SimpleNamespace(target=None)
    register = RegisterDrafter(
        model_name="m", drafter_dir=str(tmp_path / "missing"), prompts=[[1, 2, 3]]
    )
    register.measure_if_missing = False
    with caplog.at_level(logging.ERROR):
        register.on_fit_end(trainer, module)
    assert "lightning-spec promote --drafter" in caplog.text and "missing" in caplog.text
    register.strict = True
    with pytest.raises(FileNotFoundError, match="not found"):
        register.on_fit_end(trainer, module)
    # A logger that lost its store: nothing is attempted, the error says so.
    from lightning.pytorch.loggers import MLFlowLogger

    offline = MLFlowLogger.__new__(MLFlowLogger)
    offline.offline, offline._tracking_uri = True, "http://127.0.0.1:9"
    trainer.loggers = [offline]
    with pytest.raises(ConnectionError, match="went offline"):
        register.on_fit_end(trainer, module)
    trainer.is_global_zero = False
    register.on_fit_end(trainer, module)  # other ranks do nothing
    with pytest.raises(ValueError, match="margin"):
        RegisterDrafter(model_name="m", margin=-1)


def test_instantiates_from_a_cli_config() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    config = parser.parse_object(
        {
            "callbacks": [
                {
                    "class_path": "lightning_spec.callbacks.registry.RegisterDrafter",
                    "init_args": {"model_name": "smollm2-eagle3", "margin": 0.1, "tree": "chain:4"},
                }
            ]
        }
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    (callback,) = instantiate(config).callbacks
    assert isinstance(callback, RegisterDrafter)
    assert (callback.model_name, callback.margin, callback.tree) == (
        "smollm2-eagle3",
        0.1,
        "chain:4",
    )
