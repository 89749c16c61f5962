"""Every YAML under configs/ parses and instantiates through the real `lightning-spec` CLI, and so
does every experiment arm (experiments/<study>/configs/): an overlay composed on the recipe its
first line names (`--config RECIPE --config ARM`, as LightningCLI composes them), or a whole
`online` config.

The configs name the real SmolLM2 target; here the target and data are pointed at a tiny model
folder and a small JSONL file made in code (command-line overrides, as a user would), so every
class path, argument name and type in the files is checked without the real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lightning_spec.overlays import composed, overlay_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").rglob("*.yaml"))
ARMS = sorted(ROOT.glob("experiments/*/configs/*.yaml"))


def config_args(path: str | Path) -> list[str]:
    """The `--config` arguments of a config (a path from the repository root): a recipe's own
    file, an overlay after the recipe it composes on."""
    path = ROOT / path
    recipe = overlay_recipe(path)
    return [*(["--config", str(recipe)] if recipe else []), "--config", str(path)]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


# LightningCLI configs (`lightning-spec fit`); the others are read by `lightning-spec online`
CONFIGS = [p for p in RECIPES + ARMS if "model" in composed(p)]
ONLINE_CONFIGS = [p for p in RECIPES + ARMS if p not in CONFIGS]


@pytest.fixture(autouse=True)
def _run_in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The configs name relative run folders (`runs/<name>/checkpoints`, the MLflow store):
    run from a temporary folder so a test never writes checkpoints where a real run of the
    same config would resume from them."""
    monkeypatch.chdir(tmp_path)


def test_there_are_configs() -> None:
    names = {path.name for path in CONFIGS}
    assert {"eagle3_quickstart_cpu.yaml", "eagle3_sharegpt_gpu.yaml"} <= names


def test_configs_holds_recipes_by_purpose_each_in_its_readme() -> None:
    """configs/ is recipes only, in train/ improve/ online/ gpu/, each a row of
    configs/README.md; an experiment's arm is an overlay on an existing recipe or a whole
    `online` config that says so."""
    assert {p.parent.name for p in RECIPES} <= {"train", "improve", "online", "gpu"}
    assert len(RECIPES) <= 16
    readme = (ROOT / "configs" / "README.md").read_text()
    assert [p for p in RECIPES if str(p.relative_to(ROOT / "configs")) not in readme] == []
    for arm in ARMS:
        recipe = overlay_recipe(arm)
        if recipe is None:
            assert "not an overlay" in arm.read_text().split("\n", 2)[0], arm
        else:
            assert recipe.is_file() and recipe in RECIPES, arm
            assert f"--config {_name(recipe)} --config {_name(arm)}" in arm.read_text(), arm


@pytest.mark.parametrize("path", CONFIGS, ids=_name)
def test_config_instantiates(path: Path, tiny_cli_assets: dict[str, str], tmp_path: Path) -> None:
    from lightning.pytorch import LightningDataModule, LightningModule, Trainer

    from lightning_spec.cli import lightning_cli

    model_args = composed(path)["model"].get("init_args", {})
    if model_args.get("drafter_init"):
        # configs that start from a trained drafter get a tiny one for the tiny target
        start = [f"--model.init_args.drafter_init={_tiny_drafter(tiny_cli_assets, tmp_path)}"]
    else:
        start = [f"--model.init_args.draft_vocab_size={tiny_cli_assets['vocab']}"]
    overrides = [
        f"--model.init_args.target={tiny_cli_assets['model']}",
        *start,
        f"--model.init_args.cache_dir={tmp_path / 'cache'}",
        f"--data.init_args.target={tiny_cli_assets['model']}",
        f"--data.init_args.dataset={tiny_cli_assets['chats']}",
        f"--data.init_args.cache_dir={tmp_path / 'data'}",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        f"--trainer.logger.init_args.run_dir={tmp_path / 'run'}",
        "--trainer.accelerator=cpu",
    ]
    if model_args.get("mask_token_id") == "auto":
        # the tiny target has no padded row or spare special token for `auto` to pick (SmolLM2's
        # pick is tested in tests/models/test_dflash_layout.py): name one
        overrides.append("--model.init_args.mask_token_id=3")
    if _uses_fsdp(path):  # FSDP needs CUDA: its strategy is checked on its own below
        overrides += [
            "--trainer.strategy=auto",
            "--trainer.devices=1",
            "--trainer.precision=32-true",
        ]
    cli = lightning_cli([*config_args(path), *overrides], run=False)
    assert isinstance(cli.model, LightningModule)
    assert isinstance(cli.datamodule, LightningDataModule)
    assert isinstance(cli.trainer, Trainer)
    assert cli.trainer.callbacks, "configs attach the acceptance/checkpoint callbacks"


