"""`export --format gguf`: an EAGLE-3 folder as llama.cpp's ``eagle3`` GGUF, read back with
``gguf`` and run by a numpy forward written the way llama.cpp computes (adjacent-pair rotary,
the residual on the raw fused feature), which must give our drafter's logits."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from lightning_spec.cli import export as export_cli
from lightning_spec.export.gguf import GgufExportError, rope_permute, write_eagle3_gguf
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config

VOCAB, DRAFT_VOCAB, HIDDEN, LAYERS = 128, 40, 64, 6


def _target_gguf(path: Path, *, vocab: int = VOCAB, hidden: int = HIDDEN) -> Path:
    """A target GGUF with what the drafter's file takes from it: sizes and a tokenizer."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", LAYERS)
    writer.add_uint32("llama.embedding_length", hidden)
    writer.add_uint32("llama.vocab_size", vocab)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    writer.add_array("tokenizer.ggml.token_type", [1] * vocab)
    writer.add_array("tokenizer.ggml.merges", ["t 1", "t 2"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("gguf")
    target = TargetModel.from_config(tiny_config("llama", vocab_size=VOCAB), seed=3)
    counts = torch.arange(VOCAB).flip(0).float()  # frequent = low ids, then shuffled below
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=DRAFT_VOCAB, token_counts=counts)
    torch.manual_seed(0)
    with torch.no_grad():  # every weight distinct, so a wrong mapping cannot hide
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn_like(p))
        d2t = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values - torch.arange(DRAFT_VOCAB)
        drafter.d2t.copy_(d2t)
    drafter.save_pretrained(root / "drafter")
    gguf_target = _target_gguf(root / "target.gguf")
    out = write_eagle3_gguf(root / "drafter", gguf_target, root / "drafter.gguf")
    return {"root": root, "target": target, "drafter": drafter, "gguf": out, "target_gguf": gguf_target}


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}


