"""OnlineSpec with an engine serving: rounds are served there, learned from here, and the updated
drafter is pushed back into the running engine between rounds.

An engine (`ServingEngine`) serves prompts greedily with the drafter it holds and replaces that
drafter only through `push` (a folder written by `save_pretrained`, hashed by the sender, checked
and loaded all or nothing by the engine: `online/vllm_draft.py`). Two implement it:

* `VllmOnlineEngine` (`online/vllm_engine.py`): vLLM serving our EAGLE-3 drafter, in its own
  interpreter; the push runs vLLM's in-place reload on the draft model.
* `DecoderEngine` (here): our own decoder behind the same protocol, with its own copy of the
  drafter: the reference the vLLM path is read against, and what the default test suite runs.

The learner never sees the engine's internals: from each served reply it rebuilds the feedback
our strategies read (`online.loop.replay_request`: one teacher-forced target pass and our
decoder's replay of the same drafter, so features, soft labels and verification records are
those our own decoder would have kept; at T = 0 the replay's acceptance is the engine's, a check
of engine parity on every request).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from lightning_spec.bench.engines import PromptResult
from lightning_spec.decoding.build import TreePolicy
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.io import atomic_folder, sha256_file
from lightning_spec.online.vllm_draft import WEIGHTS, DraftRejected, push_drafter, read_drafter

__all__ = ["DecoderEngine", "PushFailed", "ServingEngine", "engine_tau", "publish"]


class PushFailed(RuntimeError):
    """The engine refused or could not load a drafter; it serves the previous one."""


class ServingEngine(Protocol):
    name: str
    served: str
    """sha256 of the drafter file the engine serves now."""

    def serve(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[PromptResult]: ...

    def push(self, folder: Path) -> float: ...

    def close(self) -> None: ...


def engine_tau(results: Sequence[PromptResult]) -> tuple[float, int]:
    """(tokens committed per verify step, verify steps) from the engine's per-step accepted
    counts: each step commits its accepted drafts plus the target's own token, and a request's
    steps together commit at most its reply less the prefill's first token. vLLM counts the
    drafts its last step accepted even when the length limit or an end token then cuts them
    (128 tokens from 100 steps logged as 128 committed, not 127), which would put its tau a
    step's worth above what it served and above our replay's."""
    committed = steps = 0
    for result in results:
        lengths = list(result.meta.get("accepted_lengths", []))
        steps += len(lengths)
        committed += min(sum(lengths) + len(lengths), max(0, len(result.tokens) - 1))
    return (committed / steps if steps else float("nan")), steps


class DecoderEngine:
    """Our decoder as a `ServingEngine`: serves with its own drafter copy, replaced by `push`."""

    def __init__(self, target: Any, drafter_folder: Path, policy: TreePolicy) -> None:
        from lightning_spec.models.drafters.base import load_drafter

        self.name = "decoder"
        self.target, self.policy = target, policy
        self.drafter = load_drafter(drafter_folder, target=target)
        self._file = read_drafter(drafter_folder)
        self.served = self._file.sha256

    def serve(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[PromptResult]:
        decoder = SpeculativeDecoder(self.target, self.drafter, self.policy)
        out = []
        for prompt in prompts:
            generation = decoder.generate(list(prompt), max_new_tokens)
            lengths = [r.accept_length for r in generation.records]
            out.append(
                PromptResult(
                    tokens=list(generation.tokens),
                    seconds=max(generation.total_seconds - generation.prefill_seconds, 1e-9),
                    drafted=sum(r.tree.num_nodes for r in generation.records),
                    accepted=sum(lengths),
                    meta={"accepted_lengths": lengths},
                )
            )
        return out

    def _load(self, tensors: Any) -> None:
        self.drafter.load_exported_state_dict(dict(tensors))

    def push(self, folder: Path) -> float:
        tic = time.perf_counter()
        try:
            new = read_drafter(folder, sha256_file(Path(folder) / WEIGHTS))
            self._file = push_drafter(self._load, new, self._file)
        except DraftRejected as error:
            raise PushFailed(str(error)) from error
        except Exception as error:  # loaded back by push_drafter: the previous drafter serves
            raise PushFailed(repr(error)) from error
        self.served = self._file.sha256
        return time.perf_counter() - tic

    def close(self) -> None:
        pass


def publish(engine: ServingEngine, drafter: Any, folder: Path) -> dict[str, Any]:
    """Write `drafter` to `folder` (atomically) and push it; the push's seconds, or why it failed
    (the engine then serves its previous drafter and the stream goes on)."""
    tic = time.perf_counter()
    with atomic_folder(folder) as staging:
        drafter.save_pretrained(staging)
    try:
        engine.push(folder)
    except PushFailed as error:
        return {"push_seconds": time.perf_counter() - tic, "push_failed": 1.0, "push_error": str(error)}
    return {"push_seconds": time.perf_counter() - tic, "push_failed": 0.0}
