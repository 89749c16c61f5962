"""bench: interleaved measurement of all methods on tiny targets, rows, files and the CLI.

Tiny random targets built in code (no downloads). The slow tests at the end run the real
SmolLM2 from the asset cache and skip when it is not cached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_spec import specs
from lightning_spec.bench import machine as bench_machine
from lightning_spec.bench import report as bench_report
from lightning_spec.bench import runner as bench_runner
from lightning_spec.cli import bench as bench_cli
from lightning_spec.decoding.engine import autoregressive_generate
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.drafters.standalone import StandaloneDrafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config

REQUIRED = (
    "method",
    "dataset",
    "temperature",
    "tau",
    "tokens_per_second",
    "speedup_vs_autoregressive",
    "mismatches",
)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=11)


def _prompts(count: int, seed: int = 0) -> list[tuple[list[int], dict]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(3, 128, (10,), generator=generator).tolist(),
            {"id": f"p{i}", "category": "ab"[i % 2]},
        )
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def self_result(target: TargetModel) -> dict:
    drafter = StandaloneDrafter.from_model(target.model)
    return bench_runner.run_bench(
        target,
        drafter,
        "chain:3",
        {"toy": _prompts(3)},
        max_new_tokens=17,
        stop_on_eos=False,
        warmup=1,
        bootstrap_resamples=200,
    )


def test_self_drafter_is_lossless_and_commits_k_plus_one(self_result: dict) -> None:
    rows = self_result["rows"]
    # 4 methods x (overall + categories a and b)
    assert len(rows) == 12
    for row in rows:
        assert all(key in row for key in bench_report.REQUIRED_ROW_KEYS)
        assert all(key in row for key in REQUIRED)
        assert row["mismatches"] == 0, row
    for entry in self_result["per_prompt"]:
        spec = entry["methods"]["speculative"]
        assert spec["new_tokens"] == 17
        # 16 tokens after the prefill's: 4 steps of k + 1 = 4 tokens
        assert spec["accept_lengths"] == [3, 3, 3, 3]
        assert spec["committed_by_verification"] == 16
    overall = next(r for r in rows if r["method"] == "speculative" and r["category"] is None)
    assert overall["tau"] == pytest.approx(4.0)
    assert overall["tau_ci"] == pytest.approx([4.0, 4.0])
    assert overall["alpha"] == pytest.approx([1.0, 1.0, 1.0])
    assert overall["tree"] == "chain:3"
    assert set(overall["time_fraction"]) >= {"prefill", "draft", "verify", "update", "other"}
    assert sum(overall["time_fraction"].values()) == pytest.approx(1.0, abs=1e-3)
    ms = overall["ms_per_step"]
    assert set(ms) == {"draft", "verify", "update"} and ms["draft"] > 0 and ms["verify"] > 0
    seconds = overall["time_fraction"]["draft"] * overall["seconds"]
    assert ms["draft"] == pytest.approx(1000 * seconds / overall["verifications"], rel=1e-2)
    assert overall["speedup_vs_autoregressive"] > 0
    assert overall["speedup_vs_hf_generate_ci"] is not None
    autoregressive = next(r for r in rows if r["method"] == "autoregressive")
    assert autoregressive["tau"] is None and autoregressive["alpha"] is None


def test_methods_are_interleaved_and_the_order_recorded(self_result: dict) -> None:
    orders = [entry["order"] for entry in self_result["per_prompt"]]
    assert orders[0] == ["autoregressive", "hf_generate", "hf_prompt_lookup", "speculative"]
    assert orders[1] == ["hf_generate", "hf_prompt_lookup", "speculative", "autoregressive"]
    assert orders[2] == ["hf_prompt_lookup", "speculative", "autoregressive", "hf_generate"]
    assert self_result["config"]["order"] == "rotate"
    assert self_result["config"]["machine"]["torch_threads"] == 1


def test_hf_methods_match_the_target_and_prompt_lookup_reports_tau(
    target: TargetModel, self_result: dict
) -> None:
    for entry, (prompt, _) in zip(self_result["per_prompt"], _prompts(3), strict=True):
        reference = autoregressive_generate(target, prompt, 17, stop_on_eos=False)
        for method in ("autoregressive", "hf_generate", "hf_prompt_lookup", "speculative"):
            assert entry["methods"][method]["tokens"] == reference, method
        lookup = entry["methods"]["hf_prompt_lookup"]
        assert 1 <= lookup["target_forwards"] <= 17
    row = next(
        r
        for r in self_result["rows"]
        if r["method"] == "hf_prompt_lookup" and r["category"] is None
    )
    assert row["tau"] >= 1.0 and "estimated" in row["tau_note"]


def test_hf_baseline_ignores_the_model_generation_defaults(target: TargetModel) -> None:
    """A checkpoint's sampling / repetition-penalty defaults must not leak into the baseline."""
    prompt = list(range(5, 15))
    reference = autoregressive_generate(target, prompt, 10, stop_on_eos=False)
    defaults = target.model.generation_config
    target.model.generation_config = type(defaults)(
        do_sample=True, temperature=5.0, repetition_penalty=3.0, eos_token_id=reference[2]
    )
    try:
        runner = bench_runner._Runner(
            target, {}, None, max_new_tokens=10, temperature=0.0, seed=0, stop_on_eos=False,
            prompt_lookup_num_tokens=4, max_matching_ngram_size=2,
        )  # fmt: skip
        assert runner.run("hf_generate", prompt, 0).tokens == reference
        assert runner.run("hf_prompt_lookup", prompt, 0).tokens == reference
    finally:
        target.model.generation_config = defaults


