"""SFT: TTT == the decoder's chain, a two-step CPU smoke run read back from a real SQLite
MLflow store, checkpoints without the target, non-finite steps skipped, draft-vocab counting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer
from torch.utils.data import DataLoader

from lightning_spec.callbacks.acceptance import AcceptanceEval
from lightning_spec.callbacks.checkpoint import STATE_FILE, DrafterCheckpoint
from lightning_spec.callbacks.plots import AcceptancePlot
from lightning_spec.decoding.tree import DraftTree, TreeBatch
from lightning_spec.models.drafters.base import load_drafter
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.objectives import sft
from lightning_spec.objectives.sft import SFT, WarmupCosine
from lightning_spec.objectives.ttt import (
    cached_ttt_labels,
    ttt_attention_mask,
    ttt_loss_masks,
    ttt_unroll,
)
from lightning_spec.tracking import default_tracking_uri, make_mlflow_logger
from tests.conftest import quiet_trainer

VOCAB = 128


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=4), seed=1)


def _drafter(target: TargetModel, noise: float = 0.0, kind: str = "eagle3") -> Eagle3Drafter:
    from lightning_spec.models.drafters.hydra import HydraDrafter

    cls = HydraDrafter if kind == "hydra" else Eagle3Drafter
    drafter = cls.from_target(
        target, draft_vocab_size=48, token_counts=torch.arange(VOCAB), intermediate_size=64
    )
    if noise:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for parameter in drafter.parameters():
                parameter.add_(noise * torch.randn(parameter.shape, generator=generator))
    return drafter


def _batch(length: int = 16, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (2, length), generator=generator)
    attention_mask = torch.ones(2, length, dtype=torch.long)
    attention_mask[1, length - 4 :] = 0  # right padding
    input_ids[1, length - 4 :] = 0
    loss_mask = torch.zeros(2, length, dtype=torch.long)
    loss_mask[:, length // 3 :] = 1
    loss_mask *= attention_mask
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "source": ["a", "b"],
    }


class TinyData(LightningDataModule):
    """The same batch twice per epoch (so a working step lowers the next loss), one val batch."""

    def __init__(self, batch: dict, prompts: list[list[int]] | None = None) -> None:
        super().__init__()
        self.batch = batch
        self.prompts = prompts or [[5, 9, 14, 3, 22], [40, 41, 42]]

    def train_dataloader(self) -> DataLoader:
        return DataLoader([self.batch, self.batch], batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader([self.batch], batch_size=None)

    def eval_prompts(self, n: int) -> list[list[int]]:
        return self.prompts[:n]


# ------------------------------------------------------------------------------------------ TTT


def test_ttt_mask_pattern_by_hand() -> None:
    mask = ttt_attention_mask(4, 2)[0].int()
    # block 0: entry i sees committed entries <= i - 2; block 1: entry i - 1; block 2: itself.
    expected = torch.tensor(
        [
            [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
            [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
            [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
            [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1],
        ]
    )
    assert torch.equal(mask, expected)
    assert torch.equal(ttt_attention_mask(3, 0)[0], torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.parametrize("kind", ["eagle3", "hydra"])
def test_ttt_step_k_equals_decoder_chain_at_depth_k(target: TargetModel, kind: str) -> None:
    """Step k at position j must be the decoder's depth-k node of a chain rooted at j - k
    (for Hydra: head k, the head the decoder uses at depth k)."""
    drafter = _drafter(target, noise=0.05, kind=kind).eval()
    batch = _batch(length=10)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    features = target(ids, attention_mask=attention, use_cache=False).features
    steps = 4
    with torch.no_grad():
        outputs = ttt_unroll(drafter, input_ids=ids, features=features, steps=steps)
    worst, compared = 0.0, 0
    for b in range(2):
        real = int(attention[b].sum())
        for k in range(steps):
            for j in range(k + 1, real):
                root = j - k
                state = drafter.new_state(1)
                with torch.no_grad():
                    # The decoder absorbs committed x_1 .. x_R with true features f_0 .. f_{R-1}.
                    absorbed = drafter.step(
                        state,
                        ids[b : b + 1, 1 : root + 1],
                        torch.arange(1, root + 1).unsqueeze(0),
                        features=features[b : b + 1, :root],
                    )
                    logprobs = torch.log_softmax(absorbed.logits[0, -1], -1)
                    hidden = absorbed.hidden[0, -1]
                    if k > 0:  # ... then expands a chain of k ground-truth tokens.
                        proposer = drafter.proposer(
                            state,
                            absorbed.logits[0, -1:],
                            absorbed.hidden[0, -1:],
                            torch.tensor([root]),
                        )
                        chain = TreeBatch.stack(
                            [
                                DraftTree(
                                    tokens=ids[b, root + 1 : root + k + 1].clone(),
                                    parents=torch.arange(-1, k - 1),
                                    logprobs=torch.zeros(k),
                                )
                            ]
                        )
                        for node in range(k):
                            rows = proposer.expand(chain, torch.tensor([[node]]))
                        logprobs = rows[0, 0]
                        hidden = proposer.hidden[0, k - 1]
                    else:
                        logprobs = drafter.to_target(logprobs)
                ttt = drafter.to_target(torch.log_softmax(outputs[k].logits[b, j - 1], -1))
                finite = torch.isfinite(ttt)
                assert torch.equal(finite, torch.isfinite(logprobs))
                worst = max(worst, (ttt[finite] - logprobs[finite]).abs().max().item())
                worst = max(worst, (outputs[k].hidden[b, j - 1] - hidden).abs().max().item())
                compared += 1
    assert compared == sum(r - 1 - k for r in (10, 6) for k in range(steps) if r - 1 - k > 0)
    assert worst < 1e-5, f"TTT differs from the decoder by {worst}"


def test_loss_masks_shift_and_drop_rootless_entries() -> None:
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    masks = ttt_loss_masks(loss_mask, steps=3)
    # entry i (position i + 1) predicts token i + 2; step k needs i >= k.
    assert masks[0, 0].tolist() == [1, 1, 1, 0, 0]
    assert masks[1, 0].tolist() == [0, 1, 1, 0, 0]
    assert masks[2, 0].tolist() == [0, 0, 1, 0, 0]


def test_cached_features_give_the_online_loss(target: TargetModel) -> None:
    module = SFT.from_objects(target, _drafter(target), ttt_steps=2)
    batch = _batch()
    online = module._common_step(batch)
    output = target(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    cached = module._common_step(
        {**batch, "features": output.features, "last_hidden": output.last_hidden}
    )
    torch.testing.assert_close(cached.loss, online.loss)
    torch.testing.assert_close(cached.step_accuracy, online.step_accuracy)
    assert online.tokens == int(ttt_loss_masks(batch["loss_mask"], steps=1).sum())
    # with the cached argmax too, the labels skip the full-vocabulary head: same loss
    argmax = {**batch, "features": output.features, "last_hidden": output.last_hidden}
    argmax["target_argmax"] = output.logits.argmax(-1)
    fast = module._common_step(argmax)
    torch.testing.assert_close(fast.loss, online.loss)
    torch.testing.assert_close(fast.step_accuracy, online.step_accuracy)


def test_cached_labels_by_hand() -> None:
    """Draft vocabulary = target ids (0, 2): labels are the softmax of those two head rows."""
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))

    class Draft:
        target_vocab_size = 3
        draft_vocab_size = 2
        d2t = torch.tensor([0, 1])  # draft id d -> target id d + d2t[d]: 0 -> 0, 1 -> 2

    hidden = torch.tensor([[[9.0, 9.0], [2.0, 0.0], [0.0, 0.0]]])
    probs, argmax = cached_ttt_labels(
        Draft(), head=head, last_hidden=hidden, target_argmax=torch.tensor([[5, 1, 2]])
    )
    # rows 1 and 2 of the sequence: logits over target ids (0, 2) = (2, 2) and (0, 0)
    torch.testing.assert_close(probs, torch.full((1, 2, 2), 0.5))
    assert argmax.tolist() == [[1, 2]]


def test_warmup_cosine_by_hand() -> None:
    schedule = WarmupCosine(warmup=2, total=12, floor=0.1)
    assert [schedule(s) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert schedule(7) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert schedule(12) == pytest.approx(0.1) and schedule(50) == pytest.approx(0.1)
    assert WarmupCosine(warmup=2, total=float("inf"))(100) == 1.0


def test_mismatched_drafter_is_rejected(target: TargetModel) -> None:
    other = TargetModel.from_config(tiny_config("llama", vocab_size=96, num_layers=4), seed=2)
    with pytest.raises(ValueError, match="another tokenizer"):
        SFT.from_objects(target, Eagle3Drafter.from_target(other))


# ------------------------------------------------------------------------------------ smoke run


class _TargetModeProbe(Callback):
    def __init__(self) -> None:
        self.modes: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.modes.append(any(m.training for m in pl_module.target.modules()))


def test_two_step_smoke_run_logs_to_sqlite_mlflow(
    target: TargetModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # anything written relative to the cwd would show up here
    run_dir = tmp_path / "runs" / "smoke"
    drafter = _drafter(target)
    embedding_before = target.input_embeddings().weight.clone()
    module = SFT.from_objects(
        target, drafter, ttt_steps=3, lr=2e-3, warmup_steps=1, max_steps_for_schedule=10
    )
    probe = _TargetModeProbe()
    logger = make_mlflow_logger("sft-smoke", run_dir)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        max_epochs=1,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(run_dir),
        logger=logger,
        callbacks=[
            AcceptanceEval(num_prompts=2, max_new_tokens=8, tree="chain:3"),
            DrafterCheckpoint(),
            AcceptancePlot(),
            probe,
        ],
    )
    trainer.fit(module, datamodule=TinyData(_batch()))
    assert trainer.global_step == 2
    assert probe.modes == [False, False]  # the frozen target never goes to train mode
    # the shared embeddings stay the target's, unchanged, and out of the drafter's parameters
    assert module.drafter._embedding.data_ptr() == target.input_embeddings().weight.data_ptr()
    torch.testing.assert_close(target.input_embeddings().weight, embedding_before)

    # Drafter folders: best/ and last/ with weights, config and the training state.
    folder = run_dir / "drafter"
    for name in ("best", "last"):
        files = sorted(p.name for p in (folder / name).iterdir())
        assert files == ["config.json", "model.safetensors", STATE_FILE]
        state = json.loads((folder / name / STATE_FILE).read_text())
        assert state["global_step"] == 2 and state["monitor"] == "val/tau"
    assert not list(folder.glob(".tmp-*"))
    reloaded = load_drafter(folder / "best")
    torch.testing.assert_close(reloaded.fc.weight, module.drafter.fc.weight)

    # Everything read back from the SQLite store.
    uri = default_tracking_uri(run_dir)
    assert uri == f"sqlite:///{tmp_path}/runs/mlflow.db" and uri.startswith("sqlite:////")
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(logger.run_id)
    assert run.data.params["ttt_steps"] == "3" and run.data.params["lr"] == "0.002"
    keys = set(run.data.metrics)
    expected = {"train/loss", "train/lr", "train/tokens", "train/skipped_nonfinite"}
    expected |= {f"train/{m}_{k}" for m in ("loss", "acc") for k in range(3)}
    expected |= {"val/loss", "val/acc_0", "val/tau", "val/tokens_per_step"}
    expected |= {f"val/alpha_{d}" for d in (1, 2, 3)}
    assert expected <= keys, expected - keys
    losses = [
        m.value
        for m in sorted(
            client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step
        )
    ]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    assert 1.0 <= run.data.metrics["val/tau"] <= 4.0
    plots = [a.path for a in client.list_artifacts(run.info.run_id, "plots")]
    assert plots == ["plots/acceptance.png"]
    drafter_files = sorted(a.path for a in client.list_artifacts(run.info.run_id, "drafter"))
    assert drafter_files == [
        "drafter/config.json",
        "drafter/model.safetensors",
        f"drafter/{STATE_FILE}",
    ]
    artifact_root = tmp_path / "runs" / "mlartifacts" / "sft-smoke"
    assert run.info.artifact_uri.startswith(artifact_root.as_uri())
    assert (artifact_root / run.info.run_id / "artifacts" / "plots" / "acceptance.png").is_file()
    assert not (tmp_path / "mlruns").exists()

    # Lightning checkpoints leave the frozen target out and load back strictly.
    trainer.save_checkpoint(tmp_path / "sft.ckpt")
    checkpoint = torch.load(tmp_path / "sft.ckpt", weights_only=False)
    assert not [k for k in checkpoint["state_dict"] if k.startswith("target.")]
    assert "drafter.fc.weight" in checkpoint["state_dict"]
    fresh = SFT.from_objects(target, _drafter(target, noise=0.1), ttt_steps=3)
    fresh.on_load_checkpoint(checkpoint)
    fresh.load_state_dict(checkpoint["state_dict"], strict=True)
    torch.testing.assert_close(fresh.drafter.fc.weight, module.drafter.fc.weight)
    assert fresh._tokens_seen == module._tokens_seen > 0


def test_nonfinite_steps_are_skipped_then_fatal(target: TargetModel) -> None:
    batch = _batch()
    output = target(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    poisoned = {
        **batch,
        "features": torch.full_like(output.features, float("nan")),
        "last_hidden": output.last_hidden,
    }

    def fit(limit: int) -> SFT:
        module = SFT.from_objects(
            target, _drafter(target), ttt_steps=2, max_consecutive_nonfinite=limit, warmup_steps=1
        )
        trainer = quiet_trainer()
        before = {k: v.clone() for k, v in module.drafter.state_dict().items()}
        trainer.fit(module, datamodule=TinyData(poisoned))
        for key, value in module.drafter.state_dict().items():
            torch.testing.assert_close(value, before[key], msg=f"{key} changed on a skipped step")
        assert float(trainer.callback_metrics["train/skipped_nonfinite"]) == 2.0
        return module

    assert fit(limit=5)._nonfinite_total == 2
    with pytest.raises(FloatingPointError, match="2 consecutive.*target features of the last"):
        fit(limit=2)


def test_nonfinite_message_says_when_the_inputs_were_finite(target: TargetModel) -> None:
    module = SFT.from_objects(target, _drafter(target), ttt_steps=2)
    module._common_step(_batch())
    assert "features and labels were finite" in module.describe_nonfinite()


# ------------------------------------------------------------------------------- draft vocabulary


def test_draft_token_counts_from_assistant_turns(
    target: TargetModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "</s>", "<|user|>", "<|assistant|>", "hello", "good", "answer"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", unk_token="[UNK]", pad_token="[PAD]"
    )
    data = tmp_path / "chats.jsonl"
    chat = {
        "messages": [
            {"role": "user", "content": "hello hello"},
            {"role": "assistant", "content": "good answer good"},
        ]
    }
    data.write_text("\n".join(json.dumps(chat) for _ in range(3)) + "\n")
    monkeypatch.setattr(target, "tokenizer", tokenizer)
    counts = sft.draft_token_counts(target, source=str(data), conversations=2, cache_dir=tmp_path)
    assert counts.shape == (VOCAB,)
    # Two conversations, assistant tokens only: good x2, answer x1, </s> x1 each.
    assert {i: int(c) for i, c in enumerate(counts.tolist()) if c} == {2: 2, 6: 4, 7: 2}
    cached = list((tmp_path / "vocab").glob("*.pt"))
    assert len(cached) == 1

    def no_reading(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("counts should come from the cache")

    monkeypatch.setattr("lightning_spec.data.sources.load_source", no_reading)
    again = sft.draft_token_counts(target, source=str(data), conversations=2, cache_dir=tmp_path)
    assert torch.equal(again, counts)


# ------------------------------------------------------------------------------------ two ranks


class SpawnSafeSFT(SFT):
    """SFT that re-registers the target's output recorders in a spawned process.

    transformers 5.24 records which outputs a model class can capture in a registry filled by
    the model's __init__; a model unpickled in a fresh process (ddp_spawn) is not in it and
    returns no hidden states. The fix belongs in TargetModel (a __setstate__ doing this).
    """

    def setup(self, stage: str) -> None:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

        for module in self.target.modules():
            if isinstance(module, PreTrainedModel):
                _CAN_RECORD_REGISTRY[module] = module._can_record_outputs


@pytest.mark.slow
def test_ddp_spawn_two_ranks_agree_with_one_process(
    target: TargetModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two CPU ranks (gloo): training runs, prompts are sharded, and the summed acceptance
    metrics equal one process decoding every prompt with the same drafter."""
    # ddp_spawn pickles the module with torch's reductions, which pass one file descriptor per
    # tensor storage it meets; after earlier tests in this module the shared target's storages
    # are reached through more than one tensor object and the same descriptor is listed twice,
    # which CPython's spawnv_passfds rejects ("bad value(s) in fds_to_keep"). The file_system
    # strategy shares storages by name, not by descriptor. (`strategy="ddp"`, Lightning's
    # default for devices > 1 from the command line, starts processes without pickling.)
    import torch.multiprocessing as torch_mp

    monkeypatch.setattr(torch_mp, "_sharing_strategy", torch_mp.get_sharing_strategy())
    torch_mp.set_sharing_strategy("file_system")
    prompts = [[5, 9, 14, 3, 22], [40, 41, 42], [7, 8, 9, 10]]  # 2 + 1 over two ranks
    module = SpawnSafeSFT.from_objects(target, _drafter(target), ttt_steps=2, warmup_steps=1)
    evaluator = AcceptanceEval(num_prompts=3, max_new_tokens=6, tree="chain:2")
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=2,
        max_epochs=1,
        logger=False,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        callbacks=[evaluator],
    )
    batch = _batch()
    trainer.fit(module, datamodule=TinyData(batch, prompts=prompts))
    # Each rank gets one of the two batches (one step); train/tokens sums both ranks.
    per_batch = int(ttt_loss_masks(batch["loss_mask"], steps=1).sum())
    assert float(trainer.callback_metrics["train/tokens"]) == 2 * per_batch
    # ddp_spawn hands rank 0's weights and logged metrics back to this process.
    single = AcceptanceEval(num_prompts=3, max_new_tokens=6, tree="chain:2")
    result = single.evaluate(module, prompts)
    assert float(trainer.callback_metrics["val/tau"]) == pytest.approx(
        float(result["tau"].compute())
    )
    alphas = result["alpha"].compute().tolist()
    for depth, value in enumerate(alphas, start=1):
        logged = float(trainer.callback_metrics[f"val/alpha_{depth}"])
        assert logged == pytest.approx(value, nan_ok=True)
    tokens_per_step = result["new_tokens"] / result["forwards"]
    assert float(trainer.callback_metrics["val/tokens_per_step"]) == pytest.approx(tokens_per_step)


