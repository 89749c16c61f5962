"""On-policy data: the rollout buffer that `RolloutDataModule(mode="on_policy")` trains on.

The buffer holds the latest rollouts of the current drafter (records with ``source="rollout"``
and their StepRecords). A refresh (every N optimizer steps, driven by the
`lightning_spec.callbacks.on_policy.RefreshRollouts` callback or by an objective) replaces them
with new rollouts from a `RolloutSource`; the buffer goes into Lightning checkpoints (through
the data module's ``state_dict``), so a resumed run continues with the very same buffer.
The number of records is fixed (one per prompt of a refresh), so the sampler's epoch length
never changes under a refresh.

Batches carry the usual keys (``input_ids``, ``attention_mask``, ``loss_mask``...) plus the
collated steps (`collate_steps`), the fields Draft-OPD and on-policy objectives read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_spec.data.records import (
    RolloutRecord,
    attach_step_rows,
    record_from_generation,
    step_rows_tensors,
)

__all__ = [
    "OnPolicyBuffer",
    "OnPolicyRollouts",
    "OnPolicyTable",
    "RolloutSettings",
    "collate_steps",
]

STEP_KEYS = (
    "step_mask",
    "step_anchor",
    "step_depth",
    "step_accept_length",
    "step_committed",
    "step_bonus",
    "rejected_mask",
    "rejected_tokens",
    "rejected_depth",
    "rejected_target_logprobs",
    "rejected_draft_logprobs",
)
"""Batch keys `collate_steps` adds (see its docstring for shapes)."""


class OnPolicyBuffer:
    """The current rollouts (see the module docstring)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("an on-policy buffer needs at least one prompt per refresh")
        self.size = int(size)
        self.records: list[RolloutRecord] = []
        self.refreshes = 0
        self.version: str | None = None
        self.refreshed_at_step: int | None = None

    def __len__(self) -> int:
        return len(self.records)

    def replace(
        self, generations: Sequence[Any], *, version: str, step: int, max_length: int
    ) -> None:
        """New rollouts (one `Generation` per prompt) made by drafter `version` at `step`."""
        if len(generations) != self.size:
            raise ValueError(f"a refresh must bring {self.size} rollouts, got {len(generations)}")
        records = []
        for index, generation in enumerate(generations):
            record = record_from_generation(
                f"rollout-{self.refreshes}-{index}", generation, meta={"drafter_version": version}
            )
            rows = step_rows_tensors(generation.records)
            if rows:
                record.meta["step_rows"] = rows
            records.append(record.truncated(max_length))
        self.records = records
        self.refreshes += 1
        self.version = version
        self.refreshed_at_step = int(step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "records": [r.to_dict() for r in self.records],
            "refreshes": self.refreshes,
            "version": self.version,
            "refreshed_at_step": self.refreshed_at_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("size", self.size)) != self.size:
            raise ValueError(
                f"the checkpoint's on-policy buffer holds {state.get('size')} rollouts per "
                f"refresh, this run {self.size}: resume with the same rollout_prompts"
            )
        self.records = [RolloutRecord.from_dict(r) for r in state.get("records", [])]
        self.refreshes = int(state.get("refreshes", 0))
        self.version = state.get("version")
        self.refreshed_at_step = state.get("refreshed_at_step")


