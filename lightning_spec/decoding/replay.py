"""Exact greedy rollouts replayed over a known continuation: the decoder without its target loop.

At T = 0 what speculative decoding commits does not depend on the drafter: it is the target's
greedy continuation, whatever was drafted. What the drafter changes is only *where* each
verification step starts (its anchor), what it drafted there and what the target rejected. So
once a prompt's greedy continuation is known (from one real rollout), a rollout of any later
drafter on that prompt can be rebuilt exactly, with no token-by-token target loop:

1. One teacher-forced target pass over prompt + continuation gives the features the drafter
   reads and the target's rows along the committed text.
2. The drafter drafts a tree at every continuation position at once, through the decoder's own
   seam (`Drafter.sequence_proposer` + `TreePolicy.build_batch`, as GTO does).
3. Walking from the first generated token, each anchor's tree is verified by the decoder's own
   `verify_greedy_argmax`, with the target's argmax known along the committed text (the next
   committed token) and unknown elsewhere; the step commits what verification accepts and the
   walk moves to the next anchor.

The continuation must be the target's greedy one: every committed token is checked against the
teacher-forced rows (a token whose logit is below its row's maximum by more than `tolerance`
raises `ReplayMismatch`; the tolerance absorbs ties that batched and incremental arithmetic may
break differently).

The records equal the real decoder's (tests compare them step by step), except where the real
step had target rows that lie off the committed text, i.e. below a rejected node: there
`target_argmax` is -1 and `target_token_logprobs` NaN. Those rows score nodes verification never
tried, which no objective reads (Draft-OPD reads the tried-and-rejected nodes, whose parents lie
on the committed text). Sampled rollouts (T > 0) depend on the drafter and cannot be replayed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lightning_spec.decoding.build import TreePolicy
from lightning_spec.decoding.engine import (
    Generation,
    StepRecord,
    top_label_rows,
    without_draft_probs,
)
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.decoding.verify import verify_greedy_argmax
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.drafters.proposer import absorbed_offset
from lightning_spec.models.target import TargetModel

__all__ = [
    "ReplayMismatch",
    "TextPass",
    "check_greedy",
    "committed_argmax",
    "greedy_prefix",
    "replay_greedy",
    "text_pass",
]


class ReplayMismatch(RuntimeError):
    """The continuation to replay is not the target's greedy one (`check_greedy`)."""


def committed_argmax(tree: DraftTree, following: Tensor) -> tuple[Tensor, Tensor]:
    """The target's greedy argmax over a tree's rows where the committed text determines it.

    `following` [D] holds the committed tokens after the root (following[d] is the token at
    depth d + 1; shorter than the tree near the end of the text). Returns (argmax [N + 1],
    known [N + 1]): row 0 (the root) and the row of every node whose path equals the committed
    text carry the next committed token; the other rows, and rows past the end, are -1 and not
    known (greedy verification never accepts a child of such a row).
    """
    n = tree.num_nodes
    argmax = torch.full((n + 1,), -1, dtype=torch.long)
    known = torch.zeros(n + 1, dtype=torch.bool)
    depth_known = int(following.shape[0])
    if depth_known == 0:
        return argmax, known
    argmax[0], known[0] = following[0], True
    tokens, parents, depth = tree.tokens.cpu(), tree.parents.cpu(), tree.depth.cpu()
    on_text = torch.zeros(n + 1, dtype=torch.bool)  # row i + 1: node i's path is the text
    on_text[0] = True
    for node in torch.argsort(depth, stable=True).tolist():  # parents before children
        d = int(depth[node])
        if d > depth_known or not bool(on_text[int(parents[node]) + 1]):
            continue
        if int(tokens[node]) == int(following[d - 1]):
            on_text[node + 1] = True
            if d < depth_known:
                argmax[node + 1], known[node + 1] = following[d], True
    return argmax, known


def _greedy_gaps(rows: Tensor, tokens: Tensor) -> Tensor:
    """How far (in logits) each of `tokens` [T] lies below the argmax of its row of `rows` [T, V]."""
    picked = rows.gather(1, tokens.to(rows.device).unsqueeze(1)).squeeze(1)
    return rows.amax(dim=-1) - picked


