"""``RolloutDataModule``: the training data of every drafter objective, over one record format.

Modes (docs/training.md, data modes):

* ``dataset``: the dataset's own assistant answers, rendered with the target's chat template;
  features and soft labels come from the frozen target inside the training step (or from the
  feature cache). This mode was once also called ``online``; that name now belongs to
  OnlineSpec's online learning and is refused here.
* ``regenerated``: the target's own answers to the dataset prompts (first user turn),
  regenerated once with batched ``generate``, or through the servers that serve the target
  (``regenerate_with``, every user turn with ``regenerate_turns: all``), and cached as token
  shards; optional cached features (``feature_cache_bytes``; those of answers served by
  `lightning-spec serve --engine vllm --spool DIR` can come from its captures,
  ``features_from_spool``).
* ``mixture``: each training conversation is served once per epoch, as its regenerated
  version with probability ``regenerated_fraction`` (drawn per epoch from the seed) and as
  the dataset version otherwise, so the data budget equals the other modes'.
* ``on_policy``: rollouts of the *current* drafter under real verification (a
  `RolloutSource`, by default our `SpeculativeDecoder`), for ``rollout_prompts`` training
  prompts, kept in a checkpointed buffer and refreshed every N optimizer steps by the
  `RefreshRollouts` callback (``data/on_policy.py``); batches also carry the collated steps.

Rendered dataset records are cached as shards too (rendering ShareGPT costs ~25 ms per
conversation on a busy CPU core), so every mode reads a :class:`RolloutStore`. The
train/validation split hashes the conversation id, so it is the same in every run, mode and
seed. Training batches come from a length-bucketed sampler whose order is a function of
(seed, epoch) only; the data module's ``state_dict`` records how many batches of the current
epoch were consumed so that ``fit --ckpt_path last`` continues exactly where it stopped.

Batch (the contract the objectives rely on): ``input_ids``, ``attention_mask``, ``loss_mask``
(LongTensor [B, T], right-padded), optional ``features`` (FloatTensor [B, T, F], only when
every row has cached features) and ``last_hidden`` (FloatTensor [B, T, H], the target's final
hidden state, cached with the features), ``source`` (list[str]) and ``ids`` (list[str]).

Why one file (~610 lines): the thin `RolloutDataModule` that composes the store preparation
(data/preparation.py), epoch planning and sampling (data/sampling.py) and on-policy buffers
(data/on_policy.py); what is left is Lightning's hooks and the configuration they check.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_spec.data.on_policy import (
    OnPolicyBuffer,
    OnPolicyRollouts,
    OnPolicyTable,
    RolloutSettings,
)
from lightning_spec.data.preparation import DataStores, StoreSettings
from lightning_spec.data.rollouts import RolloutStore
from lightning_spec.data.sampling import (
    EpochPlan,
    EpochTracker,
    LengthBucketBatchSampler,
    ResumableDataLoader,
    SamplerPosition,
)
from lightning_spec.data.tables import BatchCollate, Entry, RecordTable, prompt_of, split_ids

__all__ = ["MODES", "RolloutDataModule", "resolve_target_source"]

log = logging.getLogger(__name__)

MODES = ("dataset", "regenerated", "mixture", "on_policy")
DEFAULT_RECORDS_PER_SHARD = 256


def resolve_target_source(target: str) -> tuple[str, str | None]:
    """``(folder or hub id, gguf file name or None)`` for a target spec, as TargetModel does."""
    source = str(target)
    if source in {"smollm2", "default"}:
        from lightning_spec.data.assets import default_target_path

        source = str(default_target_path())
    if source.endswith(".gguf"):
        path = Path(source)
        return str(path.parent), path.name
    return source, None


class RolloutDataModule(pl.LightningDataModule):
    """Drafter training data: dataset answers, target-regenerated answers or a mixture.

    Args:
        target: The target model (``"smollm2"`` = the embedded default, a hub id, a local folder
            or a ``.gguf`` file); its tokenizer renders the data and it regenerates answers.
        dataset: Training conversations: ``sharegpt``, ``mtbench``, ``humaneval`` or a
            ``.jsonl``/``.json`` path (anything ``load_source`` accepts).
        mode: ``dataset`` (the dataset's answers, features computed in the training step or
            cached), ``regenerated`` (the target's own answers, cached as shards), ``mixture``
            (both, see ``regenerated_fraction``) or ``on_policy`` (the current drafter's
            rollouts, refreshed by the ``RefreshRollouts`` callback).
        regenerated_fraction: In ``mixture`` mode, the probability that a conversation is served
            in its regenerated version in a given epoch (else its dataset version).
        cache_dir: Where shards go (``<cache_dir>/dataset``, ``<cache_dir>/regenerated``).
            Default: ``<asset cache>/rollouts/<kind>-<config hash>``. An explicit directory made
            under another configuration is refused.
        max_length: Tokens per sequence; longer ones keep their beginning.
        max_conversations: Use the first N conversations of the dataset (None = all).
        val_fraction: Share of conversations held out for validation, chosen by a hash of the
            conversation id (the same in every run, mode and seed).
        batch_size: Sequences per batch (per device).
        num_workers: DataLoader worker processes.
        seed: Seed of the data order (a function of seed and epoch) and of the mixture draws.
        regenerate_max_new_tokens: Longest regenerated answer, in tokens.
        regenerate_batch_size: Prompts per ``generate`` call when regenerating.
        regenerate_temperature: 0 = greedy regeneration, > 0 = sampled at this temperature.
        feature_cache_bytes: Cache the target's features for up to this many bytes of fp16
            shards (0 = no cache: the objective computes features online).
        prompts_for_eval: Held-out prompts for the acceptance-eval callback (``eval_prompts``).
        target_dtype: dtype the target regenerates and computes cached features in (match the
            objective's so the process-shared target is loaded once).
        shard_format: ``jsonl``, ``jsonl.gz`` or ``safetensors``.
        records_per_shard: Records per shard file (the resume granularity).
        bucket_batches: Batches per length bucket (larger = less padding, less randomness).
        progress: Show progress bars while rendering and regenerating.
        rollout_prompts: ``on_policy``: training prompts rolled out per refresh (the buffer
            size; prompts rotate through the training split, sharded over ranks).
        rollout_max_new_tokens: ``on_policy``: tokens decoded per rollout.
        rollout_tree: ``on_policy``: tree policy of the rollouts (``chain:4``, ``dynamic:...``).
        rollout_temperature: ``on_policy``: 0 = greedy rollouts, > 0 = sampled.
        rollout_target_rows: ``on_policy``: top-k target log-probs kept per tried row (0 = none).
        rollout_pool: ``on_policy``: rotate through only the first N training prompts (0 = all),
            so prompts come back under later drafters.
        rollout_replay: ``on_policy``, greedy: decode each prompt once and rebuild its later
            rollouts exactly from the remembered continuation (`ReplayingRolloutSource`; no
            target loop), which makes revisits (``rollout_pool``) cheap.
        rollout_decode_batch: with ``rollout_replay``, > 0: new prompts are answered by the
            target's batched greedy generation, this many at a time, and replayed at once (each
            cut to its exact greedy prefix); 0 = the real decoder, one prompt at a time.
        rollout_sft_mix: ``on_policy``: each rollout row also carries a training row of the
            dataset (with its cached features when ``feature_cache_bytes`` > 0), new rows with
            every refresh, under the batch key ``sft``: for an objective's token loss on dataset
            text beside its on-policy loss (`DraftOPD`'s ``lambda_sft``).
        text_format: ``auto`` (the chat template; plain-text continuation for a tokenizer
            without one, i.e. a base model), ``chat`` (the template, or a made-up role format
            without one) or ``plain`` (plain text even with a template); see `data.chat`.
        regenerate_with: Regenerate through these OpenAI-compatible servers instead of the
            target's batched ``generate`` here: ``http://HOST:PORT`` URLs, comma-separated or a
            list (vLLM, llama.cpp's llama-server, ...; `data.regenerate_served`). The store is
            the same, so a later run without servers finds it complete.
        regenerate_concurrency: With ``regenerate_with``: requests in flight on each server.
        regenerate_turns: ``first`` (the opening user turn) or ``all`` (every user turn, each
            answered against the target's own earlier replies; needs ``regenerate_with``).
        features_from_spool: The ``--spool DIR`` of the ``lightning-spec serve --engine vllm``
            server that answered the regeneration: the regenerated records' features come from
            its captures instead of a target pass (`data.spool_features`; needs
            ``feature_cache_bytes`` > 0); records no capture covers are cached as before.
    """

    def __init__(
        self,
        target: str = "smollm2",
        dataset: str = "sharegpt",
        mode: str = "dataset",
        regenerated_fraction: float = 0.5,
        cache_dir: str | None = None,
        max_length: int = 512,
        max_conversations: int | None = None,
        val_fraction: float = 0.02,
        batch_size: int = 4,
        num_workers: int = 0,
        seed: int = 0,
        regenerate_max_new_tokens: int = 256,
        regenerate_batch_size: int = 8,
        regenerate_temperature: float = 0.0,
        feature_cache_bytes: int = 0,
        prompts_for_eval: str = "mtbench",
        target_dtype: str = "float32",
        shard_format: str = "jsonl",
        records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
        bucket_batches: int = 32,
        progress: bool = True,
        rollout_prompts: int = 32,
        rollout_max_new_tokens: int = 64,
        rollout_tree: str = "chain:4",
        rollout_temperature: float = 0.0,
        rollout_target_rows: int = 0,
        rollout_pool: int = 0,
        rollout_replay: bool = False,
        rollout_decode_batch: int = 0,
        rollout_sft_mix: bool = False,
        text_format: str = "auto",
        regenerate_with: str | list[str] | None = None,
        regenerate_concurrency: int = 8,
        regenerate_turns: str = "first",
        features_from_spool: str | None = None,
    ) -> None:
        super().__init__()
        from lightning_spec.data.chat import TEXT_FORMATS

        if text_format not in TEXT_FORMATS:
            raise ValueError(f"text_format must be one of {TEXT_FORMATS}, got {text_format!r}")
        self.text_format = text_format
        if mode == "online":
            raise ValueError(
                "mode 'online' was renamed 'dataset' (the dataset's answers, target features "
                "computed in the training step); 'online' now means OnlineSpec's online learning"
            )
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        rollouts = RolloutSettings(
            prompts=rollout_prompts, max_new_tokens=rollout_max_new_tokens, tree=rollout_tree,
            temperature=rollout_temperature, target_rows=rollout_target_rows, pool=rollout_pool,
            replay=rollout_replay, decode_batch=rollout_decode_batch, seed=seed,
        )  # fmt: skip
        rollouts.check(on_policy=mode == "on_policy")
        if not 0.0 <= regenerated_fraction <= 1.0:
            raise ValueError("regenerated_fraction must be in [0, 1]")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError("val_fraction must be in [0, 1)")
        if max_length <= 1 or batch_size <= 0:
            raise ValueError("max_length must be > 1 and batch_size > 0")
        if max_conversations is not None and max_conversations <= 0:
            raise ValueError("max_conversations must be positive (or None for all)")
        from lightning_spec.data.served_protocol import parse_server_urls

        servers = tuple(parse_server_urls(regenerate_with))  # a mistyped URL fails here
        if regenerate_concurrency < 1:
            raise ValueError("regenerate_concurrency must be >= 1")
        if regenerate_turns not in ("first", "all"):
            raise ValueError(f"regenerate_turns must be first or all, got {regenerate_turns!r}")
        if regenerate_turns == "all" and not servers:
            raise ValueError(
                "regenerate_turns: all needs regenerate_with (servers): the batched generate "
                "loop answers the first user turn only"
            )
        if features_from_spool is not None:
            if feature_cache_bytes <= 0:
                raise ValueError(
                    "features_from_spool fills the feature cache: set feature_cache_bytes > 0"
                )
            if mode not in ("regenerated", "mixture"):
                raise ValueError(
                    "features_from_spool gives regenerated records their features: it needs "
                    f"mode regenerated or mixture, not {mode!r}"
                )
        self.save_hyperparameters()
        self.target = target
        self.dataset = dataset
        self.mode = mode
        self.regenerated_fraction = regenerated_fraction
        self.cache_dir = cache_dir
        self.max_length = max_length
        self.max_conversations = max_conversations
        self.val_fraction = val_fraction
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.regenerate_max_new_tokens = regenerate_max_new_tokens
        self.regenerate_batch_size = regenerate_batch_size
        self.regenerate_temperature = regenerate_temperature
        self.feature_cache_bytes = feature_cache_bytes
        self.prompts_for_eval = prompts_for_eval
        self.target_dtype = target_dtype
        self.shard_format = shard_format
        self.records_per_shard = records_per_shard
        self.bucket_batches = bucket_batches
        self.progress = progress
        self.rollout_prompts = rollout_prompts
        self.rollout_max_new_tokens = rollout_max_new_tokens
        self.rollout_tree = rollout_tree
        self.rollout_temperature = rollout_temperature
        self.rollout_target_rows = rollout_target_rows
        self.rollout_pool = rollout_pool
        self.rollout_replay = rollout_replay
        self.rollout_decode_batch = rollout_decode_batch
        self.rollout_sft_mix = rollout_sft_mix
        self.regenerate_with = servers
        self.regenerate_concurrency = regenerate_concurrency
        self.regenerate_turns = regenerate_turns
        self.features_from_spool = features_from_spool
        self.rollouts = OnPolicyRollouts(rollouts, lambda: self.target_model)
        self._tokenizer: Any = None
        self._target_model: Any = None
        self._target_spec = str(target)
        self._data_stores: DataStores | None = None
        self._train: RecordTable | None = None
        self._val: RecordTable | None = None
        self._train_plan: EpochPlan | None = None
        self._val_plan: EpochPlan | None = None
        self._position = SamplerPosition()
        self._eval_prompts: dict[int | None, list[list[int]]] = {}

    @classmethod
    def from_objects(
        cls, *, tokenizer: Any = None, target_model: Any = None, **kwargs: Any
    ) -> RolloutDataModule:
        """A data module over an already built tokenizer and/or TargetModel (tests, notebooks).

        ``kwargs`` are the ``__init__`` arguments; ``target`` defaults to the model's name and
        only identifies the cache.
        """
        if tokenizer is None and target_model is not None:
            tokenizer = getattr(target_model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("from_objects needs a tokenizer (or a target_model that has one)")
        if "target" not in kwargs:
            name = getattr(target_model, "name", None) or getattr(tokenizer, "name_or_path", "")
            kwargs["target"] = str(name or "objects")
        module = cls(**kwargs)
        module._tokenizer = tokenizer
        module._target_model = target_model
        if module.text_format != "auto":
            from lightning_spec.data.chat import set_text_format

            set_text_format(tokenizer, module.text_format)
        return module

    # ------------------------------------------------------------------ resources
    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (loaded on first use; shared with a loaded target)."""
        if self._tokenizer is None:
            if self._target_model is not None or self._needs_target():
                self._tokenizer = self.target_model.tokenizer
            else:
                from transformers import AutoTokenizer

                source, gguf_file = resolve_target_source(self.target)
                kwargs = {"gguf_file": gguf_file} if gguf_file else {}
                self._tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            from lightning_spec.data.chat import set_text_format

            set_text_format(self._tokenizer, self.text_format)
        return self._tokenizer

    @property
    def target_model(self) -> Any:
        """The frozen TargetModel (process-shared through ``load_target``)."""
        if self._target_model is None:
            from lightning_spec.models.target import load_target

            self._target_model = load_target(self.target, dtype=self.target_dtype)
        return self._target_model

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else 0

    def _needs_target(self) -> bool:
        return self.mode in ("regenerated", "mixture", "on_policy") or self.feature_cache_bytes > 0

    def _kinds(self) -> list[str]:
        """The stores a mode reads (on_policy: the rendered dataset, for its prompts)."""
        return {
            "dataset": ["dataset"],
            "regenerated": ["regenerated"],
            "on_policy": ["dataset"],
        }.get(self.mode, ["dataset", "regenerated"])

    def _world(self) -> tuple[int, int]:
        """(global rank, world size) from the attached trainer, else (0, 1)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def _target_on_device(self) -> Any:
        """The target on this process's training device (a GPU under a GPU trainer): it is the
        same process-shared object the objective trains against, which Lightning would move
        there anyway, so generation does not run on the CPU while a GPU waits."""
        target = self.target_model
        trainer = getattr(self, "trainer", None)
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        if device is not None and target.device != device:
            target.to(device)
        return target

    def _on_every_rank(self, what: str, work: Any) -> None:
        """Run `work` on this rank, then agree with every rank on whether any failed (one
        collective, which is also the barrier); on a failure every rank raises."""
        failure: BaseException | None = None
        try:
            work()
        except Exception as error:  # noqa: BLE001 - re-raised below, after the agreement
            failure = error
        trainer = getattr(self, "trainer", None)
        failed = failure is not None
        if trainer is not None:
            failed = bool(trainer.strategy.reduce_boolean_decision(failed, all=False))
        if failure is not None:
            raise failure
        if failed:
            rank, world_size = self._world()
            raise RuntimeError(
                f"rank {rank} of {world_size}: another rank failed while {what} (its log says "
                "why); stopping here too rather than waiting for it at a barrier"
            )

    # ------------------------------------------------------------------ stores
    @property
    def stores(self) -> DataStores:
        """The shard stores this configuration reads and the steps that make them."""
        if self._data_stores is None:
            self._data_stores = DataStores(
                StoreSettings(
                    target=self._target_spec, dataset=self.dataset, max_length=self.max_length,
                    max_conversations=self.max_conversations, cache_dir=self.cache_dir,
                    seed=self.seed, regenerate_max_new_tokens=self.regenerate_max_new_tokens,
                    regenerate_batch_size=self.regenerate_batch_size,
                    regenerate_temperature=self.regenerate_temperature,
                    feature_cache_bytes=self.feature_cache_bytes, target_dtype=self.target_dtype,
                    shard_format=self.shard_format, records_per_shard=self.records_per_shard,
                    progress=self.progress, regenerate_with=self.regenerate_with,
                    regenerate_concurrency=self.regenerate_concurrency,
                    regenerate_turns=self.regenerate_turns,
                    features_from_spool=self.features_from_spool,
                ),
                tokenizer=lambda: self.tokenizer,
                target_model=lambda: self.target_model,
                target_on_device=self._target_on_device,
            )  # fmt: skip
        return self._data_stores

    def store_config(self, kind: str, *, legacy: bool = False) -> dict[str, Any]:
        """What owns the shards of ``kind``; its hash names the default cache directory."""
        return self.stores.store_config(kind, legacy=legacy)

    def store_dir(self, kind: str) -> Path:
        return self.stores.store_dir(kind)

    def store(self, kind: str) -> RolloutStore:
        """The shard store of ``kind`` (``dataset`` or ``regenerated``)."""
        return self.stores.store(kind)

    def prepare_data(self) -> None:
        """Render the dataset and, on a single process, regenerate and cache features
        (those a spool holds first).

        Lightning calls this on one process per node; under DDP the regeneration is shared by
        all ranks in :meth:`setup` instead (rank r takes prompts i % world_size == r).
        """
        _, world_size = self._world()
        stores = self.stores
        if self.regenerate_with and "regenerated" in self._kinds():
            if not stores.is_complete("regenerated"):  # a silent server stops us before any work
                from lightning_spec.data.served_protocol import check_servers

                check_servers(self.regenerate_with)
        stores.repair(self._kinds())
        if "dataset" in self._kinds():
            stores.render_dataset()
        if "regenerated" in self._kinds() and world_size == 1:
            if not stores.is_complete("regenerated"):
                stores.regenerate(0, 1)
                stores.mark_regenerated()
        if self.features_from_spool and world_size == 1:  # before the target pass: it skips them
            stores.features_from_spool()
        if self.feature_cache_bytes > 0 and world_size == 1:
            self._cache_features()

    def _cache_features(self) -> None:
        """The feature cache of every store this mode reads (a rank's share under DDP)."""
        self.stores.cache_features(self._kinds())

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str | None = None) -> None:
        """Finish the shared preparation under DDP, then load the train/val records."""
        if self._train is not None:
            return
        rank, world_size = self._world()
        stores = self.stores
        if world_size > 1:
            # Every phase ends in a collective that also says whether some rank failed: a rank
            # that fails makes all of them stop with the reason, none waits at a barrier for a
            # rank that is gone (30 minutes by default, then an unrelated timeout error).
            if "regenerated" in self._kinds() and not stores.is_complete("regenerated"):
                self._on_every_rank("regenerating", lambda: stores.regenerate(rank, world_size))
                self._on_every_rank("marking the regeneration complete",
                                    lambda: rank == 0 and stores.mark_regenerated())  # fmt: skip
            if self.features_from_spool:  # one process reads the spool, before the shared caching
                self._on_every_rank("taking features from the spool",
                                    lambda: rank == 0 and stores.features_from_spool())  # fmt: skip
            if self.feature_cache_bytes > 0:
                # shared: every rank claims feature shards of its own (`data.claims`)
                self._on_every_rank("caching features", self._cache_features)
        for kind in self._kinds():
            if not stores.is_complete(kind):
                if world_size > 1:
                    raise RuntimeError(
                        f"the {kind} shards in {self.store(kind).directory} are incomplete; "
                        "prepare_data() must run before setup()"
                    )
                self.prepare_data()
        self._build_tables()

    def _build_tables(self) -> None:
        by_kind = {kind: self.stores.read_entries(kind) for kind in self._kinds()}
        all_ids = [entry[0].id for entries in by_kind.values() for entry in entries]
        train_ids, val_ids = split_ids(all_ids, self.val_fraction)
        self._train, self._train_plan = self._table(by_kind, train_ids, train=True)
        self._val, self._val_plan = self._table(by_kind, val_ids, train=False)
        if self.mode == "on_policy":
            # train prompts (the text before each first assistant token), this rank's share;
            # the dataset answers themselves are not trained on, the rollouts are
            rank, world_size = self._world()
            prompts = [prompt_of(self._train, i) for i in range(len(self._train))]
            mine = [p for i, p in enumerate(prompts) if p and i % world_size == rank]
            self.rollouts.prompts = mine
            if not mine:
                raise RuntimeError(
                    f"no training prompts for on-policy rollouts in {self.dataset!r}"
                )
            companion = self._train if self.rollout_sft_mix else None
            self._train = OnPolicyTable(self.buffer, companion, self.seed)  # type: ignore[assignment]
            self._train_plan = EpochPlan(len(self._train))
        if len(self._train) == 0:
            raise RuntimeError(
                f"no training records for mode={self.mode!r} from {self.dataset!r} "
                f"(max_conversations={self.max_conversations}, max_length={self.max_length})"
            )
        log.info(
            "RolloutDataModule(mode=%s): %d train / %d val items (%d / %d conversations)",
            self.mode,
            len(self._train),
            len(self._val),
            len(self._train_plan),
            len(self._val_plan),
        )

    def _table(
        self, by_kind: dict[str, list[Entry]], keep: set[str], train: bool
    ) -> tuple[RecordTable, EpochPlan]:
        kept: list[Entry] = []
        index: dict[tuple[str, str], int] = {}
        for kind, entries in by_kind.items():
            for entry in entries:
                if entry[0].id in keep:
                    index[(kind, entry[0].id)] = len(kept)
                    kept.append(entry)
        table = RecordTable(
            [e[0] for e in kept], [e[1] for e in kept], [e[2] for e in kept], [e[3] for e in kept]
        )
        if self.mode != "mixture":
            return table, EpochPlan(len(table))
        ids = sorted({entry[0].id for entry in kept})
        groups = [(index.get(("dataset", i), -1), index.get(("regenerated", i), -1)) for i in ids]
        return table, EpochPlan(
            len(table), groups, self.regenerated_fraction, self.seed, vary_with_epoch=train
        )

    # ------------------------------------------------------------------ loaders
    def _loader(self, table: RecordTable, plan: EpochPlan, train: bool) -> DataLoader:
        rank, world_size = self._world()
        sampler = LengthBucketBatchSampler(
            EpochTracker(num_replicas=world_size, rank=rank),
            self.batch_size,
            False,
            lengths=table.lengths,
            plan=plan,
            seed=self.seed,
            shuffle=train,
            bucket_batches=self.bucket_batches,
            position=self._position if train else SamplerPosition(),
        )
        kwargs: dict[str, Any] = {
            "batch_sampler": sampler,
            "num_workers": self.num_workers,
            "collate_fn": BatchCollate(self.pad_id),
        }
        if train:
            return ResumableDataLoader(table, owner=self, **kwargs)
        return DataLoader(table, **kwargs)

    # ------------------------------------------------------------------ on-policy rollouts
    @property
    def buffer(self) -> OnPolicyBuffer:
        """The current on-policy rollouts (``mode="on_policy"``)."""
        return self.rollouts.buffer

    @property
    def rollout_source(self) -> Any:
        """What makes the rollouts (built at the first refresh)."""
        return self.rollouts.source

    def refresh_rollouts(self, drafter: Any, *, step: int = 0, version: str | None = None) -> None:
        """Replace the on-policy buffer with rollouts of `drafter` (refresh number r takes the
        next `rollout_prompts` training prompts, cycling). Called by `RefreshRollouts`."""
        if self.mode != "on_policy":
            raise RuntimeError(f"refresh_rollouts needs mode='on_policy', not {self.mode!r}")
        if self._train is None:
            self.setup("fit")
        self.rollouts.refresh(
            drafter, step=step, version=version or f"step-{step}", max_length=self.max_length
        )

    def train_dataloader(self) -> DataLoader:
        if self._train is None:
            self.setup("fit")
        assert self._train is not None and self._train_plan is not None
        return self._loader(self._train, self._train_plan, train=True)

    def val_dataloader(self) -> DataLoader | list:
        if self._val is None:
            self.setup("validate")
        assert self._val is not None and self._val_plan is not None
        if len(self._val) == 0:
            return []
        return self._loader(self._val, self._val_plan, train=False)

    # ------------------------------------------------------------------ eval prompts
    def train_prompts(self, limit: int) -> list[list[int]]:
        """Token ids of the first `limit` training prompts (the text before each record's first
        loss token; on-policy: the rollout prompts): for callbacks that measure what training
        changed on its own data (`ReplayAcceptance`'s error-fix rate). Needs ``setup``."""
        if self.mode == "on_policy":
            return [list(p) for p in self.rollouts.prompts[:limit]]
        if self._train is None:
            raise RuntimeError("train_prompts needs the data set up: call setup('fit') first")
        prompts: list[list[int]] = []
        for index in range(len(self._train)):
            if len(prompts) >= limit:
                break
            prompt = prompt_of(self._train, index)
            if prompt:
                prompts.append(prompt)
        return prompts

    def train_token_counts(self, vocab_size: int) -> Tensor:
        """Frequencies of the training records' loss tokens (`vocab_source: data`). Needs
        ``setup``; every rank counts all records (not its share), so ranks agree."""
        if self.mode == "on_policy":
            raise ValueError(
                "vocab_source: data counts fixed training records; mode on_policy has none "
                "before its first rollouts: name a source (e.g. vocab_source: sharegpt)"
            )
        if self._train is None:
            raise RuntimeError("train_token_counts needs the data set up: call setup('fit') first")
        return self._train.loss_token_counts(vocab_size)

    def eval_prompts(self, limit: int | None = None) -> list[list[int]]:
        """Token ids of held-out prompts (``prompts_for_eval``), rendered with the chat template
        and ending with the assistant header: what the acceptance-eval callback decodes from."""
        if limit not in self._eval_prompts:
            from lightning_spec.data.chat import render_prompt
            from lightning_spec.data.sources import load_source

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                source = load_source(self.prompts_for_eval, limit=limit)
            prompts = [render_prompt(self.tokenizer, messages) for messages in source.prompts()]
            self._eval_prompts[limit] = prompts[:limit] if limit is not None else prompts
        return [list(p) for p in self._eval_prompts[limit]]

    # ------------------------------------------------------------------ resume
    def _train_position(self) -> tuple[int, int]:
        """(epoch, batches of it already trained on), from the trainer's progress if fitting."""
        trainer = getattr(self, "trainer", None)
        fit_loop = getattr(trainer, "fit_loop", None) if trainer is not None else None
        if fit_loop is not None and getattr(trainer.state, "fn", None) == "fit":
            epoch = int(fit_loop.epoch_progress.current.processed)
            batches = int(fit_loop.epoch_loop.batch_progress.current.processed)
            return epoch, batches
        return self._position.epoch, self._position.drawn

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the data order (saved in Lightning checkpoints)."""
        epoch, batches = self._train_position()
        state = {"epoch": epoch, "batches_consumed": batches, "seed": self.seed, "mode": self.mode}
        if self.mode == "on_policy":
            state.update(self.rollouts.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the saved epoch after its consumed batches (no replay, no skip)."""
        if int(state_dict.get("seed", self.seed)) != self.seed:
            log.warning(
                "restoring data position saved with seed %s under seed %s: the data order differs",
                state_dict.get("seed"),
                self.seed,
            )
        self._position.resume_epoch = int(state_dict.get("epoch", 0))
        self._position.resume_batches = int(state_dict.get("batches_consumed", 0))
        self._position.epoch = self._position.resume_epoch
        self._position.drawn = self._position.resume_batches
        if self.mode == "on_policy":
            self.rollouts.load_state_dict(state_dict)
