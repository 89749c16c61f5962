"""The shard stores a run reads, and how they are made: rendered, regenerated, cached, adopted.

`DataStores` owns every step that turns a dataset into records on disk, each resumable and
shared between processes through the store's claims (`data.claims`):

* **render**: the dataset's conversations with the target's chat template (``dataset`` store);
* **regenerate**: the target's own answers to the first user turns (``regenerated`` store),
  a rank's share at a time under DDP, by its batched ``generate`` or through the servers that
  serve it (``regenerate_with``, `data.regenerate_served`; every user turn with
  ``regenerate_turns="all"``);
* **cache features**: the target's features, final hidden states and argmax beside the token
  shards, up to a byte cap (those of regenerated records first from the spool of the server that
  answered them, ``features_from_spool``: `data.spool_features`);
* **adopt**: stores made before the content-keyed folder names are rekeyed, not recomputed;
* **read**: the records this run selected (the first ``max_conversations`` of the source), with
  their cached tensors.

A store's folder is named by the hash of what owns it (`store_config`): the tokenizer, the
source's content, ``max_length`` and, for regenerated answers, the target and the generation
settings, so a changed input never reuses stale shards. The data module (`data.datamodule`)
decides when each step runs (one process, or every DDP rank); this module does the work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_spec.data.records import RolloutRecord
from lightning_spec.data.rollouts import RolloutStore
from lightning_spec.data.shards import StoreError, tokenizer_fingerprint
from lightning_spec.data.tables import Entry

__all__ = ["DataStores", "EMBEDDED_TARGETS", "StoreSettings"]

log = logging.getLogger(__name__)

#: Target specs naming the embedded default (SmolLM2-135M-Instruct from its pinned asset).
EMBEDDED_TARGETS = ("smollm2", "default")


@dataclass(frozen=True)
class StoreSettings:
    """What the stores are made from and how (the data module's arguments of the same names)."""

    target: str
    dataset: str
    max_length: int
    max_conversations: int | None
    cache_dir: str | None
    seed: int
    regenerate_max_new_tokens: int
    regenerate_batch_size: int
    regenerate_temperature: float
    feature_cache_bytes: int
    target_dtype: str
    shard_format: str
    records_per_shard: int
    progress: bool
    regenerate_with: tuple[str, ...] = ()
    """Servers that answer the prompts (`data.regenerate_served`); empty: the batched HF loop."""
    regenerate_concurrency: int = 8
    regenerate_turns: str = "first"
    """``first``: answer the opening user turn; ``all``: every user turn (servers only)."""
    features_from_spool: str | None = None
    """The spool of the server that answered the regeneration: features from its captures
    (`data.spool_features`) before the caching pass."""


class DataStores:
    """The ``dataset`` and ``regenerated`` stores of one data configuration (see the module
    docstring). `tokenizer` and `target_model` are called when first needed (a tokenizer-only
    run never loads the target); `target_on_device` gives the target on the training device
    for the steps that run it (regeneration, feature caching)."""

    def __init__(
        self,
        settings: StoreSettings,
        *,
        tokenizer: Callable[[], Any],
        target_model: Callable[[], Any],
        target_on_device: Callable[[], Any],
    ) -> None:
        self.settings = settings
        self._tokenizer = tokenizer
        self._target_model = target_model
        self._target_on_device = target_on_device
        self._target_key: str | None = None
        self._source_sha256: str | None = None
        self._conversations: list[tuple[int, Any]] | None = None
        self._source_count = 0
        self._stores: dict[str, RolloutStore] = {}

    # ------------------------------------------------------------------ names and keys
    def _source_identity(self, legacy: bool = False) -> dict[str, Any]:
        """A data file by its content (sha256), so a moved or edited file keys the right store;
        a packaged source (``sharegpt``, ...) by its name: its content is pinned by the asset
        manifest's sha256."""
        dataset = self.settings.dataset
        path = Path(dataset).expanduser()
        if path.is_file():
            if legacy:
                return {"spec": str(path.resolve()), "bytes": path.stat().st_size}
            if self._source_sha256 is None:
                from lightning_spec.io import sha256_file

                self._source_sha256 = sha256_file(path)
            return {"sha256": self._source_sha256}
        return {"spec": dataset.strip().lower()}

    @property
    def target_id(self) -> str:
        """The target as cache keys name it: the embedded default by name (its weights are
        pinned by the asset manifest's sha256), any other by a fingerprint of its weights, so
        a target retrained in place never reuses stale answers or features."""
        if self.settings.target in EMBEDDED_TARGETS:
            return "smollm2"
        if self._target_key is None:
            from lightning_spec.models.fingerprint import cached_target_fingerprint

            weights = cached_target_fingerprint(self._target_model())["weights"]
            self._target_key = f"weights:{weights}"
        return self._target_key

    @property
    def feature_target_id(self) -> str:
        """The target and dtype the cached features were computed by (their shards' key)."""
        return f"{self.target_id}|{self.settings.target_dtype}"

    def generation_settings(self) -> Any:
        from lightning_spec.data.regenerate import GenerationSettings

        return GenerationSettings(
            max_new_tokens=self.settings.regenerate_max_new_tokens,
            temperature=self.settings.regenerate_temperature,
            seed=self.settings.seed,
        )

    def store_config(self, kind: str, *, legacy: bool = False) -> dict[str, Any]:
        """What owns the shards of ``kind``; its hash names the default cache directory."""
        config: dict[str, Any] = {
            "kind": kind,
            "tokenizer": tokenizer_fingerprint(self._tokenizer(), legacy=legacy),
            "source": self._source_identity(legacy=legacy),
            "max_length": self.settings.max_length,
        }
        if kind == "regenerated":
            config["target"] = self.settings.target if legacy else self.target_id
            config["target_dtype"] = self.settings.target_dtype
            config["generation"] = self.generation_settings().as_config()
            # every turn answered is other data; the engine is not: the answers are the
            # target's whichever engine computed them, so a store made through servers is
            # the one a later run without them finds complete
            if self.settings.regenerate_turns != "first":
                config["turns"] = self.settings.regenerate_turns
        return config

    def store_dir(self, kind: str) -> Path:
        if self.settings.cache_dir:
            return Path(self.settings.cache_dir).expanduser() / kind
        from lightning_spec.data.assets import cache_root
        from lightning_spec.data.shards import config_hash

        root = cache_root() / "rollouts"
        config = self.store_config(kind)
        folder = root / f"{kind}-{config_hash(config)}"
        if self._adopts_legacy_stores():
            self._adopt_legacy_store(kind, root, folder, config)
        return folder

    def _adopt_legacy_store(
        self, kind: str, root: Path, folder: Path, config: dict[str, Any]
    ) -> None:
        """Stores made before the content-keyed names, for the embedded default target and a
        packaged source: their content is what the new key names, so they are rekeyed and
        renamed, not recomputed (hours of cached features on a CPU). The manifest is rekeyed
        before the rename, so a kill in between leaves a store the next run finishes adopting;
        a folder renamed by an earlier version without its manifest is rekeyed in place."""
        from lightning_spec.data.rollouts import rekey_store
        from lightning_spec.data.shards import config_hash

        old_hash = config_hash(self.store_config(kind, legacy=True))
        if folder.is_dir():
            # a no-op unless an earlier version renamed it without its manifest
            rekey_store(folder, old_hash, config)
            return
        legacy = root / f"{kind}-{old_hash}"
        if not legacy.is_dir():
            return
        try:
            if not rekey_store(legacy, old_hash, config):
                log.warning("%s is not a store of this configuration: left as it is", legacy)
                return
            legacy.rename(folder)
            log.info("%s store adopted under its content-keyed name: %s", kind, folder)
        except OSError as error:  # another process adopted it first, or no rights
            if not folder.exists():
                log.warning("could not adopt %s (%s): it is rebuilt", legacy, error)

    def _adopts_legacy_stores(self) -> bool:
        return (
            self.settings.target in EMBEDDED_TARGETS
            and not Path(self.settings.dataset).expanduser().exists()
        )

    def store(self, kind: str) -> RolloutStore:
        """The shard store of ``kind`` (``dataset`` or ``regenerated``)."""
        if kind not in self._stores:
            self._stores[kind] = RolloutStore(
                self.store_dir(kind),
                self.store_config(kind),
                shard_format=self.settings.shard_format,
                prefix=kind,
            )
        return self._stores[kind]

    # ------------------------------------------------------------------ the source
    def conversations(self) -> list[tuple[int, Any]]:
        """(order, conversation) of the first ``max_conversations``, ids made unique."""
        if self._conversations is None:
            from lightning_spec.data.sources import load_source

            dataset = self.settings.dataset
            source = load_source(dataset, limit=self.settings.max_conversations)
            seen: set[str] = set()
            conversations = []
            duplicates = 0
            for order, conversation in enumerate(source):
                if conversation.id in seen:
                    duplicates += 1
                    continue
                seen.add(conversation.id)
                conversations.append((order, conversation))
            if duplicates:
                log.warning("%s: %d duplicate conversation ids skipped", dataset, duplicates)
            self._source_count = len(conversations) + duplicates
            self._conversations = conversations
        return self._conversations

    def selected(self, record: RolloutRecord) -> bool:
        """Whether a stored record belongs to this run (``max_conversations`` of the source)."""
        limit = self.settings.max_conversations
        if limit is None:
            return True
        order = record.meta.get("order")
        return order is not None and int(order) < limit

    def _complete_key(self) -> str:
        """The completion mark of a full pass over the selected conversations."""
        self.conversations()
        limit = self.settings.max_conversations
        exhausted = limit is None or self._source_count < limit
        return "all" if exhausted else f"first:{limit}"

    def is_complete(self, kind: str) -> bool:
        """Whether the store of ``kind`` holds a full pass over the selected conversations."""
        marks = self.store(kind).completed()
        if "all" in marks:
            return True
        limit = self.settings.max_conversations
        if limit is None:
            return False
        counts = [int(k.split(":", 1)[1]) for k in marks if k.startswith("first:")]
        return any(c >= limit for c in counts)

    # ------------------------------------------------------------------ the steps
    def repair(self, kinds: list[str]) -> None:
        """Set damaged files aside, so that only their contents are made again."""
        for kind in kinds:
            report = self.store(kind).repair()
            if report["shards"] or report["features"]:
                log.warning("%s store repaired: %s", kind, report)

    def render_dataset(self) -> None:
        """Render the dataset's conversations into the ``dataset`` store (resumable)."""
        from lightning_spec.data.chat import render_conversation
        from lightning_spec.data.claims import claimed_batches
        from lightning_spec.progress import progress_bar

        if self.is_complete("dataset"):
            return
        store = self.store("dataset")
        settings = self.settings
        done = store.done_ids()
        todo = [(o, c) for o, c in self.conversations() if c.id not in done]
        failed = tokens = 0
        start = time.perf_counter()
        enabled = settings.progress and bool(todo)
        with progress_bar("rendering", enabled=enabled, unit="tok/s") as bar:
            task = bar.add_task("conversations", total=len(todo), rate=0.0)
            # claimed a shard at a time: a second process on the same store renders the rest
            for chunk in claimed_batches(
                store.claims, todo, lambda item: item[1].id, size=settings.records_per_shard,
                what=f"rendering {settings.dataset}",
            ):  # fmt: skip
                buffer: list[RolloutRecord] = []
                unusable: list[str] = []
                for order, conversation in chunk:
                    try:
                        rendered = render_conversation(
                            self._tokenizer(), conversation.messages, settings.max_length
                        )
                    except Exception as exc:  # a template may reject a conversation's shape
                        failed += 1
                        unusable.append(conversation.id)
                        log.debug("cannot render %s: %s", conversation.id, exc)
                        continue
                    buffer.append(
                        RolloutRecord(
                            conversation.id,
                            rendered.input_ids,
                            rendered.loss_mask,
                            "dataset",
                            {**conversation.meta, "order": order},
                        )
                    )
                    tokens += len(rendered)
                if buffer:
                    store.write_shard(buffer)
                if unusable:
                    store.claims.finish(unusable)
                rate = tokens / max(time.perf_counter() - start, 1e-9)
                bar.update(task, advance=len(chunk), rate=rate)
        store.claims.release()
        if failed:
            log.warning("%s: %d conversations could not be rendered", settings.dataset, failed)
        store.mark_complete(self._complete_key(), failed=failed)

    def prompt_items(self) -> list[Any]:
        """The `PromptItem` of every selected conversation that opens with a user turn: that
        opening (system + first user message), or the whole conversation when every turn is
        answered (its dataset answers are replaced, never sent)."""
        from lightning_spec.data.regenerate import PromptItem

        prompts = []
        for order, conversation in self.conversations():
            try:
                messages = conversation.prompt()
            except ValueError:
                continue
            if self.settings.regenerate_turns == "all":
                messages = [dict(message) for message in conversation.messages]
            meta = {**conversation.meta, "order": order}
            prompts.append(PromptItem(conversation.id, messages=messages, meta=meta))
        return prompts

    def regenerate(self, rank: int, world_size: int) -> None:
        """This rank's share of the regeneration (resumable): through the servers of
        ``regenerate_with`` when there are any, else the target's batched ``generate``."""
        from lightning_spec.data.regenerate import regenerate

        if self.is_complete("regenerated"):
            return
        prompts = self.prompt_items()
        settings = self.settings
        if settings.regenerate_with:
            self._regenerate_served(prompts, rank, world_size)
            return
        regenerate(
            self._target_on_device(),
            self._tokenizer(),
            prompts,
            self.store("regenerated"),
            settings=self.generation_settings(),
            batch_size=settings.regenerate_batch_size,
            max_length=settings.max_length,
            records_per_shard=min(settings.records_per_shard, 64),
            rank=rank,
            world_size=world_size,
            progress=settings.progress,
        )

    def _regenerate_served(self, prompts: list[Any], rank: int, world_size: int) -> None:
        """The regeneration through servers. A run that ends with no server left in the
        rotation raises, so the store is not marked complete and the next run asks for the
        rest; prompts a server refused (a 4xx) or that no server answered usably are counted
        and left out, as too long prompts are."""
        from lightning_spec.data.regenerate_served import regenerate_served

        settings = self.settings
        report = regenerate_served(
            settings.regenerate_with,
            self._tokenizer(),
            prompts,
            self.store("regenerated"),
            settings=self.generation_settings(),
            concurrency=settings.regenerate_concurrency,
            max_length=settings.max_length,
            records_per_shard=min(settings.records_per_shard, 64),
            rank=rank,
            world_size=world_size,
            progress=settings.progress,
            eos_token_ids=sorted(self._target_model().eos_token_ids),
        )
        unanswered = report.skipped.get("no_server", 0)
        if unanswered:
            raise RuntimeError(
                f"{unanswered} prompts were not answered: no server was left in the rotation "
                f"(the log says why). The {report.generated} answers of this run are stored; "
                "run the same command again, with the servers up, to ask for the rest"
            )
        if report.skipped:
            log.warning("regeneration through servers: prompts left out: %s", report.skipped)

    def mark_regenerated(self) -> None:
        self.store("regenerated").mark_complete(self._complete_key())

    def features_from_spool(self) -> Any:
        """The regenerated records' features from the captures in ``features_from_spool``
        (`data.spool_features`; its report, None without a spool): the caching pass after it
        runs the target only on the records no capture covers. One process runs it."""
        from lightning_spec.data.regenerate import feature_config
        from lightning_spec.data.spool_features import features_from_spool

        settings = self.settings
        if not settings.features_from_spool:
            return None
        target = self._target_on_device()  # its LM head gives the argmax
        return features_from_spool(
            self.store("regenerated"),
            settings.features_from_spool,
            target,
            feature_config=feature_config(target, self.feature_target_id),
            cap_bytes=settings.feature_cache_bytes,
            max_length=settings.max_length,
            select=self.selected,
        )

    def cache_features(self, kinds: list[str]) -> None:
        """The target's features, final hidden states and argmax beside the shards of `kinds`,
        up to ``feature_cache_bytes`` (shared between processes by claims)."""
        from lightning_spec.data.regenerate import cache_features

        settings = self.settings
        for kind in kinds:
            cache_features(
                self._target_on_device(),
                self.store(kind),
                cap_bytes=settings.feature_cache_bytes,
                batch_size=settings.regenerate_batch_size,
                max_length=settings.max_length,
                target_id=self.feature_target_id,
                progress=settings.progress,
                select=self.selected,
            )

    # ------------------------------------------------------------------ reading
    def read_entries(self, kind: str) -> list[Entry]:
        """The selected records of one store with their cached features (or None)."""
        from lightning_spec.data.regenerate import feature_config

        store = self.store(kind)
        config = None
        if self.settings.feature_cache_bytes > 0:
            config = feature_config(self._target_model(), self.feature_target_id)
        entries: list[Entry] = []
        dropped = 0
        for info in store.shards():
            features, last_hidden, argmax = {}, {}, {}
            if config is not None:
                try:
                    cached = store.read_cached(info.name, feature_config=config)
                except StoreError as error:  # derived data: drop it, compute it online
                    store.drop_feature_shard(info.name, str(error))
                    cached = {"features": {}, "last_hidden": {}, "target_argmax": {}}
                features = cached["features"]
                last_hidden = cached["last_hidden"]
                argmax = cached["target_argmax"]
            try:
                records = store.read_shard(info)
            except StoreError as error:
                ids = store.quarantine_shard(info.name, str(error))
                raise StoreError(
                    f"{kind} shard {info.name} was damaged after preparation and is set aside "
                    f"({len(ids) if ids else info.records} records); run again: only those "
                    "records are made again"
                ) from error
            for record in records:
                if not self.selected(record):
                    continue
                record = record.truncated(self.settings.max_length)
                if record.num_loss_tokens == 0:
                    dropped += 1
                    continue
                entries.append(
                    (
                        record,
                        features.get(record.id),
                        last_hidden.get(record.id),
                        argmax.get(record.id),
                    )
                )
        if dropped:
            log.info("%s: %d records without loss tokens after truncation dropped", kind, dropped)
        return entries
