"""lightning-spec bench compare (lightning_spec/bench/compare_objectives.py): equal budgets, outputs
redirected, nothing else changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_spec.overlays import composed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare():  # noqa: ANN201
    from lightning_spec.bench import compare_objectives

    return compare_objectives


def test_budgeted_config_resizes_the_budget_and_moves_outputs(compare, tmp_path: Path) -> None:
    for name in ("gto_on_dataset.yaml", "control_sft_continue.yaml", "draft_opd_on_policy.yaml"):
        path = ROOT / "experiments" / "gto-draft-opd" / "configs" / name
        original = composed(path)  # an arm is an overlay: the run gets it merged into its recipe
        config = compare.budgeted_config(path, 12.5, tmp_path / "r")
        budgets = [c for c in config["trainer"]["callbacks"] if c["class_path"] == compare.BUDGET]
        assert [b["init_args"]["minutes"] for b in budgets] == [12.5]
        assert config["trainer"]["default_root_dir"] == str(tmp_path / "r")
        assert config["trainer"]["logger"]["init_args"]["run_dir"] == str(tmp_path / "r")
        dirs = [c["init_args"]["dirpath"] for c in config["trainer"]["callbacks"]
                if "dirpath" in c.get("init_args", {})]  # fmt: skip
        assert dirs == [str(tmp_path / "r" / "checkpoints")]
        assert config["model"] == original["model"] and config["data"] == original["data"]


def test_a_config_without_a_budget_gets_one(compare, tmp_path: Path) -> None:
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"max_steps": 3}, "model": {}}))
    config = compare.budgeted_config(path, 5.0, tmp_path / "r")
    assert config["trainer"]["callbacks"] == [
        {"class_path": compare.BUDGET, "init_args": {"minutes": 5.0}}
    ]


def test_steps_set_every_run_to_the_same_step_count(compare, tmp_path: Path) -> None:
    config = compare.budgeted_config(
        ROOT / "configs" / "train" / "dflash_2h_cpu.yaml", 9.0, tmp_path, steps=7
    )
    assert config["trainer"]["max_steps"] == 7
    untouched = compare.budgeted_config(ROOT / "configs" / "train" / "dflash_2h_cpu.yaml", 9.0, tmp_path)
    assert untouched["trainer"]["max_steps"] == 20000


def test_an_overlay_arm_is_run_composed_on_its_recipe(compare, tmp_path: Path) -> None:
    """An arm states only what differs from its recipe; the run gets every key of both."""
    arm = ROOT / "experiments" / "gto-draft-opd" / "configs" / "control_sft_same_texts.yaml"
    recipe = yaml.safe_load((ROOT / "configs" / "improve" / "draft_opd_eagle3_cpu.yaml").read_text())
    own = yaml.safe_load(arm.read_text())
    config = compare.budgeted_config(arm, 3.0, tmp_path / "r")
    assert set(recipe) <= set(config) and set(own) <= set(config)
    for key in set(recipe["data"]["init_args"]) - set(own.get("data", {}).get("init_args", {})):
        assert config["data"]["init_args"][key] == recipe["data"]["init_args"][key], key
