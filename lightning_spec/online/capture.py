"""The target's features of what was served, assembled from the serving engine's own steps.

A serving engine that speculates computes, at every step, the target's hidden states of every
token it scheduled: a prefill chunk's prompt tokens, then at each verification step the last
committed token and the drafts. Those are the features an EAGLE-3 drafter learns from (the aux
layers) and the rows its soft labels come from (the final hidden state, through the target's
``lm_head``). Keeping them while serving spares the learner a second target pass over
everything served.

Which rows are valid follows from verification. A step that scheduled ``[t0, d1 .. dk]`` and
sampled ``[s1 .. s(a+1)]`` accepted ``a`` drafts (``d1 .. da == s1 .. sa``): the rows of ``t0``
and the accepted drafts were computed on the committed prefix and are kept; the rejected drafts'
rows are not the committed text's and are dropped. The step's last sampled token is committed
but not yet computed: it is the next step's ``t0``. A prefill chunk keeps every row; the chunk
that ends the prompt samples the first token.

Everything here is engine-agnostic: `RequestCapture` takes plain token lists and row tensors,
so the vLLM worker extension (`online.vllm_capture`) and the tests (our own decoder standing in
for an engine) feed it the same way. A step that does not continue what was captured (a
preempted request recomputed from scratch, a token that is not the one sampled before) marks
the request unusable instead of guessing: it is skipped and counted, never half-learned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["CaptureBroken", "CapturedRequest", "RequestCapture", "StepCapture"]


class CaptureBroken(ValueError):
    """A step that does not continue the captured text; the request cannot be learned from."""


@dataclass
class CapturedRequest:
    """One finished request as the engine computed it."""

    request_id: str
    prompt_len: int
    token_ids: list[int]
    """The prompt and every committed token, in order."""
    aux: Tensor
    """[n, A] the target's aux-layer hidden states of ``token_ids[:n]`` as inputs (n is one
    less than ``len(token_ids)``: the last committed token was never computed)."""
    last: Tensor | None
    """[n, H] the target's final hidden states of the same rows (their next-token logits
    through ``lm_head``), or None when the engine did not hand them over."""
    accepted: list[int] = field(default_factory=list)
    """Accepted drafts of each verification step, in order."""
    drafted: list[int] = field(default_factory=list)
    """Drafts proposed at each verification step."""

    @property
    def answer(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def computed(self) -> list[int]:
        """The tokens whose rows the engine computed: all but the last committed one."""
        return self.token_ids[:-1]

    def text_pass(self):  # noqa: ANN201 - decoding.replay.TextPass (imported here: engine side stays light)
        """The target's pass over `computed` as a replay reads it (`decoding.replay.text_pass`),
        from the served rows: the features of every computed token and the final hidden states
        from the prompt's last token on. No target forward."""
        from lightning_spec.decoding.replay import TextPass

        if self.last is None:
            raise ValueError(f"{self.request_id}: captured without final hidden states")
        return TextPass(self.aux.unsqueeze(0), self.last[self.prompt_len - 1 :])

    @property
    def tau(self) -> float:
        """Tokens committed per verification step (accepted drafts + 1), nan without steps."""
        return (
            (sum(self.accepted) + len(self.accepted)) / len(self.accepted)
            if self.accepted
            else float("nan")
        )


