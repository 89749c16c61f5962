"""The speculative decoder: draft a tree, verify it with one target forward, keep what matches.

This one engine produces training rollouts, measures acceptance, serves online updates and
defines what export must reproduce (docs/architecture.md), so it records every verification step as a
`StepRecord`: GTO reads the trees and target probabilities, Draft-OPD the anchors and the
accept/reject split, OnlineSpec the per-round feedback.

`SpeculativeDecoder.generate` runs a `DecodeSession` to the end; serving and online learning
drive the session step by step and may swap the drafter between steps. Drafting goes through
the drafter's own proposer (`Drafter.proposer`, the seam objectives use for B trees) and
verification through `decoding.score` (the tree-block conventions), so there is one engine.

Why one file (~620 lines): the decoder and its per-request session are the one engine; the
tree maths, masks and verification it calls live in their own modules (tree.py, verify.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from lightning_spec.decoding.build import TreePolicy
from lightning_spec.decoding.score import score_trees_target
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.decoding.verify import (
    Verification,
    draw_uniforms,
    inverse_cdf_sample,
    verify_greedy,
    verify_greedy_argmax,
    verify_sample,
)
from lightning_spec.metrics import tau_from_records
from lightning_spec.models.cache import keep_cache_entries
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.drafters.proposer import absorb, absorbed_offset
from lightning_spec.models.logits import tempered_log_softmax, tempered_softmax
from lightning_spec.models.target import TargetModel

GreedyVerifier = Callable[[DraftTree, Tensor], Verification]

RECORD_VERSION = 2


@dataclass
class SparseRows:
    """Top-k of the target's log-probs at some tree rows (0 = root, i + 1 = node i).

    The rows kept are those that score *tried* nodes (the root and the accepted nodes):
    enough for distillation at the drafter's errors without V floats per node.
    """

    rows: Tensor  # [r] long
    logprobs: Tensor  # [r, k] the k best target log-probs of each row
    ids: Tensor  # [r, k] their token ids
    logsumexp: Tensor  # [r] of the (tempered) logits: logit = logprob + logsumexp


@dataclass
class StepRecord:
    """One verification step: the raw material of every training objective (format v2).

    The record carries no model state, so a serving engine (SGLang, vLLM) can produce the same
    records for large targets without anything else changing. A node is *tried* when its
    parent is the root or accepted (verification looked at it); *rejected* nodes are tried and
    not accepted. When the step was cut (EOS among the accepted drafts, or the token limit),
    `accepted` is cut with `committed`, `bonus_committed` is False, and the children of the
    last kept node count as untried: what lies beyond the cut is not part of the record.
    """

    anchor: int
    """Sequence position of the root (the last committed token before this step)."""
    tree: DraftTree
    """The verified tree (on the CPU), with draft log-probs and, when sampling, draft rows."""
    target_token_logprobs: Tensor
    """[N] log p_target(node token | its parent's context) at the step's temperature."""
    target_argmax: Tensor
    """[N + 1] the target's argmax at the root (row 0) and at each node (row i + 1)."""
    accepted: Tensor
    """[a] accepted node indices, depth 1 first."""
    committed: list[int]
    """Tokens this step appended: accepted drafts then the bonus token (cut at EOS / limit)."""
    temperature: float = 0.0
    target_probs: Tensor | None = None
    """[N + 1, V] target distribution rows, only when the decoder keeps them."""
    timings: dict[str, float] = field(default_factory=dict)
    bonus_committed: bool = True
    """Whether committed[-1] is the target's bonus/correction token (False after a cut)."""
    target_rows: SparseRows | None = None
    """Optional sparse target rows for the rows that score tried nodes."""
    drafter_version: str | None = None
    """The drafter that drafted this step (stale rollouts are detectable)."""

    @property
    def accept_length(self) -> int:
        return int(self.accepted.shape[0])

    @property
    def tried(self) -> Tensor:
        """Bool [N]: the node's parent is the root or accepted (see the class docstring)."""
        parents = self.tree.parents.cpu()
        open_rows = torch.zeros(self.tree.num_nodes + 1, dtype=torch.bool)
        open_rows[0] = True
        open_rows[self.accepted.cpu() + 1] = True
        if not self.bonus_committed:  # the cut closed the last kept node's children
            last = int(self.accepted[-1]) + 1 if self.accept_length else 0
            open_rows[last] = False
        return open_rows[parents + 1]

    @property
    def rejected(self) -> Tensor:
        """[r] tried and not accepted nodes, ascending (Draft-OPD's rejected stream)."""
        mask = self.tried.clone()
        mask[self.accepted.cpu()] = False
        return mask.nonzero().flatten()

    @property
    def first_rejected(self) -> int:
        """The first tried-and-rejected node after the accepted path (where the accepted path
        broke: the lowest-index rejected child of the last accepted node or of the root), -1
        when there is none (a leaf was reached or the step was cut)."""
        if not self.bonus_committed:
            return -1
        last = int(self.accepted[-1]) if self.accept_length else -1
        children = (self.tree.parents.cpu() == last).nonzero().flatten()
        return int(children[0]) if children.numel() else -1

    def cut(self, count: int) -> StepRecord:
        """This step with only the first `count` committed tokens (EOS, token or length cut)."""
        if count >= len(self.committed):
            return self
        if count < 1:
            raise ValueError("a step commits at least one token")
        return replace(
            self,
            committed=self.committed[:count],
            accepted=self.accepted[: min(count, self.accept_length)],
            bonus_committed=False,
        )


@dataclass
class Generation:
    """Output of `SpeculativeDecoder.generate` (or a finished `DecodeSession`)."""

    prompt: list[int]
    tokens: list[int]
    """New tokens (the prefill's first token included)."""
    records: list[StepRecord]
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    stopped_on_eos: bool = False
    features: Tensor | None = None
    """[len(prompt + tokens) - 1, F] the target's features of every committed token but the
    last (what an EAGLE loss reads), when the decoder keeps them: OnlineSpec trains on them
    without a second target pass."""
    drafter_version: str | None = None
    label_logprobs: Tensor | None = None
    """[len(tokens), k] the top-k target log-probs of the distribution each new token was chosen
    from (row i: the target after the token before ``tokens[i]``), when the decoder keeps them
    (``keep_labels``): OnlineSpec's soft labels, again without a second target pass."""
    label_ids: Tensor | None = None
    """[len(tokens), k] the token ids of `label_logprobs`."""

    @property
    def tau(self) -> float:
        """Tokens committed per target verification (`metrics.tau_from_records`); NaN if none."""
        tau = tau_from_records(self.records)
        return float("nan") if tau is None else tau

    @property
    def num_verifications(self) -> int:
        return len(self.records)


class SpeculativeDecoder:
    """Lossless speculative decoding of a frozen target with a drafter and a tree policy."""

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter,
        policy: TreePolicy,
        *,
        temperature: float = 0.0,
        greedy_verifier: GreedyVerifier | None = None,
        keep_target_probs: bool = False,
        keep_target_rows: int = 0,
        keep_features: bool = False,
        keep_labels: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        use_kernels: bool = False,
        drafter_version: str | None = None,
    ) -> None:
        """`use_kernels` routes the target's tree forward through the Triton tree-attention
        kernel and greedy verification through the fused tree-verify kernel (GPU, or CPU under
        TRITON_INTERPRET=1); it switches the target model's attention implementation.
        `keep_target_rows` > 0 records that many top target log-probs per tried row
        (`StepRecord.target_rows`); `keep_features` keeps the committed tokens' target features
        on the `Generation`, and `keep_labels` > 0 that many top target log-probs of the
        distribution each new token came from (`Generation.label_logprobs`)."""
        _check_temperature(temperature)
        if use_kernels:
            from lightning_spec.decoding.fast_path import (
                enable_tree_attention,
                triton_greedy_verifier,
            )

            enable_tree_attention(target.model)
            greedy_verifier = greedy_verifier or triton_greedy_verifier
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.temperature = float(temperature)
        self.greedy_verifier = greedy_verifier or verify_greedy
        self.keep_target_probs = keep_target_probs
        self.keep_target_rows = int(keep_target_rows)
        self.keep_features = keep_features
        if keep_labels < 0:
            raise ValueError(f"keep_labels must be >= 0, got {keep_labels}")
        self.keep_labels = int(keep_labels)
        self.drafter_version = drafter_version
        self.eos_token_ids = set(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
        _check_vocab(drafter, target)
        drafter.bind_target(target)  # weights shared with the target (DFlash), else a no-op

    def start(
        self,
        prompt_ids: Sequence[int] | Tensor,
        max_new_tokens: int,
        *,
        temperature: float | None = None,
        generator: torch.Generator | None = None,
        stop_on_eos: bool = True,
    ) -> DecodeSession:
        """Prefill `prompt_ids` and return a session that decodes step by step."""
        return DecodeSession(
            self,
            prompt_ids,
            max_new_tokens,
            temperature=self.temperature if temperature is None else float(temperature),
            generator=generator,
            stop_on_eos=stop_on_eos,
        )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int] | Tensor,
        max_new_tokens: int,
        *,
        temperature: float | None = None,
        generator: torch.Generator | None = None,
        stop_on_eos: bool = True,
    ) -> Generation:
        """Decode up to `max_new_tokens` after `prompt_ids` (a 1-D list or tensor)."""
        session = self.start(
            prompt_ids,
            max_new_tokens,
            temperature=temperature,
            generator=generator,
            stop_on_eos=stop_on_eos,
        )
        while not session.done:
            session.step()
        return session.result()


