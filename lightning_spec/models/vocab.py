"""Reduced draft vocabulary for EAGLE-3 drafters.

A drafter's LM head over the target's full vocabulary is most of its parameters and time; the
EAGLE-3 recipe keeps only the tokens that appear most often in training responses. Two maps
travel with the checkpoint, in the convention SGLang and vLLM load: `d2t[d]` is the offset with
`target_id = d + d2t[d]`, and `t2d` is a boolean mask over the target vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> Tensor:
    """Token frequencies [vocab_size] over an iterable of id sequences."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sequence in sequences:
        ids = torch.as_tensor(list(sequence), dtype=torch.long)
        if ids.numel():
            if int(ids.max()) >= vocab_size or int(ids.min()) < 0:
                raise ValueError(f"token id out of range for a vocabulary of {vocab_size}")
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(
    counts: Tensor, draft_vocab_size: int, always_include: Iterable[int] = ()
) -> tuple[Tensor, Tensor]:
    """Pick the `draft_vocab_size` most frequent ids; return `(d2t, t2d)`.

    Ids in `always_include` (EOS, chat-turn markers) are kept whatever their count, so the
    drafter can always propose the end of an answer. Draft ids are ordered by target id, which
    makes `d2t` non-decreasing and the map easy to inspect. Ties break towards the lower id.
    """
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    forced = sorted({int(i) for i in always_include})
    if len(forced) > draft_vocab_size:
        raise ValueError("more always-included tokens than the draft vocabulary holds")
    # Stable descending sort: equal counts keep ascending id order.
    scores = counts.to(torch.float64).clone()
    if forced:
        scores[forced] = float("inf")
    order = torch.sort(scores, descending=True, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    return d2t, target_vocab_mask(d2t, vocab_size)


def target_vocab_mask(d2t: Tensor, target_vocab_size: int) -> Tensor:
    """`t2d`: a [V] bool mask of the target ids the draft vocabulary `d2t` holds (all of them when
    the vocabularies are the same size)."""
    if d2t.numel() == target_vocab_size:
        return torch.ones(target_vocab_size, dtype=torch.bool, device=d2t.device)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[draft_to_target_ids(d2t)] = True
    return t2d


def draft_to_target_ids(d2t: Tensor) -> Tensor:
    """Target ids of every draft id: `d + d2t[d]`."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def draft_to_target_logprobs(logprobs: Tensor, d2t: Tensor, target_vocab_size: int) -> Tensor:
    """Draft-vocabulary log-probs [..., V_draft] -> target vocabulary [..., V] (-inf where the
    draft vocabulary has no token); the identity when the vocabularies are the same."""
    if d2t.numel() == target_vocab_size:
        return logprobs
    out = logprobs.new_full((*logprobs.shape[:-1], target_vocab_size), float("-inf"))
    out[..., draft_to_target_ids(d2t)] = logprobs
    return out


def target_to_draft(target_ids: Tensor, d2t: Tensor, target_vocab_size: int) -> Tensor:
    """Target ids -> draft ids (-1 where the draft vocabulary lacks the token)."""
    if d2t.numel() == target_vocab_size:
        return target_ids
    lookup = torch.full((target_vocab_size,), -1, dtype=torch.long, device=target_ids.device)
    lookup[draft_to_target_ids(d2t)] = torch.arange(d2t.numel(), device=target_ids.device)
    return lookup[target_ids]
