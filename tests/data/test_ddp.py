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

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from lightning.pytorch import Trainer
    from lightning_spec.data.datamodule import RolloutDataModule
    from lightning_spec.objectives.sft import EagleSFT

    model, chats, vocab, cache, out, fail = sys.argv[1:7]
    torch.set_num_threads(1)

    class Data(RolloutDataModule):
        def _cache_features(self):
            if fail == "1" and self.trainer.global_rank == 0:
                raise OSError("injected: the feature cache's disk failed on rank 0")
            super()._cache_features()

    data = Data(target=model, dataset=chats, mode="dataset", batch_size=2, max_length=64,
                val_fraction=0.0, feature_cache_bytes=10**8, cache_dir=cache, records_per_shard=8)
    module = EagleSFT(target=model, draft_vocab_size=int(vocab), cache_dir=cache, ttt_steps=2,
                      lr=1e-3, warmup_steps=1)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    if trainer.global_rank == 0:
        json.dump({"step": trainer.global_step}, open(out, "w"))
    """
)


def _run(assets: dict[str, str], tmp_path: Path, *, fail: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "ddp_fit.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MASTER_PORT": str(29500 + os.getpid() % 1000), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(script), assets["model"], assets["chats"], assets["vocab"],
         str(tmp_path / "cache"), str(tmp_path / "out.json"), "1" if fail else "0"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip


def test_two_ranks_share_the_feature_cache_and_train(
    tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    done = _run(tiny_cli_assets, tmp_path, fail=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "out.json").read_text())["step"] == 2
    claims = list((tmp_path / "cache").rglob("claims.json"))
    holders = {
        entry["pid"]
        for path in claims
        for key, entry in json.loads(path.read_text()).items()
        if key.startswith("features:")
    }
    assert len(holders) == 2, holders  # both ranks cached feature shards of their own


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
    assert not (tmp_path / "out.json").exists()
