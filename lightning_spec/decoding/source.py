"""Where on-policy rollouts come from: (drafter, prompts) -> generations with StepRecords.

Objectives that train on the drafter's own decoding (Draft-OPD, on-policy SFT) need rollouts
made by the *current* drafter under real verification. `RolloutSource` is that seam: the
built-in `DecoderRolloutSource` runs our `SpeculativeDecoder`; a serving-engine adapter (SGLang,
vLLM, for 8B-70B targets) can implement the same protocol and nothing else changes, because the
records are the engine's own `StepRecord`s (docs/architecture.md, the one engine and its seams). `ReplayingRolloutSource`
remembers each prompt's greedy continuation and rebuilds later greedy rollouts of the same prompt
exactly, for any drafter, without the target's token-by-token loop (`decoding.replay`).

Rollouts are made without gradients, in eval mode and outside any autocast context, so the
training precision never changes what the decoder commits (greedy output stays the target's).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_spec.data.regenerate import greedy_answers
from lightning_spec.decoding.build import TreePolicy, parse_tree_spec
from lightning_spec.decoding.engine import Generation, SpeculativeDecoder
from lightning_spec.decoding.lookup import require_drafter_policy
from lightning_spec.decoding.replay import TextPass, greedy_prefix, replay_greedy, text_pass
from lightning_spec.metrics import tau_from_records
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.tensor_lru import TensorLRU, tensor_key

log = logging.getLogger(__name__)

__all__ = ["DecoderRolloutSource", "ReplayingRolloutSource", "RolloutSource"]


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
        self.last_throughput = _throughput(results, time.perf_counter() - tic)
        _log_rollouts("rollouts", results, self.last_throughput, version)
        return results


class ReplayingRolloutSource:
    """Greedy rollouts that decode each prompt once and replay it afterwards.

    At T = 0 the committed text does not depend on the drafter, so a prompt's first rollout
    (the real decoder, `DecoderRolloutSource`) fixes its continuation for good; every later
    rollout of that prompt, by whatever drafter, is rebuilt exactly from it (`replay_greedy`:
    one teacher-forced target pass and batched drafting instead of a target forward per step).
    That pass depends on the text alone and is kept up to `cache_bytes` (its features and final
    hidden states), so a revisit costs only the drafter. The continuations are the source's
    state (`state_dict`), so a resumed run keeps them.

    `decode_batch_size` > 0 answers new prompts with the target's batched greedy generation
    instead (`greedy_answers`; several times the tokens/s of batch-1 decoding on a CPU) and
    replays even their first rollout. Batched arithmetic can break a near-tie differently, so
    each continuation is cut to its longest prefix that is the batch-1 greedy text
    (`greedy_prefix`) before it is replayed or kept: the rollouts stay exact.
    """

    def __init__(
        self,
        target: TargetModel,
        *,
        tree: str | TreePolicy = "chain:4",
        max_new_tokens: int = 64,
        seed: int = 0,
        cache_bytes: int = 500_000_000,
        decode_batch_size: int = 0,
    ) -> None:
        if decode_batch_size < 0:
            raise ValueError(f"decode_batch_size must be >= 0, got {decode_batch_size}")
        self.live = DecoderRolloutSource(
            target, tree=tree, max_new_tokens=max_new_tokens, temperature=0.0, seed=seed
        )
        self.decode_batch_size = int(decode_batch_size)
        self.target = target
        self.policy = self.live.policy
        self.max_new_tokens = int(max_new_tokens)
        self.continuations: dict[tuple[int, ...], list[int]] = {}
        self.cache = TensorLRU(cache_bytes)
        self.last_throughput: dict[str, float] = {}

    def generate(
        self, drafter: Drafter, prompts: Sequence[Sequence[int]], *, version: str | None = None
    ) -> list[Generation]:
        keys = [tuple(int(t) for t in prompt) for prompt in prompts]
        fresh = list(dict.fromkeys(k for k in keys if k not in self.continuations))
        tic = time.perf_counter()
        decoded: dict[tuple[int, ...], Generation] = {}
        if fresh and self.decode_batch_size:
            answers = greedy_answers(
                self.target,
                [list(k) for k in fresh],
                max_new_tokens=self.max_new_tokens,
                batch_size=self.decode_batch_size,
            )
            for key, answer in zip(fresh, answers, strict=True):
                self.continuations[key] = answer  # checked and cut at its first replay
        elif fresh:
            generations = self.live.generate(drafter, [list(k) for k in fresh], version=version)
            for key, generation in zip(fresh, generations, strict=True):
                self.continuations[key] = list(generation.tokens)
                decoded[key] = generation
        live_seconds = time.perf_counter() - tic
        was_training = drafter.training
        drafter.eval()
        results: list[Generation] = []
        replayed = replay_tokens = 0
        try:
            with torch.no_grad(), _no_autocast(self.target.device):
                for key in keys:
                    generation = decoded.pop(key, None)  # a repeat in one call is replayed
                    if generation is None:
                        generation = self._replay(drafter, key, version)
                        replayed += 1
                        replay_tokens += len(generation.tokens)
                    results.append(generation)
        finally:
            drafter.train(was_training)
        seconds = time.perf_counter() - tic
        self.last_throughput = _throughput(results, seconds)
        replay_seconds = seconds - live_seconds
        self.last_throughput.update(
            rollout_decoded=float(len(fresh)),
            rollout_replayed=float(replayed),
            rollout_replay_tokens_per_s=replay_tokens / replay_seconds
            if replayed and replay_seconds > 0
            else float("nan"),
        )
        _log_rollouts(f"rollouts ({replayed} replayed)", results, self.last_throughput, version)
        return results

    def _replay(self, drafter: Drafter, prompt: tuple[int, ...], version: str | None) -> Generation:
        """One replay, with the target's pass over the text from the cache when it is there."""
        continuation = self.continuations[prompt]
        ids = torch.tensor([list(prompt) + continuation], device=self.target.device)
        key = tensor_key(ids)
        kept = self.cache.get(key)
        if kept is not None and (kept[0] is not None or not drafter.needs_features):
            text = TextPass(kept[0], kept[1])
        else:
            text = text_pass(self.target, ids, len(prompt), features=drafter.needs_features)
            text, continuation = self._greedy_text(prompt, continuation, text)
            ids = torch.tensor([list(prompt) + continuation], device=self.target.device)
            self.cache.put(tensor_key(ids), (text.features, text.last_hidden))
        return replay_greedy(
            self.target,
            drafter,
            self.policy,
            list(prompt),
            continuation,
            drafter_version=version,
            text=text,
        )

    def _greedy_text(
        self, prompt: tuple[int, ...], continuation: list[int], text: TextPass
    ) -> tuple[TextPass, list[int]]:
        """`continuation` cut to its greedy prefix (kept from now on) and the pass cut with it;
        the decoder's own continuations pass whole. A continuation whose very first token is off
        (a batched near-tie) becomes the target's argmax token alone."""
        keep = greedy_prefix(self.target, text, continuation)
        if keep == len(continuation):
            return text, continuation
        log.info(
            "rollout continuation cut to its greedy prefix: %d of %d tokens",
            keep,
            len(continuation),
        )
        if keep == 0:
            first = int(self.target.head_argmax(text.last_hidden[:1])[0])
            cut = [first]
            ids = torch.tensor([list(prompt) + cut], device=self.target.device)
            text = text_pass(self.target, ids, len(prompt), features=text.features is not None)
        else:
            cut, text = continuation[:keep], text.prefix(len(prompt), keep)
        self.continuations[prompt] = cut
        return text, cut

    def state_dict(self) -> dict[str, Any]:
        return {"continuations": [[list(k), v] for k, v in self.continuations.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.continuations = {
            tuple(int(t) for t in key): [int(t) for t in tokens]
            for key, tokens in state.get("continuations", [])
        }


def _throughput(results: Sequence[Generation], seconds: float) -> dict[str, float]:
    tokens = sum(len(g.tokens) for g in results)
    tau = tau_from_records([r for g in results for r in g.records])
    return {
        "rollout_seconds": seconds,
        "rollout_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "rollout_tau": float("nan") if tau is None else tau,
    }


def _log_rollouts(
    what: str, results: Sequence[Generation], throughput: dict[str, float], version: str | None
) -> None:
    log.info(
        "%s: %d prompts, %d tokens in %.1f s (%.1f tok/s, tau %.2f, drafter %s)",
        what,
        len(results),
        sum(len(g.tokens) for g in results),
        throughput["rollout_seconds"],
        throughput["rollout_tokens_per_s"],
        throughput["rollout_tau"],
        version,
    )


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Disable any autocast the caller is inside (training precision must not leak in)."""
    return torch.autocast(device_type=device.type, enabled=False)