def check_greedy(rows: Tensor, tokens: Tensor, *, tolerance: float, offset: int = 0) -> None:
    """Raise `ReplayMismatch` unless each of `tokens` [T] is the argmax of its row of `rows`
    [T, V] up to `tolerance` (in logits); `offset` only names positions in the message."""
    gap = _greedy_gaps(rows, tokens)
    bad = (gap > tolerance).nonzero().flatten()
    if bad.numel():
        at = int(bad[0])
        raise ReplayMismatch(
            f"the continuation is not the target's greedy one: at position {offset + at} it "
            f"holds token {int(tokens[at])}, {float(gap[at]):.4g} logits below the target's "
            f"argmax {int(rows[at].argmax())} ({bad.numel()} such positions)"
        )


@dataclass
class TextPass:
    """What a replay needs of the target over prompt + continuation; a function of the text
    alone, so a caller may keep it for the next replay of the same text."""

    features: Tensor | None
    """[1, L, F] the target's features of every token (None when the drafter reads none)."""
    last_hidden: Tensor
    """[L - start + 1, H] final hidden states from the prompt's last token on (the rows)."""

    def prefix(self, start: int, keep: int) -> TextPass:
        """This pass cut to the first `keep` continuation tokens (the target is causal, so the
        rows and features of a prefix do not depend on what follows it)."""
        features = None if self.features is None else self.features[:, : start + keep].clone()
        return TextPass(features, self.last_hidden[: keep + 1].clone())  # copies: kept alone


@torch.no_grad()
def greedy_prefix(
    target: TargetModel, text: TextPass, continuation: Sequence[int], *, tolerance: float = 1e-3
) -> int:
    """How many leading tokens of `continuation` are the target's greedy choice (up to
    `tolerance` logits) after the text `text` was computed over; a replay of that prefix is exact."""
    if not continuation:
        return 0
    rows = target.head_logits(text.last_hidden[: len(continuation)]).float()
    gap = _greedy_gaps(rows, torch.tensor(list(continuation), dtype=torch.long))
    bad = (gap > tolerance).nonzero().flatten()
    return int(bad[0]) if bad.numel() else len(continuation)


@torch.no_grad()
def text_pass(target: TargetModel, ids: Tensor, start: int, *, features: bool) -> TextPass:
    """One teacher-forced target pass over `ids` [1, L] whose continuation starts at `start`."""
    output = target(ids, output_features=features, use_cache=False, logits_to_keep=1)
    return TextPass(output.features, output.last_hidden[0, start - 1 :])


@torch.no_grad()
def replay_greedy(
    target: TargetModel,
    drafter: Drafter,
    policy: TreePolicy,
    prompt: Sequence[int],
    continuation: Sequence[int],
    *,
    drafter_version: str | None = None,
    tolerance: float = 1e-3,
    text: TextPass | None = None,
    keep_labels: int = 0,
) -> Generation:
    """The greedy rollout `drafter` would make on `prompt`, rebuilt from its known greedy
    `continuation` (the new tokens a real T = 0 rollout committed; see the module docstring).
    `text`: the target's pass over this text from an earlier replay (`text_pass`);
    `keep_labels` > 0 keeps that many top target log-probs per new token, as the decoder's
    ``keep_labels`` does."""
    prompt, continuation = [int(t) for t in prompt], [int(t) for t in continuation]
    if not prompt or not continuation:
        raise ValueError("a replay needs a prompt and at least the first generated token")
    tic = time.perf_counter()
    start = len(prompt)  # position of the first generated token: the first root
    ids = torch.tensor([prompt + continuation], device=target.device)
    length = int(ids.shape[1])
    records: list[StepRecord] = []
    labels = None
    if start < absorbed_offset(drafter):
        raise ValueError(f"the prompt must hold at least {absorbed_offset(drafter)} tokens")
    if length - 1 > start:
        drafter.bind_target(target)
        if text is None:
            text = text_pass(target, ids, start, features=drafter.needs_features)
        if drafter.needs_features and text.features is None:
            raise ValueError("the drafter reads target features: the text pass holds none")
        every, labels = _checked_rows(target, text, ids, start, keep_labels, tolerance)
        rows = every[1:]
        roots = torch.arange(start, length - 1, device=ids.device)
        draft_tic = time.perf_counter()
        proposer = drafter.sequence_proposer(ids, roots, features=text.features)
        trees = policy.build_batch(proposer, temperature=0.0)
        proposer.finish()
        draft_seconds = (time.perf_counter() - draft_tic) / max(1, len(trees))
        by_root = dict(zip(roots.tolist(), trees, strict=True))
        anchor = start
        while anchor < length - 1:
            record = _replayed_step(
                by_root[anchor], anchor, ids[0], rows[anchor - start :], draft_seconds
            )
            records.append(replace(record, drafter_version=drafter_version))
            anchor += len(record.committed)
    eos = target.eos_token_ids
    return Generation(
        prompt=prompt,
        tokens=continuation,
        records=records,
        total_seconds=time.perf_counter() - tic,
        stopped_on_eos=continuation[-1] in eos,
        drafter_version=drafter_version,
        label_logprobs=None if labels is None else labels[0],
        label_ids=None if labels is None else labels[1],
    )


