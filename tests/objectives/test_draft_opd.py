"""DraftOPD on tiny models: rollouts from the real decoder, replay rows equal what drafting and
verification saw at each step, both KL forms train, ablations, a Lightning run on on-policy data."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lightning_spec.data.on_policy import collate_steps
from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.objectives.draft_opd import DraftOPD, replay_blocks


def _sft_helpers():  # noqa: ANN202 - test_sft's builders, reused as plain functions
    path = Path(__file__).with_name("test_sft.py")
    spec = importlib.util.spec_from_file_location("sft_helpers_opd", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HELPERS = _sft_helpers()


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


@pytest.fixture(scope="module")
def trained_state(target: TargetModel, greedy_fit) -> dict:  # noqa: ANN001
    """A drafter trained a little on the target's own greedy text, so rollouts accept some
    drafts and reject others (both streams non-empty)."""
    drafter = HELPERS._drafter(target)
    greedy_fit(target, drafter, [[5, 9, 14, 3], [40, 41]])
    return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def _trainer(tmp_path: Path, *, steps: int):  # noqa: ANN202
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator="cpu", devices=1, max_steps=steps, max_epochs=1, log_every_n_steps=1,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=str(tmp_path), logger=False,
        limit_val_batches=0,
    )  # fmt: skip


def _module(target: TargetModel, state: dict, **overrides: object) -> DraftOPD:
    # these tests are about the tried-node form; the reference's suffix form: test_opd_suffix
    options = {"lr": 1e-2, "warmup_steps": 1, "max_steps_for_schedule": 10, "ttt_steps": 2,
               "rejected_stream": "tried"}  # fmt: skip
    options.update(overrides)
    drafter = HELPERS._drafter(target)
    drafter.load_state_dict(state)
    return DraftOPD.from_objects(target, drafter, **options)


def _rollout_batch(module: DraftOPD, tree: str = "dynamic:3,3,8") -> tuple[dict, list]:
    """Two rollouts of the module's drafter by the real decoder, collated as on-policy data."""
    decoder = SpeculativeDecoder(module.target, module.drafter, parse_tree_spec(tree))
    prompts = [[5, 9, 14, 3], [40, 41]]  # the texts the drafter was trained on
    generations = [decoder.generate(p, 20, stop_on_eos=False) for p in prompts]
    sequences = [p + g.tokens for p, g in zip(prompts, generations, strict=True)]
    width = max(len(s) for s in sequences)
    ids = torch.zeros(2, width, dtype=torch.long)
    attention = torch.zeros(2, width, dtype=torch.long)
    loss_mask = torch.zeros(2, width, dtype=torch.long)
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        loss_mask[row, len(prompt) : len(sequence)] = 1
    steps = collate_steps([{"steps": g.records} for g in generations])
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, **steps}
    return batch, generations


def _blocks(batch: dict, row: int, **kwargs: object):  # noqa: ANN202
    length = int(batch["attention_mask"][row].sum())
    return replay_blocks(
        batch["input_ids"][row, :length],
        step_mask=batch["step_mask"][row],
        anchors=batch["step_anchor"][row],
        accept_lengths=batch["step_accept_length"][row],
        rejected_mask=batch["rejected_mask"][row],
        rejected_depth=batch["rejected_depth"][row],
        rejected_tokens=batch["rejected_tokens"][row],
        offset=1,
        **kwargs,
    )


def test_replay_rows_equal_what_drafting_and_verification_saw(
    target: TargetModel, trained_state: dict
) -> None:
    """At each step's rejected drafts, the replayed drafter row gives the log q the tree was
    built with and the replayed target row the log p verification recorded (full vocabulary
    convention: the target's own log-softmax)."""
    module = _module(target, trained_state, vocabulary="full")
    batch, generations = _rollout_batch(module)
    blocks = _blocks(batch, 0)
    assert blocks is not None and blocks.anchors.numel() == len(generations[0].records)
    ids = batch["input_ids"][:1, : int(batch["attention_mask"][0].sum())]
    with torch.no_grad():
        target_rows, draft_rows = module.replay_rows(ids, blocks)
    checked = 0
    for s, record in enumerate(generations[0].records):
        for node in record.rejected.tolist():
            depth = int(record.tree.depth[node])
            draft_id = module.drafter.target_to_draft_ids(record.tree.tokens[node : node + 1])
            q = float(draft_rows[s, depth - 1, draft_id])
            p = float(target_rows[s, depth - 1, draft_id])
            assert q == pytest.approx(float(record.tree.logprobs[node]), abs=1e-4)
            assert p == pytest.approx(float(record.target_token_logprobs[node]), abs=1e-4)
            checked += 1
        # the accepted drafts are the committed tokens after the anchor
        n = int(record.accept_length)
        assert blocks.chains[s, :n].tolist() == record.committed[:n]
    assert checked > 0


