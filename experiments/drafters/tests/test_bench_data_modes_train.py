"""scripts/bench_data_modes_train.py: every mode's generated config is a real, valid fit config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def script(study_script):  # noqa: ANN001, ANN201
    return study_script("bench_data_modes_train")


def test_mode_config_budgets_the_whole_run(script, tmp_path: Path) -> None:
    base = yaml.safe_load((ROOT / "configs" / "train" / "eagle3_quickstart_cpu.yaml").read_text())
    config = script.mode_config(
        base, mode="regenerated", conversations=70, minutes=9.5, workdir=tmp_path
    )
    trainer = config["trainer"]
    assert trainer["max_time"] is None and trainer["max_steps"] >= 10_000
    budget = [c for c in trainer["callbacks"] if c["class_path"].endswith("RunBudget")]
    assert budget == [
        {"class_path": "lightning_spec.callbacks.budget.RunBudget", "init_args": {"minutes": 9.5}}
    ]
    assert not any(c["class_path"].endswith("RichProgressBar") for c in trainer["callbacks"])
    assert config["data"]["init_args"]["mode"] == "regenerated"
    assert config["data"]["init_args"]["max_conversations"] == 70
    assert trainer["default_root_dir"] == str(tmp_path / "regenerated")
    before = yaml.safe_load((ROOT / "configs" / "train" / "eagle3_quickstart_cpu.yaml").read_text())
    assert base == before, "the base config is not modified"


def test_mode_config_instantiates(script, tiny_cli_assets: dict[str, str], tmp_path: Path) -> None:
    from lightning_spec.callbacks.budget import RunBudget
    from lightning_spec.cli import lightning_cli

    base = yaml.safe_load((ROOT / "configs" / "train" / "eagle3_quickstart_cpu.yaml").read_text())
    config = script.mode_config(base, mode="mixture", conversations=5, minutes=1, workdir=tmp_path)
    path = tmp_path / "mixture.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = lightning_cli(
        [
            "--config",
            str(path),
            f"--model.init_args.target={tiny_cli_assets['model']}",
            f"--model.init_args.draft_vocab_size={tiny_cli_assets['vocab']}",
            f"--data.init_args.target={tiny_cli_assets['model']}",
            f"--data.init_args.dataset={tiny_cli_assets['chats']}",
        ],
        run=False,
    )
    assert any(isinstance(c, RunBudget) for c in cli.trainer.callbacks)
    assert cli.datamodule.mode == "mixture"


def test_fresh_cache_links_assets_but_not_rollouts(script, tmp_path, monkeypatch) -> None:
    real = tmp_path / "real"
    for name in ("assets", "models", "vocab", "rollouts"):
        (real / name).mkdir(parents=True)
    monkeypatch.setenv("LIGHTNING_SPEC_CACHE", str(real))
    fresh = script.fresh_cache(tmp_path / "fresh")
    assert sorted(p.name for p in fresh.iterdir()) == ["assets", "models", "vocab"]
    assert (fresh / "models").resolve() == (real / "models").resolve()


def test_bad_conversation_counts(script) -> None:
    assert script.parse_conversations(["dataset=12"])["dataset"] == 12
    with pytest.raises(SystemExit, match="mode=N"):
        script.parse_conversations(["online=3"])


def test_prep_seconds_from_the_mirror(script, tmp_path: Path) -> None:
    import json

    lines = [
        {"seq": 0, "type": "start", "time": 1.0},
        {"seq": 1, "type": "metrics", "step": 0, "metrics": {"budget/prep_seconds": 215.24}},
    ]
    (tmp_path / "mlflow_mirror.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert script.prep_seconds(tmp_path) == 215.2
    assert script.prep_seconds(tmp_path / "missing") is None