class DecodeSession:
    """One generation, step by step: `step()` drafts, verifies and commits once; `refresh`
    swaps or reloads the drafter between steps (re-absorbing the committed tokens with the
    target features the session kept), so an online learner can update mid-stream.

    Bookkeeping (batch size 1). The committed sequence is t_0 .. t_R; the last committed token
    t_R is the *root*: the target cache holds t_0 .. t_{R-1} (the root's row is computed by the
    next verification). A step feeds [root] + the N tree nodes with the tree mask and
    positions R + depth (`decoding.score`), keeps the root and the accepted path in the cache,
    and appends the accepted tokens and the bonus token to the sequence. The drafter holds one
    entry per absorbed token (`models.drafters.proposer`); after drafting it is rolled back to
    the committed tokens, which are then re-absorbed with the target's true features.
    """

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        prompt_ids: Sequence[int] | Tensor,
        max_new_tokens: int,
        *,
        temperature: float,
        generator: torch.Generator | None,
        stop_on_eos: bool,
    ) -> None:
        _check_temperature(temperature)
        self.decoder = decoder
        self.temperature = temperature
        self.generator = generator
        self.stop_on_eos = stop_on_eos
        self.max_new_tokens = int(max_new_tokens)
        target = decoder.target
        prompt = [
            int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, Tensor) else prompt_ids)
        ]
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if max(prompt) >= target.vocab_size or min(prompt) < 0:
            raise ValueError("prompt token id out of the target's vocabulary")
        target.check_fits(len(prompt), max(0, int(max_new_tokens)))
        self.prompt = prompt
        self.records: list[StepRecord] = []
        self.new_tokens: list[int] = []
        self.sequence = list(prompt)
        self.stopped = False
        self._features: list[Tensor] = []  # target features of sequence[:-1], in chunks
        self._labels: list[tuple[Tensor, Tensor]] = []  # top-k label rows of new_tokens
        self._start_time = time.perf_counter()
        self.prefill_seconds = 0.0
        self.cache: object | None = None
        if self.max_new_tokens <= 0:
            return
        needs_features = decoder.drafter.needs_features or decoder.keep_features
        # Only the last row's logits are used: the lm_head over the whole prompt (49k x 576 per
        # token on SmolLM2) would be most of the time to first token.
        output = target(
            torch.tensor([prompt], device=target.device),
            output_features=needs_features,
            logits_to_keep=1,
        )
        self.cache = output.cache
        first = _choose(output.logits[0, -1], temperature, generator)
        self.sequence.append(first)
        self.new_tokens.append(first)
        self.prefill_seconds = time.perf_counter() - self._start_time
        self.stopped = stop_on_eos and first in decoder.eos_token_ids
        if output.features is not None:
            self._features.append(output.features[0])
        if decoder.keep_labels:
            self._labels.append(top_label_rows(output.logits[0, -1:], decoder.keep_labels))
        self._absorb_all()

    # ------------------------------------------------------------------ state
    @property
    def done(self) -> bool:
        return self.stopped or len(self.new_tokens) >= self.max_new_tokens

    @property
    def features(self) -> Tensor | None:
        """[len(sequence) - 1, F] target features of the committed tokens but the last."""
        return torch.cat(self._features) if self._features else None

    def refresh(self, drafter: Drafter | None = None, *, version: str | None = None) -> None:
        """Use `drafter` (or the decoder's current one, e.g. after an update) from the next
        step on: a fresh drafter state re-absorbs every committed token."""
        decoder = self.decoder
        if drafter is not None:
            _check_vocab(drafter, decoder.target)
            drafter.bind_target(decoder.target)
            decoder.drafter = drafter
        if version is not None:
            decoder.drafter_version = version
        if decoder.drafter.needs_features and not self._features:
            raise RuntimeError("the session kept no target features to re-absorb")
        if not self.done:
            self._absorb_all()

    def _absorb_all(self) -> None:
        """A new drafter state over the whole committed sequence (prefill or refresh)."""
        drafter = self.decoder.drafter
        self.state = drafter.new_state(1)
        offset = absorbed_offset(drafter)
        device = self.decoder.target.device
        tokens = torch.tensor([self.sequence[offset:]], device=device)
        features = None
        if drafter.needs_features:
            features = self.features[: tokens.shape[1]].unsqueeze(0)
        output = absorb(drafter, self.state, tokens, offset, features)
        self.root_logits, self.root_hidden = output.logits[0, -1], output.hidden[0, -1]

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def step(self) -> StepRecord:
        """Draft, verify and commit once; returns the step's record."""
        if self.done:
            raise RuntimeError("the session is done: no tokens left to decode")
        decoder = self.decoder
        record, committed_features, label_rows = self._verify_step()
        budget = self.max_new_tokens - len(self.new_tokens)
        count = min(len(record.committed), budget)
        for index, token in enumerate(record.committed[:count]):
            if self.stop_on_eos and token in decoder.eos_token_ids:
                count = index + 1
                self.stopped = True
                break
        record = record.cut(count)
        if committed_features is not None:  # one row per committed token: cut with them
            committed_features = committed_features[:count]
        if label_rows is not None:
            self._labels.append((label_rows[0][:count], label_rows[1][:count]))
        self.records.append(record)
        self.new_tokens.extend(record.committed)
        self.sequence.extend(record.committed)
        if committed_features is not None:
            self._features.append(committed_features)
        if not self.done:
            tic = time.perf_counter()
            absorbed = record.accept_length + 1
            root = len(self.sequence) - 1
            device = decoder.target.device
            tokens = torch.tensor([self.sequence[-absorbed:]], device=device)
            features = None
            if decoder.drafter.needs_features:
                features = committed_features.unsqueeze(0)
            output = absorb(decoder.drafter, self.state, tokens, root - absorbed + 1, features)
            self.root_logits, self.root_hidden = output.logits[0, -1], output.hidden[0, -1]
            record.timings["draft"] += time.perf_counter() - tic
        return record

    def result(self) -> Generation:
        """The generation so far (complete once `done`)."""
        return Generation(
            prompt=self.prompt,
            tokens=list(self.new_tokens),
            records=list(self.records),
            prefill_seconds=self.prefill_seconds,
            total_seconds=time.perf_counter() - self._start_time,
            stopped_on_eos=self.stopped,
            features=self.features if self.decoder.keep_features else None,
            drafter_version=self.decoder.drafter_version,
            label_logprobs=torch.cat([v for v, _ in self._labels]) if self._labels else None,
            label_ids=torch.cat([i for _, i in self._labels]) if self._labels else None,
        )

    def _verify_step(self) -> tuple[StepRecord, Tensor | None, tuple[Tensor, Tensor] | None]:
        decoder = self.decoder
        drafter, target, temperature = decoder.drafter, decoder.target, self.temperature
        root_position = len(self.sequence) - 1
        timings: dict[str, float] = {}
        # ---- draft, through the drafter's own proposer (the seam objectives use too)
        tic = time.perf_counter()
        device = self.root_logits.device
        proposer = drafter.proposer(
            self.state,
            self.root_logits.unsqueeze(0),
            self.root_hidden.unsqueeze(0),
            torch.tensor([root_position], device=device),
            temperature=temperature,
        )
        tree = decoder.policy.build_batch(
            proposer,
            temperature=temperature,
            generator=self.generator,
            keep_draft_probs=decoder.policy.needs_draft_probs(temperature),
        )[0]
        proposer.finish()
        graft = getattr(decoder.policy, "graft", None)  # prompt lookup (decoding.lookup)
        if graft is not None:
            tree = graft(tree, self.sequence, temperature)
        timings["draft"] = time.perf_counter() - tic
        # ---- verify: one target forward over [root] + nodes with the tree mask
        tic = time.perf_counter()
        n = tree.num_nodes
        outputs = {"rows"}
        keep_features = drafter.needs_features or decoder.keep_features
        if keep_features:
            outputs.add("features")
        scores = score_trees_target(
            target,
            self.cache,
            [tree],
            [self.sequence[-1]],
            [root_position],
            outputs=outputs,
            keep_block=True,
            max_tokens=n + 1,
        )[0]
        logits = scores.rows  # [N + 1, V] float
        argmax = logits.argmax(dim=-1)  # [N + 1], once: the record and greedy verification
        if temperature > 0:
            probs = tempered_softmax(logits, temperature)
            verification = verify_sample(tree, probs, generator=self.generator)
        elif decoder.greedy_verifier is verify_greedy:
            probs = None
            verification = verify_greedy_argmax(tree, argmax)
        else:
            probs = None
            verification = decoder.greedy_verifier(tree, logits)
        timings["verify"] = time.perf_counter() - tic
        observe = getattr(decoder.policy, "observe", None) if graft is not None else None
        if observe is not None:
            observe(verification.committed_tokens(tree))  # the lookup's running acceptance
        # ---- update: keep the root and the accepted path in the target cache
        tic = time.perf_counter()
        accepted = verification.accepted.cpu()
        keep = torch.cat([torch.zeros(1, dtype=torch.long), accepted + 1])
        keep_cache_entries(self.cache, n + 1, keep)
        features = None
        if keep_features:
            features = scores.features[keep.to(scores.features.device)]
        # log p of each node token from its parent's row: a log-softmax over the rows that are
        # parents only (about half the tree's rows), never all [N + 1, V]
        token_logprobs = torch.zeros(0)
        if n:
            parent_rows = tree.parents.to(logits.device) + 1
            rows, inverse = torch.unique(parent_rows, return_inverse=True)
            row_logprobs = tempered_log_softmax(logits[rows], temperature)
            token_logprobs = row_logprobs[inverse, tree.tokens.to(logits.device)].cpu()
        target_rows = None
        if decoder.keep_target_rows > 0:
            rows = keep.to(logits.device)  # the root and the accepted nodes score tried nodes
            kept = logits[rows]
            values, ids = tempered_log_softmax(kept, temperature).topk(
                min(decoder.keep_target_rows, logits.shape[-1])
            )
            lse = torch.logsumexp(_tempered(kept, temperature), dim=-1)
            target_rows = SparseRows(rows.cpu(), values.cpu(), ids.cpu(), lse.cpu())
        timings["update"] = time.perf_counter() - tic
        keep_q = tree.draft_probs is not None and tree.iid_children
        record = StepRecord(
            anchor=root_position,
            tree=tree.to("cpu") if keep_q else without_draft_probs(tree).to("cpu"),
            target_token_logprobs=token_logprobs,
            target_argmax=argmax.cpu(),
            accepted=accepted,
            committed=verification.committed_tokens(tree),
            temperature=temperature,
            target_probs=(probs if probs is not None else torch.softmax(logits, -1)).cpu()
            if decoder.keep_target_probs
            else None,
            timings=timings,
            target_rows=target_rows,
            drafter_version=decoder.drafter_version,
        )
        labels = None
        if decoder.keep_labels:  # the root's and accepted rows chose the committed tokens
            labels = top_label_rows(logits[keep.to(logits.device)], decoder.keep_labels)
        return record, features, labels