def test_prepacked_target_and_bf16_autocast_keep_the_targets_fp32_features() -> None:
    """`prepack_target` gives the unpacked target's loss to fp32 noise; under the trainer's
    bf16 autocast (precision bf16-mixed, for the drafter's step) the frozen target still
    computes its features in fp32, equal to those computed without autocast."""
    from lightning_spec.models.packed import is_prepacked, prepack_unavailable_reason

    plain_target = TargetModel.from_config(tiny_config("llama", num_layers=4), seed=1)
    reason = prepack_unavailable_reason(plain_target.model)
    if reason is not None:
        pytest.skip(f"prepacking cannot run here: {reason}")
    packed_target = TargetModel.from_config(tiny_config("llama", num_layers=4), seed=1)
    plain_drafter, packed_drafter = _drafter(plain_target), _drafter(packed_target)
    packed_drafter.load_state_dict(plain_drafter.state_dict())
    plain = SFT.from_objects(plain_target, plain_drafter, ttt_steps=2)
    packed = SFT.from_objects(packed_target, packed_drafter, ttt_steps=2, prepack_target=True)
    assert is_prepacked(packed_target.model) and not is_prepacked(plain_target.model)
    batch = _batch()
    torch.testing.assert_close(
        packed._common_step(batch).loss, plain._common_step(batch).loss, rtol=1e-5, atol=1e-5
    )
    reference_features, reference_last = plain._target_outputs(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features, last = plain._target_outputs(batch)
        drafter_loss = plain._common_step(batch).loss
    assert features.dtype == torch.float32 and last.dtype == torch.float32
    torch.testing.assert_close(features, reference_features)
    torch.testing.assert_close(last, reference_last)
    assert torch.isfinite(drafter_loss)


@pytest.mark.parametrize("objective", ["gto", "draft_opd"])
def test_gto_and_draft_opd_prepack_through_eagle_sft(objective: str) -> None:
    """The subclasses pass `prepack_target` to SFT (one prepacking path), and GTO's frozen
    reference drafter, copied after it, equals the trained one."""
    from lightning_spec.models.packed import is_prepacked, prepack_unavailable_reason
    from lightning_spec.objectives.draft_opd import DraftOPD
    from lightning_spec.objectives.gto import GTO

    target = TargetModel.from_config(tiny_config("llama", num_layers=4), seed=1)
    reason = prepack_unavailable_reason(target.model)
    if reason is not None:
        pytest.skip(f"prepacking cannot run here: {reason}")
    cls = GTO if objective == "gto" else DraftOPD
    module = cls.from_objects(target, _drafter(target), prepack_target=True)
    assert is_prepacked(target.model)
    if objective == "gto":
        for name, value in module.reference.state_dict().items():
            torch.testing.assert_close(value, module.drafter.state_dict()[name])
