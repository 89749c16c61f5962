"""scripts/engine_vs_greedy.py (an engine's replies against cached greedy answers, hand-made files)
and scripts/vllm_beside_probe.py's refusal of a config vLLM does not serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def script(study_script):  # noqa: ANN001, ANN201
    return study_script("engine_vs_greedy")


def _files(tmp_path: Path, replies: dict[str, list[list[int]]]) -> list[str]:
    stream = tmp_path / "stream.jsonl"
    stream.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "p"}) + "\n" for i in range(3)))
    answers = tmp_path / "answers.jsonl"
    rows = [{"header": True, "max_new_tokens": 4}, {"id": "r0", "tokens": [1, 2, 3, 4]},
            {"id": "r1", "tokens": [5, 6, 2]}, {"id": "r2", "tokens": [7, 8, 9, 9]}]  # fmt: skip
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"prompts": 3, "tokens": replies}))
    return ["--bench", str(bench), "--stream", str(stream), "--answers", str(answers)]


def test_counts_replies_that_leave_the_greedy_answer(script, tmp_path: Path) -> None:  # noqa: ANN001
    replies = {"plain": [[1, 2, 3, 4], [5, 6, 2], [7, 8, 9, 9]],
               "eagle3@3": [[1, 2, 3, 4], [5, 6, 3], [7, 8, 9, 9]]}  # fmt: skip
    out = tmp_path / "out.json"
    assert script.main([*_files(tmp_path, replies), "--output", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    assert modes["plain"] == {"checked": 3, "mismatches": 0, "first": []}
    assert modes["eagle3@3"] == {"checked": 3, "mismatches": 1, "first": ["r1"]}


def test_a_short_bench_is_refused(script, tmp_path: Path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="2 replies for 3"):
        script.main(_files(tmp_path, {"plain": [[1, 2, 3, 4], [5, 6, 2]]}))


def test_missing_files_are_a_parser_error(script, tmp_path: Path) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):
        script.main(["--bench", str(tmp_path / "none.json"), "--stream", "x", "--answers", "y"])


def test_the_beside_probe_needs_an_engine_config(study_script, tmp_path: Path) -> None:  # noqa: ANN001
    """scripts/vllm_beside_probe.py refuses a config that vLLM does not serve, before loading."""
    probe = study_script("vllm_beside_probe")
    with pytest.raises(SystemExit):
        probe.main(["--config", "experiments/onlinespec/configs/serve_strong_warm_start.yaml", "--output", str(tmp_path / "p.json")])