def top_label_rows(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(log-probs, ids) [rows, k] of the k most likely tokens of each row of `logits`, on the
    CPU: a soft label at k floats per token instead of the vocabulary's."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(int(k), logits.shape[-1]))
    return values.cpu(), ids.cpu()


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """Logits scaled for `temperature` so that log p = scaled - logsumexp(scaled) stays finite
    at any T > 0 (max subtracted first, as in `tempered_log_softmax`)."""
    if temperature <= 0 or temperature == 1.0:
        return logits
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature


def without_draft_probs(tree: DraftTree) -> DraftTree:
    """The tree without its [N + 1, V] q rows (kept only where verification reads them)."""
    if tree.draft_probs is None:
        return tree
    return replace(tree, draft_probs=None)


def _check_vocab(drafter: Drafter, target: TargetModel) -> None:
    drafter_vocab = drafter.target_vocab_size
    if drafter_vocab != target.vocab_size:
        raise ValueError(
            f"drafter maps onto a vocabulary of {drafter_vocab} tokens but the target has "
            f"{target.vocab_size}: the drafter was built for another tokenizer"
        )


def _check_temperature(temperature: float) -> None:
    if not temperature >= 0:  # also catches NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")


def _choose(logits: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy or sampled token from one row of target logits.

    The uniform is drawn on the generator's own device, so a CUDA generator works too
    (`torch.multinomial` on CPU probabilities rejects one).
    """
    if temperature <= 0:
        return int(logits.argmax())
    probs = tempered_softmax(logits, temperature)
    return inverse_cdf_sample(probs, draw_uniforms(1, generator)[0])


@torch.no_grad()
def autoregressive_generate(
    target: TargetModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_on_eos: bool = True,
    timings: dict[str, float] | None = None,
) -> list[int]:
    """Plain decoding with our own KV-cache loop: the reference for losslessness and speed.

    `timings`, when given, receives ``first_token``: seconds from the call to the first chosen
    token (the prefill forward; time to first token in benches).
    """
    if max_new_tokens <= 0:
        return []
    target.check_fits(len(prompt_ids), max_new_tokens)
    device = target.device
    eos = target.eos_token_ids
    tic = time.perf_counter()
    output = target(
        torch.tensor([list(prompt_ids)], device=device), output_features=False, logits_to_keep=1
    )
    cache = output.cache
    tokens: list[int] = []
    while True:
        token = _choose(output.logits[0, -1], temperature, generator)
        if timings is not None and not tokens:
            timings["first_token"] = time.perf_counter() - tic
        tokens.append(token)
        if len(tokens) >= max_new_tokens or (stop_on_eos and token in eos):
            return tokens
        output = target(torch.tensor([[token]], device=device), cache=cache, output_features=False)
