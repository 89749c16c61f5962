"""The speculative decoder: draft a tree, verify it with one target forward, keep what matches.

This one engine produces training rollouts, measures acceptance, serves online updates and
defines what export must reproduce (ARCHITECTURE.md), so it records every verification step as a
`StepRecord`: GTO reads the trees and target probabilities, Draft-OPD the anchors and the
accept/reject split, OnlineSpec the per-round feedback.

Bookkeeping (batch size 1). The committed sequence is t_0 .. t_R; the last committed token t_R is
the *root*: the target cache holds t_0 .. t_{R-1} (the root's logits are computed by the next
verification). A step feeds [root] + the N tree nodes to the target with the tree mask and
positions R + depth, keeps the root and the accepted path in the cache (gathered, since accepted
nodes are not contiguous) and appends accepted tokens + the bonus token to the sequence.
Drafters hold one cache entry per absorbed token at that token's position; an EAGLE entry for
token t_j also reads the target feature of t_{j-1} (so t_0 is never absorbed), and a tree node's
entry reads its parent's drafter hidden state instead. After drafting, the drafter cache is
rolled back to the committed tokens, which are then re-absorbed with the target's true features.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_spec.decoding.build import TreePolicy
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.decoding.verify import Verification, verify_greedy, verify_sample
from lightning_spec.models.cache import keep_cache_entries
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.target import TargetModel

GreedyVerifier = Callable[[DraftTree, Tensor], Verification]


@dataclass
class StepRecord:
    """One verification step: the raw material of every training objective.

    The record carries no model state, so a serving engine (SGLang, vLLM) can produce the same
    records for large targets without anything else changing.
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

    @property
    def accept_length(self) -> int:
        return int(self.accepted.shape[0])

    @property
    def rejected(self) -> Tensor:
        """Nodes that were verified and not accepted (Draft-OPD's rejected stream)."""
        mask = torch.ones(self.tree.num_nodes, dtype=torch.bool)
        mask[self.accepted] = False
        return mask.nonzero().flatten()


@dataclass
class Generation:
    """Output of `SpeculativeDecoder.generate`."""

    prompt: list[int]
    tokens: list[int]
    """New tokens (the prefill's first token included)."""
    records: list[StepRecord]
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    stopped_on_eos: bool = False

    @property
    def tau(self) -> float:
        """Tokens committed per target verification (accepted drafts + bonus), averaged."""
        if not self.records:
            return float("nan")
        return sum(len(r.committed) for r in self.records) / len(self.records)

    @property
    def num_verifications(self) -> int:
        return len(self.records)