@pytest.mark.parametrize("kl", ["exact", "estimator"])
def test_both_kl_forms_give_a_finite_loss_with_gradients(
    target: TargetModel, trained_state: dict, kl: str
) -> None:
    module = _module(target, trained_state, kl=kl)
    batch, _ = _rollout_batch(module)
    result = module.opd_loss(batch)
    loss = result["loss"]
    assert torch.isfinite(loss) and float(loss.detach()) > 0
    assert result["accepted"] > 0 and result["rejected"] > 0
    loss.backward()
    assert float(module.drafter.fc.weight.grad.abs().sum()) > 0


def test_ablations_change_what_is_trained(target: TargetModel, trained_state: dict) -> None:
    batch, _ = _rollout_batch(_module(target, trained_state))
    forward_only = _module(target, trained_state, lambda_rejected=0.0).opd_loss(batch)
    reverse_only = _module(target, trained_state, lambda_accepted=0.0).opd_loss(batch)
    both = _module(target, trained_state).opd_loss(batch)
    assert float(forward_only["loss"].detach()) == pytest.approx(both["loss_accepted"], rel=1e-4)
    assert float(reverse_only["loss"].detach()) == pytest.approx(both["loss_rejected"], rel=1e-4)
    flat = _module(target, trained_state, gamma=1.0).opd_loss(batch)
    assert flat["loss_rejected"] >= both["loss_rejected"]  # no down-weighting of late slots
    moved = _blocks(batch, 0, random_anchors=True, generator=torch.Generator().manual_seed(0))
    errors = _blocks(batch, 0)
    assert torch.equal(moved.lengths <= errors.lengths, torch.ones_like(moved.lengths).bool())
    assert not torch.equal(moved.anchors, errors.anchors)
    with pytest.raises(ValueError, match="lambdas"):
        _module(target, trained_state, lambda_accepted=0.0, lambda_rejected=0.0)
    with pytest.raises(ValueError, match="kl"):
        _module(target, trained_state, kl="k2")


def test_a_dataset_batch_is_refused_with_the_reason(
    target: TargetModel, trained_state: dict
) -> None:
    module = _module(target, trained_state)
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "loss_mask": torch.ones(1, 4)}
    with pytest.raises(KeyError, match="on_policy"):
        module.on_train_batch_start(batch, 0)


def test_draft_opd_trains_in_lightning_and_resumes_its_counters(
    target: TargetModel, trained_state: dict, tmp_path: Path
) -> None:
    module = _module(target, trained_state)
    batch, _ = _rollout_batch(module)
    before = module.drafter.fc.weight.clone()
    trainer = _trainer(tmp_path, steps=2)
    trainer.fit(module, datamodule=HELPERS.TinyData(batch))
    assert trainer.global_step == 2
    assert not torch.equal(module.drafter.fc.weight, before)
    for key in ("train/loss", "train/loss_accepted", "train/loss_rejected", "train/rejected_slots"):
        assert key in trainer.logged_metrics, key
    trainer.save_checkpoint(tmp_path / "opd.ckpt")
    checkpoint = torch.load(tmp_path / "opd.ckpt", weights_only=False)
    fresh = _module(target, trained_state)
    fresh.on_load_checkpoint(checkpoint)
    fresh.load_state_dict(checkpoint["state_dict"], strict=True)
    assert fresh._accepted_seen == module._accepted_seen > 0


