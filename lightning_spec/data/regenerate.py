"""Regenerate training responses with the target itself, batched, resumable and rank-sharded.

A drafter is judged by how often the *target* accepts its guesses, so training on the target's
own answers (rather than the dataset's, written by another model) aligns the training
distribution with what the drafter will see (EAGLE and Medusa report gains from it). For each
training prompt (system message + first user turn, rendered with the chat template) the target
answers with batched ``model.generate`` (left padding, greedy or sampled), and each answer
becomes a record ``prompt (loss 0) + answer (loss 1)`` tagged ``source="regenerated"``.

Records land in a :class:`~lightning_spec.data.rollouts.RolloutStore` shard by shard as they
complete. A rerun reads the ids already stored and skips them, so an interrupted job resumes
without duplicates (a shard the manifest does not list never counts). Under DDP, rank ``r``
takes the prompts at positions ``i % world_size == r`` of the full prompt list and writes its
own shard names; any world size can resume any other's work since done ids are global.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_spec.data.chat import render_prompt
from lightning_spec.data.claims import claimed_batches
from lightning_spec.data.records import RolloutRecord
from lightning_spec.data.rollouts import RolloutStore
from lightning_spec.data.shards import ShardInfo, StoreError
from lightning_spec.data.store_features import CACHED_FIELDS
from lightning_spec.progress import progress_bar

log = logging.getLogger(__name__)

Message = dict[str, str]


@dataclass(frozen=True)
class GenerationSettings:
    """How the target answers; part of the store's config hash (changing it means new data)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    """0 = greedy; > 0 samples at this temperature."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k filter (transformers would otherwise default to 50 when sampling)."""
    seed: int = 0
    """Sampling seed; each batch draws from a generator seeded by (seed, the batch's ids)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_config(self) -> dict[str, Any]:
        config = asdict(self)
        if self.greedy:  # sampling knobs do not change greedy output
            config = {"max_new_tokens": self.max_new_tokens, "temperature": 0.0}
        return config


@dataclass
class PromptItem:
    """One prompt to answer: chat ``messages`` (rendered lazily) or ready ``input_ids``."""

    id: str
    messages: list[Message] | None = None
    input_ids: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.messages is None and self.input_ids is None:
            raise ValueError(f"prompt {self.id!r} needs messages or input_ids")


@dataclass
class RegenerationReport:
    """What one call did (this rank only)."""

    assigned: int = 0
    already_done: int = 0
    too_long: int = 0
    generated: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    shards: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def _pad_id(target: Any, tokenizer: Any, eos_ids: Sequence[int]) -> int:
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(target.model.config, "pad_token_id", None),
    ):
        if isinstance(candidate, int):
            return candidate
    return int(sorted(eos_ids)[0]) if eos_ids else 0


def _batch_seed(seed: int, ids: Sequence[str]) -> int:
    digest = hashlib.sha256(f"{seed}|{'|'.join(ids)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.inference_mode()
def generate_batch(
    target: Any,
    prompts: Sequence[Sequence[int]],
    *,
    settings: GenerationSettings,
    max_new_tokens: int,
    pad_id: int,
    eos_ids: Sequence[int],
    seed: int = 0,
) -> list[tuple[list[int], str]]:
    """Answer left-padded ``prompts`` with ``target.model.generate``.

    Returns ``(new tokens, finish)`` per prompt, cut after the first end-of-turn token
    (``finish = "eos"``) or at the limit (``"length"``). Tokens after an EOS are padding;
    without an EOS nothing is trimmed (the pad id may be a real token).
    """
    device = target.device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "pad_token_id": pad_id,
        "eos_token_id": list(eos_ids) or None,
        "do_sample": not settings.greedy,
    }
    if not settings.greedy:
        kwargs.update(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        output = target.model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs
        )
    eos = set(eos_ids)
    results: list[tuple[list[int], str]] = []
    for row in output[:, width:].tolist():
        cut = next((i for i, token in enumerate(row) if token in eos), None)
        if cut is None:
            results.append((row, "length"))
        else:
            results.append((row[: cut + 1], "eos"))
    return results


def greedy_answers(
    target: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int
) -> list[list[int]]:
    """The target's greedy answer to each of `prompts` (token ids), `batch_size` at a time.

    Batched arithmetic (left padding) may break a near-tie differently from one-at-a-time
    decoding, so a caller that needs the exact batch-1 greedy text checks it (`ReplayingRolloutSource`
    keeps the longest greedy prefix). Prompts are batched by length to keep padding low.
    """
    return target_answers(
        target, prompts, settings=GenerationSettings(max_new_tokens=max_new_tokens),
        batch_size=batch_size,
    )  # fmt: skip


def target_answers(
    target: Any,
    prompts: Sequence[Sequence[int]],
    *,
    settings: GenerationSettings,
    batch_size: int,
) -> list[list[int]]:
    """The target's answer to each of `prompts` under `settings` (greedy, or sampled with
    `settings.seed` and each batch's position in the length order: the same prompts and seed
    give the same answers), `batch_size` at a time, prompts batched by length."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    eos_ids = sorted(target.eos_token_ids)
    pad_id = _pad_id(target, getattr(target, "tokenizer", None), eos_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    for begin in range(0, len(order), batch_size):
        chunk = order[begin : begin + batch_size]
        results = generate_batch(
            target,
            [prompts[i] for i in chunk],
            settings=settings,
            max_new_tokens=settings.max_new_tokens,
            pad_id=pad_id,
            eos_ids=eos_ids,
            seed=settings.seed * 1_000_003 + begin,
        )
        for i, (tokens, _) in zip(chunk, results, strict=True):
            answers[i] = tokens
    return answers


class ShardBuffer:
    """Finished records waiting to be written as a shard of `store`, each written shard named in
    `report` and handed to `on_shard` (both regeneration paths write through this)."""

    def __init__(self, store: RolloutStore, rank: int, report: RegenerationReport,
                 on_shard: Callable[[ShardInfo], None] | None) -> None:  # fmt: skip
        self.store, self.rank, self.report, self.on_shard = store, rank, report, on_shard
        self.records: list[RolloutRecord] = []

    def flush(self, count: int) -> None:
        info = self.store.write_shard(self.records[:count], rank=self.rank)
        del self.records[:count]
        if info is None:  # another process listed these records first
            return
        self.report.shards.append(info.name)
        if self.on_shard is not None:
            self.on_shard(info)

    def flush_all(self) -> None:
        if self.records:
            self.flush(len(self.records))


def regenerate(
    target: Any,
    tokenizer: Any,
    prompts: Sequence[PromptItem],
    store: RolloutStore,
    *,
    settings: GenerationSettings | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    records_per_shard: int = 64,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
    on_shard: Callable[[ShardInfo], None] | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> RegenerationReport:
    """Answer every prompt of this rank that ``store`` does not hold yet; return a report.

    ``target`` is a :class:`~lightning_spec.models.target.TargetModel` (``.model`` generates,
    ``.device``, ``.eos_token_ids``). Prompts of ``max_length`` tokens or more are skipped (no
    room for an answer); answers stop at ``max_length`` total tokens. Pending prompts are
    sorted by length before batching so a batch carries little padding.
    """
    settings = settings or GenerationSettings()
    if batch_size <= 0 or records_per_shard <= 0:
        raise ValueError("batch_size and records_per_shard must be positive")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    report = RegenerationReport()
    mine = [p for i, p in enumerate(prompts) if i % world_size == rank]
    report.assigned = len(mine)
    done = store.done_ids()
    pending: list[tuple[PromptItem, list[int]]] = []
    seen: set[str] = set()
    for item in mine:
        if item.id in done:
            report.already_done += 1
            continue
        if item.id in seen:
            log.warning("prompt id %r appears twice; keeping the first", item.id)
            continue
        seen.add(item.id)
        ids = list(item.input_ids) if item.input_ids is not None else None
        if ids is None:
            ids = render_prompt(tokenizer, item.messages or [])
        if max_length is not None and len(ids) >= max_length:
            report.too_long += 1
            continue
        pending.append((item, ids))
    if report.too_long:
        log.info("regeneration: %d prompts of %d+ tokens skipped", report.too_long, max_length)
    if not pending:
        return report
    pending.sort(key=lambda pair: (len(pair[1]), pair[0].id))
    eos_ids = sorted(eos_token_ids if eos_token_ids is not None else target.eos_token_ids)
    pad_id = _pad_id(target, tokenizer, eos_ids)
    shards = ShardBuffer(store, rank, report, on_shard)
    buffer, flush, flush_all = shards.records, shards.flush, shards.flush_all

    start = time.perf_counter()
    try:
        with progress_bar("regenerating", enabled=progress, unit="tok/s") as bar:
            task = bar.add_task("prompts", total=len(pending), rate=0.0)
            # claimed a batch at a time: processes sharing the store split the prompts between them
            for batch in claimed_batches(
                store.claims, pending, lambda pair: pair[0].id, size=batch_size,
                what="regenerating", before_wait=flush_all,
            ):  # fmt: skip
                budget = settings.max_new_tokens
                if max_length is not None:
                    budget = min(budget, max_length - min(len(ids) for _, ids in batch))
                answers = generate_batch(
                    target,
                    [ids for _, ids in batch],
                    settings=settings,
                    max_new_tokens=budget,
                    pad_id=pad_id,
                    eos_ids=eos_ids,
                    seed=_batch_seed(settings.seed, [item.id for item, _ in batch]),
                )
                for (item, ids), (tokens, finish) in zip(batch, answers, strict=True):
                    report.new_tokens += len(tokens)
                    if max_length is not None and len(ids) + len(tokens) > max_length:
                        tokens, finish = tokens[: max_length - len(ids)], "max_length"
                    meta: Mapping[str, Any] = {
                        **item.meta,
                        "prompt_tokens": len(ids),
                        "new_tokens": len(tokens),
                        "finish": finish,
                    }
                    buffer.append(
                        RolloutRecord(
                            id=item.id,
                            input_ids=ids + tokens,
                            loss_mask=[0] * len(ids) + [1] * len(tokens),
                            source="regenerated",
                            meta=dict(meta),
                        )
                    )
                    report.generated += 1
                report.seconds = time.perf_counter() - start
                bar.update(task, advance=len(batch), rate=report.tokens_per_second)
                while len(buffer) >= records_per_shard:
                    flush(records_per_shard)
            flush_all()
    finally:
        # also on an error: a claim left behind would make every other writer (another
        # DDP rank) wait for this live process, which waits for them at a collective
        store.claims.release()
    report.seconds = time.perf_counter() - start
    log.info(
        "regeneration (rank %d/%d): %d answers, %d new tokens in %.1f s (%.1f tok/s), "
        "%d already done, %d shards",
        rank,
        world_size,
        report.generated,
        report.new_tokens,
        report.seconds,
        report.tokens_per_second,
        report.already_done,
        len(report.shards),
    )
    return report


def feature_config(target: Any, target_id: str | None = None) -> dict[str, Any]:
    """What cached features depend on: the target, its feature layers and its dtype."""
    return {
        "target": target_id or str(getattr(target, "name", type(target).__name__)),
        "feature_layers": list(getattr(target, "feature_layers", [])),
        "dtype": str(getattr(target, "dtype", "")),
        "stored_as": "float16",
        "last_hidden": True,
        "target_argmax": True,
    }


@torch.inference_mode()
def cache_features(
    target: Any,
    store: RolloutStore,
    *,
    cap_bytes: int,
    batch_size: int = 8,
    max_length: int | None = None,
    target_id: str | None = None,
    progress: bool = False,
    select: Callable[[RolloutRecord], bool] | None = None,
) -> int:
    """Compute and store the target's fused features and final hidden states of the records of
    ``store`` that have none yet, until the cache would exceed ``cap_bytes``; return the bytes
    cached now.

    ``select`` limits the work to the records a run uses (a run over the first N conversations
    of a store rendered for more must not pay the target for all of them); a later run that
    selects more records adds theirs to the same shard files.

    Features of token t depend only on tokens <= t (causal attention), so a record truncated
    to ``max_length`` later still matches its cached prefix.
    """
    if cap_bytes <= 0:
        return 0
    config = feature_config(target, target_id)
    if store.feature_cache_full(config):
        return 0
    cached = store.feature_shards(config)
    plan: list[tuple[Any, list[RolloutRecord], dict[str, dict[str, Tensor]]]] = []
    for info in store.shards():
        wanted = [r for r in store.read_shard(info) if select is None or select(r)]
        have = {key: {} for key in CACHED_FIELDS}
        if info.name in cached:
            try:
                have = store.read_cached(info.name, feature_config=config)
            except StoreError as error:  # a damaged feature shard: recompute only it
                store.drop_feature_shard(info.name, str(error))
        missing = [r.truncated(max_length) for r in wanted if r.id not in have["features"]]
        if missing:
            plan.append((info, missing, have))
    config_key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]

    def claim_key(entry: tuple[Any, list[RolloutRecord], Any]) -> str:
        """One claim per (feature config, shard, records to add): concurrent runs that want the
        same features share it; a later run that selects more records gets a new one."""
        ids = hashlib.sha256("\n".join(sorted(r.id for r in entry[1])).encode()).hexdigest()
        return f"features:{config_key}:{entry[0].name}:{ids[:12]}"

    written = 0
    total_records = sum(len(entry[1]) for entry in plan)
    full = False
    try:
        with progress_bar("caching features", enabled=progress, unit="tok/s") as bar:
            task = bar.add_task("conversations", total=total_records, rate=0.0)
            start, tokens = time.perf_counter(), 0
            # one feature shard at a time, claimed: processes sharing the store split the shards
            for (entry,) in claimed_batches(
                store.claims, plan, claim_key, size=1, what="caching features"
            ):
                info, records, have = entry
                # cap reached (here or by another writer) or disk full: leave the rest, undone
                # (released: others stop waiting, and a later run with room caches it)
                if full or store.feature_cache_full(config):
                    full = True
                    store.claims.release([claim_key(entry)])
                    continue
                features = dict(have["features"])
                last_hidden = dict(have["last_hidden"])
                argmax = dict(have["target_argmax"])
                order = sorted(range(len(records)), key=lambda i: len(records[i]))
                for lo in range(0, len(order), batch_size):
                    batch = [records[i] for i in order[lo : lo + batch_size]]
                    width = max(len(r) for r in batch)
                    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
                    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
                    for row, record in enumerate(batch):
                        input_ids[row, : len(record)] = torch.tensor(record.input_ids)
                        attention_mask[row, : len(record)] = 1
                    output = target(
                        input_ids.to(target.device),
                        attention_mask=attention_mask.to(target.device),
                        use_cache=False,
                        logits_to_keep=1,  # the argmax below comes chunked: no [B, T, V] logits
                    )
                    batch_argmax = target.head_argmax(output.last_hidden)
                    for row, record in enumerate(batch):
                        features[record.id] = output.features[row, : len(record)].to("cpu")
                        last_hidden[record.id] = output.last_hidden[row, : len(record)].to("cpu")
                        argmax[record.id] = batch_argmax[row, : len(record)].to("cpu")
                        tokens += len(record)
                    rate = tokens / max(time.perf_counter() - start, 1e-9)
                    bar.update(task, advance=len(batch), rate=rate)
                stored = store.write_features(
                    info.name,
                    features,
                    feature_config=config,
                    cap_bytes=cap_bytes,
                    last_hidden=last_hidden,
                    target_argmax=argmax,
                )
                if not stored:  # not cached: released, not finished (a later run caches it)
                    store.claims.release([claim_key(entry)])
                    full = True
                    continue
                store.claims.finish([claim_key(entry)])
                written += sum(
                    int(f.numel()) * 2
                    for rid in features
                    if rid not in have["features"]
                    for f in (features[rid], last_hidden[rid])
                )
    finally:
        # also on an error: a claim left behind would make every other writer (another
        # DDP rank) wait for this live process, which waits for them at a collective
        store.claims.release()
    return written