class RequestCapture:
    """The rows of one request, step by step (see the module docstring for which are kept)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._tokens: list[int] = []
        self._aux: list[Tensor] = []
        self._last: list[Tensor] = []
        self._pending: int | None = None  # sampled, committed, not yet computed
        self._prompt_len: int | None = None
        self.accepted: list[int] = []
        self.drafted: list[int] = []

    @property
    def prompt_len(self) -> int:
        """The prompt's length once it is computed (0 before)."""
        return self._prompt_len or 0

    def served_tokens(self) -> int:
        """Prompt and committed tokens so far."""
        return len(self._tokens) + (self._pending is not None)

    def add_step(
        self,
        token_ids: Sequence[int],
        aux: Tensor,
        sampled: Sequence[int],
        *,
        last: Tensor | None = None,
    ) -> None:
        """One engine step of this request: the `token_ids` it scheduled, their `aux` rows
        [len(token_ids), A] (and final hidden `last` rows), and the tokens it `sampled` (the
        accepted drafts and the target's own token; none for a prompt chunk that does not end
        the prompt; padding such as vLLM's -1 already removed)."""
        token_ids, sampled = [int(t) for t in token_ids], [int(t) for t in sampled]
        if aux.shape[0] != len(token_ids) or (last is not None and last.shape[0] != len(token_ids)):
            raise CaptureBroken(
                f"{self.request_id}: {len(token_ids)} tokens scheduled but {aux.shape[0]} rows"
            )
        if not token_ids:
            return
        if self._pending is None:  # the prompt, in one chunk or several
            if self._prompt_len is not None:
                raise CaptureBroken(f"{self.request_id}: a prompt chunk after the prompt ended")
            keep = len(token_ids)
            if sampled:
                self._prompt_len = len(self._tokens) + keep
                if len(sampled) != 1:
                    raise CaptureBroken(f"{self.request_id}: a prompt step sampled {len(sampled)}")
        else:  # a verification step: [t0, d1 .. dk] against [s1 .. s(a+1)]
            if token_ids[0] != self._pending:
                raise CaptureBroken(
                    f"{self.request_id}: the step starts at token {token_ids[0]}, not the "
                    f"committed {self._pending} (preempted and recomputed?)"
                )
            drafts, accepted = token_ids[1:], len(sampled) - 1
            if accepted < 0 or accepted > len(drafts) or drafts[:accepted] != sampled[:accepted]:
                raise CaptureBroken(
                    f"{self.request_id}: sampled {sampled} does not accept a prefix of the "
                    f"drafts {drafts}"
                )
            keep = 1 + accepted
            self.accepted.append(accepted)
            self.drafted.append(len(drafts))
        self._tokens += token_ids[:keep]
        self._aux.append(aux[:keep].detach().to("cpu", torch.float32))
        if last is not None:
            self._last.append(last[:keep].detach().to("cpu", torch.float32))
        if sampled:
            self._pending = sampled[-1]

    def finish(self) -> CapturedRequest:
        """The request as served; `CaptureBroken` when it never got past its prompt."""
        if self._prompt_len is None or self._pending is None:
            raise CaptureBroken(f"{self.request_id}: finished before its first token")
        rows = len(self._tokens)
        last = None
        if self._last:
            last = torch.cat(self._last)
            if last.shape[0] != rows:
                raise CaptureBroken(f"{self.request_id}: final hidden states of some steps only")
        return CapturedRequest(
            request_id=self.request_id,
            prompt_len=self._prompt_len,
            token_ids=self._tokens + [self._pending],
            aux=torch.cat(self._aux),
            last=last,
            accepted=list(self.accepted),
            drafted=list(self.drafted),
        )


class StepCapture:
    """Every running request's capture; a broken one is dropped and counted, never raised into
    the engine."""

    def __init__(self) -> None:
        self.running: dict[str, RequestCapture] = {}
        self.broken: set[str] = set()
        self.skipped: Counter[str] = Counter()

    def add_step(
        self,
        request_id: str,
        token_ids: Sequence[int],
        aux: Tensor,
        sampled: Sequence[int],
        *,
        last: Tensor | None = None,
    ) -> None:
        if request_id in self.broken:
            return
        capture = self.running.setdefault(request_id, RequestCapture(request_id))
        try:
            capture.add_step(token_ids, aux, sampled, last=last)
        except CaptureBroken:
            self._drop(request_id, "broken")

    def finish(self, request_id: str) -> CapturedRequest | None:
        """The finished request, or None when it was broken, aborted before its first token or
        never seen (counted in `skipped`)."""
        if request_id in self.broken:
            self.broken.discard(request_id)
            return None
        capture = self.running.pop(request_id, None)
        if capture is None:
            self.skipped["unseen"] += 1
            return None
        try:
            return capture.finish()
        except CaptureBroken:
            self.skipped["no_tokens"] += 1
            return None

    def _drop(self, request_id: str, reason: str) -> None:
        self.running.pop(request_id, None)
        self.broken.add(request_id)
        self.skipped[reason] += 1
