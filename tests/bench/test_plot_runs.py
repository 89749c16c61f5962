"""lightning-spec bench plot (lightning_spec/bench/plot_runs.py): metric series from real run
mirrors, summaries, the PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lightning_spec.tracking.mirror import MIRROR_NAME


@pytest.fixture(scope="module")
def plot():  # noqa: ANN201
    from lightning_spec.bench import plot_runs

    return plot_runs


def _mirror(folder: Path, rows: list[tuple[float, int, dict]]) -> Path:
    """A mirror file as SpecMLFlowLogger writes it: a start record, then metrics records."""
    folder.mkdir(parents=True)
    lines = [{"seq": 0, "type": "start", "time": 1000.0}]
    for seq, (time, step, metrics) in enumerate(rows, start=1):
        lines.append({"seq": seq, "type": "metrics", "time": time, "step": step,
                      "metrics": metrics})  # fmt: skip
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (folder / MIRROR_NAME).write_text(text + '{"seq": 99, "type": "metr')  # a torn last line
    return folder


def test_series_keeps_finite_values_of_the_metric_in_order(plot, tmp_path: Path) -> None:
    run = _mirror(tmp_path / "a", [
        (1060.0, 0, {"rollout/rollout_tau": 2.0, "other": 1.0}),
        (1090.0, 4, {"train/loss": 3.0}),
        (1120.0, 20, {"rollout/rollout_tau": float("nan")}),
        (1180.0, 40, {"rollout/rollout_tau": 2.5}),
    ])  # fmt: skip
    rows = plot.metric_series(run, "rollout/rollout_tau")
    assert rows == [
        {"step": 0.0, "minutes": 1.0, "value": 2.0},
        {"step": 40.0, "minutes": 3.0, "value": 2.5},
    ]
    summary = plot.summarise(rows)
    assert summary == {"points": 2, "first": 2.0, "last": 2.5, "mean": 2.25}
    empty = plot.summarise([])
    assert empty["points"] == 0 and math.isnan(empty["mean"])


def test_main_draws_a_png_and_writes_the_series(plot, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    a = _mirror(tmp_path / "a", [(1060.0, 0, {"m": 1.0}), (1120.0, 20, {"m": 2.0})])
    b = _mirror(tmp_path / "b", [(1030.0, 0, {"m": 1.5})])
    png, out = tmp_path / "fig.png", tmp_path / "fig.json"
    code = plot.main(["--run", f"opd={a}", "--run", f"control={b}", "--metric", "m",
                      "--x", "minutes", "--output", str(png), "--json", str(out)])  # fmt: skip
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads(out.read_text())
    assert payload["summaries"]["opd"]["last"] == 2.0
    assert [r["value"] for r in payload["series"]["control"]] == [1.5]
    assert "opd: m points 2 first 1.000 last 2.000" in capsys.readouterr().out


def test_main_refuses_a_missing_run_or_metric(plot, tmp_path: Path) -> None:
    assert plot.main(["--run", f"x={tmp_path / 'nope'}", "--metric", "m",
                      "--output", str(tmp_path / "f.png")]) == 2  # fmt: skip
    run = _mirror(tmp_path / "a", [(1060.0, 0, {"other": 1.0})])
    assert plot.main(["--run", f"x={run}", "--metric", "m",
                      "--output", str(tmp_path / "f.png")]) == 1  # fmt: skip
    assert not (tmp_path / "f.png").exists()
    with pytest.raises(SystemExit):
        plot.main(["--run", "no-equals-sign", "--metric", "m", "--output", "f.png"])