def _uses_fsdp(path: Path) -> bool:
    strategy = (composed(path).get("trainer") or {}).get("strategy")
    return isinstance(strategy, dict) and "FSDP" in str(strategy.get("class_path"))


FSDP_CONFIGS = [p for p in CONFIGS if _uses_fsdp(p)]


@pytest.mark.parametrize("path", FSDP_CONFIGS, ids=lambda p: p.name)
def test_fsdp_strategy_instantiates_with_its_wrap_policy(path: Path) -> None:
    """The FSDP block of a GPU config builds the real `FSDPStrategy` (what the Trainer gets on
    a CUDA machine), with the wrap policy resolved to the target's decoder-layer class."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=FSDPStrategy)
    block = yaml.safe_load(path.read_text())["trainer"]["strategy"]
    config = parser.parse_object({"strategy": block})
    strategy = parser.instantiate_classes(config).strategy
    assert isinstance(strategy, FSDPStrategy)
    policy = strategy.kwargs.get("auto_wrap_policy") or getattr(strategy, "auto_wrap_policy", None)
    assert isinstance(policy, ModuleWrapPolicy)
    assert {cls.__name__ for cls in policy._module_classes} == {"LlamaDecoderLayer"}
    assert strategy.kwargs["use_orig_params"] is True  # frozen target + trained drafter
    assert strategy.sharding_strategy.name == "FULL_SHARD"


def _tiny_drafter(assets: dict[str, str], root: Path) -> Path:
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.models.target import load_target

    target = load_target(assets["model"])
    folder = root / "drafter"
    Eagle3Drafter.from_target(target, draft_vocab_size=target.vocab_size).save_pretrained(folder)
    return folder


def _tiny_run_args(assets: dict[str, str], tmp_path: Path, run: Path) -> list[str]:
    """Overrides that point a SmolLM2 config at the tiny target, a tiny drafter, the tiny chats
    and folders under `tmp_path` (`run` for the run's own files)."""
    return [
        f"--model.init_args.target={assets['model']}",
        f"--model.init_args.drafter_init={_tiny_drafter(assets, tmp_path)}",
        f"--model.init_args.cache_dir={tmp_path / 'cache'}",
        f"--data.init_args.target={assets['model']}",
        f"--data.init_args.dataset={assets['chats']}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
        f"--trainer.default_root_dir={run}",
        f"--trainer.logger.init_args.run_dir={run}",
    ]


def _tiny_fit_metrics(
    config: str, experiment: str, assets: dict[str, str], tmp_path: Path, data_args: list[str]
) -> set[str]:
    """`lightning-spec fit` of `config` (a recipe or an arm, from the repository root) for 2
    steps on the tiny target and drafter (`data_args`: the config's own data options); the
    metric names its MLflow run logged."""
    from mlflow.tracking import MlflowClient

    from lightning_spec.cli import main
    from lightning_spec.tracking import default_tracking_uri

    run = tmp_path / "run"
    code = main(
        [
            "fit",
            *config_args(config),
            *_tiny_run_args(assets, tmp_path, run),
            "--data.init_args.val_fraction=0.2",
            *data_args,
            "--data.init_args.batch_size=2",
            "--trainer.max_steps=2",
            "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1",
            "--trainer.log_every_n_steps=1",
        ]
    )
    assert code == 0
    assert (run / "drafter" / "last" / "model.safetensors").is_file()
    client = MlflowClient(tracking_uri=default_tracking_uri(run))
    found_experiment = client.get_experiment_by_name(experiment)
    (found,) = client.search_runs([found_experiment.experiment_id])
    return set(found.data.metrics)


def test_bad_config_fails_clearly(tmp_path: Path) -> None:
    from lightning_spec.cli import lightning_cli

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model:\n  class_path: lightning_spec.objectives.sft.EagleSFT\n  init_args:\n    ttt_stepz: 3\n"
    )
    with pytest.raises(SystemExit) as error:
        lightning_cli(["--config", str(bad)], run=False)
    assert error.value.code != 0