class OnPolicyTable(Dataset):
    """A map-style view of the buffer: item i is the buffer's record i at the time it is read.

    With a `companion` table (the dataset's training records), item i also carries companion
    row ``order[(r - 1) * size + i]`` under ``"sft"`` (r = refreshes so far, `order` a fixed
    permutation from `seed`): objectives that add a token loss on dataset text next to the
    on-policy loss get fresh rows with every refresh, reproducibly across a resume.
    """

    def __init__(self, buffer: OnPolicyBuffer, companion: Any = None, seed: int = 0) -> None:
        self.buffer = buffer
        self.companion = companion
        self._order: list[int] = []
        if companion is not None:
            if len(companion) == 0:
                raise ValueError("the companion dataset table is empty")
            generator = torch.Generator().manual_seed(int(seed))
            self._order = torch.randperm(len(companion), generator=generator).tolist()

    def __len__(self) -> int:
        return self.buffer.size

    @property
    def lengths(self) -> np.ndarray:
        """Uniform lengths: the order must not depend on the buffer's contents (which change at
        every refresh and are restored later than the sampler is built on resume)."""
        return np.ones(self.buffer.size, dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if len(self.buffer) < self.buffer.size:
            raise RuntimeError(
                "the on-policy buffer is empty: add the lightning_spec.callbacks.on_policy."
                "RefreshRollouts callback (or call RolloutDataModule.refresh_rollouts) so "
                "rollouts exist before the first batch"
            )
        record = self.buffer.records[index]
        steps = record.step_records()
        rows = record.meta.get("step_rows")
        if rows:
            attach_step_rows(steps, rows)
        item = {
            "id": record.id,
            "source": record.source,
            "input_ids": torch.tensor(record.input_ids, dtype=torch.long),
            "loss_mask": torch.tensor(record.loss_mask, dtype=torch.long),
            "features": None,
            "last_hidden": None,
            "target_argmax": None,
            "steps": steps,
        }
        if self.companion is not None:
            at = (max(0, self.buffer.refreshes - 1) * self.buffer.size + index) % len(self._order)
            item["sft"] = self.companion[self._order[at]]
        return item


def collate_steps(rows: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
    """The StepRecords of a batch as padded tensors ([B, S] per step, [B, S, R] per rejected
    node; S = most steps in a row, R = most rejected nodes in a step):

    ``step_mask`` (real steps), ``step_anchor`` (root position), ``step_depth`` (deepest
    drafted node), ``step_accept_length``, ``step_committed`` (tokens committed),
    ``step_bonus`` (committed[-1] is the target's bonus token); ``rejected_mask``,
    ``rejected_tokens``, ``rejected_depth`` (block position k of the rejected draft),
    ``rejected_target_logprobs`` (log p_target of the rejected token at its slot) and
    ``rejected_draft_logprobs`` (log q at drafting time). Tried-and-rejected nodes only
    (StepRecord v2), so nodes verification never reached are not counted as errors.
    """
    steps = [row.get("steps") or [] for row in rows]
    batch, width = len(rows), max((len(s) for s in steps), default=0)
    rejected = [[step.rejected for step in row] for row in steps]
    depth_r = max((int(r.numel()) for row in rejected for r in row), default=0)
    out = {
        "step_mask": torch.zeros(batch, width, dtype=torch.bool),
        "step_anchor": torch.full((batch, width), -1, dtype=torch.long),
        "step_depth": torch.zeros(batch, width, dtype=torch.long),
        "step_accept_length": torch.zeros(batch, width, dtype=torch.long),
        "step_committed": torch.zeros(batch, width, dtype=torch.long),
        "step_bonus": torch.zeros(batch, width, dtype=torch.bool),
        "rejected_mask": torch.zeros(batch, width, depth_r, dtype=torch.bool),
        "rejected_tokens": torch.full((batch, width, depth_r), -1, dtype=torch.long),
        "rejected_depth": torch.zeros(batch, width, depth_r, dtype=torch.long),
        "rejected_target_logprobs": torch.zeros(batch, width, depth_r),
        "rejected_draft_logprobs": torch.zeros(batch, width, depth_r),
    }
    for b, row in enumerate(steps):
        for s, step in enumerate(row):
            out["step_mask"][b, s] = True
            out["step_anchor"][b, s] = step.anchor
            out["step_depth"][b, s] = step.tree.max_depth
            out["step_accept_length"][b, s] = step.accept_length
            out["step_committed"][b, s] = len(step.committed)
            out["step_bonus"][b, s] = step.bonus_committed
            nodes = rejected[b][s]
            count = int(nodes.numel())
            if count:
                out["rejected_mask"][b, s, :count] = True
                out["rejected_tokens"][b, s, :count] = step.tree.tokens[nodes]
                out["rejected_depth"][b, s, :count] = step.tree.depth[nodes]
                out["rejected_target_logprobs"][b, s, :count] = step.target_token_logprobs[nodes]
                out["rejected_draft_logprobs"][b, s, :count] = step.tree.logprobs[nodes]
    return out


@dataclass(frozen=True)
class RolloutSettings:
    """How on-policy rollouts are made (the data module's ``rollout_*`` arguments)."""

    prompts: int = 32
    max_new_tokens: int = 64
    tree: str = "chain:4"
    temperature: float = 0.0
    target_rows: int = 0
    pool: int = 0
    replay: bool = False
    decode_batch: int = 0
    seed: int = 0

    def check(self, *, on_policy: bool) -> None:
        """Refuse settings no rollout can be made with (the tree only when rollouts are made)."""
        if self.prompts < 1 or self.max_new_tokens < 1:
            raise ValueError("rollout_prompts and rollout_max_new_tokens must be >= 1")
        if self.pool < 0:
            raise ValueError(
                f"rollout_pool must be >= 0 (0 = every training prompt), got {self.pool}"
            )
        if self.replay and (self.temperature > 0 or self.target_rows > 0):
            raise ValueError(
                "rollout_replay rebuilds greedy rollouts only: it needs rollout_temperature 0 "
                "(a sampled rollout depends on the drafter) and rollout_target_rows 0"
            )
        if self.decode_batch < 0 or (self.decode_batch and not self.replay):
            raise ValueError(
                "rollout_decode_batch must be >= 0 and needs rollout_replay (batched greedy "
                f"answers are replayed), got {self.decode_batch}"
            )
        if on_policy:
            from lightning_spec.decoding.build import parse_tree_spec
            from lightning_spec.decoding.lookup import require_drafter_policy

            try:
                require_drafter_policy(parse_tree_spec(self.tree), "rollout_tree")
            except ValueError as error:
                raise ValueError(f"rollout_tree {self.tree!r}: {error}") from error


class OnPolicyRollouts:
    """The on-policy side of the data module: the buffer, the source that refills it from the
    current drafter, the training prompts it rotates through, and their checkpoint state (a
    resumed run continues with the same buffer and, for replayed rollouts, the remembered
    continuations)."""

    def __init__(self, settings: RolloutSettings, target_model: Callable[[], Any]) -> None:
        self.settings = settings
        self._target_model = target_model
        self.buffer = OnPolicyBuffer(settings.prompts)
        self.source: Any = None
        self.prompts: list[list[int]] = []
        self._source_state: dict[str, Any] | None = None  # restored before the source exists

    def refresh(self, drafter: Any, *, step: int, version: str, max_length: int) -> None:
        """Replace the buffer with rollouts of `drafter` (refresh number r takes the next
        ``prompts`` training prompts, cycling through the first ``pool``)."""
        if not self.prompts:
            raise RuntimeError("no training prompts for on-policy rollouts: set up the data first")
        if self.source is None:
            self.source = self._build_source()
        size = self.settings.prompts
        start = self.buffer.refreshes * size
        pool = min(self.settings.pool or len(self.prompts), len(self.prompts))
        prompts = [self.prompts[(start + i) % pool] for i in range(size)]
        generations = self.source.generate(drafter, prompts, version=version)
        self.buffer.replace(generations, version=version, step=step, max_length=max_length)

    def _build_source(self) -> Any:
        from lightning_spec.decoding.source import DecoderRolloutSource, ReplayingRolloutSource

        settings = self.settings
        if settings.replay:
            source: Any = ReplayingRolloutSource(
                self._target_model(),
                tree=settings.tree,
                max_new_tokens=settings.max_new_tokens,
                seed=settings.seed,
                decode_batch_size=settings.decode_batch,
            )
            if self._source_state is not None:
                source.load_state_dict(self._source_state)
            return source
        return DecoderRolloutSource(
            self._target_model(),
            tree=settings.tree,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            seed=settings.seed,
            keep_target_rows=settings.target_rows,
        )

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"on_policy": self.buffer.state_dict()}
        source_state = getattr(self.source, "state_dict", None)
        if source_state is not None:
            state["rollout_source"] = source_state()
        elif self._source_state is not None:  # restored, not yet rebuilt
            state["rollout_source"] = self._source_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "on_policy" in state:
            self.buffer.load_state_dict(state["on_policy"])
        if "rollout_source" in state:
            self._source_state = state["rollout_source"]
            load = getattr(self.source, "load_state_dict", None)
            if load is not None:
                load(self._source_state)
