"""EAGLE-3 drafter folders -> GGUF files that llama.cpp's ``draft-eagle3`` speculation loads.

llama.cpp (``--spec-type draft-eagle3``) reads an EAGLE-3 drafter as its own architecture,
``eagle3``: one decoder layer whose attention reads concat(norm(embedding), norm(feature)), a
fusion layer ``fc`` over three target layers, a draft-vocabulary LM head and ``d2t``. This
module writes that file with the ``gguf`` package, so an export needs no llama.cpp tree; its
layout is the one llama.cpp's own ``convert_hf_to_gguf.py`` writes for such a folder, which a
slow test checks tensor by tensor. What the layout needs from us:

* **Layer ids.** llama.cpp reads the *input* of target layer i (``eagle3.target_layers``);
  our ids index Hugging Face's ``hidden_states``, where i is also the input of layer i
  (0 = embeddings), so they carry over unchanged (`lightning_spec.models.layer_ids`).
* **Rotary layout.** llama.cpp rotates adjacent pairs, Hugging Face (and we) the two halves of
  each head: the q and k rows are permuted per head, as the converter does for Llama.
* **Draft vocabulary.** ``d2t`` becomes absolute target ids (ours stores offsets); ``t2d``
  is not used by llama.cpp and is dropped.
* **Embeddings and tokenizer.** The drafter shares the target's embeddings (llama.cpp takes
  them from the target context), and its vocabulary must be the target's token for token
  (llama.cpp refuses a drafter whose vocabulary differs): every ``tokenizer.*`` key is copied
  from the target's own GGUF, so the two files cannot disagree.

Only the plain EAGLE-3 form is exported: llama.cpp's ``norm_before_fc`` is one RMSNorm over
the whole concatenation, not our EAGLE-3.1 per-layer ``feature_norm``, so such a folder is
refused with that reason rather than exported wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_spec.io import atomic_path
from lightning_spec.models.drafters.base import drafter_type_of
from lightning_spec.models.layer_ids import feature_layers_of

__all__ = [
    "GGUF_ARCH",
    "GgufExportError",
    "TargetGguf",
    "read_target_gguf",
    "rope_permute",
    "write_eagle3_gguf",
]

GGUF_ARCH = "eagle3"
OUTTYPES = ("f32", "f16")


class GgufExportError(ValueError):
    """The drafter folder or the target GGUF cannot make a llama.cpp EAGLE-3 file."""


@dataclass(frozen=True)
class TargetGguf:
    """What the drafter's GGUF needs from its target's: sizes and the tokenizer keys."""

    path: Path
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    tokenizer: dict[str, tuple[Any, list[Any]]]  # key -> (value, [GGUFValueType, ...])


def _field_value(field: Any) -> Any:
    return field.contents()


def read_target_gguf(path: str | Path) -> TargetGguf:
    """Sizes and every ``tokenizer.*`` key of a target model's GGUF (any quantization)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise GgufExportError(f"target GGUF {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as error:
        raise GgufExportError(f"{path} is not a readable GGUF file: {error}") from error
    fields = reader.fields
    if "general.architecture" not in fields:
        raise GgufExportError(f"{path} names no general.architecture")
    arch = _field_value(fields["general.architecture"])

    def number(key: str) -> int | None:
        field = fields.get(f"{arch}.{key}")
        return None if field is None else int(_field_value(field))

    tokenizer = {
        key: (_field_value(field), list(field.types))
        for key, field in fields.items()
        if key.startswith("tokenizer.")
    }
    if "tokenizer.ggml.tokens" not in tokenizer:
        raise GgufExportError(f"{path} carries no tokenizer (tokenizer.ggml.tokens is missing)")
    vocab = number("vocab_size") or len(tokenizer["tokenizer.ggml.tokens"][0])
    hidden, layers = number("embedding_length"), number("block_count")
    if hidden is None or layers is None:
        raise GgufExportError(f"{path}: {arch}.embedding_length or {arch}.block_count is missing")
    return TargetGguf(path, arch, vocab, hidden, layers, tokenizer)


