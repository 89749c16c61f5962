"""Training records, and the verification steps an on-policy record carries, as plain data.

A *record* is one training sequence: ``{"id", "input_ids", "loss_mask", "source", "meta"}``,
where ``source`` says where the assistant tokens came from (``"dataset"``: the dataset's own
answer, ``"regenerated"``: the target's answer to the dataset prompt, ``"rollout"``: an
on-policy decode with the current drafter). On-policy records also carry ``steps``: serialized
:class:`~lightning_spec.decoding.engine.StepRecord` s, the raw material of GTO, Draft-OPD and
OnlineSpec. The format is plain JSON so that a serving-engine adapter (SGLang, vLLM) can write
the same records for large targets without anything else changing. The sparse target rows of
steps are too large for JSON floats and go to a safetensors sidecar (`save_step_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_spec.io import atomic_write

if TYPE_CHECKING:
    from lightning_spec.decoding.engine import Generation, StepRecord

__all__ = [
    "FORMAT_VERSION",
    "SOURCES",
    "RolloutRecord",
    "attach_step_rows",
    "load_step_rows",
    "record_from_generation",
    "save_step_rows",
    "step_record_from_dict",
    "step_record_to_dict",
    "step_rows_tensors",
]

FORMAT_VERSION = 2
"""2: StepRecord v2 (bonus_committed, drafter_version; sparse target rows in a sidecar)."""
SOURCES = ("dataset", "regenerated", "rollout")


@dataclass
class RolloutRecord:
    """One training sequence; ``loss_mask[t] = 1`` marks an assistant token to be predicted."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str = "dataset"
    meta: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] | None = None
    """Serialized StepRecords (:func:`step_record_to_dict`), on-policy records only."""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(
                f"record {self.id!r}: {len(self.input_ids)} input ids but "
                f"{len(self.loss_mask)} loss-mask entries"
            )

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "input_ids": [int(t) for t in self.input_ids],
            "loss_mask": [int(m) for m in self.loss_mask],
            "source": self.source,
            "meta": self.meta,
        }
        if self.steps is not None:
            out["steps"] = self.steps
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutRecord:
        try:
            return cls(
                id=str(data["id"]),
                input_ids=list(data["input_ids"]),
                loss_mask=list(data["loss_mask"]),
                source=str(data.get("source", "dataset")),
                meta=dict(data.get("meta") or {}),
                steps=data.get("steps"),
            )
        except KeyError as exc:
            raise ValueError(f"a rollout record needs the key {exc.args[0]!r}") from None

    def truncated(self, max_length: int | None) -> RolloutRecord:
        """The first ``max_length`` tokens (the beginning is kept, as for the dataset).

        Steps beyond the cut are dropped and the step that straddles it is cut with its
        committed tokens (`StepRecord.cut`), so steps always describe the kept tokens.
        """
        if max_length is None or len(self) <= max_length:
            return self
        steps = None
        if self.steps is not None:
            steps = []
            for data in self.steps:
                room = max_length - 1 - int(data["anchor"])  # tokens after the root that fit
                if room < 1:
                    break
                if room < len(data["committed"]):
                    data = step_record_to_dict(step_record_from_dict(data).cut(room))
                steps.append(data)
        return RolloutRecord(
            self.id,
            self.input_ids[:max_length],
            self.loss_mask[:max_length],
            self.source,
            self.meta,
            steps,
        )

    def step_records(self) -> list[StepRecord]:
        """Deserialize ``steps`` into engine StepRecords (empty for non-rollout records)."""
        return [step_record_from_dict(s) for s in self.steps or []]


# --------------------------------------------------------------------------------------------
# StepRecord <-> dict
# --------------------------------------------------------------------------------------------


def _tensor_to_list(value: Tensor | None) -> list | None:
    return None if value is None else value.detach().cpu().tolist()


def step_record_to_dict(record: StepRecord, *, include_probs: bool = False) -> dict[str, Any]:
    """A JSON-ready dict of one verification step (tensors become lists).

    The ``[N + 1, V]`` draft/target distribution rows are skipped unless ``include_probs``:
    they are V floats per node (49k for SmolLM2), far bigger than the rest of the record.
    """
    tree = record.tree
    tree_dict: dict[str, Any] = {
        "tokens": _tensor_to_list(tree.tokens),
        "parents": _tensor_to_list(tree.parents),
        "logprobs": _tensor_to_list(tree.logprobs.float()),
        "iid_children": bool(tree.iid_children),
    }
    out: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "anchor": int(record.anchor),
        "tree": tree_dict,
        "target_token_logprobs": _tensor_to_list(record.target_token_logprobs.float()),
        "target_argmax": _tensor_to_list(record.target_argmax),
        "accepted": _tensor_to_list(record.accepted),
        "committed": [int(t) for t in record.committed],
        "temperature": float(record.temperature),
        "timings": {k: float(v) for k, v in record.timings.items()},
        "bonus_committed": bool(record.bonus_committed),
        "drafter_version": record.drafter_version,
    }
    if include_probs:
        if tree.draft_probs is not None:
            tree_dict["draft_probs"] = _tensor_to_list(tree.draft_probs.float())
        if record.target_probs is not None:
            out["target_probs"] = _tensor_to_list(record.target_probs.float())
    return out


