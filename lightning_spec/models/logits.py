"""Temperature-scaled log-probabilities that stay finite at any temperature > 0.

Dividing raw logits by a tiny temperature overflows to +-inf and `log_softmax` then returns NaN
(inf - inf). Subtracting each row's maximum first keeps every scaled value <= 0, so the result
degrades gracefully to a one-hot (greedy) distribution instead. The decoder, the drafting seam
and the scoring module all scale through here, so drafts and verification agree on it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def tempered_log_softmax(logits: Tensor, temperature: float = 0.0) -> Tensor:
    """float32 log-probs of `logits` [..., V] at `temperature` (<= 0 means 1: the raw model)."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    return torch.log_softmax(logits, dim=-1)


def tempered_softmax(logits: Tensor, temperature: float) -> Tensor:
    """Probabilities at `temperature` (see `tempered_log_softmax`)."""
    return tempered_log_softmax(logits, temperature).exp()
