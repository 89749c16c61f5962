"""The regenerated records' target features from the serving engine's spool, not a second pass.

``lightning-spec serve --engine vllm --drafter D --spool DIR`` keeps, for every finished request,
the target's aux-layer hidden states (the fused EAGLE-3 features) and final hidden states that
vLLM computed while serving it (`online.capture.CapturedRequest`, one file a request:
`online.spool`). A regeneration through that server (``--regenerate-with``) has therefore
already paid for the target pass the feature cache needs: `features_from_spool` writes those
rows into the store's feature cache (`data.store_features`) in the form
`regenerate.cache_features` writes, so the caching pass that runs next finds them and runs the
target only on the records no capture covers.

Matching is by token ids alone (features are a function of the tokens): a record takes a
capture whose ``token_ids`` begin with the record's tokens: the same request, or a longer one
whose prefix it is (a record cut at ``max_length``). A multi-turn record is the last turn's
prompt and answer, which is that turn's request. Records no capture covers (an answer a
text-only server gave, a capture the engine dropped) are left to the caching pass or the
training step, and counted; captures no record takes (the servers' probe, earlier turns, other
clients) are counted too. The spool is only read, never moved or emptied, so a learner reading
the same spool is not disturbed.

Two things are not copied from a capture, and why:

* **The final token's row.** The engine never computes the row of the last committed token
  (nothing is sampled after it). No loss or metric reads that row of a record: the EAGLE-3
  unroll and the drafters' sequence proposers feed features f_0 .. f_{T-2} only
  (`objectives.ttt.ttt_unroll`, `DrafterProposer.from_sequence`, DFlash's `absorb`), and the
  label the last row would give predicts a token past the text, which every objective masks
  (`ttt_loss_masks`; `block_sft_losses` and Draft-OPD's stream masks likewise; GTO's roots keep
  a tree inside the text and its rewards read parents' rows only). So when a capture ends where
  the record ends, that row is stored as a placeholder: zeros for the features and the final
  hidden state (finite, as the training step checks its inputs are: masked entries are weighted
  by multiplication) and `NO_TOKEN` for the argmax, the "no token" `decoding.score.text_scores`
  already gives rows it does not know. Such records are not left to a second pass for one row:
  that row alone would cost the whole forward this module saves.
* **The argmax.** The cache holds the target's full-vocabulary argmax per token, which a
  capture does not carry. It is computed here from the captured final hidden states through the
  target's LM head only (`TargetModel.head_argmax`, chunked over the vocabulary): one matrix
  product a token instead of a forward through every layer. Leaving it to be computed later is
  not an option: a cache shard holds all three fields for every record or the caching pass
  cannot add its records to the shard, and the objectives read the cached argmax as the exact
  label of their acceptance metrics. The target is loaded where this runs anyway (the feature
  config and the store's key name its weights).

The features are the engine's numbers (its dtype and kernels), stored under the training step's
feature config: the spool must come from a server of the same target whose drafter reads the
same feature layers. The widths are checked; the layer ids are not recorded in a capture.

The spool is read through its own definitions (`online.spool`'s file names, `online.capture`'s
`CapturedRequest`) rather than a copy of its format: an import up a floor, but of two
engine-side modules that import nothing of ours besides each other, so it cannot close a cycle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_spec.data.records import RolloutRecord
from lightning_spec.data.rollouts import RolloutStore
from lightning_spec.data.shards import ShardInfo, StoreError
from lightning_spec.data.store_features import CACHED_FIELDS
from lightning_spec.online.capture import CapturedRequest
from lightning_spec.online.spool import SUFFIX

__all__ = ["NO_TOKEN", "SpoolFeaturesReport", "features_from_spool", "spool_files"]

log = logging.getLogger(__name__)

NO_TOKEN = -1
"""The argmax stored for a final token's row, which the engine never computes."""


@dataclass
class SpoolFeaturesReport:
    """What `features_from_spool` did; records count among those the run selects."""

    matched: int = 0
    """Records a capture covers."""
    written: int = 0
    """Of those, the records whose features are now cached (fewer when the cache is full)."""
    unmatched: int = 0
    """Records no capture covers: left to the caching pass, or to the training step."""
    already_cached: int = 0
    """Records cached before (by an earlier run or a target pass): left as they are."""
    unused_captures: int = 0
    """Captures no record takes (the servers' probe, earlier turns, other clients)."""
    unusable: int = 0
    """Spool files that do not load, are cut short or hold no final hidden states (skipped)."""
    rows: int = 0
    """Feature rows written from captures."""
    placeholder_rows: int = 0
    """Of those, final-token rows stored as placeholders (see the module docstring)."""
    cache_full: bool = False
    """The cache reached its cap (or the disk filled): later shards were not written."""