def step_record_from_dict(data: Mapping[str, Any]) -> StepRecord:
    """Inverse of :func:`step_record_to_dict` (tensors on the CPU)."""
    from lightning_spec.decoding.engine import StepRecord
    from lightning_spec.decoding.tree import DraftTree

    version = int(data.get("version", FORMAT_VERSION))
    if version > FORMAT_VERSION:
        raise ValueError(
            f"step record format {version} is newer than this reader ({FORMAT_VERSION})"
        )
    tree_data = data["tree"]
    draft_probs = tree_data.get("draft_probs")
    tree = DraftTree(
        tokens=torch.tensor(tree_data["tokens"], dtype=torch.long),
        parents=torch.tensor(tree_data["parents"], dtype=torch.long),
        logprobs=torch.tensor(tree_data["logprobs"], dtype=torch.float32),
        draft_probs=None if draft_probs is None else torch.tensor(draft_probs, dtype=torch.float32),
        iid_children=bool(tree_data.get("iid_children", False)),
    )
    target_probs = data.get("target_probs")
    return StepRecord(
        anchor=int(data["anchor"]),
        tree=tree,
        target_token_logprobs=torch.tensor(data["target_token_logprobs"], dtype=torch.float32),
        target_argmax=torch.tensor(data["target_argmax"], dtype=torch.long),
        accepted=torch.tensor(data["accepted"], dtype=torch.long),
        committed=[int(t) for t in data["committed"]],
        temperature=float(data.get("temperature", 0.0)),
        target_probs=None if target_probs is None else torch.tensor(target_probs),
        timings=dict(data.get("timings", {})),
        bonus_committed=bool(data.get("bonus_committed", True)),
        drafter_version=data.get("drafter_version"),
    )


def step_rows_tensors(records: Sequence[StepRecord]) -> dict[str, Tensor]:
    """The sparse target rows of `records` as flat tensors for a safetensors sidecar
    (``{i}.rows``, ``{i}.logprobs``, ``{i}.ids``, ``{i}.logsumexp`` for step i), not JSON
    float lists; steps without rows are absent."""
    out: dict[str, Tensor] = {}
    for index, record in enumerate(records):
        rows = record.target_rows
        if rows is None:
            continue
        out[f"{index}.rows"] = rows.rows.long().contiguous()
        out[f"{index}.logprobs"] = rows.logprobs.float().contiguous()
        out[f"{index}.ids"] = rows.ids.long().contiguous()
        out[f"{index}.logsumexp"] = rows.logsumexp.float().contiguous()
    return out


def attach_step_rows(records: Sequence[StepRecord], tensors: Mapping[str, Tensor]) -> None:
    """Inverse of :func:`step_rows_tensors`: set ``target_rows`` of the listed steps."""
    from lightning_spec.decoding.engine import SparseRows

    for index, record in enumerate(records):
        if f"{index}.rows" in tensors:
            record.target_rows = SparseRows(
                tensors[f"{index}.rows"],
                tensors[f"{index}.logprobs"],
                tensors[f"{index}.ids"],
                tensors[f"{index}.logsumexp"],
            )


def save_step_rows(path: str | Path, records: Sequence[StepRecord]) -> None:
    """Write the sparse target rows of `records` to a safetensors sidecar (atomically)."""
    from safetensors.torch import save

    with atomic_write(Path(path), "wb") as handle:
        handle.write(save(step_rows_tensors(records)))


def load_step_rows(path: str | Path, records: Sequence[StepRecord]) -> None:
    """Read a sidecar written by :func:`save_step_rows` into `records`."""
    from safetensors.torch import load_file

    attach_step_rows(records, load_file(str(path)))


def record_from_generation(
    record_id: str,
    generation: Generation,
    *,
    meta: Mapping[str, Any] | None = None,
    include_probs: bool = False,
) -> RolloutRecord:
    """An on-policy record from one ``SpeculativeDecoder.generate`` call: the prompt (no loss)
    then the generated tokens (loss), with every verification step attached."""
    prompt, tokens = list(generation.prompt), list(generation.tokens)
    return RolloutRecord(
        id=record_id,
        input_ids=prompt + tokens,
        loss_mask=[0] * len(prompt) + [1] * len(tokens),
        source="rollout",
        meta={**(meta or {}), "prompt_tokens": len(prompt), "tau": generation.tau},
        steps=[step_record_to_dict(r, include_probs=include_probs) for r in generation.records],
    )
