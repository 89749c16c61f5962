"""`lightning-spec fit --ckpt_path last` continues a KILLED run and ends where an uninterrupted
run ends: same data order (the data module's position is in the checkpoint), same
optimizer and schedule state, so the same final drafter weights.

Three real `lightning-spec fit` processes on a tiny target: A runs straight through; B is
killed with SIGKILL after its step-4 checkpoint exists; C resumes B's folder with
`--ckpt_path last`. C's final drafter must equal A's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 8
KILL_AFTER = 4


def _config(tiny: dict[str, str], run: Path, cache: Path, slow: float) -> Path:
    """A fit config like configs/train/eagle3_quickstart_cpu.yaml, with a step checkpoint on every step."""
    text = f"""
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {MAX_STEPS}
  limit_val_batches: 0
  log_every_n_steps: 1
  enable_progress_bar: false
  default_root_dir: {run}
  logger:
    class_path: lightning_spec.tracking.SpecMLFlowLogger
    init_args:
      experiment_name: resume
      run_dir: {run}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {run / "checkpoints"}
        filename: "step{{step}}"
        auto_insert_metric_name: false
        save_last: true
        every_n_train_steps: 1
        save_top_k: -1
    - class_path: lightning_spec.callbacks.checkpoint.DrafterCheckpoint
    - class_path: slow_steps.SlowSteps
      init_args:
        seconds: {slow}
model:
  class_path: lightning_spec.objectives.sft.SFT
  init_args:
    target: {tiny["model"]}
    draft_vocab_size: {tiny["vocab"]}
    ttt_steps: 2
    lr: 1.0e-2
    warmup_steps: 2
    cache_dir: {cache}
data:
  class_path: lightning_spec.data.datamodule.RolloutDataModule
  init_args:
    target: {tiny["model"]}
    dataset: {tiny["chats"]}
    mode: dataset
    max_length: 48
    batch_size: 2
    val_fraction: 0.1
    cache_dir: {cache}
    progress: false
"""
    path = run.parent / f"{run.name}.yaml"
    run.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    env.pop("MLFLOW_TRACKING_URI", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _fit(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_spec.cli", "fit", "--config", str(config), *extra],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "drafter" / "last" / "model.safetensors"))


def test_killed_fit_resumes_to_the_uninterrupted_state(
    tiny_cli_assets: dict[str, str], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    straight = tmp_path / "straight"
    process = _fit(_config(tiny_cli_assets, straight, cache, slow=0.0))
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]

    killed = tmp_path / "killed"
    process = _fit(_config(tiny_cli_assets, killed, cache, slow=0.4))
    marker = killed / "checkpoints" / f"step{KILL_AFTER}.ckpt"
    deadline = time.monotonic() + 240
    try:
        while not marker.is_file():
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no step checkpoint appeared"
            time.sleep(0.05)
        time.sleep(0.2)  # let it get into the next step, then kill it without warning
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    done = sorted(killed.glob("checkpoints/step*.ckpt"))
    assert not (killed / "checkpoints" / f"step{MAX_STEPS}.ckpt").exists(), "killed too late"
    assert (killed / "checkpoints" / "last.ckpt").is_file()

    process = _fit(_config(tiny_cli_assets, killed, cache, slow=0.0), "--ckpt_path", "last")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    assert (killed / "checkpoints" / f"step{MAX_STEPS}.ckpt").is_file()
    assert len(done) < MAX_STEPS

    expected, resumed = _weights(straight), _weights(killed)
    assert expected.keys() == resumed.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=name)
    # and the run really trained: the drafter moved away from its initial weights
    state = torch.load(
        killed / "checkpoints" / "step1.ckpt", map_location="cpu", weights_only=False
    )
    first = {k.removeprefix("drafter."): v for k, v in state["state_dict"].items()}
    moved = [n for n, t in expected.items() if n in first and not torch.equal(first[n], t)]
    assert moved, "the final drafter equals the step-1 drafter: nothing trained"
