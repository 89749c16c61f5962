"""Batches of the target's own greedy text, with the cached pass the regenerated store keeps.

At T = 0 the objectives that replay the drafter on greedy text (GTO's cached rewards,
Draft-OPD's chain blocks, `decoding.replay`) read each text's features, final hidden states and
argmax from the store instead of a target forward. Benches that measure those objectives build
the same batches here: greedy answers generated in batches, then one teacher-forced pass per
batch, in the collated layout of `data.tables.collate_records`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["greedy_text_batches", "store_text_batches"]


def greedy_text_batches(
    target: Any,
    prompts: list[list[int]],
    *,
    new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """Batches of the target's greedy continuations with their cached teacher-forced pass;
    with `temperature` > 0, of its sampled continuations instead (seeded): the states a T > 0
    verification reads, which leave the greedy text (their cached argmax is then the target's
    argmax on sampled text, which no T = 0 shortcut may read as the greedy continuation)."""
    from lightning_spec.data.regenerate import GenerationSettings, target_answers

    settings = GenerationSettings(max_new_tokens=new_tokens, temperature=temperature, seed=seed)
    # batch 32: 93 tok/s here, against 72 at 16 and 25 at 4 (bench_data_modes --throughput)
    answers = target_answers(target, prompts, settings=settings, batch_size=32)
    texts = [p + a for p, a in zip(prompts, answers, strict=True)]
    batches = []
    for begin in range(0, len(texts), batch_size):
        chunk = texts[begin : begin + batch_size]
        prompt_lengths = [len(p) for p in prompts[begin : begin + batch_size]]
        width = max(len(t) for t in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros_like(ids)
        loss_mask = torch.zeros_like(ids)
        for row, (text, plen) in enumerate(zip(chunk, prompt_lengths, strict=True)):
            ids[row, : len(text)] = torch.tensor(text)
            attention[row, : len(text)] = 1
            loss_mask[row, plen : len(text)] = 1
        with torch.no_grad():
            output = target(ids, attention_mask=attention, output_features=True)
        batches.append(
            {
                "input_ids": ids,
                "attention_mask": attention,
                "loss_mask": loss_mask,
                "features": output.features,
                "last_hidden": output.last_hidden,
                "target_argmax": target.head_argmax(output.last_hidden),
            }
        )
    return batches


def store_text_batches(config: Path, texts: int, *, batch_size: int) -> tuple[Any, list[dict]]:
    """The first `texts` training texts of a fit config's data in `batch_size` batches, with
    the target its data module loaded: for a `regenerated` store (built once by
    `lightning-spec prepare`), the very batches, cached pass included, that config trains on."""
    import importlib

    import yaml

    data = yaml.safe_load(Path(config).read_text())["data"]
    module_name, _, name = data["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    datamodule = cls(**{**data.get("init_args", {}), "batch_size": batch_size, "progress": False})
    datamodule.prepare_data()
    datamodule.setup("fit")
    batches: list[dict] = []
    for batch in datamodule.train_dataloader():
        if len(batches) * batch_size >= texts:
            break
        if batch.get("last_hidden") is None:
            raise ValueError(f"{config}: its data has no cached pass (feature_cache_bytes > 0)")
        batches.append(batch)
    return datamodule.target_model, batches