@dataclass(frozen=True)
class _Capture:
    """What matching needs of one spool file (its tensors stay on disk until written)."""

    path: Path
    tokens: tuple[int, ...]
    prompt_len: int
    rows: int
    """Token rows the engine computed (an engine that reused cached prefix blocks computes
    fewer than ``len(tokens) - 1``: such a capture covers only records that short)."""


def spool_files(folder: str | Path) -> list[Path]:
    """The complete capture files of a spool, those not taken yet and those a learner took
    (``done/``), oldest first in each; `FileNotFoundError` when the folder does not exist."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"no spool folder {root}: give the --spool DIR of the `lightning-spec serve "
            "--engine vllm` server that answered the regeneration"
        )
    done = root / "done"
    taken = sorted(done.glob(f"*{SUFFIX}")) if done.is_dir() else []
    return sorted(root.glob(f"*{SUFFIX}")) + taken


def _load(path: Path) -> CapturedRequest | None:
    """The capture in `path` (tensors memory-mapped, not read), or None when it is unusable."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        request = CapturedRequest(**data)
        rows = len(request.token_ids) - 1  # the engine computed every token's row but the last
        whole = (
            rows >= 1
            and request.aux.dim() == 2
            and request.aux.shape[0] == rows
            and request.last is not None
            and tuple(request.last.shape[:1]) == (rows,)
        )
    except Exception as error:  # noqa: BLE001 - a bad file is skipped and counted, never fatal
        log.warning("spool file %s does not load (%r): skipped", path, error)
        return None
    if not whole:
        log.warning("spool file %s holds no whole capture with final hidden states: skipped", path)
        return None
    return request


def _reload(capture: _Capture) -> CapturedRequest | None:
    """The capture again, where it was indexed or where a learner has moved it since."""
    for path in (capture.path, capture.path.parent / "done" / capture.path.name):
        if path.is_file():
            return _load(path)
    return None


def _check_widths(request: CapturedRequest, target: Any, path: Path) -> None:
    """Refuse a spool whose rows are not the training target's (another target or layers)."""
    features, hidden = int(target.feature_size), int(target.hidden_size)
    assert request.last is not None  # `_load` returns captures with final hidden states only
    if request.aux.shape[1] != features or request.last.shape[1] != hidden:
        raise ValueError(
            f"{path}: the captured features are {request.aux.shape[1]} wide and the final "
            f"hidden states {request.last.shape[1]}, but the target here gives {features} "
            f"({len(target.feature_layers)} feature layers of {hidden}) and {hidden}: the spool "
            "comes from another target, or from a drafter that reads other layers"
        )


def _match(
    record: RolloutRecord,
    captures: Sequence[_Capture],
    by_prompt: Mapping[tuple[int, ...], list[int]],
    by_tokens: Mapping[tuple[int, ...], int],
) -> int | None:
    """The capture that covers `record`'s tokens (the one with the most computed rows), or
    None. Candidates are looked up by the record's prompt (``meta["prompt_tokens"]``, what was
    sent), else by its whole token list."""
    ids = tuple(int(t) for t in record.input_ids)
    prompt = record.meta.get("prompt_tokens")
    candidates: list[int] = []
    if isinstance(prompt, int) and 0 < prompt <= len(ids):
        candidates = [
            i for i in by_prompt.get(ids[:prompt], []) if captures[i].tokens[: len(ids)] == ids
        ]
    if not candidates and ids in by_tokens:
        candidates = [by_tokens[ids]]
    # every row but the final token's must be the engine's own (no rows skipped)
    candidates = [i for i in candidates if captures[i].rows >= len(ids) - 1]
    if not candidates:
        return None
    return max(candidates, key=lambda i: len(captures[i].tokens))  # the first of equals