def test_rope_permute_interleaves_the_halves_of_each_head() -> None:
    # two heads of dim 4: HF rows (x0, x1 | y0, y1) -> llama.cpp (x0, y0, x1, y1)
    weight = np.arange(8, dtype=np.float32)[:, None]
    assert rope_permute(weight, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_metadata_layout_and_tokenizer(setup: dict) -> None:
    reader = gguf.GGUFReader(str(setup["gguf"]))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    config = setup["drafter"].config
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == list(config["target_layer_ids"])
    assert fields["eagle3.target_hidden_size"] == HIDDEN
    assert fields["eagle3.block_count"] == 1
    assert fields["eagle3.attention.head_count"] == config["num_attention_heads"]
    assert fields["eagle3.attention.head_count_kv"] == config["num_key_value_heads"]
    assert fields["eagle3.vocab_size"] == VOCAB
    assert fields["eagle3.norm_before_residual"] is False
    assert fields["eagle3.rope.freq_base"] == pytest.approx(config["rope_theta"])
    target = gguf.GGUFReader(str(setup["target_gguf"]))
    for key, field in target.fields.items():
        if key.startswith("tokenizer."):
            assert fields[key] == field.contents(), key
    names = {t.name: (t.tensor_type.name, list(t.shape)) for t in reader.tensors}
    assert names["d2t"] == ("I64", [DRAFT_VOCAB])
    assert names["output.weight"] == ("F32", [HIDDEN, DRAFT_VOCAB])
    assert names["fc.weight"] == ("F32", [3 * HIDDEN, HIDDEN])
    assert "t2d" not in names and "token_embd.weight" not in names  # shared with the target
    tensors = _tensors(setup["gguf"])
    assert tensors["d2t"].tolist() == (setup["drafter"].d2t + torch.arange(DRAFT_VOCAB)).tolist()


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _rope_pairs(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """llama.cpp's NORM rotary: adjacent pairs (2i, 2i+1) rotate by pos * base^(-2i/d)."""
    dim = x.shape[-1]
    angle = positions[:, None] * base ** (-np.arange(0, dim, 2) / dim)  # [T, d/2]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]  # broadcast over heads
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def _llamacpp_forward(
    t: dict[str, np.ndarray], meta: dict, embeds: np.ndarray, features: np.ndarray
) -> np.ndarray:
    """The eagle3 decoder graph of llama.cpp (src/models/eagle3.cpp) in numpy, from the GGUF."""
    eps, base = meta["eps"], meta["base"]
    heads, kv_heads, head_dim = meta["heads"], meta["kv_heads"], meta["head_dim"]
    steps = embeds.shape[0]
    g = features @ t["fc.weight"].T
    x = np.concatenate(
        [_rms(embeds, t["blk.0.attn_norm.weight"], eps), _rms(g, t["blk.0.attn_norm_2.weight"], eps)], -1
    )
    positions = np.arange(steps, dtype=np.float64)
    q = _rope_pairs((x @ t["blk.0.attn_q.weight"].T).reshape(steps, heads, head_dim), positions, base)
    k = _rope_pairs((x @ t["blk.0.attn_k.weight"].T).reshape(steps, kv_heads, head_dim), positions, base)
    v = (x @ t["blk.0.attn_v.weight"].T).reshape(steps, kv_heads, head_dim)
    group = heads // kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim)
    scores = scores + np.triu(np.full((steps, steps), -np.inf), 1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attended = np.einsum("hts,shd->thd", weights, v).reshape(steps, heads * head_dim)
    hidden = attended @ t["blk.0.attn_output.weight"].T + g  # residual: the raw fused feature
    normed = _rms(hidden, t["blk.0.ffn_norm.weight"], eps)
    gate, up = normed @ t["blk.0.ffn_gate.weight"].T, normed @ t["blk.0.ffn_up.weight"].T
    hidden = hidden + (gate / (1 + np.exp(-gate)) * up) @ t["blk.0.ffn_down.weight"].T
    return _rms(hidden, t["output_norm.weight"], eps) @ t["output.weight"].T


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_llamacpp_forward_of_the_file_gives_our_logits(setup: dict, outtype: str) -> None:
    drafter: Eagle3Drafter = setup["drafter"]
    path = setup["gguf"]
    if outtype == "f16":
        path = write_eagle3_gguf(
            setup["root"] / "drafter", setup["target_gguf"], setup["root"] / "d16.gguf", outtype="f16"
        )
    tensors = {k: v.astype(np.float64) for k, v in _tensors(path).items() if k != "d2t"}
    config = drafter.config
    meta = {
        "eps": config["rms_norm_eps"], "base": config["rope_theta"], "heads": config["num_attention_heads"],
        "kv_heads": config["num_key_value_heads"], "head_dim": config["head_dim"],
    }
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, 5))
    features = torch.randn(1, 5, 3 * HIDDEN)
    with torch.no_grad():
        ours = drafter.step(
            drafter.new_state(), ids, torch.arange(5)[None], features=features
        ).logits[0].double().numpy()
    embeds = setup["target"].input_embeddings().weight.detach()[ids[0]].double().numpy()
    theirs = _llamacpp_forward(tensors, meta, embeds, features[0].double().numpy())
    tolerance = 1e-3 if outtype == "f32" else 5e-2
    np.testing.assert_allclose(theirs, ours, atol=tolerance * np.abs(ours).max(), rtol=0)
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()


def test_refuses_what_llamacpp_would_run_differently(setup: dict, tmp_path: Path) -> None:
    wrong_vocab = _target_gguf(tmp_path / "other.gguf", vocab=VOCAB * 2)
    with pytest.raises(GgufExportError, match="another target"):
        write_eagle3_gguf(setup["root"] / "drafter", wrong_vocab, tmp_path / "x.gguf")
    folder = tmp_path / "eagle31"
    folder.mkdir()
    config = json.loads((setup["root"] / "drafter" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "feature_norm": True}))
    (folder / "model.safetensors").write_bytes((setup["root"] / "drafter" / "model.safetensors").read_bytes())
    with pytest.raises(GgufExportError, match="norm_before_fc"):
        write_eagle3_gguf(folder, setup["target_gguf"], tmp_path / "x.gguf")
    with pytest.raises(GgufExportError, match="not a drafter folder"):
        write_eagle3_gguf(tmp_path / "missing", setup["target_gguf"], tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_cli_writes_the_file_and_a_manifest(setup: dict, tmp_path: Path, capsys) -> None:
    code = export_cli.main(
        [
            "--format", "gguf", "--drafter", str(setup["root"] / "drafter"),
            "--output", str(tmp_path / "out"), "--target-gguf", str(setup["target_gguf"]),
        ]
    )
    assert code == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["files"]["drafter"]["path"] == "drafter-f32.gguf"
    assert _tensors(tmp_path / "out" / "drafter-f32.gguf")["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    assert "drafter-f32.gguf" in capsys.readouterr().out
    code = export_cli.main(
        ["--format", "gguf", "--drafter", str(tmp_path / "nope"), "--output", str(tmp_path / "o2")]
    )
    assert code == 2
    assert "not a drafter folder" in capsys.readouterr().err