def test_hf_generate_runs_the_default_path_beside_the_optimised_one(target: TargetModel) -> None:
    """On a prepacked target hf_generate switches packing off (what a user has), the other
    methods keep it on; every method still matches the target and reports its first token."""
    import copy

    from lightning_spec.models.packed import PackedLinear, prepack_linears

    packed = copy.deepcopy(target)
    prepack_linears(packed.model)
    layer = next(m for m in packed.model.modules() if isinstance(m, PackedLinear))
    seen: list[bool] = []
    handle = layer.register_forward_pre_hook(lambda module, args: seen.append(module.enabled))
    runner = bench_runner._Runner(
        packed, {}, None, max_new_tokens=6, temperature=0.0, seed=0, stop_on_eos=False,
        prompt_lookup_num_tokens=4, max_matching_ngram_size=2,
    )  # fmt: skip
    prompt = list(range(5, 15))
    reference = autoregressive_generate(packed, prompt, 6, stop_on_eos=False)
    try:
        for method, enabled in (
            ("hf_generate", False),
            ("hf_generate_optimized", True),
            ("hf_prompt_lookup", True),
            ("autoregressive", True),
        ):
            seen.clear()
            result = runner.run(method, prompt, 0)
            assert result.tokens == reference, method
            assert seen and set(seen) == {enabled}, method
            assert 0 < result.first_token_seconds <= result.seconds, method
    finally:
        handle.remove()
    assert layer.enabled
    assert "hf_generate_optimized" in bench_runner.default_methods(packed)
    assert "hf_generate_optimized" not in bench_runner.default_methods(target)
    result = bench_runner.run_bench(
        packed, None, None, {"toy": _prompts(2)},
        methods=["hf_generate", "hf_generate_optimized"], max_new_tokens=6, warmup=0,
        stop_on_eos=False, bootstrap_resamples=50,
    )  # fmt: skip
    default_row = next(r for r in result["rows"] if r["method"] == "hf_generate")
    optimised_row = next(r for r in result["rows"] if r["method"] == "hf_generate_optimized")
    # the reference is the optimised target's greedy output; the default path is compared to
    # it as a numerics divergence, not as a losslessness mismatch
    assert optimised_row["mismatches"] == 0
    assert default_row["mismatches"] is None and default_row["optimised_divergences"] == 0
    assert default_row["first_token_ms"] > 0
    assert "diverge (default path)" in bench_report.to_markdown(result)
    with pytest.raises(ValueError, match="optimised target"):
        bench_runner.run_bench(
            target, None, None, {"toy": _prompts(1)}, methods=["hf_generate_optimized"]
        )


