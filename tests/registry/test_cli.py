"""`lightning-spec promote` with a tiny chat target folder: measure, register, promote, print;
and clear exit-2 errors before anything slow happens."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from lightning_spec.cli.promote import main


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory, data_helpers) -> dict[str, str]:  # noqa: ANN001
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.models.drafters.standalone import StandaloneDrafter

    root = tmp_path_factory.mktemp("cli")
    tokenizer = data_helpers.make_chat_tokenizer()
    target = data_helpers.make_tiny_target(tokenizer, seed=5)
    target.model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    Eagle3Drafter.from_target(target, seed=0).save_pretrained(root / "random")
    StandaloneDrafter.from_model(target.model, target_name=target.name).save_pretrained(
        root / "self"
    )
    chats = data_helpers.write_chats(root / "chats.jsonl", 6)
    return {"root": str(root), "target": str(root / "target"), "chats": str(chats)}


def _args(assets: dict[str, str], drafter: str, tracking_uri: str, *extra: str) -> list[str]:
    return [
        "--drafter",
        str(Path(assets["root"]) / drafter),
        "--model-name",
        "cli-drafter",
        "--tracking-uri",
        tracking_uri,
        "--target",
        assets["target"],
        "--dataset",
        assets["chats"],
        "--limit",
        "3",
        "--tree",
        "chain:2",
        "--max-new-tokens",
        "6",
        "--objective",
        "sft",
        *extra,
    ]


def test_measures_registers_and_promotes(
    assets: dict[str, str], tracking_uri: str, capsys: pytest.CaptureFixture
) -> None:
    from lightning_spec.registry import registry_client

    assert main(_args(assets, "random", tracking_uri)) == 0
    out = capsys.readouterr().out
    assert "cli-drafter version 1: champion" in out
    assert "no champion yet" in out and "aliases: champion -> version 1" in out
    tags = registry_client(tracking_uri).get_model_version("cli-drafter", "1").tags
    random_tau = float(tags["tau/chats-3/T0"])
    assert 1.0 <= random_tau <= 3.0
    assert (tags["prompt_set"], tags["tree"], tags["objective"]) == ("chats-3", "chain:2", "sft")
    assert tags["target_model"] == assets["target"]

    # The target drafting for itself accepts everything: it takes the champion alias.
    assert main(_args(assets, "self", tracking_uri, "--json")) == 0
    decision = json.loads(capsys.readouterr().out)
    assert decision["outcome"] == "champion" and decision["comparable"]
    assert not decision["remeasured"]
    assert decision["candidate_tau"] > decision["champion_tau"] == pytest.approx(random_tau)
    assert decision["aliases"] == {"champion": "2"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_usage_errors_exit_2(
    assets: dict[str, str], tracking_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(_args(assets, "missing", tracking_uri)) == 2
    assert "drafter folder not found" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{oops")
    (bad / "model.safetensors").write_bytes(b"")
    assert main(_args(assets, str(bad), tracking_uri)) == 2
    assert "not valid JSON" in capsys.readouterr().err
    unreachable = f"http://127.0.0.1:{_free_port()}"
    assert main(_args(assets, "random", unreachable)) == 2
    assert "cannot reach the MLflow tracking server" in capsys.readouterr().err
    assert main(_args(assets, "random", tracking_uri, "--margin", "-1")) == 2
    assert "--margin must be >= 0" in capsys.readouterr().err
    # A drafter built for another vocabulary than the target's.
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
    from lightning_spec.models.target import TargetModel
    from lightning_spec.models.tiny import tiny_config

    other = TargetModel.from_config(tiny_config("llama", vocab_size=96, num_layers=2))
    Eagle3Drafter.from_target(other).save_pretrained(tmp_path / "other")
    assert main(_args(assets, str(tmp_path / "other"), tracking_uri)) == 2
    assert "another tokenizer" in capsys.readouterr().err


def test_help_imports_nothing_heavy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, lightning_spec.cli as c\n"
        "try:\n    c.main(['promote', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('mlflow', 'torch', 'transformers', 'lightning') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert "--model-name" in result.stdout and "docs/registry.md" in result.stdout
    assert result.stdout.strip().endswith("[]"), result.stdout
