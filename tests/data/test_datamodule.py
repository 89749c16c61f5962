"""RolloutDataModule on a tiny tokenizer/target: the batch contract, modes, the stable split,
length bucketing, determinism, mid-epoch resume (by hand and through a Lightning Trainer), DDP
sharding as Lightning re-creates the batch sampler, and (slow) real ShareGPT with SmolLM2."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from lightning_spec.data.datamodule import RolloutDataModule
from lightning_spec.data.records import RolloutRecord
from lightning_spec.data.rollouts import RolloutStore
from lightning_spec.data.sampling import EpochPlan, LengthBucketBatchSampler
from lightning_spec.data.shards import ConfigMismatchError
from lightning_spec.data.tables import collate_records, split_ids


@pytest.fixture()
def data(chats) -> Path:  # noqa: ANN001
    return chats(48, seed=7)


def _module(
    data: Path,
    tmp_path: Path,
    tokenizer,
    target=None,
    **kwargs,  # noqa: ANN001
) -> RolloutDataModule:
    options = {
        "dataset": str(data),
        "cache_dir": str(tmp_path / "cache"),
        "max_length": 64,
        "val_fraction": 0.1,
        "batch_size": 4,
        "regenerate_max_new_tokens": 12,
        "regenerate_batch_size": 8,
        "prompts_for_eval": str(data),
        "progress": False,
        **kwargs,
    }
    module = RolloutDataModule.from_objects(tokenizer=tokenizer, target_model=target, **options)
    module.prepare_data()
    module.setup("fit")
    return module


def _ids(loader) -> list[list[str]]:  # noqa: ANN001
    return [batch["ids"] for batch in loader]


# --------------------------------------------------------------------------------------------
# The batch contract
# --------------------------------------------------------------------------------------------


def test_dataset_batches_follow_the_contract(data: Path, tmp_path: Path, chat_tokenizer) -> None:
    module = _module(data, tmp_path, chat_tokenizer, max_length=40)
    loader = module.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) > 1
    specials = set(chat_tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant", "user"]))
    eos = chat_tokenizer.eos_token_id
    for batch in batches:
        assert set(batch) == {"input_ids", "attention_mask", "loss_mask", "source", "ids"}
        for key in ("input_ids", "attention_mask", "loss_mask"):
            assert batch[key].dtype == torch.long and batch[key].shape == batch["input_ids"].shape
        size, width = batch["input_ids"].shape
        assert size <= 4 and width <= 40
        assert batch["source"] == ["dataset"] * size and len(batch["ids"]) == size
        lengths = batch["attention_mask"].sum(1)
        assert int(lengths.max()) == width
        for row in range(size):
            length = int(lengths[row])
            assert batch["attention_mask"][row, :length].all()
            assert not batch["attention_mask"][row, length:].any()
            assert (batch["input_ids"][row, length:] == chat_tokenizer.pad_token_id).all()
            assert not batch["loss_mask"][row, length:].any()
            tokens = batch["input_ids"][row, :length].tolist()
            mask = batch["loss_mask"][row, :length].tolist()
            assert tokens[0] == chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
            assert sum(mask) > 0
            assert not {t for t, m in zip(tokens, mask, strict=True) if m} & specials
            # Every end-of-turn closing an assistant turn is trained on, a user one never.
            for position, token in enumerate(tokens):
                if token == eos:
                    assert mask[position] == int(mask[position - 1] == 1)


def test_collate_pads_right_and_adds_features_only_when_all_rows_have_them() -> None:
    rows = [
        {
            "id": "a",
            "source": "dataset",
            "input_ids": torch.tensor([5, 6, 7]),
            "loss_mask": torch.tensor([0, 1, 1]),
            "features": torch.ones(3, 2, dtype=torch.float16),
        },
        {
            "id": "b",
            "source": "regenerated",
            "input_ids": torch.tensor([8]),
            "loss_mask": torch.tensor([1]),
            "features": torch.full((1, 2), 2.0, dtype=torch.float16),
        },
    ]
    batch = collate_records(rows, pad_id=9)
    assert "last_hidden" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["features"].dtype == torch.float32
    assert batch["features"][:, :, 0].tolist() == [[1, 1, 1], [2, 0, 0]]
    assert batch["source"] == ["dataset", "regenerated"] and batch["ids"] == ["a", "b"]
    for row in rows:
        row["last_hidden"] = torch.ones(len(row["input_ids"]), 3)
    assert collate_records(rows)["last_hidden"].shape == (2, 3, 3)
    rows[1]["features"] = None
    assert not {"features", "last_hidden"} & set(collate_records(rows))


def test_truncation_keeps_the_beginning(data: Path, tmp_path: Path, chat_tokenizer) -> None:
    short = _module(data, tmp_path / "a", chat_tokenizer, max_length=16, val_fraction=0.0)
    long = _module(data, tmp_path / "b", chat_tokenizer, max_length=512, val_fraction=0.0)
    full = {i: row for i, row in zip(long._train.ids, range(len(long._train)), strict=True)}
    for index in range(len(short._train)):
        cut = short._train[index]
        whole = long._train[full[cut["id"]]]
        assert len(cut["input_ids"]) <= 16
        assert cut["input_ids"].tolist() == whole["input_ids"][: len(cut["input_ids"])].tolist()
        assert cut["loss_mask"].tolist() == whole["loss_mask"][: len(cut["loss_mask"])].tolist()


# --------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------


def test_regenerated_mode_serves_target_answers(
    data: Path, tmp_path: Path, chat_tokenizer, tiny_target
) -> None:
    module = _module(data, tmp_path, chat_tokenizer, tiny_target, mode="regenerated")
    header = chat_tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant"])
    for batch in module.train_dataloader():
        assert set(batch["source"]) == {"regenerated"}
        for row in range(len(batch["ids"])):
            mask = batch["loss_mask"][row].tolist()
            first = mask.index(1)
            assert batch["input_ids"][row, first - 2 : first].tolist() == header
            assert sum(mask) <= 12 and all(mask[first : first + sum(mask)])


def test_split_is_stable_across_modes_and_seeds(
    data: Path, tmp_path: Path, chat_tokenizer, tiny_target
) -> None:
    splits = []
    for mode, seed in (("dataset", 0), ("regenerated", 3), ("mixture", 5)):
        module = _module(
            data, tmp_path, chat_tokenizer, tiny_target, mode=mode, seed=seed, val_fraction=0.25
        )
        splits.append((set(module._train.ids), set(module._val.ids)))
    for train, val in splits:
        assert train and val and not train & val
        assert (train, val) == splits[0]
    ids = [f"x{i}" for i in range(1000)]
    train, val = split_ids(ids, 0.02)
    assert 5 <= len(val) <= 40 and train | val == set(ids)
    assert split_ids(ids[:500], 0.02)[1] == {i for i in val if i in ids[:500]}  # per-id decision


def test_mixture_serves_each_conversation_once_per_epoch(
    data: Path, tmp_path: Path, chat_tokenizer, tiny_target
) -> None:
    counts = {}
    for fraction in (0.0, 0.5, 1.0):
        module = _module(
            data, tmp_path, chat_tokenizer, tiny_target, mode="mixture",
            regenerated_fraction=fraction,
        )  # fmt: skip
        loader = module.train_dataloader()
        sources = []
        for epoch in (0, 1):
            loader.batch_sampler.set_epoch(epoch)
            epoch_ids, epoch_sources = [], []
            for batch in loader:
                epoch_ids += batch["ids"]
                epoch_sources += batch["source"]
            assert sorted(epoch_ids) == sorted(set(module._train.ids))
            sources.append(epoch_sources)
        counts[fraction] = [s.count("regenerated") / len(s) for s in sources]
        if fraction == 0.5:
            assert sources[0] != sources[1]  # drawn again each epoch
    assert counts[0.0] == [0.0, 0.0] and counts[1.0] == [1.0, 1.0]
    assert all(0.2 < c < 0.8 for c in counts[0.5])


def test_unknown_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        RolloutDataModule(mode="offline")


def test_features_are_served_when_cached(
    data: Path, tmp_path: Path, chat_tokenizer, tiny_target
) -> None:
    module = _module(
        data, tmp_path, chat_tokenizer, tiny_target, mode="regenerated",
        feature_cache_bytes=10**8, records_per_shard=16,
    )  # fmt: skip
    batch = next(iter(module.train_dataloader()))
    size, width = batch["input_ids"].shape
    assert batch["features"].shape == (size, width, tiny_target.feature_size)
    row = 0
    length = int(batch["attention_mask"][row].sum())
    assert batch["last_hidden"].shape == (size, width, tiny_target.hidden_size)
    alone = tiny_target(batch["input_ids"][row : row + 1, :length], use_cache=False)
    torch.testing.assert_close(
        batch["features"][row, :length], alone.features[0], atol=5e-3, rtol=5e-3
    )
    torch.testing.assert_close(
        batch["last_hidden"][row, :length], alone.last_hidden[0], atol=5e-3, rtol=5e-3
    )
    assert not batch["features"][row, length:].any()
    # A cap of about one shard: some batches come with features, others without.
    capped = _module(
        data, tmp_path / "capped", chat_tokenizer, tiny_target, mode="regenerated",
        feature_cache_bytes=16 * 40 * (tiny_target.feature_size + tiny_target.hidden_size) * 2,
        records_per_shard=16,
    )  # fmt: skip
    with_features = ["features" in b for b in capped.train_dataloader()]
    assert any(with_features) and not all(with_features)


def test_an_explicit_cache_dir_refuses_another_config(
    data: Path, tmp_path: Path, chat_tokenizer
) -> None:
    _module(data, tmp_path, chat_tokenizer, max_length=64)
    with pytest.raises(ConfigMismatchError, match="another cache dir"):
        _module(data, tmp_path, chat_tokenizer, max_length=32)
    # Reuse: a second module with the same config renders nothing again.
    again = _module(data, tmp_path, chat_tokenizer, max_length=64)
    assert again.store("dataset").num_records == 48


def test_max_conversations_selects_a_prefix(data: Path, tmp_path: Path, chat_tokenizer) -> None:
    first = _module(data, tmp_path, chat_tokenizer, max_conversations=10, val_fraction=0.0)
    assert sorted(first._train.ids) == [f"conv-{i:04d}" for i in range(10)]
    # A bigger prefix extends the same store; a smaller one reads a subset without rendering.
    _module(data, tmp_path, chat_tokenizer, max_conversations=20, val_fraction=0.0)
    store = first.store("dataset")
    assert store.num_records == 20
    small = _module(data, tmp_path, chat_tokenizer, max_conversations=5, val_fraction=0.0)
    assert len(small._train) == 5 and store.num_records == 20


def test_eval_prompts_end_with_the_assistant_header(
    data: Path, tmp_path: Path, chat_tokenizer
) -> None:
    module = _module(data, tmp_path, chat_tokenizer)
    prompts = module.eval_prompts(5)
    header = chat_tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant"])
    assert len(prompts) == 5 and all(p[-2:] == header for p in prompts)
    assert all(isinstance(t, int) for p in prompts for t in p)
    assert len(module.eval_prompts()) == 48


# --------------------------------------------------------------------------------------------
# Sampling order, resume, DDP
# --------------------------------------------------------------------------------------------


def test_order_depends_on_seed_and_epoch_only(data: Path, tmp_path: Path, chat_tokenizer) -> None:
    a = _module(data, tmp_path, chat_tokenizer).train_dataloader()
    b = _module(data, tmp_path, chat_tokenizer).train_dataloader()
    c = _module(data, tmp_path, chat_tokenizer, seed=1).train_dataloader()
    assert _ids(a) == _ids(b)
    assert _ids(a) != _ids(c)
    first = _ids(a)
    a.batch_sampler.set_epoch(1)
    assert _ids(a) != first
    a.batch_sampler.set_epoch(0)
    assert _ids(a) == first


def test_length_buckets_cut_padding() -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 500, (2000,), generator=generator).numpy()

    def padding(bucket_batches: int) -> float:
        sampler = LengthBucketBatchSampler(
            batch_size=8, lengths=lengths, seed=0, bucket_batches=bucket_batches
        )
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(2000))
        assert len(batches) == len(sampler) == 250
        padded = sum(len(b) * max(lengths[b]) for b in batches)
        return 1 - lengths.sum() / padded

    assert padding(64) < 0.1 < 0.3 < padding(1)


def test_mid_epoch_resume_continues_exactly(data: Path, tmp_path: Path, chat_tokenizer) -> None:
    reference = _module(data, tmp_path, chat_tokenizer).train_dataloader()
    reference.batch_sampler.set_epoch(1)
    expected = _ids(reference)
    assert len(expected) >= 6

    module = _module(data, tmp_path, chat_tokenizer)
    loader = module.train_dataloader()
    loader.batch_sampler.set_epoch(1)
    seen = []
    for batch in loader:
        seen.append(batch["ids"])
        if len(seen) == 4:
            break
    state = module.state_dict()
    assert state["epoch"] == 1 and state["batches_consumed"] == 4

    restored = _module(data, tmp_path, chat_tokenizer)
    restored.load_state_dict(state)
    resumed = restored.train_dataloader()
    resumed.batch_sampler.set_epoch(1)
    seen += _ids(resumed)
    assert seen == expected
    resumed.batch_sampler.set_epoch(2)  # the next epoch is whole again
    reference.batch_sampler.set_epoch(2)
    assert _ids(resumed) == _ids(reference)


@pytest.mark.parametrize(("workers", "extra"), [(0, 3), (2, 3), (2, 0)])
def test_fit_resumed_from_a_checkpoint_sees_the_same_batches(
    data: Path, tmp_path: Path, chat_tokenizer, workers: int, extra: int
) -> None:
    """Stop after ``extra`` batches of the second epoch (0: at the end of the first), resume
    with ``fit(ckpt_path=last)``: together the runs see exactly the uninterrupted batches."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[list[str]] = []

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            self.seen.append(batch["ids"])
            return self.weight.sum() * batch["loss_mask"].float().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def trainer(**kwargs) -> pl.Trainer:  # noqa: ANN003
        options = {
            "accelerator": "cpu",
            "devices": 1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 0,
            "max_epochs": 2,
            "default_root_dir": str(tmp_path),
            **kwargs,
        }
        return pl.Trainer(**options)

    args = (data, tmp_path, chat_tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = Recorder()
        trainer(enable_checkpointing=False).fit(full, _module(*args, num_workers=workers))
        per_epoch = len(full.seen) // 2
        stop = per_epoch + extra
        first = Recorder()
        checkpoint = ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True
        )
        trainer(max_steps=stop, callbacks=[checkpoint]).fit(
            first, _module(*args, num_workers=workers)
        )
        second = Recorder()
        trainer(callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt2")]).fit(
            second,
            _module(*args, num_workers=workers),
            ckpt_path=str(tmp_path / "ckpt/last.ckpt"),
        )
    assert len(first.seen) == stop
    assert first.seen + second.seen == full.seen
    assert not [w for w in caught if "not resumable" in str(w.message)]