def test_random_drafter_accepts_almost_nothing(target: TargetModel) -> None:
    drafter = Eagle3Drafter.from_target(target, seed=3)
    result = bench_runner.run_bench(
        target,
        drafter,
        "dynamic:3,3,8",
        {"toy": _prompts(2, seed=1)},
        methods=["autoregressive", "speculative"],
        max_new_tokens=16,
        stop_on_eos=False,
        warmup=0,
        bootstrap_resamples=200,
    )
    row = next(r for r in result["rows"] if r["method"] == "speculative" and r["category"] is None)
    assert row["mismatches"] == 0
    assert 1.0 <= row["tau"] < 1.5
    assert row["speedup_vs_hf_generate"] is None  # not measured in this run


def test_several_trees_side_by_side_with_a_lookup_branch(target: TargetModel) -> None:
    """Repeated trees bench every drafter under each (methods `<name>@<tree>`); a lookup tree
    stays lossless and its rows say which tree they ran."""
    drafter = Eagle3Drafter.from_target(target, seed=3)
    prompts = [(p + p, meta) for p, meta in _prompts(2, seed=4)]  # prompts that quote themselves
    trees = ["chain:2", "chain:2+lookup:2,6"]
    result = bench_runner.run_bench(
        target, drafter, trees, {"toy": prompts}, methods=["autoregressive", "speculative"],
        max_new_tokens=24, stop_on_eos=False, warmup=0, bootstrap_resamples=100,
    )  # fmt: skip
    rows = {r["method"]: r for r in result["rows"] if r["category"] is None}
    assert set(rows) == {"autoregressive", *(f"speculative@{t}" for t in trees)}
    for tree in trees:
        assert rows[f"speculative@{tree}"]["tree"] == tree
        assert rows[f"speculative@{tree}"]["mismatches"] == 0
    assert result["config"]["tree"] == " | ".join(trees)
    with pytest.raises(ValueError, match="listed twice"):
        bench_runner.run_bench(target, drafter, ["chain:2", "chain:2"], {"toy": prompts})


def test_each_drafter_under_its_own_trees(target: TargetModel) -> None:
    """A dict of trees per drafter label (what `bench --tree auto` passes when the calibrations
    differ): every drafter runs under its own trees only, each row named and lossless."""
    drafters = {"eagle": Eagle3Drafter.from_target(target, seed=3),
                "self": StandaloneDrafter.from_model(target.model)}  # fmt: skip
    trees = {"eagle": "dynamic:2,2,4", "self": ["chain:2", "chain:3"]}
    result = bench_runner.run_bench(
        target, drafters, trees, {"toy": _prompts(2, seed=5)},
        methods=["autoregressive", "speculative"], max_new_tokens=12, stop_on_eos=False,
        warmup=0, bootstrap_resamples=50,
    )  # fmt: skip
    rows = {r["method"]: r for r in result["rows"] if r["category"] is None}
    expected = {"speculative:eagle@dynamic:2,2,4", "speculative:self@chain:2",
                "speculative:self@chain:3"}  # fmt: skip
    assert set(rows) == {"autoregressive", *expected}
    assert all(rows[name]["mismatches"] == 0 for name in expected)
    assert rows["speculative:self@chain:3"]["tree"] == "chain:3"
    with pytest.raises(ValueError, match="one entry per drafter"):
        bench_runner.run_bench(target, drafters, {"eagle": "chain:2"}, {"toy": _prompts(1)})


