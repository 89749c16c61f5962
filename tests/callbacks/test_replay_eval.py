"""ReplayAcceptance on a tiny target: replayed tau equals decoded tau, the error-fix rate, and
the evaluations a Trainer run logs at start, every N minutes and at the end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from lightning_spec.callbacks.acceptance import AcceptanceEval
from lightning_spec.callbacks.replay_eval import ReplayAcceptance, _holds_path
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config

PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 42], [7, 8, 9, 10]]


def _scripted():  # noqa: ANN202 - the Scripted module of test_callbacks
    path = Path(__file__).with_name("test_callbacks.py")
    spec = importlib.util.spec_from_file_location("callbacks_helpers_replay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HELPERS = _scripted()


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=4)


class Data(LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(3, 1))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(1, 1))

    def eval_prompts(self, n: int) -> list[list[int]]:
        return PROMPTS[:n]

    def train_prompts(self, n: int) -> list[list[int]]:
        return PROMPTS[::-1][:n]


def test_replayed_tau_is_the_decoders_tau(target: TargetModel) -> None:
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=40, token_counts=torch.arange(128))
    module = HELPERS.Scripted(target, drafter, None)
    replay = ReplayAcceptance(num_prompts=3, max_new_tokens=12, tree="chain:3", train_texts=0)
    replay._held_out = replay._texts(module, PROMPTS)
    decoded = AcceptanceEval(num_prompts=3, max_new_tokens=12, tree="chain:3")
    prompts = [t.prompt for t in replay._held_out]
    result = decoded.evaluate(module, prompts)
    assert all(len(t.answer) == 12 for t in replay._held_out)  # no EOS or near-tie cut here
    metrics = replay.evaluate(module)
    assert metrics["replay/tau"] == pytest.approx(float(result["tau"].compute()), abs=1e-9)
    alphas = [metrics[f"replay/alpha_{d}"] for d in (1, 2, 3)]
    assert alphas == pytest.approx(result["alpha"].compute().tolist(), nan_ok=True)
    assert "replay/error_fix_rate" not in metrics


def test_the_error_fix_rate_counts_the_starting_drafters_errors_made_no_more(
    target: TargetModel, greedy_fit  # noqa: ANN001
) -> None:
    weak = Eagle3Drafter.from_target(target)  # every token draftable, so every error fixable
    module = HELPERS.Scripted(target, weak, None)
    replay = ReplayAcceptance(num_prompts=1, max_new_tokens=12, tree="chain:3", train_texts=3)
    replay._held_out = replay._texts(module, PROMPTS[:1])
    replay._train = replay._texts(module, PROMPTS)
    replay._errors = replay._first_errors(module)
    assert replay._errors
    assert replay.evaluate(module)["replay/error_fix_rate"] == 0.0  # the same drafter
    greedy_fit(target, weak, PROMPTS, steps=300)  # memorises these very greedy texts
    assert replay.evaluate(module)["replay/error_fix_rate"] > 0.5


def test_path_lookup_in_a_tree() -> None:
    tree = DraftTree(torch.tensor([4, 5, 6, 7]), torch.tensor([-1, -1, 1, 1]), torch.zeros(4))
    assert _holds_path(tree, torch.tensor([5, 7]))
    assert not _holds_path(tree, torch.tensor([4, 6]))
    assert not _holds_path(tree, torch.tensor([5, 7, 1]))


def test_a_fit_logs_at_start_and_end_and_the_state_round_trips(
    target: TargetModel, tmp_path: Path
) -> None:
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=40, token_counts=torch.arange(128))
    replay = ReplayAcceptance(
        num_prompts=2, max_new_tokens=8, tree="chain:2", every_minutes=1e-6, train_texts=2
    )
    trainer = HELPERS._trainer(tmp_path, [replay], epochs=1)
    trainer.fit(HELPERS.Scripted(target, drafter, None), datamodule=Data())
    steps = [entry["step"] for entry in replay.history]
    assert steps[0] == 0 and steps[-1] == 3 and len(steps) >= 3  # start, every batch, end
    assert all("replay/tau" in entry and "replay/error_fix_rate" in entry for entry in replay.history)
    minutes = [entry["replay/minutes"] for entry in replay.history]
    assert minutes == sorted(minutes)
    restored = ReplayAcceptance()
    restored.load_state_dict(replay.state_dict())
    assert restored.history == replay.history and restored._errors == replay._errors
    with pytest.raises(ValueError, match="every_minutes"):
        ReplayAcceptance(every_minutes=0)