def _checked_rows(
    target: TargetModel, text: TextPass, ids: Tensor, start: int, keep_labels: int, tolerance: float
) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """The target's logits rows over the continuation, checked to be greedy (the prefill's row
    first: it chose the first generated token; then row j + 1, the target after position
    start + j), and with `keep_labels` the top log-probs each new token was chosen from."""
    every = target.head_logits(text.last_hidden).float()
    check_greedy(every[:-1], ids[0, start:], tolerance=tolerance, offset=start)
    labels = top_label_rows(every[:-1], keep_labels) if keep_labels else None  # row i: token i
    return every, labels


@torch.no_grad()
def committed_feedback(
    target: TargetModel,
    prompt: Sequence[int],
    continuation: Sequence[int],
    *,
    keep_labels: int = 0,
    tolerance: float = 1e-3,
    text: TextPass | None = None,
) -> Generation:
    """What serving `prompt` at T = 0 teaches whatever drafter served it: the committed text, its
    target features and (`keep_labels`) soft labels, from one teacher-forced pass, without the
    drafting a replay adds (no records). A learner that reads only the committed text
    (`OnlineStrategy.reads_records` False) gets from it exactly what a replay would give it.
    `text`: the target's pass over this text when one is at hand (the rows a serving engine
    computed, `online.capture`): then no target forward runs at all."""
    prompt, continuation = [int(t) for t in prompt], [int(t) for t in continuation]
    if not prompt or not continuation:
        raise ValueError("feedback needs a prompt and at least the first generated token")
    start = len(prompt)
    ids = torch.tensor([prompt + continuation], device=target.device)
    if text is None:
        text = text_pass(target, ids, start, features=True)
    elif text.features is None:
        raise ValueError("the text pass holds no features to learn from")
    _, labels = _checked_rows(target, text, ids, start, keep_labels, tolerance)
    return Generation(
        prompt=prompt,
        tokens=continuation,
        records=[],
        stopped_on_eos=continuation[-1] in target.eos_token_ids,
        features=text.features[0, : ids.shape[1] - 1],
        label_logprobs=None if labels is None else labels[0],
        label_ids=None if labels is None else labels[1],
    )


def _replayed_step(
    tree: DraftTree, anchor: int, ids: Tensor, rows: Tensor, draft_seconds: float
) -> StepRecord:
    """The record of the verification step at `anchor` (rows[d]: the target at anchor + d)."""
    tic = time.perf_counter()
    tree = without_draft_probs(tree).to("cpu")
    following = ids[anchor + 1 :].cpu()
    argmax, known = committed_argmax(tree, following)
    verification = verify_greedy_argmax(tree, argmax)
    committed = verification.committed_tokens(tree)
    # the text ends: a cut, as in the decoder (budget or EOS); committed equals the text by
    # construction (verification read its argmax from it)
    count = min(len(committed), int(following.shape[0]))
    n = tree.num_nodes
    logprobs = torch.full((n,), float("nan"))
    if n:
        parent_rows = tree.parents + 1
        readable = known[parent_rows]  # the parent's row lies on the committed text
        if bool(readable.any()):
            depth_of_row = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
            at = depth_of_row[parent_rows[readable]].to(rows.device)
            scored = torch.log_softmax(rows[at], dim=-1)
            picked = scored.gather(1, tree.tokens[readable].to(rows.device).unsqueeze(1))
            logprobs[readable] = picked.squeeze(1).cpu()
    record = StepRecord(
        anchor=anchor,
        tree=tree,
        target_token_logprobs=logprobs,
        target_argmax=argmax,
        accepted=verification.accepted.cpu(),
        committed=committed,
        temperature=0.0,
        timings={"draft": draft_seconds, "verify": time.perf_counter() - tic, "update": 0.0},
    )
    return record.cut(count)