def rope_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of a q or k projection from Hugging Face's half-split rotary layout to llama.cpp's
    adjacent-pair layout: within each head, row (half h, index i) moves to 2 i + h."""
    rows = weight.shape[0]
    head = rows // num_heads
    return (
        weight.reshape(num_heads, 2, head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _load_folder(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise GgufExportError(f"{folder} is not a drafter folder (config.json and model.safetensors)")
    config = json.loads(config_path.read_text())
    kind = drafter_type_of(config)
    if kind != "eagle3":
        raise GgufExportError(
            f"{folder} holds a {kind!r} drafter; llama.cpp's draft-eagle3 runs EAGLE-3 drafters "
            "(see docs for DFlash)"
        )
    if config.get("feature_norm"):
        raise GgufExportError(
            f"{folder} is an EAGLE-3.1 drafter (per-layer feature norms before fc); llama.cpp "
            "has only one norm over the whole concatenation (norm_before_fc), so it would run "
            "another model: train with feature_norm: false to deploy on llama.cpp"
        )
    return config, load_file(str(weights_path))


def _check_against_target(config: Mapping[str, Any], target: TargetGguf, layers: list[int]) -> None:
    vocab = int(config.get("target_vocab_size") or config.get("vocab_size"))
    if vocab != target.vocab_size:
        raise GgufExportError(
            f"the drafter maps onto a vocabulary of {vocab} tokens, {target.path.name} has "
            f"{target.vocab_size}: another target"
        )
    width = int(config.get("target_hidden_size", config["hidden_size"]))
    if width != target.hidden_size:
        raise GgufExportError(
            f"the drafter reads target features of width {width}, {target.path.name} has "
            f"hidden size {target.hidden_size}: another target"
        )
    if len(layers) != 3:
        raise GgufExportError(f"llama.cpp's EAGLE-3 reads exactly 3 target layers, not {layers}")
    if max(layers) > target.num_layers or min(layers) < 0:
        raise GgufExportError(
            f"feature layers {layers} do not exist in a {target.num_layers}-layer target"
        )


_TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}
_DROPPED = {"t2d", "embed_tokens.weight"}  # unused by llama.cpp / shared with the target


def _gguf_tensors(
    config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], outtype: str, target_vocab: int
) -> dict[str, np.ndarray]:
    unknown = set(tensors) - set(_TENSOR_NAMES) - _DROPPED - {"d2t"}
    if unknown:
        raise GgufExportError(f"tensors llama.cpp's EAGLE-3 has no place for: {sorted(unknown)}")
    missing = set(_TENSOR_NAMES) - set(tensors)
    if missing:
        raise GgufExportError(f"the drafter folder lacks {sorted(missing)}")
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    out: dict[str, np.ndarray] = {}
    for ours, theirs in _TENSOR_NAMES.items():
        weight = np.asarray(tensors[ours], dtype=np.float32)
        if ours.endswith("q_proj.weight"):
            weight = rope_permute(weight, heads)
        elif ours.endswith("k_proj.weight"):
            weight = rope_permute(weight, kv_heads)
        # norms stay f32 (as the converter keeps 1-d tensors); matrices take the outtype
        if outtype == "f16" and weight.ndim > 1:
            weight = weight.astype(np.float16)
        out[theirs] = np.ascontiguousarray(weight)
    draft_vocab = int(config.get("draft_vocab_size", target_vocab))
    if "d2t" in tensors and draft_vocab < target_vocab:
        offsets = np.asarray(tensors["d2t"], dtype=np.int64).reshape(-1)
        ids = offsets + np.arange(offsets.size, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= target_vocab:
            raise GgufExportError(f"d2t maps outside the target's {target_vocab} tokens")
        if np.unique(ids).size != ids.size:
            raise GgufExportError("d2t maps two draft tokens onto one target token")
        out["d2t"] = ids
    return out


def write_eagle3_gguf(
    drafter: str | Path,
    target_gguf: str | Path,
    output: str | Path,
    *,
    outtype: str = "f32",
    name: str | None = None,
) -> Path:
    """Write `drafter` (an EAGLE-3 folder) as a llama.cpp GGUF at `output`, atomically.

    `target_gguf` is the target's GGUF (any quantization): it supplies the tokenizer and is
    checked against the drafter's vocabulary, feature width and layers. `outtype` f32 or f16
    (matrices only; norms stay f32). Returns `output`.
    """
    import gguf

    if outtype not in OUTTYPES:
        raise GgufExportError(f"outtype {outtype!r}: choose one of {OUTTYPES}")
    folder, output = Path(drafter), Path(output)
    config, tensors = _load_folder(folder)
    target = read_target_gguf(target_gguf)
    layers = feature_layers_of(config)
    if layers is None:
        raise GgufExportError(f"{folder}/config.json names no target feature layers")
    _check_against_target(config, target, layers)
    out_tensors = _gguf_tensors(config, tensors, outtype, target.vocab_size)

    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(output) as tmp:
        writer = gguf.GGUFWriter(str(tmp), GGUF_ARCH)
        a = GGUF_ARCH
        writer.add_string("general.type", "model")
        writer.add_string("general.name", name or folder.resolve().name)
        writer.add_uint32("general.file_type", 0 if outtype == "f32" else 1)
        writer.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
        writer.add_array(f"{a}.target_layers", [int(i) for i in layers])
        writer.add_uint32(f"{a}.target_hidden_size", int(config.get("target_hidden_size", hidden)))
        writer.add_bool(f"{a}.norm_before_residual", False)
        writer.add_bool(f"{a}.norm_before_fc", False)
        writer.add_uint32(f"{a}.block_count", 1)
        writer.add_uint32(f"{a}.context_length", int(config.get("max_position_embeddings", 4096)))
        writer.add_uint32(f"{a}.embedding_length", hidden)
        writer.add_uint32(f"{a}.feed_forward_length", int(config["intermediate_size"]))
        writer.add_uint32(f"{a}.attention.head_count", heads)
        writer.add_uint32(f"{a}.attention.head_count_kv", int(config["num_key_value_heads"]))
        writer.add_float32(f"{a}.rope.freq_base", float(config.get("rope_theta", 10000.0)))
        writer.add_float32(
            f"{a}.attention.layer_norm_rms_epsilon", float(config.get("rms_norm_eps", 1e-6))
        )
        writer.add_uint32(f"{a}.attention.key_length", head_dim)
        writer.add_uint32(f"{a}.attention.value_length", head_dim)
        writer.add_uint32(f"{a}.vocab_size", target.vocab_size)
        writer.add_uint32(f"{a}.rope.dimension_count", head_dim)
        for key, (value, types) in target.tokenizer.items():
            sub_type = types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, types[0], sub_type=sub_type)
        for tensor_name, array in out_tensors.items():
            raw = gguf.GGMLQuantizationType.I64 if array.dtype == np.int64 else None
            writer.add_tensor(tensor_name, array, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return output
