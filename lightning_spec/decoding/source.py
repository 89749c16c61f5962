"""Where on-policy rollouts come from: (drafter, prompts) -> generations with StepRecords.

Objectives that train on the drafter's own decoding (Draft-OPD, on-policy SFT) need rollouts
made by the *current* drafter under real verification. `RolloutSource` is that seam: the
built-in `DecoderRolloutSource` runs our `SpeculativeDecoder`; a serving-engine adapter (SGLang,
vLLM, for 8B-70B targets) can implement the same protocol and nothing else changes, because the
records are the engine's own `StepRecord`s (ARCHITECTURE.md, Scale).

Rollouts are made without gradients, in eval mode and outside any autocast context, so the
training precision never changes what the decoder commits (greedy output stays the target's).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from lightning_spec.decoding.build import TreePolicy, parse_tree_spec
from lightning_spec.decoding.engine import Generation, SpeculativeDecoder
from lightning_spec.decoding.lookup import require_drafter_policy
from lightning_spec.metrics import tau_from_records
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.target import TargetModel

log = logging.getLogger(__name__)

__all__ = ["DecoderRolloutSource", "RolloutSource"]


@runtime_checkable
class RolloutSource(Protocol):
    """Produces on-policy generations (with their StepRecords) for prompts."""

    def generate(
        self, drafter: Drafter, prompts: Sequence[Sequence[int]], *, version: str | None = None
    ) -> list[Generation]:
        """One generation per prompt, drafted by `drafter` (recorded as `version`)."""
        ...


class DecoderRolloutSource:
    """The built-in decoder as a `RolloutSource` (see the module docstring)."""

    def __init__(
        self,
        target: TargetModel,
        *,
        tree: str | TreePolicy = "chain:4",
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int = 0,
        keep_target_rows: int = 0,
    ) -> None:
        self.target = target
        self.policy = parse_tree_spec(tree) if isinstance(tree, str) else tree
        require_drafter_policy(self.policy, "on-policy rollouts")
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.seed = int(seed)
        self.keep_target_rows = int(keep_target_rows)
        self.last_throughput: dict[str, float] = {}

    def generate(
        self, drafter: Drafter, prompts: Sequence[Sequence[int]], *, version: str | None = None
    ) -> list[Generation]:
        decoder = SpeculativeDecoder(
            self.target,
            drafter,
            self.policy,
            temperature=self.temperature,
            keep_target_rows=self.keep_target_rows,
            drafter_version=version,
        )
        generator = torch.Generator().manual_seed(self.seed)
        was_training = drafter.training
        drafter.eval()
        tic = time.perf_counter()
        results: list[Generation] = []
        try:
            with torch.no_grad(), _no_autocast(self.target.device):
                for prompt in prompts:
                    results.append(
                        decoder.generate(prompt, self.max_new_tokens, generator=generator)
                    )
        finally:
            drafter.train(was_training)
        seconds = time.perf_counter() - tic
        tokens = sum(len(g.tokens) for g in results)
        tau = tau_from_records([r for g in results for r in g.records])
        self.last_throughput = {
            "rollout_seconds": seconds,
            "rollout_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "rollout_tau": float("nan") if tau is None else tau,
        }
        log.info(
            "rollouts: %d prompts, %d tokens in %.1f s (%.1f tok/s, tau %.2f, drafter %s)",
            len(results),
            tokens,
            seconds,
            self.last_throughput["rollout_tokens_per_s"],
            self.last_throughput["rollout_tau"],
            version,
        )
        return results


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Disable any autocast the caller is inside (training precision must not leak in)."""
    return torch.autocast(device_type=device.type, enabled=False)
