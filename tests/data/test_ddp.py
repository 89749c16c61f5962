"""Two real DDP ranks (gloo, CPU, Lightning's own subprocess launcher) through the real
`RolloutDataModule`: the feature cache is shared between the ranks, and a rank that fails while
preparing makes every rank stop with the reason instead of leaving the others at a barrier
(30 minutes, then an unrelated timeout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning_spec.data.datamodule import RolloutDataModule
    from lightning_spec.objectives.sft import SFT

    model, chats, vocab, cache, out, fail, devices, batch, steps = sys.argv[1:10]
    torch.set_num_threads(1)
    seed_everything(0)

    class Data(RolloutDataModule):
        def _cache_features(self):
            if fail == "1" and self.trainer.global_rank == 0:
                raise OSError("injected: the feature cache's disk failed on rank 0")
            super()._cache_features()

    class Losses(Callback):
        def __init__(self):
            self.losses = []
        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            self.losses.append(float(outputs["loss"]))

    losses = Losses()
    data = Data(target=model, dataset=chats, mode="dataset", batch_size=int(batch),
                max_length=64, val_fraction=0.0, feature_cache_bytes=10**8, cache_dir=cache,
                records_per_shard=8)
    module = SFT(target=model, draft_vocab_size=int(vocab), cache_dir=cache, ttt_steps=2,
                      lr=1e-2, warmup_steps=1, max_steps_for_schedule=1000)
    trainer = Trainer(accelerator="cpu", devices=int(devices),
                      strategy="ddp" if int(devices) > 1 else "auto", max_steps=int(steps),
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                      callbacks=[losses])
    trainer.fit(module, datamodule=data)
    with open(f"{out}.rank{trainer.global_rank}.json", "w") as handle:
        checksum = sum(float(p.double().sum()) for p in module.drafter.parameters())
        json.dump({"step": trainer.global_step, "losses": losses.losses,
                   "checksum": checksum}, handle)
    """
)


def _run(
    assets: dict[str, str], tmp_path: Path, *, fail: bool = False, devices: int = 2,
    batch: int = 2, steps: int = 2,
) -> subprocess.CompletedProcess:  # fmt: skip
    script = tmp_path / "ddp_fit.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MASTER_PORT": str(29500 + os.getpid() % 1000), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(script), assets["model"], assets["chats"], assets["vocab"],
         str(tmp_path / "cache"), str(tmp_path / "out"), "1" if fail else "0", str(devices),
         str(batch), str(steps)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip


def _result(tmp_path: Path, rank: int = 0) -> dict:
    return json.loads((tmp_path / f"out.rank{rank}.json").read_text())


def test_two_ranks_share_the_feature_cache_and_train(
    tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    done = _run(tiny_cli_assets, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _result(tmp_path)["step"] == 2
    claims = {
        key: entry
        for path in (tmp_path / "cache").rglob("claims.json")
        for key, entry in json.loads(path.read_text()).items()
        if key.startswith("features:")
    }
    # both ranks ran the caching pass; the claims gave every shard to exactly one of them
    # (which rank gets which is timing), and every shard was finished
    assert len(claims) >= 2 and all(entry.get("done") for entry in claims.values())


def test_a_rank_failing_in_preparation_stops_every_rank(
    tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    try:
        done = _run(tiny_cli_assets, tmp_path, fail=True)
    except subprocess.TimeoutExpired:  # pragma: no cover - the bug this test exists for
        pytest.fail("a rank waited at a barrier for the rank that had failed")
    assert done.returncode != 0
    assert "injected: the feature cache's disk failed on rank 0" in done.stderr
    assert "another rank failed while caching features" in done.stderr
    assert not list(tmp_path.glob("out.rank*.json"))


def test_two_ranks_follow_the_loss_curve_of_one_process_with_the_global_batch(
    tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    """2 ranks x batch 2 train on the records one process with batch 4 trains on (global
    batches split across ranks) with DDP's averaged gradients: the two loss curves agree
    within 1% at every step while the loss itself moves by more than 5%, and the ranks hold
    identical drafters."""
    steps = 8
    # a target with peaked next-token distributions (its LM head x 8), so the drafter has
    # something to learn within a few steps (a random target's are nearly uniform)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "sharp"
    model = AutoModelForCausalLM.from_pretrained(tiny_cli_assets["model"])
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_cli_assets["model"]).save_pretrained(folder)
    assets = {**tiny_cli_assets, "model": str(folder)}
    single = tmp_path / "single"
    single.mkdir()
    done = _run(assets, single, devices=1, batch=4, steps=steps)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = tmp_path / "ddp"
    ddp.mkdir()
    done = _run(assets, ddp, devices=2, batch=2, steps=steps)
    assert done.returncode == 0, done.stderr[-3000:]
    one = _result(single)["losses"]
    ranks = [_result(ddp, rank)["losses"] for rank in (0, 1)]
    both = [(a + b) / 2 for a, b in zip(*ranks, strict=True)]  # DDP's loss: the rank mean
    assert len(one) == len(both) == steps
    assert one[0] - min(one) > 0.05 * one[0], one  # the curve moves well past the bound
    for step, (a, b) in enumerate(zip(one, both, strict=True)):
        assert abs(a - b) <= 0.01 * a, (step, one, both)
    # gradients were averaged: both ranks hold the same drafter after every update
    assert _result(ddp, 0)["checksum"] == _result(ddp, 1)["checksum"]
