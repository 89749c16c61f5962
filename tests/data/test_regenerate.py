"""Batched regeneration with a tiny target: record shape, greedy equality with plain decoding,
kill-and-resume without duplicates (a real SIGKILL), rank sharding, feature caching."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from lightning_spec.data.chat import render_prompt
from lightning_spec.data.regenerate import (
    GenerationSettings,
    PromptItem,
    cache_features,
    feature_config,
    greedy_answers,
    regenerate,
    target_answers,
)
from lightning_spec.data.rollouts import RolloutStore
from lightning_spec.decoding.engine import autoregressive_generate

CONFIG = {"kind": "regenerated", "target": "tiny", "max_length": 96}
WORDS = ["what", "is", "the", "sky", "sea", "red", "cat", "dog", "sun", "moon", "tree", "blue"]


def _prompts(count: int, seed: int = 0) -> list[PromptItem]:
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for index in range(count):
        length = int(torch.randint(2, 12, (1,), generator=generator))
        picks = torch.randint(0, len(WORDS), (length,), generator=generator).tolist()
        content = " ".join(WORDS[i] for i in picks)
        messages = [{"role": "user", "content": content}]
        prompts.append(PromptItem(f"p{index:03d}", messages=messages, meta={"n": index}))
    return prompts


def _settings(max_new_tokens: int = 12, **kwargs: float) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=max_new_tokens, **kwargs)


def test_records_are_prompt_then_answer(tmp_path: Path, tiny_target, chat_tokenizer) -> None:
    prompts = _prompts(10)
    store = RolloutStore(tmp_path, CONFIG)
    report = regenerate(
        tiny_target,
        chat_tokenizer,
        prompts,
        store,
        settings=_settings(),
        batch_size=4,
        records_per_shard=3,
        progress=False,
    )
    assert report.generated == 10 and report.assigned == 10 and report.already_done == 0
    assert [s.records for s in store.shards()] == [3, 3, 3, 1]
    assert report.new_tokens > 0 and report.tokens_per_second > 0
    records = {r.id: r for r in store.iter_records()}
    assert set(records) == {p.id for p in prompts}
    header = chat_tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant"])
    for prompt in prompts:
        record = records[prompt.id]
        prompt_ids = render_prompt(chat_tokenizer, prompt.messages)
        assert record.source == "regenerated"
        assert record.input_ids[: len(prompt_ids)] == prompt_ids
        assert prompt_ids[-2:] == header  # the answer follows the assistant header
        answer = len(record) - len(prompt_ids)
        assert record.loss_mask == [0] * len(prompt_ids) + [1] * answer
        assert 1 <= answer <= 12
        assert record.meta["finish"] in ("eos", "length") and record.meta["n"] == prompt.meta["n"]
        if record.meta["finish"] == "eos":
            assert record.input_ids[-1] == chat_tokenizer.eos_token_id
            assert chat_tokenizer.eos_token_id not in record.input_ids[len(prompt_ids) : -1]


def test_greedy_answers_equal_plain_decoding(tmp_path: Path, tiny_target, chat_tokenizer) -> None:
    # Same-length prompts share a batch without padding, so the arithmetic is the same.
    prompts = [
        PromptItem(f"q{i}", input_ids=[3, 6, 10 + i, 20 + i, 30 + i, 2, 3, 7]) for i in range(4)
    ]
    store = RolloutStore(tmp_path, CONFIG)
    regenerate(tiny_target, chat_tokenizer, prompts, store, settings=_settings(20), progress=False)
    records = {r.id: r for r in store.iter_records()}
    for prompt in prompts:
        expected = autoregressive_generate(tiny_target, prompt.input_ids, 20)
        assert records[prompt.id].input_ids[len(prompt.input_ids) :] == expected


def test_sampled_answers_are_seeded_and_leave_the_greedy_text(tiny_target) -> None:
    """The T = 1 texts the sign test trains on: reproducible per seed, not the greedy text."""
    prompts = [[3, 6, 10 + i, 20 + i, 30 + i, 2, 3, 7] for i in range(4)]
    greedy = greedy_answers(tiny_target, prompts, max_new_tokens=12, batch_size=2)
    assert greedy == target_answers(tiny_target, prompts, settings=_settings(12), batch_size=4)

    def sampled(seed: int) -> list[list[int]]:
        settings = _settings(12, temperature=1.0, seed=seed)
        return target_answers(tiny_target, prompts, settings=settings, batch_size=2)

    assert sampled(1) == sampled(1)
    assert sampled(1) != sampled(2)
    assert sampled(1) != greedy


def test_left_padding_does_not_change_greedy_answers(
    tmp_path: Path, tiny_target, chat_tokenizer
) -> None:
    prompts = _prompts(6, seed=3)
    together = RolloutStore(tmp_path / "batched", CONFIG)
    alone = RolloutStore(tmp_path / "alone", CONFIG)
    for store, batch_size in ((together, 6), (alone, 1)):
        regenerate(
            tiny_target,
            chat_tokenizer,
            prompts,
            store,
            settings=_settings(10),
            batch_size=batch_size,
            progress=False,
        )
    batched = {r.id: r.input_ids for r in together.iter_records()}
    assert batched == {r.id: r.input_ids for r in alone.iter_records()}


def test_max_length_skips_long_prompts_and_cuts_answers(
    tmp_path: Path, tiny_target, chat_tokenizer
) -> None:
    prompts = [
        PromptItem("short", input_ids=[3, 6, 12, 2, 3, 7]),
        PromptItem("long", input_ids=[3, 6] + [12] * 30 + [2, 3, 7]),
    ]
    store = RolloutStore(tmp_path, CONFIG)
    report = regenerate(
        tiny_target,
        chat_tokenizer,
        prompts,
        store,
        settings=_settings(50),
        max_length=10,
        progress=False,
        eos_token_ids=[],  # never stop early: the limit must cut the answer
    )
    assert report.too_long == 1 and report.generated == 1
    (record,) = list(store.iter_records())
    assert record.id == "short" and len(record) == 10 and record.meta["finish"] == "length"


def test_sampled_regeneration_is_reproducible(tmp_path: Path, tiny_target, chat_tokenizer) -> None:
    prompts = _prompts(6, seed=1)
    outputs = []
    for run, seed in enumerate((5, 5, 6)):
        store = RolloutStore(tmp_path / str(run), CONFIG)
        settings = _settings(16, temperature=1.0, seed=seed)
        regenerate(tiny_target, chat_tokenizer, prompts, store, settings=settings, progress=False)
        outputs.append({r.id: r.input_ids for r in store.iter_records()})
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]
    assert GenerationSettings(temperature=0.0, seed=1).as_config() == (
        GenerationSettings(temperature=0.0, seed=2).as_config()
    )


def _regenerate_slowly(store_dir: Path, tokenizer, target, prompts) -> None:  # noqa: ANN001
    """Child process body: sleep after each shard so the parent can kill it mid-run."""
    torch.set_num_threads(1)
    store = RolloutStore(store_dir, CONFIG)
    regenerate(
        target,
        tokenizer,
        prompts,
        store,
        settings=_settings(),
        batch_size=4,
        records_per_shard=4,
        progress=False,
        on_shard=lambda info: time.sleep(1.0),
    )


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs fork start method"
)
def test_sigkill_then_resume_has_no_duplicates(
    tmp_path: Path, tiny_target, chat_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    prompts = _prompts(20)
    store_dir = tmp_path / "store"
    # Forked, not spawned: the child reuses the imported torch/transformers (a spawned child
    # would spend ~10 s importing them on a busy 2-core machine).
    process = multiprocessing.get_context("fork").Process(
        target=_regenerate_slowly, args=(store_dir, chat_tokenizer, tiny_target, prompts)
    )
    process.start()
    manifest = store_dir / "manifest.json"
    deadline = time.monotonic() + 120
    store = None
    while time.monotonic() < deadline and process.is_alive():
        if manifest.exists():
            store = store or RolloutStore(store_dir, CONFIG)
            if store.shards():
                break
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    assert process.exitcode == -signal.SIGKILL, "the child finished before it could be killed"
    assert store is not None
    before = store.shards()
    assert 1 <= len(before) < 5
    report = regenerate(
        tiny_target,
        chat_tokenizer,
        prompts,
        store,
        settings=_settings(),
        batch_size=4,
        records_per_shard=4,
        progress=False,
    )
    assert report.already_done == sum(s.records for s in before)
    ids = [r.id for r in store.iter_records()]
    assert len(ids) == len(set(ids)) == 20
    assert set(ids) == {p.id for p in prompts}
    assert not [p for p in store_dir.iterdir() if ".tmp-" in p.name]
    # Resumed batches are the same batches an uninterrupted run makes: identical answers.
    reference = RolloutStore(tmp_path / "reference", CONFIG)
    regenerate(
        tiny_target,
        chat_tokenizer,
        prompts,
        reference,
        settings=_settings(),
        batch_size=4,
        records_per_shard=4,
        progress=False,
    )
    resumed = {r.id: r.input_ids for r in store.iter_records()}
    assert resumed == {r.id: r.input_ids for r in reference.iter_records()}
    # A third run has nothing left to do.
    again = regenerate(tiny_target, chat_tokenizer, prompts, store, progress=False)
    assert again.generated == 0 and again.already_done == 20


def test_ranks_split_prompts_by_position(tmp_path: Path, tiny_target, chat_tokenizer) -> None:
    prompts = _prompts(9)
    store = RolloutStore(tmp_path, CONFIG)
    by_rank = {}
    for rank in (1, 0):  # order does not matter
        regenerate(
            tiny_target,
            chat_tokenizer,
            prompts,
            RolloutStore(tmp_path, CONFIG),
            settings=_settings(6),
            batch_size=2,
            records_per_shard=2,
            rank=rank,
            world_size=2,
            progress=False,
        )
        by_rank[rank] = {
            r.id for s in store.shards() if s.rank == rank for r in store.read_shard(s)
        }
    assert by_rank[0] == {p.id for i, p in enumerate(prompts) if i % 2 == 0}
    assert by_rank[1] == {p.id for i, p in enumerate(prompts) if i % 2 == 1}
    # Each rank writes its own shard names: 5 prompts -> 3 shards, 4 prompts -> 2 shards.
    names = sorted(s.name for s in store.shards())
    assert names == [f"shard-r000-00000{k}.jsonl" for k in (1, 2, 3)] + [
        f"shard-r001-00000{k}.jsonl" for k in (1, 2)
    ]
    # Another world size resumes the same store: everything is done already.
    for rank in range(3):
        report = regenerate(
            tiny_target,
            chat_tokenizer,
            prompts,
            store,
            rank=rank,
            world_size=3,
            progress=False,
        )
        assert report.generated == 0 and report.already_done == 3
    with pytest.raises(ValueError, match="rank"):
        regenerate(tiny_target, chat_tokenizer, prompts, store, rank=2, world_size=2)


def _regenerated_store(
    tmp_path: Path, tiny_target, chat_tokenizer, *, records_per_shard: int
) -> RolloutStore:
    """Six regenerated answers (8 new tokens each) in shards of ``records_per_shard``."""
    store = RolloutStore(tmp_path, CONFIG)
    regenerate(
        tiny_target,
        chat_tokenizer,
        _prompts(6),
        store,
        settings=_settings(8),
        records_per_shard=records_per_shard,
        progress=False,
    )
    return store


def test_cached_features_match_the_target(tmp_path: Path, tiny_target, chat_tokenizer) -> None:
    store = _regenerated_store(tmp_path, tiny_target, chat_tokenizer, records_per_shard=2)
    written = cache_features(tiny_target, store, cap_bytes=10**9, batch_size=4)
    config = feature_config(tiny_target)
    assert written > 0 and len(store.feature_shards(config)) == 3
    for info in store.shards():
        cached = store.read_features(info.name, feature_config=config)
        hidden = store.read_features(info.name, feature_config=config, key="last_hidden")
        for record in store.read_shard(info):
            alone = tiny_target(torch.tensor([record.input_ids]), use_cache=False)
            assert cached[record.id].shape == (len(record), tiny_target.feature_size)
            assert hidden[record.id].shape == (len(record), tiny_target.hidden_size)
            torch.testing.assert_close(
                cached[record.id].float(), alone.features[0], atol=5e-3, rtol=5e-3
            )
            torch.testing.assert_close(
                hidden[record.id].float(), alone.last_hidden[0], atol=5e-3, rtol=5e-3
            )
    assert cache_features(tiny_target, store, cap_bytes=10**9) == 0  # nothing left to cache


def test_feature_cache_stops_at_its_cap(tmp_path: Path, tiny_target, chat_tokenizer) -> None:
    store = _regenerated_store(tmp_path, tiny_target, chat_tokenizer, records_per_shard=2)
    config = feature_config(tiny_target)
    per_token = (tiny_target.feature_size + tiny_target.hidden_size) * 2
    cap = per_token * store.shards()[0].tokens + 1000  # about one shard
    cache_features(tiny_target, store, cap_bytes=cap)
    assert 1 <= len(store.feature_shards(config)) < 3
    assert store.feature_cache_full(config)
    assert store.manifest()["features"]["bytes"] <= cap


def test_feature_cache_covers_only_selected_records_and_grows(
    tmp_path: Path, tiny_target, chat_tokenizer
) -> None:
    """A run over part of a store caches only its records; a later run selecting more adds
    theirs to the same shard files (the earlier ones are kept, not recomputed)."""
    store = _regenerated_store(tmp_path, tiny_target, chat_tokenizer, records_per_shard=4)
    config = feature_config(tiny_target)
    records = [r for info in store.shards() for r in store.read_shard(info)]
    first = {records[0].id, records[1].id}
    written = cache_features(tiny_target, store, cap_bytes=10**9, select=lambda r: r.id in first)
    cached = {
        rid
        for info in store.shards()
        for rid in store.read_features(info.name, feature_config=config)
    }
    assert cached == first
    assert written == sum(
        (tiny_target.feature_size + tiny_target.hidden_size) * 2 * len(r) for r in records[:2]
    )
    shard = store.shards()[0].name
    before = store.read_features(shard, feature_config=config)[records[0].id].clone()

    later = {r.id for r in records[:5]}
    cache_features(tiny_target, store, cap_bytes=10**9, select=lambda r: r.id in later)
    cached = {
        rid
        for info in store.shards()
        for rid in store.read_features(info.name, feature_config=config)
    }
    assert cached == later
    assert torch.equal(store.read_features(shard, feature_config=config)[records[0].id], before)
    section_bytes = store.manifest()["features"]["bytes"]
    assert section_bytes == sum(e["bytes"] for e in store.feature_shards(config).values())
    assert cache_features(tiny_target, store, cap_bytes=10**9, select=lambda r: r.id in later) == 0