def test_ddp_ranks_partition_each_epoch(data: Path, tmp_path: Path, chat_tokenizer) -> None:
    """Lightning re-creates a custom batch sampler with a DistributedSampler as ``sampler``
    under DDP; each rank then takes its slice of each global batch (what one process with the
    global batch size would train on), and all ranks run the same step count."""
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    module = _module(data, tmp_path, chat_tokenizer, val_fraction=0.0)
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        loader = module.train_dataloader()
    per_rank = []
    for rank in (0, 1):
        sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=rank, shuffle=True)
        rank_loader = _update_dataloader(loader, sampler)
        assert rank_loader.batch_sampler.rank == rank
        assert rank_loader.batch_sampler.num_replicas == 2
        rank_loader.batch_sampler.sampler.set_epoch(0)  # what Lightning calls
        per_rank.append([sorted(b) for b in _ids(rank_loader)])
        assert len(per_rank[-1]) == len(rank_loader)
    # step k of the two ranks together = global batch k of one process with twice the batch
    module_global = _module(data, tmp_path / "g", chat_tokenizer, val_fraction=0.0, batch_size=8)
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        global_loader = module_global.train_dataloader()
    global_batches = [sorted(b) for b in _ids(global_loader)]
    assert len(per_rank[0]) == len(per_rank[1]) == len(global_batches)
    assert all(len(b) == 4 for b in per_rank[0] + per_rank[1])  # full batches on every rank
    flat = {i for b in global_batches for i in b}
    for step, batch in enumerate(global_batches):
        together = sorted(per_rank[0][step] + per_rank[1][step])
        if len(batch) == 8:
            assert together == batch
        else:  # the short last global batch, filled from the epoch's first records
            assert set(batch) <= set(together) <= flat