def test_sampling_marks_mismatches_not_applicable(target: TargetModel) -> None:
    drafter = StandaloneDrafter.from_model(target.model)
    result = bench_runner.run_bench(
        target,
        drafter,
        "chain:2",
        {"toy": _prompts(2, seed=2)},
        temperature=0.8,
        max_new_tokens=10,
        stop_on_eos=False,
        warmup=0,
        bootstrap_resamples=100,
    )
    for row in result["rows"]:
        assert row["mismatches"] is None and row["temperature"] == 0.8
    for entry in result["per_prompt"]:
        assert all(m["new_tokens"] == 10 for m in entry["methods"].values())


def test_outputs_json_and_markdown(self_result: dict, tmp_path: Path) -> None:
    json_path, md_path = bench_report.write_outputs(self_result, tmp_path / "out" / "bench.json")
    loaded = json.loads(json_path.read_text())
    assert loaded["rows"] == self_result["rows"]
    assert md_path == tmp_path / "out" / "bench.md"
    markdown = md_path.read_text()
    assert "tokens committed per target verification" in markdown
    assert "bonus" in markdown
    assert markdown.count("| toy |") == 12


def test_mismatch_detail_reports_position_and_top2_gap(target: TargetModel) -> None:
    prompt = list(range(5, 15))
    reference = autoregressive_generate(target, prompt, 8, stop_on_eos=False)
    wrong = list(reference)
    wrong[3] = (wrong[3] + 1) % 128
    detail = bench_runner.mismatch_detail(target, prompt, reference, wrong)
    assert detail["position"] == 3
    assert detail["expected"] == reference[3] and detail["got"] == wrong[3]
    assert detail["top2_tokens"][0] == reference[3]
    assert detail["top2_gap"] >= 0
    assert bench_runner.mismatch_detail(target, prompt, reference, list(reference)) is None
    shorter = bench_runner.mismatch_detail(target, prompt, reference, reference[:5])
    assert shorter["position"] == 5 and shorter["got"] is None


def _entry(index: int, category: str, ar_seconds: float, spec_seconds: float, mismatch=None):
    common = {"new_tokens": 10, "tokens": [0] * 10}
    return {
        "dataset": "toy",
        "index": index,
        "id": f"p{index}",
        "category": category,
        "order": ["autoregressive", "speculative"],
        "methods": {
            "autoregressive": {**common, "seconds": ar_seconds, "mismatch": None},
            "speculative": {
                **common,
                "seconds": spec_seconds,
                "mismatch": mismatch,
                "verifications": 3,
                "committed_by_verification": 9,
                "accept_lengths": [2, 2, 2],
                "tree_depths": [2, 2, 2],
            },
        },
    }


def test_summarize_on_hand_made_prompts() -> None:
    near_tie = {
        "position": 4, "expected": 7, "got": 9, "top2_tokens": [7, 9],
        "top2_logits": [1.0, 1.0], "top2_gap": 1e-6, "near_tie": True,
    }  # fmt: skip
    per_prompt = [
        _entry(0, "a", 2.0, 1.0),  # speedup 2
        _entry(1, "a", 3.0, 1.0, near_tie),  # speedup 3
        _entry(2, "b", 1.0, 1.0),  # speedup 1
    ]
    rows = bench_report.summarize(
        per_prompt, ["autoregressive", "speculative"], temperature=0.0, resamples=100
    )
    overall = next(r for r in rows if r["method"] == "speculative" and r["category"] is None)
    assert overall["speedup_vs_autoregressive"] == pytest.approx(2.0)  # median of 2, 3, 1
    assert overall["speedup_vs_autoregressive_total"] == pytest.approx(6.0 / 3.0)
    assert overall["tau"] == pytest.approx(3.0)
    assert overall["mismatches"] == 1
    assert overall["mismatch_details"][0]["position"] == 4
    category_a = next(r for r in rows if r["method"] == "speculative" and r["category"] == "a")
    assert category_a["num_prompts"] == 2 and category_a["mismatches"] == 1
    markdown = bench_report.to_markdown({"config": {}, "rows": rows, "per_prompt": per_prompt})
    assert "Greedy mismatches" in markdown and "near tie" in markdown


