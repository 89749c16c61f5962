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
from lightning_spec.tools.vllm import VllmEnv, VllmMissing, find_vllm


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
class _SpecMetrics:  # the fields of vLLM's RequestSpecDecodeMetrics that the worker reads
    per_step_accepted: list[int]
    per_step_drafted: list[int]
    histogram: list[int] = field(default_factory=list)


@dataclass
class _Completion:
    spec_decode_metrics: _SpecMetrics | None


def test_worker_reads_the_per_request_drafting_record() -> None:
    record = vllm_worker.request_spec_metrics(
        _Completion(_SpecMetrics([2, 0, 3], [3, 3, 3], [1, 0, 1, 1])), speculative=True
    )
    assert record["drafts"] == 3 and record["drafted"] == 9 and record["accepted"] == 5
    assert record["accepted_lengths"] == [2, 0, 3]
    assert vllm_worker.request_spec_metrics(_Completion(None), speculative=False)["drafted"] == 0
    with pytest.raises(RuntimeError, match="per-request speculative metrics"):
        vllm_worker.request_spec_metrics(_Completion(None), speculative=True)


def _worker_result() -> dict:
    def prompt(tokens, seconds, lengths=(), drafted=0, decode=None):  # noqa: ANN001, ANN202
        return {"tokens": tokens, "seconds": seconds, "decode_seconds": decode, "drafts": len(lengths),
                "drafted": drafted, "accepted": sum(lengths), "accepted_lengths": list(lengths)}  # fmt: skip

    return {
        "vllm": "0.32.0",
        "modes": {
            "plain": {"prompts": [prompt([1, 2, 3, 4, 5], 1.0, decode=0.8), prompt([6, 7, 8], 0.7)]},
            "eagle3@2": {"prompts": [prompt([1, 2, 3, 4, 5], 0.6, [2, 0], 4, decode=0.5),
                                     prompt([6, 7, 9], 0.5, [0, 1], 4)]},  # fmt: skip
        },
    }


def test_worker_results_become_prompt_results_and_summarise() -> None:
    results = to_prompt_results(_worker_result())
    plain, eagle = results["plain"], results["eagle3@2"]
    assert plain[0].seconds == pytest.approx(0.8)  # vLLM's own first-to-last-token time
    assert plain[1].seconds == pytest.approx(0.7)  # else wall time
    assert eagle[0].drafted == 4 and eagle[0].accepted == 2 and eagle[0].meta["accepted_lengths"] == [2, 0]
    rows = summarize(results, reference=None, resamples=200)
    assert rows["eagle3@2"]["mismatches_vs_plain"] == 1  # the second reply differs at token 3
    assert rows["eagle3@2"]["tok_per_s"] == pytest.approx(8 / 1.0)
    per_position = accepted_per_position(eagle, 2)
    assert per_position["reach"] == [pytest.approx(2 / 4), pytest.approx(1 / 4)]
    assert per_position["alpha"] == [pytest.approx(1 / 2), pytest.approx(1 / 2)]
    # the same records give our decoder's interval quantity: one definition for both engines
    ours = reach_per_position([r.meta["accepted_lengths"] for r in eagle], 2, resamples=100)
    assert [row["reach"] for row in ours] == per_position["reach"]


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
    with pytest.raises(VllmMissing, match="lightning_spec.tools.vllm build"):
        find_vllm("0.32.0", cache_dir=tmp_path)
    stamp = tmp_path / "vllm" / "0.32.0"
    stamp.mkdir(parents=True)
    (stamp / "BUILT.json").write_text(json.dumps({"preload": []}))
    with pytest.raises(VllmMissing, match="reinstall"):  # stamped, but the venv is gone
        find_vllm("0.32.0", cache_dir=tmp_path)
    (stamp / "venv" / "bin").mkdir(parents=True)
    (stamp / "venv" / "bin" / "python").touch()
    (stamp / "venv" / "lib").mkdir()
    (stamp / "venv" / "lib" / "libiomp5.so").touch()
    # the preload is looked up when the install is found, not frozen in the stamp
    assert find_vllm("0.32.0", cache_dir=tmp_path).preload[-1] == str(stamp / "venv" / "lib" / "libiomp5.so")


def test_an_external_vllm_runs_without_the_cpu_settings(tmp_path: Path) -> None:
    env = VllmEnv.external(tmp_path / "bin" / "python")
    assert env.python == tmp_path / "bin" / "python" and not env.cpu
    settings = env.environ()
    assert "VLLM_CPU_KVCACHE_SPACE" not in settings and "VLLM_DISABLE_COMPILE_CACHE" not in settings
    assert settings["HF_HUB_OFFLINE"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" not in settings


def test_the_where_command_reports_a_missing_install(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_spec.tools import vllm as vllm_tool

    assert vllm_tool.main(["where", "--cache-dir", str(tmp_path)]) == 1
    assert "lightning_spec.tools.vllm build" in capsys.readouterr().err


def test_k_pick_and_batched_rows() -> None:
    from lightning_spec.bench import vllm_bench as module

    # alpha 0.5 at every depth: E[tau(K)] = 1.5, 1.75, 1.875; steps cost 1.0, 1.1, 1.5 s
    pick = module.pick_k([0.5, 0.5, 0.5], {1: 1.0, 2: 1.1, 3: 1.5})
    assert pick["k"] == 2 and pick["predicted_tokens_per_second"][2] == pytest.approx(1.75 / 1.1)
    raw = {"modes": {
        "plain": {"batched": {"2": {"seconds": 2.0, "tokens": [[1, 2, 3], [4, 5]]}}},
        "eagle3@2": {"batched": {"2": {"seconds": 1.0, "tokens": [[1, 2, 3], [4, 6]]}}},
    }}  # fmt: skip
    results = to_prompt_results({"modes": {"plain": {"prompts": [
        {"tokens": [1, 2, 3], "seconds": 1.0}, {"tokens": [4, 5], "seconds": 1.0}]}}})  # fmt: skip
    rows = module.batched_rows(raw, results)["2"]
    assert rows["plain"]["tok_per_s"] == pytest.approx(2.5) and rows["eagle3@2"]["speedup"] == pytest.approx(2.0)
    assert rows["eagle3@2"]["mismatches_vs_plain"] == 1 and rows["plain"]["mismatches_vs_plain"] == 0


def test_engines_side_by_side_share_the_kv_cache_budget() -> None:
    from lightning_spec.bench.vllm import kv_cache_share

    assert kv_cache_share(1) == 4 and kv_cache_share(3) == 4  # vLLM's default, as before
    assert kv_cache_share(6) == 2  # six engines side by side
    assert kv_cache_share(20) == 1  # never below 1 GiB
