"""One short check of what users run on GPUs: fit, lossless decoding, on-policy rollouts and
ONNX export, on a tiny target built in code, every step timed into one JSON file.

Why it exists: the project is built and tested on CPUs, and a GPU is lent rarely and briefly
(minutes), so the check must be ready before the device is and must not rot between loans. On
CUDA it runs each step for real (`fit` in ``bf16-mixed`` and ``32-true``, the decoder's greedy
output against the target's own with and without the Triton kernels, Draft-OPD's and GTO's
rollouts, ONNX export of the CUDA-trained drafter with onnxruntime parity on CPU). ``--dry``
runs the same steps on CPU with small counts (the kernels under Triton's interpreter) in the
default test suite, and names what only a GPU measures (peak GPU memory, the kernels compiled).

A step that cannot run where it is (a package the image lacks) is recorded as skipped with the
reason, and the check goes on; a step that raises is recorded as failed with the error, and the
check goes on. Exit status: 0 when no step failed, 1 otherwise.

    python -m lightning_spec.bench.gpu_check --out gpu_check.json          # on a GPU machine
    python -m lightning_spec.bench.gpu_check --dry --out gpu_check.json    # CPU, small
    bash scripts/gpu_check.sh OUT_DIR                                      # installs, then runs
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # before anything imports triton (lightning does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

OPTIONAL = ("lightning", "torchmetrics", "transformers", "triton", "onnx", "onnxruntime",
            "onnxscript", "mlflow", "jsonargparse", "omegaconf")  # fmt: skip


@dataclass
class Sizes:
    """How big each step is: the GPU sizes fit the 8-minute budget with room, the dry sizes
    keep the default suite's share under a minute on two CPU cores."""

    vocab: int = 1024
    hidden: int = 256
    layers: int = 4
    draft_vocab: int = 512
    prompts: int = 64
    text_length: int = 96
    batch: int = 16
    fit_steps: int = 300
    decode_prompts: int = 8
    decode_tokens: int = 48
    rollout_prompts: int = 8
    objective_steps: int = 5

    @classmethod
    def dry(cls) -> Sizes:
        return cls(vocab=128, hidden=64, layers=2, draft_vocab=64, prompts=8, text_length=32,
                   batch=4, fit_steps=40, decode_prompts=2, decode_tokens=12, rollout_prompts=2,
                   objective_steps=2)  # fmt: skip


@dataclass
class Report:
    """The JSON the check writes: one entry per step, in order, rewritten after each step so a
    check killed at its time limit still leaves what it measured."""

    path: Path
    header: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[dict[str, Any]]:
        """Time one step; the body fills the yielded dict, raises `Skip` or fails."""
        entry: dict[str, Any] = {"name": name, "status": "ok"}
        tic = time.perf_counter()
        print(f"[gpu-check] {name} ...", flush=True)
        try:
            yield entry
        except Skip as skip:
            entry.update(status="skipped", reason=str(skip))
        except Exception as error:  # noqa: BLE001 - recorded, the check goes on
            entry.update(status="failed", error=f"{type(error).__name__}: {error}",
                         traceback=traceback.format_exc(limit=8))  # fmt: skip
        entry["seconds"] = round(time.perf_counter() - tic, 3)
        self.steps.append(entry)
        self.write()
        detail = entry.get("reason") or entry.get("error") or ""
        print(f"[gpu-check] {name}: {entry['status']} in {entry['seconds']} s {detail}",
              flush=True)  # fmt: skip

    def write(self) -> None:
        failed = [s["name"] for s in self.steps if s["status"] == "failed"]
        body = {**self.header, "steps": self.steps, "failed": failed, "passed": not failed}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1, default=str) + "\n")
        tmp.replace(self.path)