def test_drafter_labels_stay_unique() -> None:
    # Two runs' `drafter/last` folders are two methods, not one overwritten by the other.
    assert bench_cli.drafter_labels(["runs/a/drafter/last", "runs/b/drafter/last", "random"]) == [
        "a/drafter/last",
        "b/drafter/last",
        "random",
    ]
    assert bench_cli.drafter_labels(["runs/a/best", "runs/a/last", "bigram:sharegpt"]) == [
        "best",
        "last",
        "bigram:sharegpt",
    ]
    assert bench_cli.drafter_labels(["x/last", "./x/last"]) == ["x/last#0", "x/last#1"]
    with pytest.raises(ValueError, match="twice"):
        bench_cli.drafter_labels(["runs/a/last", "runs/a/last"])


def test_stratified_selection_round_robins_categories() -> None:
    class Conv:
        def __init__(self, category: str) -> None:
            self.meta = {"category": category}

    conversations = [Conv(c) for c in "aaaabbbbcccc"]
    chosen = specs._stratified(conversations, 5)
    assert [c.meta["category"] for c in chosen] == ["a", "a", "b", "b", "c"]


def test_busy_machine_is_flagged(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(bench_machine.os, "getloadavg", lambda: (40.0, 40.0, 40.0))
    machine = bench_machine.machine_info("fp32")
    assert machine["busy"] and machine["load_average"][0] == 40.0
    assert bench_machine.warn_if_busy(machine)
    assert "WARNING" in capsys.readouterr().err
    monkeypatch.setattr(bench_machine.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert not bench_machine.machine_info("fp32")["busy"]


# ------------------------------------------------------------------------------ the CLI
def _tiny_folder(path: Path) -> Path:
    """A tiny llama with a word-level tokenizer, saved like a hub model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, 128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>",
    )  # fmt: skip
    TargetModel.from_config(tiny_config("llama", num_layers=2), seed=5).model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cli_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bench_cli")
    folder = _tiny_folder(root / "tiny")
    data = root / "prompts.jsonl"
    lines = [
        {"prompt": " ".join(f"w{(7 * i + j) % 120 + 4}" for j in range(8)), "category": "xy"[i % 2]}
        for i in range(5)
    ]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder, data


def test_cli_end_to_end(cli_inputs: tuple[Path, Path], tmp_path: Path) -> None:
    folder, data = cli_inputs
    output = tmp_path / "result.json"
    code = bench_cli.main(
        [
            "--target", str(folder), "--drafter", "self", "--drafter", f"bigram:{data}",
            "--dataset", str(data), "--limit", "3", "--max-new-tokens", "9", "--tree", "chain:2",
            "--threads", "1", "--warmup", "1", "--bootstrap", "100", "--no-progress",
            "--output", str(output),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(output.read_text())
    methods = {row["method"] for row in result["rows"]}
    assert methods == {
        "autoregressive", "hf_generate", "hf_prompt_lookup", "speculative:self",
        "speculative:bigram:prompts.jsonl",
    }  # fmt: skip
    assert all(row["mismatches"] == 0 for row in result["rows"])
    config = result["config"]
    assert config["flags"]["threads"] == 1 and config["machine"]["torch_threads"] == 1
    assert config["machine"]["cores"] >= 1 and "load_average" in config["machine"]
    assert config["tree"] == "chain:2" and config["datasets"] == {"prompts": 3}
    assert "commit" in config
    assert output.with_suffix(".md").is_file()


def test_cli_tree_auto(
    cli_inputs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tree auto calibrates once, then reuses the calibration cached for this machine and
    drafter; --recalibrate measures afresh."""
    monkeypatch.setenv("LIGHTNING_SPEC_CACHE", str(tmp_path / "cache"))
    folder, data = cli_inputs
    output = tmp_path / "auto.json"
    argv = [
        "--target", str(folder), "--drafter", "self", "--dataset", str(data),
        "--limit", "2", "--max-new-tokens", "8", "--tree", "auto", "--calibrate-prompts", "1",
        "--methods", "autoregressive,speculative", "--threads", "1", "--warmup", "0",
        "--bootstrap", "100", "--no-progress", "--output", str(output),
    ]  # fmt: skip
    assert bench_cli.main([*argv, "--no-lookup"]) == 0
    first = json.loads(output.read_text())["config"]
    assert first["tree"] == first["calibration"]["suggestion"]["policy"]
    assert "cached" not in first["calibration"]
    stored = list((tmp_path / "cache" / "calibration").glob("*.json"))
    assert [p.stem for p in stored] == [first["calibration"]["key"]]
    assert bench_cli.main(argv) == 0  # auto: the calibrated tree with the lookup branch
    second = json.loads(output.read_text())["config"]
    assert second["calibration"]["cached"] == str(stored[0])
    assert second["tree"] == first["tree"] + bench_cli.AUTO_LOOKUP
    assert second["calibration"]["cost_curve"] == first["calibration"]["cost_curve"]
    assert bench_cli.main([*argv, "--recalibrate"]) == 0
    assert "cached" not in json.loads(output.read_text())["config"]["calibration"]
    # auto+lookup: the calibrated tree with the lookup branch, beside the plain one
    assert bench_cli.main([*argv, "--tree", "auto+lookup:2,4"]) == 0
    both = json.loads(output.read_text())
    auto = both["config"]["calibration"]["suggestion"]["policy"]
    methods = {r["method"] for r in both["rows"]}
    assert {
        f"speculative@{auto}{bench_cli.AUTO_LOOKUP}",
        f"speculative@{auto}+lookup:2,4",
    } <= methods


def test_cli_tree_auto_calibrates_each_drafter(
    cli_inputs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several drafters, --tree auto calibrates each and benches each at its own tree."""
    monkeypatch.setenv("LIGHTNING_SPEC_CACHE", str(tmp_path / "cache"))
    folder, data = cli_inputs
    output = tmp_path / "two.json"
    assert bench_cli.main([
        "--target", str(folder), "--drafter", "self", "--drafter", "random", "--dataset",
        str(data), "--limit", "2", "--max-new-tokens", "8", "--tree", "auto", "--no-lookup",
        "--calibrate-prompts", "1", "--methods", "autoregressive,speculative", "--threads",
        "1", "--warmup", "0", "--bootstrap", "50", "--no-progress", "--output", str(output),
    ]) == 0  # fmt: skip
    result = json.loads(output.read_text())
    config = result["config"]
    assert set(config["calibrations"]) == set(config["trees_by_drafter"]) == {"self", "random"}
    for label, trees in config["trees_by_drafter"].items():
        assert trees == [config["calibrations"][label]["suggestion"]["policy"]]
    assert len(list((tmp_path / "cache" / "calibration").glob("*.json"))) == 2
    assert all(r["mismatches"] == 0 for r in result["rows"])


def test_cli_prepack_benches_the_default_and_the_optimised_target(
    cli_inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    folder, data = cli_inputs
    output = tmp_path / "packed.json"
    code = bench_cli.main(
        [
            "--target", str(folder), "--drafter", "self", "--dataset", str(data), "--limit", "2",
            "--max-new-tokens", "6", "--tree", "chain:2", "--prepack", "--threads", "1",
            "--warmup", "0", "--bootstrap", "50", "--no-progress", "--output", str(output),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(output.read_text())
    assert result["config"]["prepacked_linears"]["target"] > 0
    methods = {row["method"] for row in result["rows"]}
    assert {"hf_generate", "hf_generate_optimized", "speculative"} <= methods
    overall = {r["method"]: r for r in result["rows"] if r["category"] is None}
    assert overall["speculative"]["mismatches"] == 0
    assert overall["hf_generate"]["optimised_divergences"] == 0
    assert overall["speculative"]["speedup_vs_hf_generate_optimized"] is not None


def test_calibration_key_follows_machine_and_drafter(target: TargetModel) -> None:
    from lightning_spec.bench import calibration_cache as cache

    machine = cache.machine_fingerprint(threads=2, dtype="fp32", prepacked=False)
    drafter = StandaloneDrafter.from_model(
        TargetModel.from_config(tiny_config("llama", num_layers=1), seed=3).model
    )
    key, identity = cache.calibration_key(machine, target.model, drafter, {"prompts": 3})
    assert key == cache.calibration_key(machine, target.model, drafter, {"prompts": 3})[0]
    assert identity["machine"]["threads"] == 2
    packed_machine = {**machine, "prepacked": True}
    assert cache.calibration_key(packed_machine, target.model, drafter, {"prompts": 3})[0] != key
    assert cache.calibration_key(machine, target.model, drafter, {"prompts": 4})[0] != key
    with torch.no_grad():
        next(drafter.parameters()).add_(1e-3)  # a retrained drafter
    assert cache.calibration_key(machine, target.model, drafter, {"prompts": 3})[0] != key


def test_generate_cli_plain_decoding_on_the_prepacked_target(
    cli_inputs: tuple[Path, Path], capsys
) -> None:
    """`generate --drafter none --prepack`: plain decoding on the optimised target, a product
    feature of its own; with a drafter the output still equals the target's greedy decode."""
    from lightning_spec.cli import generate as generate_cli

    folder, _ = cli_inputs
    common = ["--target", str(folder), "--prompt", "w5 w6 w7", "--max-new-tokens", "6"]
    assert generate_cli.main([*common, "--drafter", "none", "--prepack"]) == 0
    assert "plain decoding, no drafter, prepacked target" in capsys.readouterr().out
    assert generate_cli.main([*common, "--drafter", "self", "--prepack", "--tree", "chain:2"]) == 0
    assert "speculative output equals it" in capsys.readouterr().out
    zero = ["--target", str(folder), "--prompt", "w5", "--max-new-tokens", "0"]
    assert generate_cli.main(zero) == 0  # nothing generated is no mismatch
    out = capsys.readouterr().out
    assert "tau = n/a" in out and "speculative output equals it" in out


# ------------------------------------------------------------------------------ real SmolLM2
def _smollm2() -> TargetModel:
    from lightning_spec.data.assets import AssetError, asset_path, default_target_path
    from lightning_spec.models.target import load_target

    try:
        default_target_path(fetch_if_missing=False)
        asset_path("mtbench", fetch_if_missing=False)
    except (AssetError, FileNotFoundError) as error:
        pytest.skip(f"SmolLM2 / MT-Bench not cached: {error}")
    return load_target("smollm2")


@pytest.mark.slow
def test_smollm2_self_drafter_chain4() -> None:
    target = _smollm2()
    _, prompts = specs.load_prompts("mtbench", target.tokenizer, 3)
    drafter = StandaloneDrafter.from_model(target.model)
    result = bench_runner.run_bench(
        target,
        drafter,
        "chain:4",
        {"mtbench": prompts},
        methods=["autoregressive", "speculative"],
        max_new_tokens=32,
        warmup=0,
        bootstrap_resamples=200,
    )
    for entry in result["per_prompt"]:
        lengths = entry["methods"]["speculative"]["accept_lengths"]
        assert lengths[:-1] == [4] * (len(lengths) - 1)
    for row in result["rows"]:
        assert row["mismatches"] == 0, row.get("mismatch_details")


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["chain:4", "static:small", "dynamic:5,8,32"])
def test_smollm2_random_drafter_is_lossless(tree: str) -> None:
    target = _smollm2()
    _, prompts = specs.load_prompts("mtbench", target.tokenizer, 3)
    drafter = Eagle3Drafter.from_target(target, seed=0)
    result = bench_runner.run_bench(
        target,
        drafter,
        tree,
        {"mtbench": prompts},
        methods=["speculative"],
        max_new_tokens=64,
        warmup=0,
        bootstrap_resamples=200,
    )
    for row in result["rows"]:
        assert row["mismatches"] == 0, row.get("mismatch_details")
