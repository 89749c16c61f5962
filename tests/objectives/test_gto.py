"""GroupTreeOptimization on tiny models: prefix groups, the decoder's own trees and scores,
L_GTO = 0 while the drafter equals its reference, gradients after it moves, a Lightning run that
keeps the reference frozen and out of checkpoints, misalignment statistics by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.objectives.gto import GroupTreeOptimization, choose_groups, misalignment

VOCAB = 128


def _sft_helpers():  # noqa: ANN202 - test_sft's builders, reused as plain functions
    path = Path(__file__).with_name("test_sft.py")
    spec = importlib.util.spec_from_file_location("sft_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HELPERS = _sft_helpers()


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


def _batch(length: int = 40) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, length), generator=generator)
    ids[:, 10:] = ids[:, :10].repeat(1, length // 10)[:, : length - 10]  # repeats: acceptable
    attention = torch.ones(2, length, dtype=torch.long)
    attention[1, length - 6 :] = 0
    ids[1, length - 6 :] = 0
    loss_mask = torch.zeros(2, length, dtype=torch.long)
    loss_mask[:, 8:] = 1
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask * attention}


def _module(target: TargetModel, **overrides: object) -> GroupTreeOptimization:
    drafter = HELPERS._drafter(target)
    options = {
        "tree": "dynamic:3,3,8",
        "group_size": 4,
        "groups": 2,
        "ttt_steps": 2,
        "lr": 1e-2,
        "warmup_steps": 1,
        "max_steps_for_schedule": 10,
    }
    options.update(overrides)
    return GroupTreeOptimization.from_objects(target, drafter, **options)


def test_choose_groups_takes_adjacent_valid_roots() -> None:
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1])
    generator = torch.Generator().manual_seed(0)
    roots = choose_groups(mask, groups=5, group_size=3, offset=1, generator=generator)
    # valid roots R: next token is a loss token -> R in {2..6, 8, 9}; runs of 3 start at 2..4
    assert roots.tolist() == [[2, 3, 4], [3, 4, 5], [4, 5, 6]]
    assert choose_groups(mask, groups=2, group_size=6, offset=1, generator=generator) is None
    one = choose_groups(mask, groups=1, group_size=3, offset=1, generator=generator)
    assert one.shape == (1, 3)


def test_gto_term_is_zero_at_the_reference_and_trains_once_it_moves(
    target: TargetModel,
) -> None:
    module = _module(target)
    batch = _batch()
    result = module.gto_term(batch, statistics=True)
    assert result.prefixes == 16  # 2 sequences x 2 groups x 4 prefixes
    assert result.trees_scored == 32 and result.rows_scored > 32
    # current == reference: debiased rewards are all 0, so are the advantages and the loss
    assert result.reward == pytest.approx(result.reference_reward)
    assert float(result.loss.detach()) == 0.0 and result.ratio_mean == pytest.approx(1.0)
    assert result.accept_length == pytest.approx(result.reference_accept_length)
    assert 0.0 <= result.pruned <= 1.0 and 0.0 <= result.follows <= 1.0
    assert result.pruned == result.reference_pruned
    # move the drafter (a few token-loss steps on this batch, so its drafts get accepted):
    # rewards differ from the reference and the surrogate has gradients
    optimizer = torch.optim.Adam(module.drafter.parameters(), lr=3e-3)
    for _ in range(30):
        optimizer.zero_grad()
        module._common_step(batch).loss.backward()
        optimizer.step()
    module._generator.manual_seed(0)
    moved = module.gto_term(batch)
    assert moved.reward != pytest.approx(moved.reference_reward)
    assert moved.accept_length > 0  # the repeated text makes drafts acceptable
    module.drafter.zero_grad()
    moved.loss.backward()
    grads = [p.grad for p in module.drafter.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)
    assert all(p.grad is None for p in module.reference.parameters())


def test_trees_are_the_decoders_trees(target: TargetModel) -> None:
    """The tree GTO scores at root R is the one the decoder drafts after the same prefix."""
    module = _module(target, tree="dynamic:3,3,8")
    ids = _batch()["input_ids"][:1, :20]
    with torch.no_grad():
        features = target(ids).features
        trees = module._trees(module.drafter, ids, torch.tensor([12]), features)
    decoder = SpeculativeDecoder(target, module.drafter, parse_tree_spec("dynamic:3,3,8"))
    session = decoder.start(ids[0, :12].tolist(), 2)  # prefill commits t_12 = the root
    session.sequence[-1] = int(ids[0, 12])  # the root token the trees were built from
    session._absorb_all()
    record = session.step()
    assert torch.equal(record.tree.tokens, trees[0].tokens)
    assert torch.equal(record.tree.parents, trees[0].parents)


def test_misalignment_by_hand() -> None:
    # tree: root -> 5 (node 0) -> 7 (node 1); root -> 6 (node 2)
    tree = DraftTree(torch.tensor([5, 7, 6]), torch.tensor([-1, 0, -1]), torch.zeros(3))
    kept = DraftTree(torch.tensor([5, 7]), torch.tensor([-1, 0]), torch.zeros(2))
    pruned = DraftTree(torch.tensor([6, 9]), torch.tensor([-1, 0]), torch.zeros(2))
    shares = misalignment([tree, tree, tree], [kept, pruned, kept], [[0, 1], [2], []])
    # chain 5,7 is in the tree; chain 6,9 is cut after 6. Accepted 5,7 follows chain 5,7;
    # accepted 6 follows chain 6,9; the empty path follows any chain.
    assert shares == (pytest.approx(1 / 3), 1.0)
    assert misalignment([tree], [kept], [[2]]) == (0.0, 0.0)


def test_gto_fit_keeps_the_reference_frozen_and_out_of_checkpoints(
    target: TargetModel, tmp_path: Path
) -> None:
    module = _module(target)
    reference_before = {k: v.clone() for k, v in module.reference.state_dict().items()}
    drafter_before = module.drafter.fc.weight.clone()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        max_epochs=1,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        logger=False,
    )
    trainer.fit(module, datamodule=HELPERS.TinyData(_batch()))
    assert trainer.global_step == 2
    assert not torch.equal(module.drafter.fc.weight, drafter_before)
    for key, value in module.reference.state_dict().items():
        assert torch.equal(value, reference_before[key]), key
    metrics = trainer.logged_metrics
    for key in (
        "train/loss_gto",
        "train/reward_gap",
        "train/clip_fraction",
        "val/reward",
        "val/greedy_pruned",
        "val/greedy_reference_follows",
        "train/score_trees_per_s",
    ):
        assert key in metrics, key
    trainer.save_checkpoint(tmp_path / "gto.ckpt")
    checkpoint = torch.load(tmp_path / "gto.ckpt", weights_only=False)
    keys = checkpoint["state_dict"]
    assert not [k for k in keys if k.startswith(("target.", "reference."))]
    fresh = _module(target)
    fresh.on_load_checkpoint(checkpoint)
    fresh.load_state_dict(checkpoint["state_dict"], strict=True)
    torch.testing.assert_close(fresh.drafter.fc.weight, module.drafter.fc.weight)
    assert fresh._prefixes_seen == module._prefixes_seen > 0


def test_gto_needs_a_trained_drafter_and_valid_switches(target: TargetModel) -> None:
    with pytest.raises(ValueError, match="drafter_init"):
        _module(target).build_drafter(target)
    with pytest.raises(ValueError, match="aggregation"):
        _module(target, aggregation="median")
    with pytest.raises(ValueError, match="group_size"):
        _module(target, group_size=0)
    single = _module(target, group_size=1).gto_term(_batch())
    assert single.prefixes == 4  # 2 sequences x 2 groups of one


def test_gto_at_temperature_one_samples_with_the_decoders_verifier(target: TargetModel) -> None:
    module = _module(target, temperature=1.0)
    result = module.gto_term(_batch(), statistics=True)
    assert result.prefixes == 16 and float(result.loss.detach()) == 0.0
    assert Eagle3Drafter is type(module.reference)