def _tiny_fit(config: str, assets: dict[str, str], tmp_path: Path, steps: int, *extra: str) -> list[str]:
    """`fit` arguments running `config` on the tiny target for `steps` steps into tmp/run."""
    run = tmp_path / "run"
    return [
        "fit",
        *config_args(config),
        f"--model.init_args.target={assets['model']}",
        f"--model.init_args.draft_vocab_size={assets['vocab']}",
        f"--model.init_args.cache_dir={tmp_path / 'cache'}",
        f"--data.init_args.target={assets['model']}",
        f"--data.init_args.dataset={assets['chats']}",
        # The same value as the model's: Lightning refuses hparams that differ between the
        # module and the data module when it logs them.
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
        "--data.init_args.val_fraction=0.2",
        f"--trainer.default_root_dir={run}",
        f"--trainer.logger.init_args.run_dir={run}",
        f"--trainer.max_steps={steps}",
        f"--trainer.val_check_interval={steps}",
        "--trainer.limit_val_batches=1",
        *extra,
    ]


@pytest.mark.parametrize(
    "config",
    ["configs/train/eagle3_quickstart_cpu.yaml", "configs/train/dflash_quickstart_cpu.yaml"],
)
def test_cli_fit_runs_and_saves_its_config(
    config: str, tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    """`lightning-spec fit` end to end on the quickstart configs (tiny target, 2 steps): the
    CLI must get past its own setup (it saves the resolved config into the logger's folder)."""
    from lightning_spec.cli import main

    assert main(_tiny_fit(config, tiny_cli_assets, tmp_path, 2)) == 0
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file()
    assert (run / "drafter" / "last" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("config", "options"),
    [
        ("configs/train/eagle3_quickstart_cpu.yaml", {"loss": "kl"}),
        ("configs/train/eagle3_quickstart_cpu.yaml", {"loss": "lk_alpha"}),
        (
            "configs/train/eagle3_quickstart_cpu.yaml",
            {"loss": "lk_lambda", "lk_kl_scale": 0.5, "lk_kl_decay": 2.0},
        ),
        (
            "configs/train/dflash_quickstart_cpu.yaml",
            {"loss": "lk_alpha", "block_weighting": "dpace", "dpace_alpha": 0.3},
        ),
        ("configs/train/dflash_quickstart_cpu.yaml", {"loss": "lk_lambda"}),
    ],
    ids=["eagle3-kl", "eagle3-lk_alpha", "eagle3-lk_lambda", "dflash-lk_alpha-dpace",
         "dflash-lk_lambda"],
)  # fmt: skip
def test_cli_fit_selects_each_loss_option_from_a_config(
    config: str, options: dict, tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    """The SFT loss options (LK losses, D-PACE slot weights; docs/training.md) are read from a
    config overlay by `lightning-spec fit` and train (tiny target, 2 steps)."""
    from lightning_spec.cli import main

    overlay = tmp_path / "loss.yaml"
    overlay.write_text(yaml.safe_dump({"model": {"init_args": options}}))
    args = _tiny_fit(config, tiny_cli_assets, tmp_path, 2)
    at = 1 + len(config_args(config))  # after the recipe's --config, before the overrides
    args[at:at] = ["--config", str(overlay)]
    assert main(args) == 0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert {key: saved["model"]["init_args"][key] for key in options} == options
    assert (tmp_path / "run" / "drafter" / "last" / "model.safetensors").is_file()


def test_a_fit_stopped_by_sigterm_exits_non_zero_with_its_checkpoint(
    tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM (a scheduler's stop) mid-run: the on-exception checkpoint is written and the
    command exits 143, not 0, so no wrapper takes the stopped run for a finished one."""
    from lightning_spec.cli import SIGTERM_EXIT, main

    checkpoints = tmp_path / "run" / "checkpoints"
    code = main(
        _tiny_fit(
            "configs/train/eagle3_quickstart_cpu.yaml", tiny_cli_assets, tmp_path, 6,
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={checkpoints}",
            "--trainer.callbacks.save_on_exception=true",
            "--trainer.callbacks+=tests.sigterm_callback.SigtermAtStep",
            "--trainer.callbacks.step=2",
        )  # fmt: skip
    )
    assert code == SIGTERM_EXIT
    assert list(checkpoints.glob("*.ckpt"))  # the resume point


def test_cli_fit_gto_from_a_drafter_folder(tiny_cli_assets: dict[str, str], tmp_path: Path) -> None:
    """GTO on the dataset's text (experiments/gto-draft-opd/configs/gto_on_dataset.yaml) end to
    end (tiny target and drafter, 2 steps, a small tree): GTO runs through the CLI, validates,
    saves and registers its drafter."""
    from mlflow.tracking import MlflowClient

    from lightning_spec.cli import main
    from lightning_spec.tracking import default_tracking_uri

    run = tmp_path / "run"
    code = main(
        [
            "fit",
            *config_args("experiments/gto-draft-opd/configs/gto_on_dataset.yaml"),
            *_tiny_run_args(tiny_cli_assets, tmp_path, run),
            "--model.init_args.tree=dynamic:2,2,4",
            "--model.init_args.group_size=2",
            "--data.init_args.val_fraction=0.2",
            "--trainer.max_steps=2",
            "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1",
            "--trainer.log_every_n_steps=1",
        ]
    )
    assert code == 0
    assert (run / "drafter" / "last" / "model.safetensors").is_file()
    client = MlflowClient(tracking_uri=default_tracking_uri(run))
    experiment = client.get_experiment_by_name("gto")
    (found,) = client.search_runs([experiment.experiment_id])
    metrics = set(found.data.metrics)
    assert {"train/loss_gto", "val/reward_gap", "val/greedy_pruned", "val/tau"} <= metrics


@pytest.mark.parametrize(
    ("config", "experiment", "extra"),
    [
        ("experiments/gto-draft-opd/configs/draft_opd_on_policy.yaml", "draft_opd", set()),
        ("experiments/gto-draft-opd/configs/draft_opd_mix.yaml", "draft_opd_mix",
         {"train/sft_loss"}),
    ],
)
def test_cli_fit_draft_opd_on_fresh_rollouts(
    tiny_cli_assets: dict[str, str], tmp_path: Path, config: str, experiment: str, extra: set
) -> None:
    """Draft-OPD on fresh rollouts (the on-policy and CPU-mix arms) end to end (tiny target and
    drafter, 2 steps): rollouts by the real decoder, replay, the fresh rollouts' tau in MLflow (and, in
    the CPU mix, the token loss on the dataset rows)."""
    metrics = _tiny_fit_metrics(
        config, experiment, tiny_cli_assets, tmp_path,
        ["--data.init_args.rollout_prompts=2", "--data.init_args.rollout_max_new_tokens=8",
         "--data.init_args.rollout_tree=dynamic:2,2,4"],
    )  # fmt: skip
    expected = {"train/loss", "train/loss_accepted", "rollout/rollout_tau", "val/tau"} | extra
    assert expected <= metrics, metrics


def test_cli_fit_gto_on_its_own_sampled_rollouts(
    tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    """GTO on its own rollouts (experiments/gto-draft-opd/configs/gto_on_policy.yaml) at T = 1
    end to end (tiny target and drafter, 2 steps): GTO drafts, verifies by sampling and rewards trees on the rollouts
    its own drafter sampled through the decoder, beside the control's data and refreshes."""
    metrics = _tiny_fit_metrics(
        "experiments/gto-draft-opd/configs/gto_on_policy.yaml", "gto_on_policy", tiny_cli_assets,
        tmp_path,
        ["--data.init_args.rollout_prompts=2", "--data.init_args.rollout_max_new_tokens=8",
         "--data.init_args.rollout_tree=dynamic:2,2,4", "--data.init_args.rollout_temperature=1.0",
         "--model.init_args.temperature=1.0", "--model.init_args.tree=dynamic:2,2,4",
         "--model.init_args.group_size=2"],
    )  # fmt: skip
    expected = {"train/loss_gto", "train/reward", "rollout/rollout_tau", "val/reward_gap"}
    assert expected <= metrics, metrics


@pytest.mark.parametrize(
    ("config", "experiment", "expected"),
    [
        ("configs/improve/draft_opd_eagle3_cpu.yaml", "draft_opd_greedy",
         {"train/loss_accepted", "train/loss_rejected", "train/not_greedy_texts"}),
        ("experiments/gto-draft-opd/configs/control_sft_same_texts.yaml", "sft_same_texts",
         {"train/loss"}),
        ("configs/improve/gto_eagle3_cpu.yaml", "gto_greedy", {"train/loss_gto"}),
    ],
)  # fmt: skip
def test_cli_fit_draft_opd_and_its_control_on_the_same_greedy_texts(
    tiny_cli_assets: dict[str, str], tmp_path: Path, config: str, experiment: str, expected: set
) -> None:
    """The Draft-OPD and GTO recipes and their SFT control on the same greedy texts end to end
    (tiny target and drafter, 2 steps): regenerated greedy texts with cached features, the
    reference's Draft-OPD (post-rejection suffix) and its SFT control on the same store."""
    metrics = _tiny_fit_metrics(
        config,
        experiment,
        tiny_cli_assets,
        tmp_path,
        ["--data.init_args.regenerate_max_new_tokens=12"],
    )
    assert expected | {"val/tau", "replay/tau", "replay/error_fix_rate"} <= metrics, metrics


def test_online_configs_load(tiny_cli_assets: dict[str, str], tmp_path: Path) -> None:
    """Every non-Lightning config is an `online` config and passes its checks; the command
    runs end to end on the tiny target (two rounds, frozen and ogd), logging to MLflow."""
    from mlflow.tracking import MlflowClient

    from lightning_spec.cli import main
    from lightning_spec.cli.online import load_config
    from lightning_spec.tracking import default_tracking_uri

    assert [p.name for p in ONLINE_CONFIGS] == [
        "ogd_mixed_cpu.yaml", "ogd_shift_cpu.yaml", "ogd_warm_cpu.yaml", "replay_lk_loss.yaml",
        "serve_cpu_tree.yaml", "serve_hydra_optimistic.yaml", "serve_learn_schedule.yaml",
        "serve_live_check.yaml",
        "serve_strong_warm_start.yaml", "serve_update_beside.yaml", "vllm_broad_traffic.yaml",
        "vllm_no_warm_start.yaml", "vllm_warm_start.yaml",
    ]
    for path in ONLINE_CONFIGS:
        config = load_config(path)
        assert config["stream"] and config["strategy"]["name"] in ("frozen", "ogd", "optimistic")
    small = tmp_path / "online.yaml"
    small.write_text(
        yaml.safe_dump(
            {
                "target": tiny_cli_assets["model"],
                "drafter": str(_tiny_drafter(tiny_cli_assets, tmp_path)),
                "tree": "dynamic:2,2,4",
                "stream": [{"source": tiny_cli_assets["chats"], "count": 4}],
                "round_size": 2,
                "max_new_tokens": 6,
                "strategy": {"name": "ogd", "lr": 1e-3, "steps_per_round": 1},
                "guard": {"source": tiny_cli_assets["chats"], "prompts": 2, "max_new_tokens": 4},
                "out_dir": str(tmp_path / "online"),
                "threads": 1,
            }
        )
    )
    assert main(["online", "--config", str(small)]) == 0
    rounds = (tmp_path / "online" / "rounds.jsonl").read_text().splitlines()
    assert len(rounds) == 2
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path / "online"))
    (run,) = client.search_runs([client.get_experiment_by_name("online_spec").experiment_id])
    assert {"online/tau", "online/prequential_tau", "online/update_seconds"} <= set(
        run.data.metrics
    )
    assert main(["online", "--config", str(small), "--strategy", "sgd"]) == 2
    # the hindsight ceiling: replayed only (refused without replay), fitted, then scored frozen
    hindsight = ["--hindsight", "0.5", "--hindsight-epochs", "2", "--out-dir", str(tmp_path / "h")]
    assert main(["online", "--config", str(small), *hindsight]) == 2
    config = yaml.safe_load(small.read_text())
    config.pop("guard")
    small.write_text(yaml.safe_dump({**config, "replay": True}))
    assert main(["online", "--config", str(small), *hindsight]) == 0
    summary = json.loads((tmp_path / "h" / "hindsight.json").read_text())
    assert summary["fit_requests"] == 2 and summary["scored_requests"] == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter: x\nstreem: []\n")
    assert main(["online", "--config", str(bad)]) == 2


def test_an_online_configs_stream_and_strategy_options() -> None:
    """What `online` and the vLLM probes build from a config: the stream's segments in order
    (order and skip defaulted) and the strategy's options, with the target's end ids protected
    only where the draft vocabulary is swapped."""
    from types import SimpleNamespace

    from lightning_spec.cli.online import load_config, strategy_options, stream_segments

    config = load_config(ROOT / "experiments" / "onlinespec" / "configs" / "vllm_no_warm_start.yaml")
    (segment,) = stream_segments(config)
    assert (segment.count, segment.order, segment.skip) == (1200, "source", 800)
    target = SimpleNamespace(eos_token_ids=[2, 7])
    options = strategy_options(config, target)
    assert options["vocab_swap"] == 64 and options["protected_ids"] == [2, 7]
    assert "name" not in options
    config = {"stream": [{"source": "a.jsonl", "count": 3}], "strategy": {"name": "ogd", "lr": 0.1}}
    assert [(s.order, s.skip) for s in stream_segments(config)] == [("shuffle", 0)]
    assert strategy_options(config, target) == {"lr": 0.1}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("--model.init_args.ttt_steps=0", "ttt_steps"),
        ("--model.init_args.draft_vocab_size=0", "draft_vocab_size"),
        ("--model.init_args.lr=-1", "lr"),
        ("--model.init_args.mask_token_id=next", "mask_token_id"),
    ],
)
def test_out_of_range_values_fail_before_anything_is_prepared(
    override: str, field: str, tmp_path: Path, capsys
) -> None:
    """Out-of-range config values stop the CLI at instantiation (no target load, no data
    preparation), naming the field."""
    from lightning_spec.cli import lightning_cli

    with pytest.raises((SystemExit, ValueError)) as error:
        lightning_cli(
            [*config_args("configs/train/eagle3_quickstart_cpu.yaml"), override,
             "--model.init_args.target=/nonexistent", f"--trainer.default_root_dir={tmp_path}"],
            run=False,
        )  # fmt: skip
    text = str(error.value) + capsys.readouterr().err
    assert field in text
    assert not (tmp_path / "rollouts").exists()