def test_the_target_cache_serves_revisits_with_identical_losses_and_gradients(
    target: TargetModel, trained_state: dict
) -> None:
    """A revisit of the same rollouts is served the target's side from the cache and gives
    exactly the loss and drafter gradients of a fresh computation; a changed rollout misses."""
    plain = _module(target, trained_state, target_cache_bytes=0)
    cached = _module(target, trained_state)
    assert plain._target_cache is None and cached._target_cache is not None
    batch, _ = _rollout_batch(plain)
    for visit in range(2):
        cached.drafter.zero_grad()
        cached_loss = cached.opd_loss(batch)["loss"]
        cached_loss.backward()
        plain.drafter.zero_grad()
        plain_loss = plain.opd_loss(batch)["loss"]
        plain_loss.backward()
        assert float(cached_loss.detach()) == float(plain_loss.detach()), visit
        assert torch.equal(cached.drafter.fc.weight.grad, plain.drafter.fc.weight.grad), visit
    rows = int(batch["input_ids"].shape[0])
    assert (cached._target_cache.misses, cached._target_cache.hits) == (rows, rows)
    changed = dict(batch, step_accept_length=batch["step_accept_length"].clamp(max=1))
    cached.opd_loss(changed)
    assert cached._target_cache.misses > rows
    assert _module(target, trained_state, anchors="random")._target_cache is None
    with pytest.raises(ValueError, match="target_cache_bytes"):
        _module(target, trained_state, target_cache_bytes=-1)


def test_lambda_sft_adds_the_token_loss_on_dataset_rows(
    target: TargetModel, trained_state: dict, tmp_path: Path
) -> None:
    """lambda_sft > 0: the step's loss is the Draft-OPD loss plus lambda times the EAGLE-3
    token loss on the batch's `sft` rows; without those rows the step says what to set."""
    from lightning_spec.objectives.base import BatchKeyError

    module = _module(target, trained_state, lambda_sft=0.5)
    batch, _ = _rollout_batch(module)
    sft_rows = {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"],
                "attention_mask": batch["attention_mask"]}  # fmt: skip
    with pytest.raises(BatchKeyError, match="rollout_sft_mix"):
        module.on_train_batch_start(batch, 0)
    mixed = dict(batch, sft=sft_rows)
    with torch.no_grad():
        expected = float(module.opd_loss(mixed)["loss"]) + 0.5 * float(
            module._common_step(sft_rows).loss
        )
    trainer = _trainer(tmp_path, steps=1)
    trainer.fit(module, datamodule=HELPERS.TinyData(mixed))
    assert "train/sft_loss" in trainer.logged_metrics
    assert float(trainer.logged_metrics["train/loss"]) == pytest.approx(expected, rel=1e-4)
    with pytest.raises(ValueError, match="lambda_sft"):
        _module(target, trained_state, lambda_sft=-1.0)


@pytest.mark.parametrize("kl", ["exact", "estimator"])
def test_the_correction_token_joins_the_forward_stream(
    target: TargetModel, trained_state: dict, kl: str
) -> None:
    """With `correction` every block whose text goes on adds one forward term: the committed
    token after its accepted drafts (slot n + 1), read off the target's row at anchor + n; and
    the pooled loss is the one weighted mean over both streams."""
    module = _module(target, trained_state, kl=kl)
    batch, _ = _rollout_batch(module)
    blocks = [_blocks(batch, row) for row in range(batch["input_ids"].shape[0])]
    ids = batch["input_ids"]
    corrections = [
        (blocks[row].corrections >= 0) & (module.drafter.target_to_draft_ids(blocks[row].corrections.clamp_min(0)) >= 0)
        for row in range(len(blocks)) if blocks[row] is not None
    ]
    assert all(
        int(ids[row, int(a) + int(n) + 1]) == int(c)
        for row, b in enumerate(blocks) if b is not None
        for a, n, c in zip(b.anchors, b.lengths, b.corrections, strict=True) if int(c) >= 0
    )
    with_correction = module.opd_loss(batch)
    without = _module(target, trained_state, kl=kl, correction=False).opd_loss(batch)
    added = sum(int(c.sum()) for c in corrections) if kl == "estimator" else sum(
        int((b.corrections >= 0).sum()) for b in blocks if b is not None
    )
    # the estimator needs the token in the draft vocabulary (this head's 48 ids rarely hold the
    # target's corrections); the exact KL trains the slot's whole row either way
    assert added > 0 or kl == "estimator"
    assert with_correction["accepted"] == without["accepted"] + added
    assert with_correction["rejected"] == without["rejected"]
    n_acc, n_rej = with_correction["accepted"], with_correction["rejected"]
    assert n_acc > 0 and n_rej > 0
