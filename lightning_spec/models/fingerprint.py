"""Fingerprints of targets, so a drafter is never silently paired with a target it was not
trained for.

A drafter for another target of the same vocabulary size and width loads without error and just
accepts little; the only defence is to record which target a drafter was trained for and compare
on load. `target_fingerprint` records what identifies a target for a drafter: the vocabulary
(size and a hash of the tokenizer's token-to-id map), the width, the depth, the feature layers
and a hash of its weights. Weights are hashed from each parameter's name, shape and first and
last values rounded to bf16, so the same checkpoint in fp32 or bf16, prepacked or not, on CPU or
GPU, gives one fingerprint, and a fine-tuned or different model another.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

__all__ = [
    "cached_target_fingerprint",
    "check_drafter_target",
    "fingerprint_differences",
    "target_fingerprint",
    "tokenizer_vocab_fingerprint",
    "weights_fingerprint",
]

SAMPLE = 256


@torch.no_grad()
def weights_fingerprint(module: nn.Module) -> str:
    """sha256 over every parameter's name, shape and a bf16-rounded sample of its values."""
    digest = hashlib.sha256()
    for name, parameter in sorted(module.named_parameters(), key=lambda item: item[0]):
        flat = parameter.detach().reshape(-1)
        sample = torch.cat([flat[:SAMPLE], flat[-SAMPLE:]]).to(torch.bfloat16).float().cpu()
        digest.update(f"{name}:{tuple(parameter.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:32]


def tokenizer_vocab_fingerprint(tokenizer: Any) -> str | None:
    """sha256 (32 hex) of the tokenizer's vocabulary (token -> id): its content, not its path."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:32]


def target_fingerprint(target: Any) -> dict[str, Any]:
    """What identifies `target` (a `TargetModel`) for a drafter (see the module docstring)."""
    config = target.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {
        "model": str(target.name),
        "vocab_size": int(target.vocab_size),
        "hidden_size": int(target.hidden_size),
        "num_layers": int(getattr(text, "num_hidden_layers", 0) or 0),
        "feature_layers": [int(i) for i in target.feature_layers],
        "weights": weights_fingerprint(target.model),
        "tokenizer": tokenizer_vocab_fingerprint(target.tokenizer),
    }


def fingerprint_differences(recorded: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences between a recorded and an actual fingerprint ([] if none).

    The model name is not compared (one checkpoint has many paths); a field missing on either
    side (an older folder, a target without a tokenizer) is not a difference.
    """
    out = []
    for key in (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "feature_layers",
        "weights",
        "tokenizer",
    ):
        a, b = recorded.get(key), actual.get(key)
        if a is not None and b is not None and a != b:
            note = " (another tokenizer)" if key in ("vocab_size", "tokenizer") else ""
            out.append(f"{key}: trained for {a}, this target has {b}{note}")
    return out


def cached_target_fingerprint(target: Any) -> dict[str, Any]:
    """`target_fingerprint`, computed once per loaded target."""
    cached = getattr(target, "_lightning_spec_fingerprint", None)
    if cached is None:
        cached = target_fingerprint(target)
        object.__setattr__(target, "_lightning_spec_fingerprint", cached)
    return cached


def check_drafter_target(drafter: Any, target: Any) -> None:
    """Refuse `drafter` for `target` when the target it recorded at training differs, naming
    every difference (drafters without a recorded fingerprint pass: older folders)."""
    config = getattr(drafter, "config", None)
    recorded = config.get("target_fingerprint") if isinstance(config, dict) else None
    if not recorded:
        return
    differences = fingerprint_differences(recorded, cached_target_fingerprint(target))
    if differences:
        raise ValueError(
            f"this drafter was trained for another target ({recorded.get('model')}, loaded "
            f"target: {target.name}): " + "; ".join(differences)
        )