def test_a_bad_rollout_tree_is_named() -> None:
    from lightning_spec.data.datamodule import RolloutDataModule

    with pytest.raises(ValueError, match="rollout_tree 'dynamic:2'"):
        RolloutDataModule(mode="on_policy", rollout_tree="dynamic:2")
    with pytest.raises(ValueError, match="batch_size"):
        RolloutDataModule(batch_size=0)


def test_prepare_builds_a_configs_store_once(
    tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    """`lightning-spec prepare` builds the regenerated store (answers + cached pass) a fit with
    the same arguments trains on, without training; run again, it finds the store complete and
    writes nothing (so arms compared at equal budget do not pay for the data)."""
    from lightning_spec.cli import main

    args = [
        "prepare",
        *config_args("experiments/gto-draft-opd/configs/control_sft_same_texts.yaml"),
        *_tiny_run_args(tiny_cli_assets, tmp_path, tmp_path / "run"),
        "--data.init_args.max_conversations=12",
        "--data.init_args.regenerate_max_new_tokens=8",
    ]
    assert main(args) == 0
    store = tmp_path / "cache" / "regenerated"

    def written() -> dict[str, int]:  # the store's files and their times (not its lock file)
        return {
            p.name: p.stat().st_mtime_ns
            for p in store.rglob("*")
            if p.is_file() and not p.name.endswith(".lock")
        }

    files = written()
    assert any(name.endswith(".jsonl") for name in files), "regenerated answers written"
    assert any("feature" in str(p) for p in store.rglob("*")), "the cached pass written"
    # the config's checkpoint folder is relative (runs/...), so any checkpoint lands under tmp
    assert not list(tmp_path.rglob("*.ckpt")), "prepare does not train"
    assert main(args) == 0
    assert written() == files


def test_store_text_batches_are_the_configs_batches_with_the_targets_pass(
    tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    """The benches' `store_text_batches` reads a config's regenerated store: texts the target
    answered, with a cached argmax equal to the target's own on those texts."""
    import torch

    from lightning_spec.bench.greedy import store_text_batches

    config = yaml.safe_load((ROOT / "configs" / "improve" / "gto_eagle3_cpu.yaml").read_text())
    config["data"]["init_args"].update(
        target=tiny_cli_assets["model"],
        dataset=tiny_cli_assets["chats"],
        cache_dir=str(tmp_path / "data"),
        max_conversations=10,
        regenerate_max_new_tokens=8,
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    target, batches = store_text_batches(path, 4, batch_size=2)
    assert len(batches) == 2 and all(b["input_ids"].shape[0] == 2 for b in batches)
    for batch in batches:
        assert int(batch["loss_mask"].sum()) > 0
        with torch.no_grad():
            output = target(batch["input_ids"], attention_mask=batch["attention_mask"])
        live = batch["attention_mask"].bool()
        expected = target.head_argmax(output.last_hidden)
        assert torch.equal(batch["target_argmax"][live], expected[live])