def _rows(request: CapturedRequest, length: int, target: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Features [length, F], final hidden states [length, H] and argmax [length] of the first
    `length` tokens of `request` (the last row a placeholder when the engine never computed it)."""
    assert request.last is not None
    real = min(length, int(request.aux.shape[0]))
    features = request.aux[:real].float()
    hidden = request.last[:real].float()
    argmax = target.head_argmax(hidden.to(target.device)).to("cpu", torch.long)
    if real < length:  # the final committed token (see the module docstring)
        features = torch.cat([features, features.new_zeros(1, features.shape[1])])
        hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
        argmax = torch.cat([argmax, argmax.new_full((1,), NO_TOKEN)])
    return features, hidden, argmax


def _cached(
    store: RolloutStore, info: ShardInfo, feature_config: Mapping[str, Any]
) -> dict[str, dict[str, Tensor]]:
    """The cached fields of one shard (empty when none; a damaged file is dropped)."""
    try:
        return store.read_cached(info.name, feature_config=feature_config)
    except StoreError as error:  # a damaged feature shard: its records are cached again
        store.drop_feature_shard(info.name, str(error))
        return {key: {} for key in CACHED_FIELDS}


@torch.inference_mode()
def features_from_spool(
    store: RolloutStore,
    spool: str | Path,
    target: Any,
    *,
    feature_config: Mapping[str, Any],
    cap_bytes: int,
    max_length: int | None = None,
    select: Callable[[RolloutRecord], bool] | None = None,
) -> SpoolFeaturesReport:
    """Cache the features, final hidden states and argmax of the records of `store` that a
    capture in the `spool` folder covers, shard by shard, under `feature_config` (the training
    step's: `regenerate.feature_config`) and up to `cap_bytes`, as `regenerate.cache_features`
    does; records already cached are left as they are. `target` gives the LM head of the argmax
    and the widths the captures must have; `max_length` and `select` mean what they mean for
    `cache_features`. Run on one process: unlike the caching pass, this takes no claims."""
    files = spool_files(spool)
    report = SpoolFeaturesReport()
    if cap_bytes <= 0:
        return report
    if store.feature_cache_full(feature_config):
        report.cache_full = True
        return report
    cached = store.feature_shards(feature_config)
    pending: list[tuple[ShardInfo, list[RolloutRecord]]] = []
    for info in store.shards():
        records = store.read_shard(info)
        wanted = [r.truncated(max_length) for r in records if select is None or select(r)]
        have: set[str] = set()
        if info.name in cached:
            have = set(_cached(store, info, feature_config)["features"])
        missing = [r for r in wanted if r.id not in have]
        report.already_cached += len(wanted) - len(missing)
        if missing:
            pending.append((info, missing))
    if not pending:  # nothing to add: the spool is not read
        return report

    captures: list[_Capture] = []
    for path in files:
        request = _load(path)
        if request is None:
            report.unusable += 1
            continue
        _check_widths(request, target, path)
        tokens = tuple(int(t) for t in request.token_ids)
        captures.append(
            _Capture(path, tokens, int(request.prompt_len), int(request.aux.shape[0]))
        )
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    by_tokens: dict[tuple[int, ...], int] = {}
    for index, capture in enumerate(captures):
        by_prompt.setdefault(capture.tokens[: capture.prompt_len], []).append(index)
        by_tokens.setdefault(capture.tokens, index)

    plan: list[tuple[ShardInfo, list[tuple[RolloutRecord, int]]]] = []
    used: set[int] = set()
    for info, missing in pending:
        matched: list[tuple[RolloutRecord, int]] = []
        for record in missing:
            found = _match(record, captures, by_prompt, by_tokens)
            if found is None:
                report.unmatched += 1
            else:
                matched.append((record, found))
                used.add(found)
        report.matched += len(matched)
        if matched:
            plan.append((info, matched))
    report.unused_captures = len(captures) - len(used)

    for info, matched in plan:
        if store.feature_cache_full(feature_config):
            report.cache_full = True
            break
        before = _cached(store, info, feature_config)
        features, hidden, argmax = (dict(before[key]) for key in CACHED_FIELDS)
        added = rows = placeholders = 0
        for record, index in matched:
            request = _reload(captures[index])
            if request is None:  # gone since it was indexed: left to the caching pass
                report.matched -= 1
                report.unmatched += 1
                continue
            rid = record.id
            features[rid], hidden[rid], argmax[rid] = _rows(request, len(record), target)
            added += 1
            rows += len(record)
            placeholders += int(len(record) > request.aux.shape[0])
        if not added:
            continue
        stored = store.write_features(
            info.name,
            features,
            feature_config=feature_config,
            cap_bytes=cap_bytes,
            last_hidden=hidden,
            target_argmax=argmax,
        )
        if not stored:  # the cap or a full disk: the caching pass and the training step do the rest
            report.cache_full = True
            break
        report.written += added
        report.rows += rows
        report.placeholder_rows += placeholders
    log.info(
        "features from the spool %s: %d records matched (%d written, %d rows, %d final-token "
        "placeholders), %d without a capture, %d cached before; %d captures unused, %d unusable%s",
        spool, report.matched, report.written, report.rows, report.placeholder_rows,
        report.unmatched, report.already_cached, report.unused_captures, report.unusable,
        " (the feature cache is full)" if report.cache_full else "",
    )  # fmt: skip
    return report