def test_epoch_plan_groups() -> None:
    plan = EpochPlan(5, groups=[(0, 1), (2, -1), (-1, 3), (4, -1)], regenerated_fraction=1.0)
    assert sorted(plan.items(0).tolist()) == [1, 2, 3, 4] and len(plan) == 4
    plan = EpochPlan(5, groups=[(0, 1), (2, -1)], regenerated_fraction=0.0)
    assert sorted(plan.items(3).tolist()) == [0, 2]


def test_cli_can_build_the_data_module_from_its_signature() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(RolloutDataModule, "data")
    config = parser.parse_args(["--data.mode", "mixture", "--data.max_conversations", "10"])
    assert config.data.mode == "mixture" and config.data.max_conversations == 10
    assert config.data.regenerated_fraction == 0.5 and config.data.target == "smollm2"
    assert "regenerated version" in parser.format_help()


# --------------------------------------------------------------------------------------------
# Real data (slow): ShareGPT with the SmolLM2 tokenizer
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sharegpt_with_smollm2_masks_assistant_tokens_only(tmp_path: Path) -> None:
    from lightning_spec.data.sources import ShareGPTSource

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = RolloutDataModule(  # the path a config takes: the tokenizer of "smollm2"
            target="smollm2",
            dataset="sharegpt",
            max_conversations=50,
            max_length=512,
            val_fraction=0.1,
            cache_dir=str(tmp_path),
            progress=False,
        )
        module.prepare_data()
        module.setup("fit")
        conversations = {c.id: c for c in ShareGPTSource(limit=50)}
    tokenizer = module.tokenizer
    assert tokenizer.name_or_path.endswith("smollm2-135m-instruct")
    # Conversations whose opening user turn alone fills 512 tokens carry no loss and are dropped.
    stored = list(module.store("dataset").iter_records())
    assert len(stored) == 50
    with_loss = {r.id for r in stored if r.num_loss_tokens > 0}
    assert set(module._train.ids) | set(module._val.ids) == with_loss
    assert len(with_loss) >= 30
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for loader in (module.train_dataloader(), module.val_dataloader()):
        for batch in loader:
            assert batch["input_ids"].shape[1] <= 512
            for row, conversation_id in enumerate(batch["ids"]):
                tokens = batch["input_ids"][row].tolist()
                mask = batch["loss_mask"][row].tolist()
                assert sum(mask) > 0
                runs, current = [], []
                for token, flag in zip(tokens, mask, strict=True):
                    if flag:
                        current.append(token)
                    elif current:
                        runs.append(current)
                        current = []
                if current:
                    runs.append(current)
                answers = [
                    m["content"]
                    for m in conversations[conversation_id].messages
                    if m["role"] == "assistant"
                ]
                for run in runs:
                    assert im_start not in run
                    text = tokenizer.decode([t for t in run if t != im_end]).strip()
                    assert any(text[:200] in answer for answer in answers), text[:80]
                # Each masked run is an assistant answer preceded by the assistant header.
                for start in range(1, len(mask)):
                    if mask[start] and not mask[start - 1]:
                        header = tokenizer.decode(tokens[max(0, start - 3) : start])
                        assert header.endswith("assistant\n")


