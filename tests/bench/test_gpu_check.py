"""The GPU check (scripts/gpu_check.sh, lightning_spec/bench/gpu_check.py) in its dry mode: the
same script and steps on CPU at small sizes, so the check a lent GPU runs cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_spec.bench.gpu_check import Report, Skip

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["environment", "greedy_data", "fit_bf16-mixed", "fit_32-true", "lossless",
         "lossless_kernels", "rollouts_draft_opd", "rollouts_gto", "onnx_export"]  # fmt: skip


def test_dry_check_runs_every_step_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_TIMEOUT": "600"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "--dry"],
                          env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["passed"] and report["dry"]
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == STEPS
    for name in STEPS:
        assert steps[name]["status"] == "ok", steps[name]
        assert steps[name]["seconds"] >= 0
    assert steps["environment"]["device"] == "cpu"
    assert "reason_no_gpu" in steps["environment"]
    for precision in ("bf16-mixed", "32-true"):
        fit = steps[f"fit_{precision}"]
        assert fit["loss_fell"] and fit["loss_last_tenth"] < fit["loss_first_tenth"]
        assert fit["tokens_per_second"] > 0
        assert fit["peak_gpu_memory_mib"] is None and "CUDA" in fit["peak_gpu_memory_reason"]
    for name in ("lossless", "lossless_kernels"):
        runs = steps[name]["runs"]
        assert set(runs) == {"chain:4", "dynamic:3,3,8"}
        assert all(run["mismatches"] == 0 and run["prompts"] > 0 for run in runs.values())
    assert steps["lossless_kernels"]["use_kernels"] is True
    assert steps["lossless"]["runs"]["chain:4"]["tau"] > 1.0  # drafts accepted: not vacuous
    for name in ("rollouts_draft_opd", "rollouts_gto"):
        assert steps[name]["drafter_moved"] > 0 and steps[name]["losses"]
    assert steps["rollouts_draft_opd"]["rollout_tau"] >= 1.0
    onnx = steps["onnx_export"]
    assert onnx["step_parity_passed"] and onnx["decode_tokens_equal"] and onnx["decode_trees_equal"]


def test_a_step_that_fails_or_cannot_run_is_recorded_and_the_check_goes_on(tmp_path: Path) -> None:
    report = Report(tmp_path / "r.json", {"check": "unit"})
    with report.step("skips") as entry:
        entry["partial"] = 1
        raise Skip("onnx is not installed here")
    with report.step("fails"):
        raise RuntimeError("the loss did not fall")
    with report.step("passes") as entry:
        entry["figure"] = 2.5
    written = json.loads((tmp_path / "r.json").read_text())
    statuses = {s["name"]: s["status"] for s in written["steps"]}
    assert statuses == {"skips": "skipped", "fails": "failed", "passes": "ok"}
    assert written["steps"][0]["reason"] == "onnx is not installed here"
    assert written["steps"][0]["partial"] == 1
    assert "the loss did not fall" in written["steps"][1]["error"]
    assert written["failed"] == ["fails"] and written["passed"] is False
    assert written["steps"][2]["figure"] == 2.5


def test_the_script_refuses_a_missing_out_dir_argument() -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and "usage" in done.stderr
