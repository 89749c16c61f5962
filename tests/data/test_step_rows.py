"""StepRecord v2 on disk: sparse target rows in a safetensors sidecar (not JSON float lists),
the v2 flags in the JSON record, and truncation that cuts the straddling step."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lightning_spec.data.records import (
    load_step_rows,
    record_from_generation,
    save_step_rows,
    step_record_from_dict,
    step_record_to_dict,
)
from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


def _generation(max_new_tokens: int = 20):  # noqa: ANN202
    target = TargetModel.from_config(tiny_config("llama"), seed=2)
    drafter = Eagle3Drafter.from_target(target)
    decoder = SpeculativeDecoder(
        target, drafter, parse_tree_spec("dynamic:3,3,8"), keep_target_rows=4, drafter_version="v7"
    )
    return decoder.generate(list(range(5, 15)), max_new_tokens, stop_on_eos=False)


def test_sparse_rows_round_trip_through_a_sidecar(tmp_path: Path) -> None:
    generation = _generation()
    records = generation.records
    assert all(r.target_rows is not None for r in records)
    for record in records:  # rows of the root and the accepted nodes: they score tried nodes
        assert record.target_rows.rows.tolist() == [0] + (record.accepted + 1).tolist()
        assert record.target_rows.logprobs.shape == (record.accept_length + 1, 4)
    dicts = [step_record_to_dict(r) for r in records]
    text = json.dumps(dicts)
    assert "target_rows" not in text and '"drafter_version": "v7"' in text
    save_step_rows(tmp_path / "rows.safetensors", records)
    back = [step_record_from_dict(d) for d in dicts]
    assert all(r.target_rows is None for r in back)
    load_step_rows(tmp_path / "rows.safetensors", back)
    for a, b in zip(records, back, strict=True):
        assert torch.equal(a.target_rows.ids, b.target_rows.ids)
        torch.testing.assert_close(a.target_rows.logprobs, b.target_rows.logprobs)
        torch.testing.assert_close(a.target_rows.logsumexp, b.target_rows.logsumexp)
        assert b.bonus_committed == a.bonus_committed and b.drafter_version == "v7"


def test_truncation_drops_and_cuts_steps() -> None:
    generation = _generation(24)
    record = record_from_generation("r", generation)
    prompt = len(generation.prompt)
    keep = prompt + 7  # the prompt, the prefill token and 6 committed tokens
    cut = record.truncated(keep)
    steps = cut.step_records()
    assert steps, "some steps fit"
    last = steps[-1]
    assert last.anchor + len(last.committed) == keep - 1  # the kept tokens end the last step
    committed = [t for s in steps for t in s.committed]
    assert cut.input_ids[prompt + 1 :] == committed
    if len(last.committed) < len(generation.records[len(steps) - 1].committed):
        assert not last.bonus_committed
        assert last.accept_length <= len(last.committed)