# --------------------------------------------------------------------------------------------
# Cache keys by content
# --------------------------------------------------------------------------------------------


def test_store_keys_follow_content_not_paths(data: Path, tmp_path: Path, chat_tokenizer) -> None:
    """A data file moved (or reached through a symlink) and a tokenizer saved elsewhere key the
    same stores; the file edited in place, or a target retrained in place, key new ones."""
    from lightning_spec.data.shards import config_hash
    from tests.data.conftest import make_tiny_target

    def key(dataset: Path, tokenizer, target=None, kind: str = "dataset") -> str:  # noqa: ANN001
        module = RolloutDataModule.from_objects(
            tokenizer=tokenizer, target_model=target, dataset=str(dataset),
            target=str(tmp_path / "target-folder"), progress=False,
        )  # fmt: skip
        return config_hash(module.store_config(kind))

    moved = tmp_path / "elsewhere" / "moved.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(data.read_bytes())
    linked = tmp_path / "linked.jsonl"
    linked.symlink_to(moved)
    chat_tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = type(chat_tokenizer).from_pretrained(tmp_path / "tok")
    reloaded.chat_template = chat_tokenizer.chat_template
    reloaded.name_or_path = str(tmp_path / "tok")  # another path, the same vocabulary
    first = key(data, chat_tokenizer)
    assert key(moved, chat_tokenizer) == key(linked, chat_tokenizer) == first
    assert key(data, reloaded) == first
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(data.read_bytes())
    with open(edited, "a", encoding="utf-8") as handle:
        handle.write(data.read_text().splitlines()[0] + "\n")
    assert key(edited, chat_tokenizer) != first

    target = make_tiny_target(chat_tokenizer, seed=0)
    before = key(data, chat_tokenizer, target, "regenerated")
    retrained = make_tiny_target(chat_tokenizer, seed=1)  # the same folder, new weights
    assert key(data, chat_tokenizer, retrained, "regenerated") != before