class Skip(Exception):
    """A step that cannot run here; its message says why."""


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, the device and which optional packages are missing (and what replaces them)."""
    from importlib import metadata

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in OPTIONAL:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info: dict[str, Any] = {"versions": versions, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    bf16_supported=torch.cuda.is_bf16_supported())  # fmt: skip
    else:
        info["reason_no_gpu"] = "torch.cuda.is_available() is False: CUDA steps run on CPU (dry)"
    notes = []
    if versions["mlflow"] is None:
        notes.append("mlflow absent: the fit steps log to CSV files (Lightning's CSVLogger)")
    if versions["triton"] is None:
        notes.append("triton absent: the kernel decoding steps are skipped")
    info["notes"] = notes
    return info


# ------------------------------------------------------------------------------- the pieces
def build_target(sizes: Sizes, device: torch.device, seed: int = 1) -> Any:
    """A tiny Llama built in code on CPU (so the weights are the same on every machine), made
    confident so its greedy text is learnable, then moved to `device`."""
    from lightning_spec.models.target import TargetModel
    from lightning_spec.models.tiny import tiny_config

    config = tiny_config("llama", vocab_size=sizes.vocab, hidden_size=sizes.hidden,
                         num_layers=sizes.layers, intermediate_size=2 * sizes.hidden,
                         max_positions=max(1024, 4 * sizes.text_length))  # fmt: skip
    target = TargetModel.from_config(config, seed=seed)
    with torch.no_grad():  # a confident head: the soft-label loss's floor (p's entropy) is low
        for name, parameter in target.model.named_parameters():
            if "norm" not in name:
                parameter.mul_(30.0 if "lm_head" in name else 3.0)
    target.model.to(device)
    return target


def build_drafter(target: Any, sizes: Sizes, token_counts: torch.Tensor) -> Any:
    from lightning_spec.models.drafters.eagle3 import Eagle3Drafter

    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=sizes.draft_vocab,
                                        token_counts=token_counts, seed=3)  # fmt: skip
    return drafter.to(target.device)


def random_prompts(count: int, vocab: int, seed: int, length: int = 8) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=generator).tolist()


def greedy_texts(target: Any, prompts: list[list[int]], length: int) -> torch.Tensor:
    """The target's own greedy continuations (the SFT data a regenerating user trains on)."""
    from lightning_spec.decoding.engine import autoregressive_generate

    rows = [p + autoregressive_generate(target, p, length - len(p), stop_on_eos=False)
            for p in prompts]  # fmt: skip
    return torch.tensor(rows)


class TextBatches:
    """A LightningDataModule over fixed token rows, shuffled, loss on everything after the
    prompt: the smallest data module `fit` runs (built lazily: lightning imports here)."""

    def __new__(cls, texts: torch.Tensor, batch: int, prompt: int = 8) -> Any:
        from lightning.pytorch import LightningDataModule
        from torch.utils.data import DataLoader

        class _Data(LightningDataModule):
            def train_dataloader(self) -> DataLoader:
                rows = []
                for ids in texts:
                    loss_mask = torch.ones_like(ids)
                    loss_mask[:prompt] = 0
                    rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                 "loss_mask": loss_mask})  # fmt: skip
                return DataLoader(rows, batch_size=batch, shuffle=True, drop_last=True,
                                  generator=torch.Generator().manual_seed(0))  # fmt: skip

            def eval_prompts(self, n: int) -> list[list[int]]:
                return [t[:prompt].tolist() for t in texts[:n]]

        return _Data()


