"""lightning-spec bench paired (lightning_spec/bench/paired_tau.py) on a hand-made bench result."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def paired():  # noqa: ANN201
    from lightning_spec.bench import paired_tau

    return paired_tau


def _entry(dataset: str, a: tuple[int, int], b: tuple[int, int]) -> dict:
    return {
        "dataset": dataset,
        "methods": {
            "A": {"committed_by_verification": a[0], "verifications": a[1]},
            "B": {"committed_by_verification": b[0], "verifications": b[1]},
        },
    }


def test_paired_gain_and_difference(paired) -> None:
    result = {
        "per_prompt": [
            _entry("mtbench", (22, 10), (20, 10)),
            _entry("mtbench", (33, 15), (30, 15)),
            _entry("humaneval", (24, 10), (20, 10)),
        ]
    }
    report = paired.compare(result, "A", "B", resamples=500)
    pooled = report["pooled"]
    assert pooled["tau_a"] == pytest.approx(79 / 35) and pooled["tau_b"] == pytest.approx(70 / 35)
    assert pooled["gain"] == pytest.approx(79 / 70 - 1)
    low, high = pooled["gain_ci"]
    assert 0 < low <= pooled["gain"] <= high  # every prompt gains: the interval excludes 0
    assert report["mtbench"]["prompts"] == 2 and report["humaneval"]["gain"] == pytest.approx(0.2)
    assert report["mtbench"]["mean_difference"] == pytest.approx((0.2 + 0.2) / 2)


def _run(methods: dict[str, tuple[list[int], list[int]]], temperature: float = 0.0) -> dict:
    """A bench result of one prompt: method -> (tokens, accept lengths)."""
    return {
        "config": {
            "target": "t",
            "tree": "dynamic:2,4,8",
            "max_new_tokens": 4,
            "temperature": temperature,
            "dtype": "float32",
            "stop_on_eos": True,
            "methods": list(methods),
        },
        "per_prompt": [
            {
                "dataset": "mtbench",
                "id": "mtbench-1",
                "methods": {
                    m: {
                        "tokens": toks,
                        "accept_lengths": acc,
                        "committed_by_verification": sum(acc) + len(acc),
                        "verifications": len(acc),
                    }
                    for m, (toks, acc) in methods.items()
                },
            }
        ],
    }


def test_merge_adds_an_earlier_runs_drafter_when_the_shared_one_decodes_identically(
    paired,
) -> None:
    new = _run({"control": ([1, 2, 3, 4], [1, 1]), "gto": ([1, 2, 3, 4], [2, 0])})
    old = _run({"control": ([1, 2, 3, 4], [1, 1]), "baseline": ([1, 2, 3, 4], [0, 0, 1])})
    assert paired.merge(new, old) == ["baseline"]
    report = paired.compare(new, "gto", "baseline", resamples=100)
    assert report["pooled"]["tau_a"] == pytest.approx(2.0)
    assert report["pooled"]["tau_b"] == pytest.approx(4 / 3)


def test_merge_refuses_unsound_pairs(paired) -> None:
    new = _run({"control": ([1, 2, 3, 4], [1, 1])})
    with pytest.raises(ValueError, match="decoded"):
        paired.merge(new, _run({"control": ([1, 2, 3, 4], [2, 0])}))
    with pytest.raises(ValueError, match="T = 0"):
        paired.merge(
            _run({"a": ([1], [0])}, temperature=1.0), _run({"b": ([1], [0])}, temperature=1.0)
        )
    with pytest.raises(ValueError, match="no method was benched in both"):
        paired.merge(new, _run({"b": ([1], [0])}))
    other = _run({"b": ([1], [0])})
    other["config"]["tree"] = "chain:4"
    with pytest.raises(ValueError, match="tree differs"):
        paired.merge(new, other)
    other = _run({"b": ([1], [0])})
    other["per_prompt"][0]["id"] = "mtbench-2"
    with pytest.raises(ValueError, match="different prompts"):
        paired.merge(new, other)


def _two_prompts(methods_1: dict, methods_2: dict) -> dict:
    run = _run(methods_1)
    second = _run(methods_2)["per_prompt"][0]
    second["id"] = "mtbench-2"
    run["per_prompt"].append(second)
    return run


def test_merge_text_pairs_where_the_greedy_text_is_the_same(paired) -> None:
    """A lost drafter's run pairs on identical text; a prompt whose text differs is left out
    of both sides, and a name both runs use must be renamed."""
    new = _two_prompts(
        {"speculative:drafter": ([1, 2, 3, 4], [2, 0])},
        {"speculative:drafter": ([5, 6, 7, 8], [1, 1])},
    )
    old = _two_prompts(
        {"speculative:drafter": ([1, 2, 3, 4], [0, 0, 1])},
        {"speculative:drafter": ([5, 6, 9, 9], [0, 0, 0, 0])},  # a near-tie broke otherwise
    )
    with pytest.raises(ValueError, match="rename"):
        paired.merge_text(json_copy(new), json_copy(old))
    added, left_out = paired.merge_text(new, old, {"speculative:drafter": "old"})
    assert added == ["old"] and left_out == ["mtbench-2"]
    assert [e["id"] for e in new["per_prompt"]] == ["mtbench-1"]
    report = paired.compare(new, "speculative:drafter", "old", resamples=100)
    assert report["pooled"]["prompts"] == 1
    assert report["pooled"]["tau_a"] == pytest.approx(2.0)
    assert report["pooled"]["tau_b"] == pytest.approx(4 / 3)


def test_merge_text_refuses_sampled_or_mismatched_runs(paired) -> None:
    with pytest.raises(ValueError, match="T = 0"):
        paired.merge_text(
            _run({"a": ([1], [0])}, temperature=1.0), _run({"b": ([1], [0])}, temperature=1.0)
        )
    other = _run({"b": ([1], [0])})
    other["config"]["max_new_tokens"] = 8
    with pytest.raises(ValueError, match="max_new_tokens differs"):
        paired.merge_text(_run({"a": ([1], [0])}), other)


def test_seed_runs_pool_per_prompt_and_refuse_other_settings(paired) -> None:
    """Two seeds of a T = 1 bench: each prompt's counts are summed over the seeds (one unit per
    prompt in the bootstrap); a run at the same seed, another tree or other prompts is refused."""

    def sampled(seed: int, a: list[int], b: list[int]) -> dict:
        run = _two_prompts({"A": ([1], [a[0]]), "B": ([1], [b[0]])},
                           {"A": ([1], [a[1]]), "B": ([1], [b[1]])})  # fmt: skip
        run["config"].update(temperature=1.0, seed=seed)
        return run

    first, second = sampled(0, [2, 0], [1, 0]), sampled(1, [0, 2], [0, 1])
    paired.pool_seeds(first, second)
    assert first["config"]["seed"] == [0, 1]
    (one, two) = first["per_prompt"]
    assert one["methods"]["A"]["committed_by_verification"] == 3 + 1  # one step of 3, one of 1
    assert one["methods"]["A"]["verifications"] == 2 and two["methods"]["B"]["tau"] == 1.5
    report = paired.compare(first, "A", "B", resamples=100)
    assert report["pooled"]["prompts"] == 2
    assert report["pooled"]["tau_a"] == pytest.approx(8 / 4)
    assert report["pooled"]["tau_b"] == pytest.approx(6 / 4)
    with pytest.raises(ValueError, match="both runs used seed"):
        paired.pool_seeds(sampled(0, [1, 1], [1, 1]), sampled(0, [1, 1], [1, 1]))
    with pytest.raises(ValueError, match="both runs used seed 0"):
        paired.pool_seeds(first, sampled(0, [1, 1], [1, 1]))  # a third run repeating seed 0
    other = sampled(2, [1, 1], [1, 1])
    other["config"]["tree"] = "chain:4"
    with pytest.raises(ValueError, match="tree differs"):
        paired.pool_seeds(sampled(0, [1, 1], [1, 1]), other)
    other = sampled(2, [1, 1], [1, 1])
    other["per_prompt"][1]["id"] = "mtbench-3"
    with pytest.raises(ValueError, match="different prompts"):
        paired.pool_seeds(sampled(0, [1, 1], [1, 1]), other)


def json_copy(value: dict) -> dict:
    import json

    return json.loads(json.dumps(value))
