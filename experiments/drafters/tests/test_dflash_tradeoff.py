"""scripts/dflash_tradeoff.py: variants change the drafter's shape and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tradeoff(study_script):  # noqa: ANN001, ANN201
    return study_script("dflash_tradeoff")


def test_variant_parsing(tradeoff) -> None:
    assert tradeoff.parse_variant("L1B8=1,8") == ("L1B8", 1, 8, False)
    assert tradeoff.parse_variant("A=2,16,anchor") == ("A", 2, 16, True)
    for bad in ("x=1", "=1,8", "x=0,8", "x=1,1", "x=1,8,other"):
        with pytest.raises(SystemExit, match="bad variant"):
            tradeoff.parse_variant(bad)


def test_variant_config_changes_only_the_shape_and_the_check_tree(tradeoff) -> None:
    base = yaml.safe_load(tradeoff.BASE_CONFIG.read_text())
    config = tradeoff.variant_config(base, 4, 16, True)
    model = config["model"]["init_args"]
    assert (model["num_layers"], model["block_size"], model["anchor_feature"]) == (4, 16, True)
    trees = [c["init_args"]["tree"] for c in config["trainer"]["callbacks"]
             if c["class_path"] == tradeoff.ACCEPTANCE]  # fmt: skip
    assert trees == ["chain:15"]
    assert config["data"] == base["data"]
    rest = {
        k: v for k, v in model.items() if k not in ("num_layers", "block_size", "anchor_feature")
    }
    assert rest == {k: v for k, v in base["model"]["init_args"].items()
                    if k not in ("num_layers", "block_size")}  # fmt: skip
    assert base["model"]["init_args"]["block_size"] == 8  # the base is not modified


def _bench_row(label: str, tree: str, dataset: str, tau: float, *, suffix: bool = False) -> dict:
    return {"method": f"speculative:{label}" + (f"@{tree}" if suffix else ""), "category": None, "tree": tree,
            "dataset": dataset, "tau": tau, "tau_ci": [tau - 0.1, tau + 0.1],
            "alpha": [0.5, 0.25], "ms_per_step": {"draft": 9.0, "verify": 50.0}}  # fmt: skip


def test_table_reads_the_shared_and_the_per_drafter_benches(tradeoff, tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(
        json.dumps({"runs": {"L1": {"seconds_per_step": 0.4}, "L2": {"seconds_per_step": 0.6}}})
    )
    shared = [_bench_row("L1/drafter", "chain:3", "mtbench", 1.5),
              _bench_row("L2/drafter", "chain:3", "mtbench", 1.7, suffix=True),
              _bench_row("L12/drafter", "chain:3", "mtbench", 1.9),
              {"method": "hf_generate", "category": None}]  # fmt: skip
    (tmp_path / "bench_chain3.json").write_text(json.dumps({"rows": shared}))
    alone = [_bench_row("drafter", "chain:7", "mtbench", 1.8)]  # one drafter: a bare label
    (tmp_path / "bench_L2_block.json").write_text(json.dumps({"rows": alone}))
    lines = tradeoff.table([("L1", 1, 4, False), ("L2", 2, 8, True)], tmp_path).splitlines()
    assert lines[2] == (
        "| L1 | 1 | 4 | 0.40 | chain:3 | mtbench | 1.50 [1.40, 1.60] | 0.50 0.25 | 9.00 / 50.00 |"
    )
    assert lines[3].startswith("| L2 (anchor_feature) | 2 | 8 | 0.60 | chain:3 | mtbench | 1.70")
    assert lines[4].startswith("| L2 (anchor_feature) | 2 | 8 | 0.60 | chain:7 | mtbench | 1.80")
    assert len(lines) == 5