def trainer(device: torch.device, precision: str, steps: int, out: Path, name: str,
            callbacks: list[Any] | None = None) -> Any:  # fmt: skip
    """The Trainer `fit` builds, minus what the image may lack: MLflow becomes a CSV logger."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    return Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                   precision=precision, max_steps=steps, max_epochs=10_000,
                   logger=CSVLogger(str(out), name=name), log_every_n_steps=10,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                   callbacks=callbacks or [])  # fmt: skip


def loss_recorder() -> Any:
    """A callback keeping every training step's loss and wall time (the step's throughput)."""
    from lightning.pytorch import Callback

    class _Losses(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.times: list[float] = []
            self.tokens: list[int] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:  # fmt: skip
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            if loss is not None:
                self.losses.append(float(loss.detach().float()))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            self.tokens.append(int(batch["loss_mask"].sum()))

    return _Losses()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def fit_step(entry: dict[str, Any], target: Any, texts: torch.Tensor, sizes: Sizes,
             precision: str, out: Path) -> Any:  # fmt: skip
    """Train a fresh EAGLE-3 drafter with SFT under `precision`; the loss must fall."""
    from lightning_spec.objectives.sft import SFT

    device = target.device
    counts = torch.bincount(texts.flatten(), minlength=sizes.vocab)
    drafter = build_drafter(target, sizes, counts)
    module = SFT.from_objects(target, drafter, ttt_steps=3, lr=1e-2, warmup_steps=5,
                              max_steps_for_schedule=sizes.fit_steps)  # fmt: skip
    losses = loss_recorder()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = trainer(device, precision, sizes.fit_steps, out, f"fit-{precision}", [losses])
    run.fit(module, datamodule=TextBatches(texts, sizes.batch))
    target.model.to(device)  # Lightning's teardown moved the module back to CPU
    drafter.to(device)
    tenth = max(1, len(losses.losses) // 10)
    first, last = _mean(losses.losses[:tenth]), _mean(losses.losses[-tenth:])
    warm = min(5, len(losses.times) - 2)
    seconds = losses.times[-1] - losses.times[warm] if warm >= 0 else float("nan")
    tokens = sum(losses.tokens[warm + 1 :])
    entry.update(precision=precision, steps=run.global_step, loss_first_tenth=round(first, 4),
                 loss_last_tenth=round(last, 4), loss_fell=bool(last < 0.9 * first),
                 step_seconds=round(seconds / max(1, len(losses.times) - warm - 1), 5),
                 tokens_per_second=round(tokens / seconds, 1) if seconds > 0 else None)  # fmt: skip
    if device.type == "cuda":
        entry["peak_gpu_memory_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    else:
        entry["peak_gpu_memory_mib"] = None
        entry["peak_gpu_memory_reason"] = "no GPU: measured on CUDA only"
    if run.global_step != sizes.fit_steps:
        raise RuntimeError(f"fit stopped at step {run.global_step} of {sizes.fit_steps}")
    if not entry["loss_fell"]:
        raise RuntimeError(f"the loss did not fall: {first:.4f} -> {last:.4f}")
    return drafter.eval()


@contextlib.contextmanager
def kernels_on_every_forward() -> Iterator[None]:
    """On a GPU the fast path sends short caches to SDPA; threshold 0 keeps every tree forward
    on the Triton kernel, so the check tests the kernel and not the dispatch around it."""
    from lightning_spec.models import target as target_module

    saved = target_module.KERNEL_MIN_CACHE_ON_GPU
    target_module.KERNEL_MIN_CACHE_ON_GPU = 0
    try:
        yield
    finally:
        target_module.KERNEL_MIN_CACHE_ON_GPU = saved


def lossless_step(entry: dict[str, Any], target: Any, drafter: Any, prompts: list[list[int]],
                  sizes: Sizes, *, use_kernels: bool) -> None:  # fmt: skip
    """The decoder's greedy output against the target's own, chain and tree."""
    from lightning_spec.decoding.build import parse_tree_spec
    from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate

    if use_kernels:
        from lightning_spec.kernels import TRITON_AVAILABLE

        if not TRITON_AVAILABLE:
            raise Skip("triton is not importable here")
        target = copy.deepcopy(target)  # the kernels switch the model's attention for good
    expected = [autoregressive_generate(target, p, sizes.decode_tokens, stop_on_eos=False)
                for p in prompts]  # fmt: skip
    runs = {}
    with kernels_on_every_forward() if use_kernels else contextlib.nullcontext():
        for spec in ("chain:4", "dynamic:3,3,8"):
            decoder = SpeculativeDecoder(target, drafter, parse_tree_spec(spec),
                                         use_kernels=use_kernels)  # fmt: skip
            tic = time.perf_counter()
            results = [decoder.generate(p, sizes.decode_tokens, stop_on_eos=False)
                       for p in prompts]  # fmt: skip
            seconds = time.perf_counter() - tic
            mismatches = sum(r.tokens != e for r, e in zip(results, expected, strict=True))
            tokens = sum(len(r.tokens) for r in results)
            runs[spec] = {"mismatches": mismatches, "prompts": len(prompts),
                          "tau": round(_mean([r.tau for r in results]), 3),
                          "tokens_per_second": round(tokens / seconds, 1)}  # fmt: skip
    entry.update(use_kernels=use_kernels, runs=runs)
    bad = {spec: run["mismatches"] for spec, run in runs.items() if run["mismatches"]}
    if bad:
        raise RuntimeError(f"greedy output differs from the target's own: {bad}")


def rollout_steps(entry: dict[str, Any], target: Any, drafter: Any, texts: torch.Tensor,
                  sizes: Sizes, out: Path, objective: str) -> None:  # fmt: skip
    """A few training steps of an on-policy objective on `target`'s device: Draft-OPD on
    rollouts the decoder drafted (the data module's on-policy path), GTO drafting its own trees
    inside the step."""
    from torch.utils.data import DataLoader

    device = target.device
    drafter = copy.deepcopy(drafter).train()
    before = drafter.fc.weight.detach().clone()
    losses = loss_recorder()
    if objective == "draft_opd":
        from lightning.pytorch import LightningDataModule

        from lightning_spec.data.on_policy import OnPolicyBuffer, OnPolicyTable
        from lightning_spec.data.tables import collate_records
        from lightning_spec.decoding.source import DecoderRolloutSource
        from lightning_spec.objectives.draft_opd import DraftOPD

        prompts = [t[:8].tolist() for t in texts[: sizes.rollout_prompts]]
        source = DecoderRolloutSource(target, tree="dynamic:3,3,8",
                                      max_new_tokens=sizes.decode_tokens)  # fmt: skip
        generations = source.generate(drafter, prompts, version="check")
        buffer = OnPolicyBuffer(len(prompts))
        buffer.replace(generations, version="check", step=0, max_length=4 * sizes.text_length)
        table = OnPolicyTable(buffer)
        entry.update(rollout_tau=round(_mean([g.tau for g in generations]), 3),
                     rollout_throughput=source.last_throughput)  # fmt: skip

        class _Rollouts(LightningDataModule):
            def train_dataloader(self) -> DataLoader:
                return DataLoader(table, batch_size=len(prompts), collate_fn=collate_records)

        module = DraftOPD.from_objects(target, drafter, lr=1e-3, warmup_steps=1, ttt_steps=2,
                                       max_steps_for_schedule=sizes.objective_steps)  # fmt: skip
        data = _Rollouts()
    elif objective == "gto":
        from lightning_spec.objectives.gto import GTO

        module = GTO.from_objects(target, drafter, tree="dynamic:3,3,8", group_size=4, groups=2,
                                  ttt_steps=2, lr=1e-3, warmup_steps=1,
                                  max_steps_for_schedule=sizes.objective_steps)  # fmt: skip
        data = TextBatches(texts[: 2 * sizes.batch], min(sizes.batch, 4))
    else:
        raise ValueError(f"unknown objective {objective!r}")
    run = trainer(device, "32-true", sizes.objective_steps, out, objective, [losses])
    run.fit(module, datamodule=data)
    target.model.to(device)
    moved = float((drafter.fc.weight.detach().cpu() - before.cpu()).abs().max())
    entry.update(objective=objective, steps=run.global_step,
                 losses=[round(v, 5) for v in losses.losses], drafter_moved=moved)  # fmt: skip
    if run.global_step != sizes.objective_steps:
        raise RuntimeError(f"stopped at step {run.global_step} of {sizes.objective_steps}")
    if not all(v == v and abs(v) != float("inf") for v in losses.losses):
        raise RuntimeError(f"non-finite losses: {losses.losses}")
    if moved == 0.0:
        raise RuntimeError("the drafter did not change")


def onnx_step(entry: dict[str, Any], target: Any, drafter: Any, prompts: list[list[int]],
              sizes: Sizes, folder: Path) -> None:  # fmt: skip
    """Export the GPU-trained drafter, then onnxruntime on CPU against PyTorch on CPU: random
    step inputs at several sizes, and whole greedy decodes step by step."""
    for module in ("onnx", "onnxruntime", "onnxscript"):
        if not _has(module):
            raise Skip(f"{module} is not installed here")
    from lightning_spec.export import parity
    from lightning_spec.export.onnx import export_drafter
    from lightning_spec.export.verify_graph import VERIFY_FILE, export_verify_graph

    cpu_target = copy.deepcopy(target)
    cpu_target.model.to("cpu")
    cpu_drafter = copy.deepcopy(drafter).to("cpu").eval()
    cpu_drafter.save_pretrained(folder / parity.DRAFTER_FOLDER)
    export_drafter(cpu_drafter, folder)
    export_verify_graph(folder / VERIFY_FILE, max_nodes=64)
    steps = parity.step_parity(cpu_drafter, folder)
    onnx_drafter = parity.OnnxEagle3Drafter.from_export_dir(folder)
    verifier = parity.OnnxTreeVerifier.from_export_dir(folder)
    decodes = parity.decode_parity(cpu_target, cpu_drafter, onnx_drafter, verifier, prompts,
                                   policies=("chain:4", "dynamic:3,3,8"),
                                   max_new_tokens=sizes.decode_tokens)  # fmt: skip
    entry.update(step_max_abs_diff=steps["max_abs_diff"],
                 step_argmax_agreement=steps["argmax_agreement"],
                 step_parity_passed=parity.parity_passed(steps),
                 decode_tokens_equal=decodes["tokens_equal"],
                 decode_trees_equal=decodes["trees_equal"],
                 graphs=sorted(p.name for p in folder.glob("*.onnx")))  # fmt: skip
    if not (entry["step_parity_passed"] and decodes["tokens_equal"] and decodes["trees_equal"]):
        raise RuntimeError("onnxruntime disagrees with PyTorch (see the step's figures)")


# ------------------------------------------------------------------------------------ driver
def run_check(out: Path, *, dry: bool, device: str | None = None,
              sizes: Sizes | None = None) -> dict[str, Any]:  # fmt: skip
    """Run every step; returns (and writes to `out`) the report."""
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() and not dry else "cpu"))
    sizes = sizes or (Sizes.dry() if dry or chosen.type == "cpu" else Sizes())
    torch.manual_seed(0)
    header = {"check": "gpu_check", "dry": dry, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "sizes": sizes.__dict__, "argv": sys.argv[1:]}  # fmt: skip
    report = Report(out, header)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    state: dict[str, Any] = {}

    def guarded(name: str, body: Callable[[dict[str, Any]], None], needs: tuple[str, ...] = ()):
        with report.step(name) as entry:
            missing = [n for n in needs if n not in state]
            if missing:
                raise Skip(f"needs {', '.join(missing)}, which an earlier step did not make")
            body(entry)

    with report.step("environment") as entry:
        entry.update(environment(chosen))
        header.update(device=entry["device"], gpu=entry.get("gpu"))

    def make_data(entry: dict[str, Any]) -> None:
        if not _has("lightning"):
            raise Skip("lightning is not installed (carry it in the wheelhouse)")
        target = build_target(sizes, chosen)
        prompts = random_prompts(sizes.prompts, sizes.vocab, seed=0)
        tic = time.perf_counter()
        state["texts"] = greedy_texts(target, prompts, sizes.text_length)
        state["target"] = target
        entry.update(rows=len(prompts), tokens_per_row=sizes.text_length,
                     greedy_seconds=round(time.perf_counter() - tic, 2),
                     target_parameters=sum(p.numel() for p in target.model.parameters()))  # fmt: skip

    guarded("greedy_data", make_data)
    for precision in ("bf16-mixed", "32-true"):

        def fit(entry: dict[str, Any], precision: str = precision) -> None:
            drafter = fit_step(entry, state["target"], state["texts"], sizes, precision,
                               work / "logs")  # fmt: skip
            if precision == "32-true":
                state["drafter"] = drafter

        guarded(f"fit_{precision}", fit, ("target", "texts"))
    # the prompts of training texts (drafts get accepted: the check has teeth) and unseen ones
    held_out = random_prompts(sizes.decode_prompts, sizes.vocab, seed=99)
    if "texts" in state:
        held_out = [t[:8].tolist() for t in state["texts"][: sizes.decode_prompts]] + held_out
    for use_kernels in (False, True):
        guarded("lossless_kernels" if use_kernels else "lossless",
                lambda e, k=use_kernels: lossless_step(e, state["target"], state["drafter"],
                                                       held_out, sizes, use_kernels=k),
                ("target", "drafter"))  # fmt: skip
    for objective in ("draft_opd", "gto"):
        guarded(f"rollouts_{objective}",
                lambda e, o=objective: rollout_steps(e, state["target"], state["drafter"],
                                                     state["texts"], sizes, work / "logs", o),
                ("target", "drafter", "texts"))  # fmt: skip
    guarded("onnx_export", lambda e: onnx_step(e, state["target"], state["drafter"],
                                               held_out[:2], sizes, work / "onnx"),
            ("target", "drafter"))  # fmt: skip
    report.write()
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-spec bench gpu-check",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--out", default="gpu_check.json", help="the report (JSON)")
    parser.add_argument("--dry", action="store_true",
                        help="CPU, small sizes: what the default test suite runs")  # fmt: skip
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda "
                        "when available and not --dry)")  # fmt: skip
    args = parser.parse_args(argv)
    result = run_check(Path(args.out), dry=args.dry, device=args.device)
    for step in result["steps"]:
        print(f"{step['name']:<22} {step['status']:<8} {step['seconds']:>8.2f} s")
    print(
        f"report: {args.out} ({'passed' if result['passed'] else 'FAILED: ' + ', '.join(result['failed'])})"
    )
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
