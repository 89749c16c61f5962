"""lightning-spec bench vocab (lightning_spec/bench/vocab_coverage.py) on hand-made texts: token
coverage and j-in-a-row shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def test_coverage_counts_tokens_and_runs() -> None:
    from lightning_spec.bench import vocab_coverage as module

    in_vocab = torch.zeros(10, dtype=torch.bool)
    in_vocab[[1, 2, 3]] = True
    result = module.coverage([[1, 2, 9, 3], [2, 2]], in_vocab)
    assert result["tokens"] == 6 and result["coverage"] == pytest.approx(5 / 6)
    runs = result["next_j_all_in"]
    assert runs[0] == pytest.approx(5 / 6)
    assert runs[1] == pytest.approx(2 / 4)  # windows (1,2) (2,9) (9,3) (2,2)
    assert runs[2] == pytest.approx(0 / 2)  # (1,2,9) (2,9,3); the 2-token text has none
    assert runs[5] is None  # no text has six tokens


def test_replay_texts_group_by_dataset(tmp_path: Path) -> None:
    from lightning_spec.bench import vocab_coverage as module

    path = tmp_path / "texts.jsonl"
    rows = [{"header": True}, {"id": "mtbench:0:a", "tokens": [1, 2]}, {"id": "humaneval:3:b", "tokens": [4]},
            {"id": "mtbench:1:c", "tokens": [5]}]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert module.replay_texts(path) == {"mtbench": [[1, 2], [5]], "humaneval": [[4]]}
