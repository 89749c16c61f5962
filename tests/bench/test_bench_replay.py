"""bench --replay: replayed T = 0 tau equals what live decoding measures, prompt by prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_spec.bench import runner as bench_runner
from lightning_spec.bench.replay import replay_bench, replay_markdown
from lightning_spec.cli import bench as bench_cli
from lightning_spec.io import sha256_file
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.standalone import StandaloneDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=11)


def _prompts(count: int, seed: int = 0) -> list[tuple[list[int], dict]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(3, 128, (10,), generator=generator).tolist(), {"id": f"p{i}"})
        for i in range(count)
    ]


def test_replayed_steps_equal_the_live_decode(target: TargetModel, tmp_path: Path) -> None:
    """Every drafter under every tree: the replayed verification steps (count, committed
    tokens, accept lengths) are the live decoder's on every prompt whose greedy answer was not
    cut, and a cut answer is a prefix of the live text."""
    drafters = {"eagle": Eagle3Drafter.from_target(target, seed=3),
                "other": Eagle3Drafter.from_target(target, seed=8)}  # fmt: skip
    trees = ["chain:3", "dynamic:2,2,4"]
    datasets = {"toy": _prompts(4, seed=2), "other": _prompts(2, seed=9)}
    live = bench_runner.run_bench(
        target, drafters, trees, datasets, methods=["speculative"], max_new_tokens=20,
        warmup=0, bootstrap_resamples=50,
    )  # fmt: skip
    replayed = replay_bench(
        target, drafters, trees, datasets, max_new_tokens=20, cache=tmp_path / "answers.jsonl",
        batch_size=3, resamples=50, progress=False,
    )  # fmt: skip
    assert replayed["config"]["methods"] == live["config"]["methods"]
    compared = 0
    for ours, theirs in zip(replayed["per_prompt"], live["per_prompt"], strict=True):
        assert (ours["dataset"], ours["index"]) == (theirs["dataset"], theirs["index"])
        for method, result in ours["methods"].items():
            reference = theirs["methods"][method]
            if result["tokens"] != reference["tokens"]:  # cut at a batched near-tie
                assert reference["tokens"][: len(result["tokens"])] == result["tokens"]
                continue
            for key in ("verifications", "committed_by_verification", "accept_lengths"):
                assert result[key] == reference[key], (method, key)
            compared += 1
    assert compared >= 16
    rows = {(r["dataset"], r["method"]): r for r in replayed["rows"]}
    assert {method for _, method in rows} == set(live["config"]["methods"])
    assert all(row["tau"] >= 1.0 for row in rows.values())
    with pytest.raises(ValueError, match="cannot be replayed"):
        replay_bench(target, {"self": StandaloneDrafter.from_model(target.model)}, trees,
                     datasets, max_new_tokens=20, cache=tmp_path / "x.jsonl")  # fmt: skip
    assert "speeds not measured" in replay_markdown(replayed)
    # the answers are cached: a second run generates nothing and gives the same steps
    again = replay_bench(
        target, drafters, trees[:1], datasets, max_new_tokens=20,
        cache=tmp_path / "answers.jsonl", progress=False, resamples=50,
    )  # fmt: skip
    first = replayed["per_prompt"][0]["methods"]["speculative:eagle@chain:3"]
    assert (
        again["per_prompt"][0]["methods"]["speculative:eagle"]["accept_lengths"]
        == (first["accept_lengths"])
    )


def test_cli_replay(tmp_path: Path) -> None:
    """`bench --replay` writes the rows and per-prompt steps; refuses sampling and lookup."""
    from tests.bench.test_bench import _tiny_folder

    folder = _tiny_folder(tmp_path / "tiny")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": " ".join(f"w{(5 * i + j) % 120 + 4}" for j in range(8))}) + "\n"
        for i in range(4)
    ))  # fmt: skip
    drafter = tmp_path / "eagle"
    Eagle3Drafter.from_target(TargetModel.from_pretrained(str(folder)), seed=1).save_pretrained(
        drafter
    )
    output = tmp_path / "replay.json"
    common = ["--target", str(folder), "--drafter", str(drafter), "--dataset", str(data),
              "--max-new-tokens", "9", "--methods", "speculative", "--threads", "1",
              "--bootstrap", "50", "--no-progress", "--replay",
              "--replay-cache", str(tmp_path / "answers.jsonl")]  # fmt: skip
    assert bench_cli.main([*common, "--tree", "chain:2", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert result["config"]["replay"] is True
    # the results name the drafter's weights, so they say what was compared after it is gone
    assert result["config"]["drafter_sha256"] == {
        str(drafter): sha256_file(drafter / "model.safetensors")
    }
    assert {r["method"] for r in result["rows"]} == {"speculative:eagle"}
    assert len(result["per_prompt"]) == 4 and output.with_suffix(".md").is_file()
    assert bench_cli.main([*common, "--tree", "chain:2+lookup:2,6"]) == 2
    assert bench_cli.main([*common, "--tree", "chain:2", "--temperature", "1.0"]) == 2
    self_only = [a if a != str(drafter) else "self" for a in common]
    assert bench_cli.main([*self_only, "--tree", "chain:2"]) == 2


def test_a_seeded_cache_replays_without_generating_and_cuts_a_wrong_answer(
    target: TargetModel, tmp_path: Path
) -> None:
    """`experiments/drafter-data/scripts/seed_replay_cache.py`'s core: an earlier run's per-prompt
    text seeds a new cache that the replay reads as it is (nothing generated, the same steps);
    an answer that is not this target's greedy text is cut at its first wrong token, and
    counted."""
    from lightning_spec.bench.replay import _requests
    from lightning_spec.online.continuations import seed_continuations
    from tests.conftest import load_module

    seeder = load_module(
        Path(__file__).parents[2] / "experiments/drafter-data/scripts/seed_replay_cache.py", "seeder"
    )
    drafters = {"eagle": Eagle3Drafter.from_target(target, seed=3)}
    datasets = {"toy": _prompts(3, seed=5)}
    first = replay_bench(target, drafters, ["chain:3"], datasets, max_new_tokens=16,
                         cache=tmp_path / "a.jsonl", progress=False, resamples=20)  # fmt: skip
    answers = seeder.answers_by_prompt(first)
    requests = _requests(datasets)
    known = [answers[(r.domain, r.index)] for r in requests]
    cache = tmp_path / "b.jsonl"
    assert seed_continuations(target, requests, known, max_new_tokens=16, cache=cache) == (3, 0)
    before = cache.read_text()
    again = replay_bench(target, drafters, ["chain:3"], datasets, max_new_tokens=16, cache=cache,
                         progress=False, resamples=20)  # fmt: skip
    assert cache.read_text() == before  # every answer came from the seeded cache
    assert [p["methods"] for p in again["per_prompt"]] == [p["methods"] for p in first["per_prompt"]]
    with pytest.raises(FileExistsError):
        seed_continuations(target, requests, known, max_new_tokens=16, cache=cache)
    wrong = [list(a) for a in known]
    wrong[1][4] = (wrong[1][4] + 1) % 128  # not the argmax there
    written, cut = seed_continuations(target, requests, wrong, max_new_tokens=16,
                                      cache=tmp_path / "c.jsonl")  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()[1:]]
    assert (written, cut) == (3, 1)
    assert rows[1]["tokens"] == known[1][:4] and rows[1]["cut"]