def test_stores_of_the_embedded_default_are_adopted_not_recomputed(
    tmp_path: Path, chat_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores made before the content-keyed names, for the embedded default target and a
    packaged source (content pinned by the asset manifest), are renamed to the new key."""
    from lightning_spec.data.shards import config_hash

    monkeypatch.setenv("LIGHTNING_SPEC_CACHE", str(tmp_path / "cache"))
    module = RolloutDataModule.from_objects(
        tokenizer=chat_tokenizer, dataset="mtbench", target="smollm2", progress=False
    )
    root = tmp_path / "cache" / "rollouts"
    old_config = module.store_config("dataset", legacy=True)
    legacy = root / f"dataset-{config_hash(old_config)}"
    made = RolloutStore(legacy, old_config, prefix="dataset")  # a real store, old key
    made.write_shard([RolloutRecord("r0", [1, 2, 3], [0, 1, 1], "dataset", {})])
    adopted = module.store("dataset")
    assert adopted.directory != legacy and not legacy.exists()
    assert [record.id for record in adopted.iter_records()] == ["r0"]  # opens under the new key
    # a folder an earlier version renamed without rekeying its manifest is repaired in place
    fresh = RolloutDataModule.from_objects(
        tokenizer=chat_tokenizer, dataset="mtbench", target="smollm2", progress=False
    )
    manifest = json.loads((adopted.directory / "manifest.json").read_text())
    manifest["config"], manifest["config_hash"] = old_config, config_hash(old_config)
    (adopted.directory / "manifest.json").write_text(json.dumps(manifest))
    assert [record.id for record in fresh.store("dataset").iter_records()] == ["r0"]
    # any other target is keyed by its weights, and its old stores are not taken over
    other = RolloutDataModule.from_objects(
        tokenizer=chat_tokenizer, dataset="mtbench", target="some/other-model", progress=False
    )
    old = root / f"dataset-{config_hash(other.store_config('dataset', legacy=True))}"
    old.mkdir()
    assert other.store_dir("dataset") != old and old.exists()


# --------------------------------------------------------------------------------------------
# The draft vocabulary of a prompt-only stream (vocab_source: data)
# --------------------------------------------------------------------------------------------


def test_prompt_only_stream_counts_its_vocabulary_on_the_target_answers(
    tmp_path: Path, chat_tokenizer, tiny_target
) -> None:
    """A prompt-only stream has no assistant turns: counting it must fail loudly (it once gave
    ids 0..k-1 in silence), and `vocab_source: data` counts the target's regenerated answers."""
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.models.vocab import build_draft_vocab
    from lightning_spec.objectives.sft import SFT, draft_token_counts
    from tests.conftest import quiet_trainer

    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    stream = tmp_path / "stream.jsonl"
    rows = [{"prompt": f"{words[i % 5]} {words[(i * 3) % 5]}"} for i in range(24)]
    stream.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match="vocab_source: data"):
        draft_token_counts(tiny_target, source=str(stream), conversations=24, cache_dir=tmp_path)

    data = _module(stream, tmp_path, chat_tokenizer, tiny_target, mode="regenerated")
    vocab = len(chat_tokenizer)
    counts = data.train_token_counts(vocab)
    table = data._train
    by_hand = torch.zeros(vocab, dtype=torch.long)
    for index in range(len(table)):
        item = table[index]
        for token, mask in zip(item["input_ids"].tolist(), item["loss_mask"].tolist(), strict=True):
            by_hand[token] += mask
    assert torch.equal(counts, by_hand) and int(counts.sum()) > 0

    provisional = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=8, intermediate_size=32)
    module = SFT.from_objects(
        tiny_target,
        provisional,
        vocab_source="data",
        draft_vocab_size=8,
        intermediate_size=32,
        ttt_steps=1,
        warmup_steps=0,
    )
    module.drafter = module.build_drafter(tiny_target).float()  # a fresh, provisional head
    assert module._vocab_pending
    trainer = quiet_trainer(max_steps=1, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    _, t2d = build_draft_vocab(counts, 8, tiny_target.eos_token_ids)
    assert not torch.equal(provisional.t2d, t2d)  # zero counts would have kept ids 0..k-1
    assert torch.equal(module.drafter.t2d, t2d) and not module._vocab_pending
    # the optimizer trained the rebuilt head, not the provisional one
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert id(module.drafter.fc.weight) in optimized