class _DrafterProposer:
    """Adapts a Drafter to the `Proposer` protocol of tree policies, for one step."""

    def __init__(
        self,
        drafter: Drafter,
        state: object,
        root_logprobs: Tensor,
        root_hidden: Tensor,
        root_position: int,
    ) -> None:
        self.drafter = drafter
        self.state = state
        self.root_logprobs = root_logprobs
        self.root_hidden = root_hidden  # [H]
        self.root_position = root_position
        self.committed_length = drafter.state_length(state)
        self.temperature = 0.0
        # node index -> (offset in the drafter's tree block, output hidden)
        self.offsets: dict[int, int] = {}
        self.hidden: dict[int, Tensor] = {}

    def root(self) -> Tensor:
        return self.root_logprobs

    def expand(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        nodes_list = [int(n) for n in nodes.tolist()]
        parents = tree.parents.tolist()
        depth = tree.depth.tolist()
        block = len(self.offsets)
        count = len(nodes_list)
        device = self.root_hidden.device
        mask = torch.zeros(1, count, self.committed_length + block + count, dtype=torch.bool)
        mask[:, :, : self.committed_length] = True
        for row, node in enumerate(nodes_list):
            ancestor = parents[node]
            while ancestor >= 0:
                if ancestor not in self.offsets:
                    raise RuntimeError(
                        f"node {node} is expanded before its ancestor {ancestor}: tree policies "
                        "must expand parents first"
                    )
                mask[0, row, self.committed_length + self.offsets[ancestor]] = True
                ancestor = parents[ancestor]
            mask[0, row, self.committed_length + block + row] = True
        hidden_in = torch.stack(
            [self.root_hidden if parents[n] < 0 else self.hidden[parents[n]] for n in nodes_list]
        ).unsqueeze(0)
        positions = torch.tensor(
            [[self.root_position + depth[n] for n in nodes_list]], device=device
        )
        tokens = tree.tokens[nodes].unsqueeze(0).to(device)
        output = self.drafter.step(
            self.state, tokens, positions, hidden=hidden_in, mask=mask.to(device)
        )
        for row, node in enumerate(nodes_list):
            self.offsets[node] = block + row
            self.hidden[node] = output.hidden[0, row]
        return _draft_logprobs(self.drafter, output.logits[0], self.temperature)


def _draft_logprobs(drafter: Drafter, logits: Tensor, temperature: float) -> Tensor:
    """Draft log-probs on the target vocabulary, temperature-scaled when sampling."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return drafter.to_target(F.log_softmax(logits, dim=-1))


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
        eos_token_ids: Sequence[int] | None = None,
        use_kernels: bool = False,
    ) -> None:
        """`use_kernels` routes the target's tree forward through the Triton tree-attention
        kernel and greedy verification through the fused tree-verify kernel (GPU, or CPU under
        TRITON_INTERPRET=1); it switches the target model's attention implementation."""
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
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
        self.eos_token_ids = set(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
        drafter_vocab = drafter.target_vocab_size
        if drafter_vocab != target.vocab_size:
            raise ValueError(
                f"drafter maps onto a vocabulary of {drafter_vocab} tokens but the target has "
                f"{target.vocab_size}: the drafter was built for another tokenizer"
            )

    # ------------------------------------------------------------------ helpers
    def _absorb(
        self, state: object, tokens: list[int], start: int, features: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Feed committed `tokens` (positions start..) to the drafter; return last logits, hidden."""
        device = self.target.device
        ids = torch.tensor([tokens], device=device)
        positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)
        kwargs = {}
        if self.drafter.needs_features:
            kwargs["features"] = features.unsqueeze(0)
        output = self.drafter.step(state, ids, positions, **kwargs)
        return output.logits[0, -1], output.hidden[0, -1]

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
        temperature = self.temperature if temperature is None else float(temperature)
        prompt = [
            int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, Tensor) else prompt_ids)
        ]
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if max_new_tokens <= 0:
            return Generation(prompt=prompt, tokens=[], records=[])
        if max(prompt) >= self.target.vocab_size or min(prompt) < 0:
            raise ValueError("prompt token id out of the target's vocabulary")
        device = self.target.device
        start_time = time.perf_counter()
        # Prefill: the target reads the prompt and contributes the first new token.
        output = self.target(torch.tensor([prompt], device=device))
        cache = output.cache
        first = _choose(output.logits[0, -1], temperature, generator)
        sequence = prompt + [first]
        prefill_seconds = time.perf_counter() - start_time
        new_tokens = [first]
        records: list[StepRecord] = []
        stopped = stop_on_eos and first in self.eos_token_ids
        state = self.drafter.new_state(1)
        # The drafter absorbs the prompt and the first token (EAGLE: t_1.., features t_0..).
        if self.drafter.needs_features:
            root_logits, root_hidden = self._absorb(state, sequence[1:], 1, output.features[0])
        else:
            root_logits, root_hidden = self._absorb(state, sequence, 0, None)
        while not stopped and len(new_tokens) < max_new_tokens:
            record, committed_features = self._step(
                cache, state, sequence, root_logits, root_hidden, temperature, generator
            )
            budget = max_new_tokens - len(new_tokens)
            committed = record.committed[:budget]
            for index, token in enumerate(committed):
                if stop_on_eos and token in self.eos_token_ids:
                    committed = committed[: index + 1]
                    stopped = True
                    break
            record.committed = committed
            records.append(record)
            new_tokens.extend(committed)
            sequence.extend(committed)
            if stopped or len(new_tokens) >= max_new_tokens:
                break
            tic = time.perf_counter()
            root = len(sequence) - 1
            absorbed = record.accept_length + 1
            if self.drafter.needs_features:
                root_logits, root_hidden = self._absorb(
                    state, sequence[-absorbed:], root - absorbed + 1, committed_features
                )
            else:
                root_logits, root_hidden = self._absorb(
                    state, sequence[-absorbed:], root - absorbed + 1, None
                )
            record.timings["draft"] += time.perf_counter() - tic
        return Generation(
            prompt=prompt,
            tokens=new_tokens,
            records=records,
            prefill_seconds=prefill_seconds,
            total_seconds=time.perf_counter() - start_time,
            stopped_on_eos=stopped,
        )

    def _step(
        self,
        cache: object,
        state: object,
        sequence: list[int],
        root_logits: Tensor,
        root_hidden: Tensor,
        temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[StepRecord, Tensor | None]:
        device = self.target.device
        root_position = len(sequence) - 1
        timings: dict[str, float] = {}
        # ---- draft
        tic = time.perf_counter()
        proposer = _DrafterProposer(
            self.drafter,
            state,
            _draft_logprobs(self.drafter, root_logits, temperature),
            root_hidden,
            root_position,
        )
        proposer.temperature = temperature
        committed_length = proposer.committed_length
        tree = self.policy.build(
            proposer,
            temperature=temperature,
            generator=generator,
            keep_draft_probs=temperature > 0,
        )
        self.drafter.truncate_state(state, committed_length)
        timings["draft"] = time.perf_counter() - tic
        # ---- verify: one target forward over [root] + nodes with the tree mask
        tic = time.perf_counter()
        n = tree.num_nodes
        past = root_position
        mask = torch.zeros(1, n + 1, past + n + 1, dtype=torch.bool)
        mask[:, :, : past + 1] = True
        if n:
            mask[0, 1:, past + 1 :] = tree.ancestor_mask().cpu()
        tokens = torch.cat([torch.tensor([sequence[-1]]), tree.tokens.cpu()]).unsqueeze(0)
        depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth.cpu()])
        positions = (root_position + depth).unsqueeze(0)
        output = self.target(
            tokens.to(device),
            position_ids=positions.to(device),
            tree_mask=mask.to(device),
            cache=cache,
        )
        logits = output.logits[0].float()  # [N + 1, V]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            verification = verify_sample(tree, probs, generator=generator)
            row_logprobs = torch.log(probs.clamp_min(1e-30))
        else:
            probs = None
            verification = self.greedy_verifier(tree, logits)
            row_logprobs = F.log_softmax(logits, dim=-1)
        timings["verify"] = time.perf_counter() - tic
        # ---- update: keep the root and the accepted path in the target cache
        tic = time.perf_counter()
        accepted = verification.accepted.cpu()
        keep = torch.cat([torch.zeros(1, dtype=torch.long), accepted + 1])
        keep_cache_entries(cache, n + 1, keep)
        features = None
        if self.drafter.needs_features:
            features = output.features[0, keep.to(device)]
        parent_rows = (tree.parents.cpu() + 1) if n else torch.zeros(0, dtype=torch.long)
        token_logprobs = row_logprobs.cpu()[parent_rows, tree.tokens.cpu()] if n else torch.zeros(0)
        timings["update"] = time.perf_counter() - tic
        record = StepRecord(
            anchor=root_position,
            tree=tree.to("cpu"),
            target_token_logprobs=token_logprobs,
            target_argmax=logits.argmax(dim=-1).cpu(),
            accepted=accepted,
            committed=verification.committed_tokens(tree),
            temperature=temperature,
            target_probs=(probs if probs is not None else torch.softmax(logits, -1)).cpu()
            if self.keep_target_probs
            else None,
            timings=timings,
        )
        return record, features


def _choose(logits: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy or sampled token from one row of target logits."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def autoregressive_generate(
    target: TargetModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_on_eos: bool = True,
) -> list[int]:
    """Plain decoding with our own KV-cache loop: the reference for losslessness and speed."""
    device = target.device
    eos = target.eos_token_ids
    output = target(torch.tensor([list(prompt_ids)], device=device), output_features=False)
    cache = output.cache
    tokens: list[int] = []
    while True:
        token = _choose(output.logits[0, -1], temperature, generator)
        tokens.append(token)
        if len(tokens) >= max_new_tokens or (stop_on_eos and token in eos):
            return tokens
        output = target(torch.tensor([[token]], device=device), cache=cache, output_features=False)
