"""The quickstart's closing summary reads a bench result and the run folder's MLflow mirror."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_spec.cli.quickstart_report import main, mlflow_run_info


def _row(method: str, tau: float | None, mismatches: int = 0, **extra: object) -> dict:
    return {
        "method": method,
        "dataset": "mtbench",
        "category": None,
        "tree": "dynamic:4,8,16" if method.startswith("spec") else None,
        "tau": tau,
        "tau_ci": [tau - 0.1, tau + 0.1] if tau else None,
        "mismatches": mismatches,
        "num_prompts": 20,
        **extra,
    }


def _write(tmp_path: Path, mismatches: int = 0) -> tuple[Path, Path]:
    run = tmp_path / "runs" / "quickstart"
    run.mkdir(parents=True)
    lines = [
        {
            "seq": 1,
            "type": "start",
            "tracking_uri": "sqlite:////x/mlflow.db",
            "experiment_name": "quickstart",
        },
        {"seq": 2, "type": "run", "run_id": "abc123", "experiment_id": "1"},
        {"seq": 3, "type": "metric", "key": "val/tau", "value": 1.7, "step": 10},
    ]
    (run / "mlflow_mirror.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines) + '{"torn'
    )
    result = {
        "config": {"flags": {"temperature": 0.0, "max_new_tokens": 32}},
        "rows": [
            _row("hf_generate", None),
            _row("hf_prompt_lookup", 1.26),
            _row(
                "speculative",
                1.73,
                mismatches,
                speedup_vs_hf_generate=0.8,
                speedup_vs_hf_prompt_lookup=0.9,
            ),
            {**_row("speculative", 2.5), "category": "coding"},
        ],
    }
    bench = run / "bench.json"
    bench.write_text(json.dumps(result))
    return run, bench


def test_summary_names_tau_speedups_run_and_drafter(tmp_path: Path, capsys) -> None:
    run, bench = _write(tmp_path)
    assert mlflow_run_info(run) == {
        "tracking_uri": "sqlite:////x/mlflow.db",
        "experiment": "quickstart",
        "run_id": "abc123",
    }
    assert main([str(run), str(bench)]) == 0
    out = capsys.readouterr().out
    assert "tau 1.73" in out and "HF prompt lookup 1.26" in out
    assert "vs HF generate 0.80" in out and "vs HF prompt lookup 0.90" in out
    assert (
        "MLflow run abc123" in out and "mlflow ui --backend-store-uri sqlite:////x/mlflow.db" in out
    )
    assert f"drafter folder: {run / 'drafter' / 'last'}" in out
    assert "mismatches against the target's own output: 0" in out


def test_summary_fails_on_mismatch_and_on_missing_bench(tmp_path: Path, capsys) -> None:
    run, bench = _write(tmp_path, mismatches=2)
    assert main([str(run), str(bench)]) == 1
    assert main([str(run), str(tmp_path / "none.json")]) == 2


def test_summary_says_what_ran_prepacked(tmp_path: Path, capsys) -> None:
    run, bench = _write(tmp_path)
    assert main([str(run), str(bench)]) == 0
    assert "prepacked" not in capsys.readouterr().out
    result = json.loads(bench.read_text())
    result["config"]["flags"]["prepack"] = True
    bench.write_text(json.dumps(result))
    assert main([str(run), str(bench)]) == 0
    assert "HF generate ran as loaded" in capsys.readouterr().out
    # with the optimised-target peer in the run, both speedups are printed
    result["rows"].append(_row("hf_generate_optimized", None, speedup_vs_hf_generate=1.4))
    result["rows"][2]["speedup_vs_hf_generate_optimized"] = 1.2
    bench.write_text(json.dumps(result))
    assert main([str(run), str(bench)]) == 0
    out = capsys.readouterr().out
    assert "vs HF generate on the same optimised target 1.20" in out
    assert "HF generate itself runs 1.40x faster there" in out
