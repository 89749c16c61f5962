"""Targets unlike SmolLM2, built in code: on the llama, qwen3, mistral and gemma3
families, hidden states past fp16's range (2e5), no chat template (a base model), and a
256k-token vocabulary, all at once. The quickstart configuration with only the target (and the
data, which must be in the target's words) changed trains with finite losses on each, saves a
drafter folder that reloads, decodes losslessly, and benches."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from lightning_spec.models.tiny import stress_target, write_documents

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 262_144


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral", "gemma3"])
def stress(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    family = request.param
    folder = tmp_path_factory.mktemp(f"stress-{family}")
    target = stress_target(family, vocab_size=VOCAB)
    target.model.save_pretrained(folder / "model")
    target.tokenizer.save_pretrained(folder / "model")
    documents = write_documents(folder / "documents.jsonl", 24, vocab_size=VOCAB)
    return {"family": family, "model": folder / "model", "documents": documents, "root": folder}


def _fit(stress: dict, run: Path, cache: Path) -> int:
    from lightning_spec.cli import main

    model, documents = str(stress["model"]), str(stress["documents"])
    return main(
        [
            "fit", "--config", str(ROOT / "configs" / "train" / "eagle3_quickstart_cpu.yaml"),
            f"--model.init_args.target={model}",
            f"--data.init_args.target={model}",
            f"--data.init_args.dataset={documents}",
            # The draft vocabulary is counted on the target's own words (ShareGPT is not in them).
            f"--model.init_args.vocab_source={documents}",
            "--model.init_args.vocab_conversations=24",
            f"--model.init_args.cache_dir={cache}", f"--data.init_args.cache_dir={cache}",
            "--data.init_args.val_fraction=0.2",
            f"--trainer.default_root_dir={run}", f"--trainer.logger.init_args.run_dir={run}",
            "--trainer.max_steps=2", "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
        ]
    )  # fmt: skip


def _train_losses(run: Path) -> list[float]:
    losses = []
    for line in (run / "mlflow_mirror.jsonl").read_text().splitlines():
        metrics = json.loads(line).get("metrics") or {}
        if "train/loss" in metrics:
            losses.append(float(metrics["train/loss"]))
    return losses


def test_quickstart_trains_decodes_and_benches(
    stress: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_spec.cli import bench as bench_cli
    from lightning_spec.data.chat import render_prompt
    from lightning_spec.data.sources import load_source
    from lightning_spec.decoding.build import parse_tree_spec
    from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
    from lightning_spec.models.drafters.base import load_drafter
    from lightning_spec.models.fingerprint import check_drafter_target
    from lightning_spec.models.target import load_target

    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="lightning_spec"):
        assert _fit(stress, run, tmp_path / "cache") == 0
    assert "plain-text continuation" in caplog.text  # a base model: chosen and said
    losses = _train_losses(run)
    assert len(losses) >= 2 and all(math.isfinite(v) for v in losses), losses
    stored = list((tmp_path / "cache").rglob("*.safetensors"))
    assert stored, "the quickstart caches the target's features"

    target = load_target(str(stress["model"]))
    features = target(torch.arange(4, 40).unsqueeze(0), use_cache=False, output_features=True)
    assert float(features.features.abs().max()) > 65504  # past fp16 and still trained finite

    drafter = load_drafter(run / "drafter" / "last")
    check_drafter_target(drafter, target)  # the folder records this target: accepted
    assert drafter.target_vocab_size == VOCAB and drafter.draft_vocab_size == 4096
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec("dynamic:2,4,8"))
    for conversation in load_source(str(stress["documents"]), limit=2):
        prompt = render_prompt(target.tokenizer, conversation.messages[:1])
        expected = autoregressive_generate(target, prompt, 16, stop_on_eos=False)
        assert decoder.generate(prompt, 16, stop_on_eos=False).tokens == expected

    output = tmp_path / "bench.json"
    code = bench_cli.main(
        [
            "--target", str(stress["model"]), "--drafter", str(run / "drafter" / "last"),
            "--dataset", str(stress["documents"]), "--limit", "2", "--max-new-tokens", "8",
            "--tree", "dynamic:2,4,8", "--methods", "autoregressive,speculative",
            "--threads", "1", "--warmup", "0", "--bootstrap", "100", "--no-progress",
            "--output", str(output),
        ]
    )  # fmt: skip
    assert code == 0
    rows = json.loads(output.read_text())["rows"]
    assert {r["method"] for r in rows} >= {"autoregressive"} and len(rows) == 2
    assert all(r["mismatches"] == 0 for r in rows)
