"""mode="on_policy": rollouts by the real decoder with the current drafter, refreshed every N
optimizer steps, step fields in the batch, and a killed-and-resumed run on the same buffer."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_spec.callbacks.on_policy import RefreshRollouts
from lightning_spec.data.datamodule import RolloutDataModule
from lightning_spec.data.on_policy import STEP_KEYS
from lightning_spec.decoding.engine import autoregressive_generate
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.objectives.sft import SFT


class Recording(SFT):
    """SFT that remembers what each training batch held."""

    seen: list[dict]

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if not hasattr(self, "seen"):
            self.seen = []
        self.seen.append(
            {
                "ids": list(batch["ids"]),
                "anchors": batch["step_anchor"].tolist(),
                "keys": set(batch),
                "input_ids": batch["input_ids"].tolist(),
            }
        )
        return super().training_step(batch, batch_idx)


def _module(tmp_path: Path, chats: Path, tokenizer, target, **overrides) -> RolloutDataModule:  # noqa: ANN001, ANN003
    options = {"rollout_prompts": 4, "rollout_tree": "dynamic:3,2,6"} | overrides
    module = RolloutDataModule.from_objects(
        tokenizer=tokenizer,
        target_model=target,
        mode="on_policy",
        dataset=str(chats),
        cache_dir=str(tmp_path / "cache"),
        max_length=64,
        val_fraction=0.0,
        batch_size=2,
        rollout_max_new_tokens=8,
        prompts_for_eval=str(chats),
        progress=False,
        **options,
    )
    return module


def _objective(target) -> Recording:  # noqa: ANN001
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(target)
    # one schedule for the 5-step, the 3-step and the resumed run (the cosine's length would
    # otherwise follow each run's max_steps, and a resume restores the shorter one)
    return Recording.from_objects(
        target, drafter, ttt_steps=2, warmup_steps=1, lr=1e-3, max_steps_for_schedule=100
    )


def _trainer(tmp_path: Path, max_steps: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        max_steps=max_steps,
        default_root_dir=str(tmp_path),
        callbacks=callbacks,
    )


def test_on_policy_rollouts_refresh_and_resume(tmp_path: Path, chats, chat_tokenizer, tiny_target):  # noqa: ANN001
    data = chats(24, seed=3)
    target = tiny_target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # uninterrupted: refreshes at steps 0, 2 and 4 (every 2 optimizer steps)
        full_data = _module(tmp_path / "a", data, chat_tokenizer, target)
        full = _objective(target)
        _trainer(tmp_path / "a", 5, [RefreshRollouts(every_n_steps=2)]).fit(full, full_data)

        assert full_data.buffer.refreshes == 3  # at steps 0, 2 and 4
        assert full_data.buffer.version == "step-4"
        first = full.seen[0]
        assert set(STEP_KEYS) <= first["keys"]
        assert all(i.startswith("rollout-0-") for i in first["ids"])
        assert all(i.startswith("rollout-1-") for i in full.seen[2]["ids"])  # refreshed at 2
        # the rollouts are the decoder's: tokens after each prompt = the target's greedy decode
        for record in full_data.buffer.records:
            prompt = record.meta["prompt_tokens"]
            generated = record.input_ids[prompt:]
            reference = autoregressive_generate(target, record.input_ids[:prompt], 8)
            assert generated == reference[: len(generated)]
            assert record.steps and record.steps[0]["drafter_version"] == "step-4"
            assert sum(len(s["committed"]) for s in record.steps) + 1 == len(generated)

        # killed after step 3 (checkpoint every step), resumed: same buffer, same batches
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True)
        part_data = _module(tmp_path / "b", data, chat_tokenizer, target)
        part = _objective(target)
        _trainer(tmp_path / "b", 3, [RefreshRollouts(every_n_steps=2), ckpt]).fit(part, part_data)
        saved = [r.to_dict()["input_ids"] for r in part_data.buffer.records]

        resumed_data = _module(tmp_path / "c", data, chat_tokenizer, target)
        resumed = _objective(target)
        _trainer(tmp_path / "c", 5, [RefreshRollouts(every_n_steps=2)]).fit(
            resumed, resumed_data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
        )
    assert part.seen + resumed.seen == full.seen
    assert [r.input_ids for r in resumed_data.buffer.records] != saved  # refreshed again at 4
    assert resumed_data.buffer.refreshes == 3


@pytest.mark.parametrize("decode_batch", [0, 3])
def test_replayed_pool_rollouts_equal_decoded_ones_and_resume(  # noqa: ANN001
    tmp_path: Path, chats, chat_tokenizer, tiny_target, decode_batch: int
) -> None:
    """rollout_pool + rollout_replay: prompts come back, revisits are replayed (no decoding),
    the replayed rollouts equal what the decoder makes for the drafter of the time, and a
    resumed run keeps the remembered continuations. decode_batch 3: the pool's answers come
    from batched greedy generation instead of the decoder, with the same rollouts."""
    from lightning_spec.decoding.source import DecoderRolloutSource

    data = chats(24, seed=3)
    options = {
        "rollout_pool": 4,
        "rollout_replay": True,
        "rollout_prompts": 2,
        "rollout_decode_batch": decode_batch,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full_data = _module(tmp_path / "a", data, chat_tokenizer, tiny_target, **options)
        full = _objective(tiny_target)
        _trainer(tmp_path / "a", 6, [RefreshRollouts(every_n_steps=2)]).fit(full, full_data)
        source = full_data.rollout_source
        assert len(source.continuations) == 4  # the pool, decoded once each
        assert source.last_throughput["rollout_replayed"] == 2  # step 4: pool prompts 0 and 1
        assert source.last_throughput["rollout_decoded"] == 0
        prompts = [r.input_ids[: r.meta["prompt_tokens"]] for r in full_data.buffer.records]
        decoded = DecoderRolloutSource(
            tiny_target, tree="dynamic:3,2,6", max_new_tokens=8
        ).generate(full.drafter, prompts, version="step-4")
        for record, generation in zip(full_data.buffer.records, decoded, strict=True):
            assert record.input_ids[record.meta["prompt_tokens"] :] == generation.tokens
            assert [(s["anchor"], s["committed"]) for s in record.steps] == [
                (r.anchor, r.committed) for r in generation.records
            ]

        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True)
        part_data = _module(tmp_path / "b", data, chat_tokenizer, tiny_target, **options)
        part = _objective(tiny_target)
        _trainer(tmp_path / "b", 3, [RefreshRollouts(every_n_steps=2), ckpt]).fit(part, part_data)
        resumed_data = _module(tmp_path / "c", data, chat_tokenizer, tiny_target, **options)
        resumed = _objective(tiny_target)
        _trainer(tmp_path / "c", 6, [RefreshRollouts(every_n_steps=2)]).fit(
            resumed, resumed_data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
        )
    assert part.seen + resumed.seen == full.seen
    assert resumed_data.rollout_source.last_throughput["rollout_decoded"] == 0  # remembered
    assert len(resumed_data.rollout_source.continuations) == 4


def test_replay_needs_greedy_rollouts() -> None:
    with pytest.raises(ValueError, match="rollout_temperature 0"):
        RolloutDataModule(mode="on_policy", rollout_replay=True, rollout_temperature=1.0)
    with pytest.raises(ValueError, match="rollout_pool"):
        RolloutDataModule(mode="on_policy", rollout_pool=-1)
    with pytest.raises(ValueError, match="needs rollout_replay"):
        RolloutDataModule(mode="on_policy", rollout_decode_batch=8)


def test_online_mode_name_is_refused() -> None:
    with pytest.raises(ValueError, match="renamed 'dataset'"):
        RolloutDataModule(mode="online")


def test_empty_buffer_says_what_to_add(tmp_path: Path, chats, chat_tokenizer, tiny_target) -> None:  # noqa: ANN001
    module = _module(tmp_path, chats(12), chat_tokenizer, tiny_target)
    module.prepare_data()
    module.setup("fit")
    with pytest.raises(RuntimeError, match="RefreshRollouts"):
        next(iter(module.train_dataloader()))


def test_sft_mix_rows_ride_along_and_rotate_with_refreshes(
    tmp_path: Path, chats, chat_tokenizer, tiny_target
) -> None:  # noqa: ANN001
    module = _module(tmp_path, chats(24, seed=3), chat_tokenizer, tiny_target, rollout_sft_mix=True)
    module.prepare_data()
    module.setup("fit")
    drafter = _objective(tiny_target).drafter
    module.refresh_rollouts(drafter, step=0)
    first = [module._train[i]["sft"]["id"] for i in range(4)]
    batch = next(iter(module.train_dataloader()))
    assert batch["sft"]["input_ids"].shape[0] == batch["input_ids"].shape[0]
    assert "step_mask" in batch and "step_mask" not in batch["sft"]
    assert bool(batch["sft"]["loss_mask"].any())
    module.refresh_rollouts(drafter, step=2)
    second = [module._train[i]["sft"]["id"] for i in range(4)]
    assert len(set(first)) == 4 and not set(first) & set(second)  # new dataset rows
