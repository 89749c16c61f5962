"""The vLLM bench's own parts, without vLLM: modes, the worker's counter arithmetic, results as
the shared `PromptResult`s, acceptance per position beside ours, the cached environment."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lightning_spec.bench import vllm_worker
from lightning_spec.bench.engines import reach_per_position, summarize
from lightning_spec.bench.vllm import accepted_per_position, to_prompt_results, vllm_mode
from lightning_spec.export.vllm import VllmEnv, VllmMissing, find_vllm


def test_modes_name_the_method_and_the_drafts(tmp_path: Path) -> None:
    assert vllm_mode("plain") == {"name": "plain", "speculative_config": None}
    eagle = vllm_mode("eagle3", drafter=tmp_path, k=2)
    assert eagle["name"] == "eagle3@2"
    assert eagle["speculative_config"] == {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 2}
    ngram = vllm_mode("ngram", k=4)["speculative_config"]
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 4
    with pytest.raises(ValueError, match="drafter folder"):
        vllm_mode("dflash")
    with pytest.raises(ValueError, match="unknown vLLM mode"):
        vllm_mode("medusa")


@dataclass
class _Metric:  # the fields of vLLM's metric records that the worker reads
    name: str
    value: int = 0
    values: list[int] = field(default_factory=list)


class _Engine:
    def __init__(self, metrics: list[_Metric]) -> None:
        self.metrics = metrics

    def get_metrics(self) -> list[_Metric]:
        return self.metrics


def test_worker_counters_and_their_difference() -> None:
    before = vllm_worker.spec_counters(_Engine([]))
    assert before == {"drafts": 0, "drafted": 0, "accepted": 0, "per_position": [], "first_token_seconds": 0.0}
    after = vllm_worker.spec_counters(_Engine([
        _Metric("vllm:spec_decode_num_drafts", 10), _Metric("vllm:spec_decode_num_draft_tokens", 30),
        _Metric("vllm:spec_decode_num_accepted_tokens", 12),
        _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[7, 4, 1]),
        _Metric("vllm:generation_tokens", 99),
    ]))  # fmt: skip
    delta = vllm_worker.counter_delta(after, before)
    assert delta == {"drafts": 10, "drafted": 30, "accepted": 12, "per_position": [7, 4, 1],
                     "first_token_seconds": None}  # fmt: skip
    again = dict(after, drafts=14, drafted=42, accepted=15, per_position=[9, 5, 1], first_token_seconds=0.25)
    assert vllm_worker.counter_delta(again, after) == {
        "drafts": 4, "drafted": 12, "accepted": 3, "per_position": [2, 1, 0], "first_token_seconds": 0.25,
    }  # fmt: skip


def _worker_result() -> dict:
    def prompt(tokens, seconds, first, drafts=0, accepted=0, per_position=()):  # noqa: ANN001, ANN202
        return {"tokens": tokens, "seconds": seconds, "first_token_seconds": first, "drafts": drafts,
                "drafted": 2 * drafts, "accepted": accepted, "per_position": list(per_position)}  # fmt: skip

    return {
        "vllm": "0.32.0",
        "modes": {
            "plain": {"prompts": [prompt([1, 2, 3, 4, 5], 1.0, 0.2), dict(prompt([6, 7, 8], 0.7, 0.1), decode_seconds=0.5)]},
            "eagle3@2": {"prompts": [prompt([1, 2, 3, 4, 5], 0.6, 0.2, 2, 2, [2, 0]),
                                     prompt([6, 7, 9], 0.5, 0.1, 1, 0, [0, 0])]},  # fmt: skip
        },
    }


def test_worker_results_become_prompt_results_and_summarise() -> None:
    results = to_prompt_results(_worker_result())
    plain, eagle = results["plain"], results["eagle3@2"]
    assert plain[0].seconds == pytest.approx(0.8)  # decode time: wall minus the first token's
    assert plain[1].seconds == pytest.approx(0.5)  # or vLLM's own first-to-last-token time
    assert eagle[0].drafted == 4 and eagle[0].accepted == 2 and eagle[0].meta["per_position"] == [2, 0]
    rows = summarize(results, reference=None, resamples=200)
    assert rows["eagle3@2"]["mismatches_vs_plain"] == 1  # the second reply differs at token 3
    assert rows["eagle3@2"]["tok_per_s"] == pytest.approx(8 / 0.8)
    per_position = accepted_per_position(eagle)
    assert per_position["reach"] == [pytest.approx(2 / 3), 0.0]
    assert per_position["alpha"] == [pytest.approx(2 / 3), 0.0]


def test_our_reach_per_position_and_its_interval() -> None:
    lengths = [[2, 0, 1], [0, 0], [2, 2, 2, 1]]  # accepted drafts per verification, per prompt
    rows = reach_per_position(lengths, 3, resamples=500)
    steps = 9
    assert rows[0]["reach"] == pytest.approx(6 / steps)  # a >= 1
    assert rows[1]["reach"] == pytest.approx(4 / steps)  # a >= 2
    assert rows[2]["reach"] == 0.0
    assert all(r["low"] <= r["reach"] <= r["high"] for r in rows)


def test_environment_settings_and_a_missing_install(tmp_path: Path) -> None:
    env = VllmEnv(tmp_path, "0.32.0", ("/lib/libtcmalloc.so", "/venv/lib/libiomp5.so"))
    settings = env.environ(kv_cache_gib=2)
    assert settings["LD_PRELOAD"].split(":")[:2] == ["/lib/libtcmalloc.so", "/venv/lib/libiomp5.so"]
    assert settings["VLLM_CPU_KVCACHE_SPACE"] == "2" and settings["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert settings["VLLM_DISABLE_COMPILE_CACHE"] == "1" and "PYTHONPATH" not in settings
    with pytest.raises(VllmMissing, match="lightning_spec.export.vllm build"):
        find_vllm("0.32.0", cache_dir=tmp_path)
    stamp = tmp_path / "vllm" / "0.32.0"
    stamp.mkdir(parents=True)
    (stamp / "BUILT.json").write_text(json.dumps({"preload": []}))
    with pytest.raises(VllmMissing, match="reinstall"):  # stamped, but the venv is gone
        find_vllm("0.32.0", cache_dir=tmp_path)


def test_an_external_vllm_runs_without_the_cpu_settings(tmp_path: Path) -> None:
    env = VllmEnv.external(tmp_path / "bin" / "python")
    assert env.python == tmp_path / "bin" / "python" and not env.cpu
    settings = env.environ()
    assert "VLLM_CPU_KVCACHE_SPACE" not in settings and "VLLM_DISABLE_COMPILE_CACHE" not in settings
    assert settings["HF_HUB_OFFLINE"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" not in settings
