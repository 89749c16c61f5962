"""GTO, Group Tree Optimization (arXiv 2509.22134): train the drafter on the tree it decodes with.

Ordinary drafters learn the next greedy token; decoding verifies a whole tree, reranked and
pruned by the tree policy. GTO optimises the tree itself (docs/methods/gto.md). Per
training sequence:

1. K groups of m adjacent prefix positions R (roots whose next token is an assistant token).
2. For every root, the current drafter's tree and the frozen reference drafter's tree, built by
   the decoder's own tree policy through the decoder's own drafting seam
   (`Drafter.sequence_proposer` + `policy.build_batch`: one teacher-forced drafter pass per
   sequence serves all roots).
3. Both sets of trees scored by the target in chunked forwards over ONE cache of the sequence
   (`decoding.score.score_trees_target`, the scoring code verification uses): per-node factors
   p_T(node | parent) give branch values and the tree reward r (`losses.gto_tree_reward`); the
   target's argmax (T = 0) or the decoder's own rejection sampler (T > 0) gives the accepted path
   S of the current tree (`decoding.verify`).
4. Debiased reward R = r - rbar (reference tree at the same prefix), group-standardised
   advantages, the per-token geometric-mean ratio s = exp((log M(S) - log M0(S)) / l) with
   log M(S) re-scored with gradients through the same seam (`path_logprobs`), and the clipped
   surrogate. Total loss = L_token (the EAGLE-3 TTT loss, `SFT`) + omega * L_GTO.

Nothing here builds a tree, a mask or a verification of its own: what GTO trains on is exactly
what the decoder would build and verify at that prefix.

Misalignment statistics (the paper's motivation), per validation batch for both drafters: the
share of prefixes whose greedy chain (the drafter's top-1 at every depth, drafted by `chain:D`
through the same seam) is pruned from the tree, and the share whose accepted path follows that
chain. They are measured on teacher-forced prefixes of held-out sequences, not on free decodes.

Why one file (~630 lines): one objective; its group choice, cached T = 0 rows, misalignment
statistics and the LightningModule are the paper's Algorithm 1 in order, and the pure reward
maths is in `losses.py`.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_spec.decoding.build import ChainPolicy, parse_tree_spec
from lightning_spec.decoding.lookup import require_drafter_policy
from lightning_spec.decoding.score import TreeScores, score_trees_target, text_scores
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.decoding.verify import verify_greedy_argmax, verify_sample
from lightning_spec.deprecation import renamed
from lightning_spec.models.drafters.base import Drafter
from lightning_spec.models.drafters.proposer import absorbed_offset
from lightning_spec.models.logits import tempered_softmax
from lightning_spec.models.target import TargetModel
from lightning_spec.objectives import losses
from lightning_spec.objectives.sft import SFT

log = logging.getLogger(__name__)

__all__ = ["GTO", "GTOResult", "choose_groups", "misalignment"]

AGGREGATIONS = ("lse", "max", "mean")
VALIDATION_SEED = 1_000_003
REWARD_FACTORS = ("auto", "probs", "greedy")


def choose_groups(
    loss_mask: Tensor,
    *,
    groups: int,
    group_size: int,
    offset: int,
    generator: torch.Generator,
    reach: int = 0,
) -> Tensor | None:
    """[K', m] root positions: up to `groups` non-overlapping groups of `group_size` adjacent
    valid roots (the paper partitions the sequence into K groups of m, K up to s / m).

    A root R is valid when the drafter has an entry for it (R >= offset), a next position
    exists and that next token is a loss (assistant) token, and a tree `reach` deep from it
    stays inside the text (R + reach < L): a tree that runs past the end of the text cannot be
    scored from the cached pass, and at serving time the text ends there. Each run of
    consecutive valid roots is cut into whole groups of m from its start; `groups` of those (all,
    when fewer) are drawn without replacement and returned in sequence order. None when no run
    holds m roots.
    """
    length = int(loss_mask.shape[0])
    valid = torch.zeros(length, dtype=torch.bool, device=loss_mask.device)
    valid[: length - 1] = loss_mask[1:].bool()
    valid[:offset] = False
    if reach > 0:
        valid[max(0, length - reach) :] = False
    flags = valid.cpu().tolist()
    starts: list[int] = []
    position = 0
    while position < length:
        if not flags[position]:
            position += 1
            continue
        end = position
        while end < length and flags[end]:
            end += 1
        starts.extend(range(position, end - group_size + 1, group_size))
        position = end
    if not starts:
        return None
    order = torch.randperm(len(starts), generator=generator)[:groups]
    chosen = torch.tensor(starts)[order].sort().values
    return chosen.unsqueeze(1) + torch.arange(group_size).unsqueeze(0)


def _cached_rows(
    batch: Mapping[str, Any], row: int, length: int
) -> tuple[Tensor | None, Tensor | None]:
    """(features [1, L, F] or None, target argmax [L] or None) of one batch row, when the data
    module supplied the cached teacher-forced pass."""
    argmax = batch.get("target_argmax")
    features = batch.get("features")
    return (
        None if features is None else features[row : row + 1, :length],
        None if argmax is None else argmax[row, :length],
    )


def misalignment(
    trees: list[DraftTree], greedy_chains: list[DraftTree], accepted: list[list[int]]
) -> tuple[float, float]:
    """(share of trees whose greedy chain is pruned, share whose accepted path follows it).

    `greedy_chains[i]` is the drafter's top-1 chain at the same root, as deep as the tree
    policy drafts; `accepted[i]` the accepted node indices of `trees[i]`. A chain counts as
    pruned when it is not entirely a path of the tree; an accepted path follows the chain when
    its tokens are a prefix of the chain's (an empty accepted path follows every chain).
    """
    if not trees:
        return 0.0, 0.0
    pruned = follows = 0
    for tree, chain, path in zip(trees, greedy_chains, accepted, strict=True):
        chain_tokens = chain.tokens.tolist()
        depth = min(len(chain_tokens), int(tree.max_depth))
        if len(tree.follow(chain_tokens[:depth])) < depth:
            pruned += 1
        taken = tree.tokens[path].tolist() if path else []
        if taken == chain_tokens[: len(taken)]:
            follows += 1
    return pruned / len(trees), follows / len(trees)


@dataclass
class GTOResult:
    """What the GTO term of one batch computed (0-d tensors; floats for statistics)."""

    loss: Tensor
    reward: float = 0.0
    reference_reward: float = 0.0
    accept_length: float = 0.0
    reference_accept_length: float = 0.0
    clip_fraction: float = 0.0
    ratio_mean: float = 1.0
    prefixes: int = 0
    trees_scored: int = 0
    rows_scored: int = 0
    score_seconds: float = 0.0
    seconds: float = 0.0
    pruned: float | None = None
    follows: float | None = None
    reference_pruned: float | None = None
    reference_follows: float | None = None
    extra: dict[str, float] = field(default_factory=dict)
    accept_lengths: list[int] = field(default_factory=list)  # per prefix, in root order
    rewards: list[float] = field(default_factory=list)  # per prefix, in root order


class GTO(SFT):
    """GTO on top of the EAGLE-3 TTT loss (see the module docstring).

    Starts from a trained drafter folder (`drafter_init`); a frozen copy of it is the
    reference (never trained, never in checkpoints: it is reloaded from `drafter_init`).
    """

    checkpoint_key: ClassVar[str] = "gto"

    def __init__(
        self,
        target: str = "smollm2",
        target_dtype: str = "float32",
        drafter_init: str | None = None,
        tree: str = "dynamic:6,10,32",
        temperature: float = 0.0,
        group_size: int = 8,
        groups: int = 16,
        eta: float = 1.0,
        aggregation: str = "lse",
        reward_factors: str = "auto",
        clip_eps: float = 0.2,
        delta: float = 1e-6,
        omega: float = 0.5,
        debias: bool = True,
        token_weight: float = 1.0,
        cached_rewards: bool = True,
        score_max_tokens: int = 512,
        prepack_target: bool = False,
        ttt_steps: int = 7,
        ttt_decay: float = 0.8,
        lr: float = 5e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 1000,
        max_steps_for_schedule: int | None = None,
        max_consecutive_nonfinite: int = 10,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        """
        Args:
            target: Target model: "smollm2" (the embedded default), a hub id, a local folder or a
                `.gguf` file.
            target_dtype: Dtype of the frozen target.
            drafter_init: The trained drafter folder GTO starts from (required); its frozen copy
                is the reference drafter.
            tree: The tree policy decoding uses (chain:K, static:NAME, dynamic:D,K,T): GTO trains
                on the trees this policy builds.
            temperature: Decoding temperature the trees are built and verified at (0 or > 0).
            group_size: m, adjacent prefixes per group (paper: 8; 1 = the ablation without
                groups, where the debiased reward itself is the advantage).
            groups: K, groups per training sequence (paper: 16; CPU configs use fewer).
            eta: LSE temperature of the tree reward (paper: 1).
            aggregation: Tree reward over branch values: lse (paper) | max | mean (ablations).
            reward_factors: Per-node factors of the branch values: "auto" (default) = "greedy"
                at T = 0 and "probs" at T > 0, the factors whose reward is the acceptance the
                decoder verifies with (the paper's Theorem 1b is about the 0/1 factors);
                "probs" = the target's probability of the node token (the T = 1 expected
                acceptance) or "greedy" = 1 if it is the target's argmax (0/1 factors).
            clip_eps: PPO clip range eps of the ratio (ours: 0.2; the paper does not state it).
            delta: Added to the group standard deviation (ours: 1e-6).
            omega: Weight of L_GTO in L_token + omega * L_GTO (paper: 0.5).
            debias: Subtract the reference drafter's tree reward (False: the ablation).
            token_weight: Weight of L_token (1: the paper; 0: GTO alone, the mechanism test).
            cached_rewards: At T = 0 with greedy factors, take every factor from the batch's
                cached target argmax (the teacher-forced pass of the feature store) wherever
                that is exact (the text is the target's greedy text over the tree's depth), and
                the features from the batch: no target forward in the step. Sequences where it
                is not exact are scored through the target as before.
            score_max_tokens: Block rows per target scoring forward (bounds memory).
            prepack_target: CPU fp32: prepack the frozen target's linear weights for oneDNN
                (`models.packed`; faster scoring, same maths to ~1e-6).
            ttt_steps: Unroll steps of the TTT token loss.
            ttt_decay: Weight decay**k of unroll step k in the token loss.
            lr: Peak learning rate of AdamW (paper: 5e-6).
            weight_decay: AdamW weight decay.
            betas: AdamW betas (paper: 0.9, 0.95).
            warmup_steps: Linear warmup steps (paper: 1,000; short CPU runs use fewer).
            max_steps_for_schedule: Steps of the cosine decay; None: the trainer's estimate.
            max_consecutive_nonfinite: Raise after this many consecutive non-finite losses.
            seed: Seed of the prefix choice (and of verification sampling at T > 0).
            cache_dir: Asset cache root.
        """
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if reward_factors not in REWARD_FACTORS:
            raise ValueError(f"reward_factors must be one of {REWARD_FACTORS}")
        if token_weight < 0:
            raise ValueError("token_weight must be >= 0")
        if group_size < 1:
            raise ValueError("group_size must be >= 1 (1: the no-grouping ablation)")
        if groups < 1 or eta <= 0 or clip_eps <= 0 or temperature < 0:
            raise ValueError("groups >= 1, eta > 0, clip_eps > 0 and temperature >= 0 required")
        super().__init__(
            target=target,
            target_dtype=target_dtype,
            drafter_init=drafter_init,
            ttt_steps=ttt_steps,
            ttt_decay=ttt_decay,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            warmup_steps=warmup_steps,
            max_steps_for_schedule=max_steps_for_schedule,
            max_consecutive_nonfinite=max_consecutive_nonfinite,
            cache_dir=cache_dir,
            prepack_target=prepack_target,
        )
        self.policy = parse_tree_spec(tree)
        require_drafter_policy(self.policy, "GTO")
        self.greedy_policy = ChainPolicy(int(self.policy.max_depth))
        self.reference = copy.deepcopy(self.drafter).requires_grad_(False).eval()
        self.factors = (
            ("greedy" if temperature == 0 else "probs")
            if reward_factors == "auto"
            else reward_factors
        )
        self._generator = torch.Generator().manual_seed(int(seed))
        self._prefixes_seen = 0
        self._cached_sequences = 0
        self._scored_sequences = 0

    def build_drafter(self, target: TargetModel) -> Drafter:
        raise ValueError(
            "GTO starts from a trained drafter: set model.init_args.drafter_init to a drafter "
            "folder (e.g. the output of configs/train/eagle3_2h_cpu.yaml)"
        )

    def train(self, mode: bool = True) -> GTO:
        super().train(mode)
        self.reference.eval()  # frozen, whatever Lightning asks of the module tree
        return self

    # ---------------------------------------------------------------------------- GTO term
    def gto_term(
        self,
        batch: Mapping[str, Any],
        *,
        statistics: bool = False,
        generator: torch.Generator | None = None,
    ) -> GTOResult:
        """L_GTO of a batch, sequence by sequence (see the module docstring); `generator`
        draws the groups (default: the training generator)."""
        hp = self.hparams
        tic = time.perf_counter()
        input_ids = batch["input_ids"]
        loss_mask = batch["loss_mask"]
        attention = batch.get("attention_mask")
        parts: list[GTOResult] = []
        for row in range(input_ids.shape[0]):
            length = int(attention[row].sum()) if attention is not None else input_ids.shape[1]
            roots = choose_groups(
                loss_mask[row, :length],
                groups=int(hp.groups),
                group_size=int(hp.group_size),
                offset=absorbed_offset(self.drafter),
                generator=generator or self._generator,
                reach=int(self.policy.max_depth),
            )
            if roots is None:
                continue
            cached = _cached_rows(batch, row, length)
            parts.append(
                self._sequence_term(input_ids[row : row + 1, :length], roots, statistics, cached)
            )
        zero = sum(p.sum() for p in self.drafter.parameters() if p.requires_grad) * 0.0
        if not parts:
            return GTOResult(loss=zero, seconds=time.perf_counter() - tic)
        return _combine(parts, zero, time.perf_counter() - tic)

    def _sequence_term(
        self,
        ids: Tensor,
        roots: Tensor,
        statistics: bool,
        cached: tuple[Tensor | None, Tensor | None] = (None, None),
    ) -> GTOResult:
        hp = self.hparams
        temperature = float(hp.temperature)
        groups, size = roots.shape
        flat = roots.reshape(-1).to(ids.device)
        limit = int(flat.max()) + 1  # the sequence up to the last root
        sequence = ids[:, :limit]
        cached_features, cached_argmax = cached
        with torch.no_grad():
            use_cache = (
                bool(hp.cached_rewards)
                and self.factors == "greedy"
                and temperature == 0
                and cached_argmax is not None
                and (cached_features is not None or not self.drafter.needs_features)
            )
            output = None
            if use_cache:
                features = None if cached_features is None else cached_features[:, :limit]
            else:
                output = self.target(sequence, output_features=self.drafter.needs_features)
                features = output.features
            trees = self._trees(self.drafter, sequence, flat, features)
            reference_trees = self._trees(self.reference, sequence, flat, features)
            score_tic = time.perf_counter()
            scores = reference_scores = None
            if use_cache:
                scores = text_scores(trees, ids[0], cached_argmax, flat)
                reference_scores = text_scores(reference_trees, ids[0], cached_argmax, flat)
            if scores is None or reference_scores is None:  # not exact here: score
                if output is None:
                    output = self.target(sequence, output_features=False)
                root_tokens = sequence[0, flat]
                wanted = ["logprobs", "argmax"] + (["rows"] if temperature > 0 else [])
                scores = self._score(output.cache, trees, root_tokens, flat, wanted)
                reference_scores = self._score(
                    output.cache, reference_trees, root_tokens, flat, ["logprobs", "argmax"]
                )
                self._scored_sequences += 1
            else:
                self._cached_sequences += 1
            score_seconds = time.perf_counter() - score_tic
            rewards = self._rewards(trees, scores)
            reference_rewards = self._rewards(reference_trees, reference_scores)
            accepted = [self._accepted(t, s) for t, s in zip(trees, scores, strict=True)]
            reference_accepted = [
                self._accepted(t, s, sample=False)
                for t, s in zip(reference_trees, reference_scores, strict=True)
            ]
            debiased = losses.debiased_rewards(
                rewards=rewards, reference_rewards=reference_rewards, enabled=bool(hp.debias)
            )
            advantages = losses.group_advantages(
                rewards=debiased.reshape(groups, size), delta=float(hp.delta)
            ).reshape(-1)
        lengths = torch.tensor([len(a) for a in accepted], device=ids.device)
        width = max(1, int(lengths.max()))
        paths = torch.zeros(len(trees), width, dtype=torch.long, device=ids.device)
        for index, (tree, path) in enumerate(zip(trees, accepted, strict=True)):
            if path:
                paths[index, : len(path)] = tree.tokens[path].to(ids.device)
        current = self.drafter.sequence_proposer(
            sequence, flat, features=features, temperature=temperature
        ).path_logprobs(paths, lengths)
        with torch.no_grad():
            reference = self.reference.sequence_proposer(
                sequence, flat, features=features, temperature=temperature
            ).path_logprobs(paths, lengths)
        ratio = losses.sequence_ratio(
            logprobs=current, reference_logprobs=reference, lengths=lengths
        )
        loss, clip_fraction = losses.clipped_surrogate(
            ratio=ratio, advantages=advantages.to(ratio.device), eps=float(hp.clip_eps)
        )
        result = GTOResult(
            loss=loss,
            reward=float(rewards.mean()),
            reference_reward=float(reference_rewards.mean()),
            accept_length=float(lengths.float().mean()),
            reference_accept_length=sum(len(a) for a in reference_accepted) / len(trees),
            clip_fraction=float(clip_fraction),
            ratio_mean=float(ratio.detach().mean()),
            prefixes=len(trees),
            trees_scored=2 * len(trees),
            rows_scored=sum(t.num_nodes + 1 for t in trees + reference_trees),
            score_seconds=score_seconds,
            accept_lengths=[int(n) for n in lengths.tolist()],
            rewards=[float(r) for r in rewards.tolist()],
        )
        if statistics:
            with torch.no_grad():
                chains = self._trees(self.drafter, sequence, flat, features, self.greedy_policy)
                reference_chains = self._trees(
                    self.reference, sequence, flat, features, self.greedy_policy
                )
            result.pruned, result.follows = misalignment(trees, chains, accepted)
            result.reference_pruned, result.reference_follows = misalignment(
                reference_trees, reference_chains, reference_accepted
            )
        return result

    def _trees(
        self,
        drafter: Drafter,
        sequence: Tensor,
        roots: Tensor,
        features: Tensor | None,
        policy: Any = None,
    ) -> list[DraftTree]:
        """The decoder's own trees at `roots`: one teacher-forced pass, `policy.build_batch`."""
        temperature = float(self.hparams.temperature)
        proposer = drafter.sequence_proposer(
            sequence, roots, features=features, temperature=temperature
        )
        trees = (policy or self.policy).build_batch(proposer, temperature=temperature)
        proposer.finish()
        return trees

    def _score(
        self,
        cache: object,
        trees: list[DraftTree],
        root_tokens: Tensor,
        roots: Tensor,
        outputs: list[str],
    ) -> list[TreeScores]:
        return score_trees_target(
            self.target,
            cache,
            trees,
            root_tokens,
            roots,
            outputs=outputs,
            temperature=float(self.hparams.temperature),
            max_tokens=int(self.hparams.score_max_tokens),
        )

    def _rewards(self, trees: list[DraftTree], scores: list[TreeScores]) -> Tensor:
        hp = self.hparams
        values = []
        for tree, score in zip(trees, scores, strict=True):
            assert score.argmax is not None
            assert self.factors == "greedy" or score.token_logprobs is not None
            if self.factors == "greedy":
                factors = tree.tokens.to(score.argmax.device) == score.argmax[tree.parents + 1]
                factors = factors.float()
            else:
                factors = score.token_logprobs.exp()
            values.append(
                losses.gto_tree_reward(
                    tree=tree.to(factors.device),
                    factors=factors,
                    aggregation=str(hp.aggregation),
                    eta=float(hp.eta),
                )
            )
        return torch.stack(values).float()

    def _accepted(self, tree: DraftTree, score: TreeScores, *, sample: bool = True) -> list[int]:
        """The accepted node path of `tree`, by the decoder's own verification."""
        temperature = float(self.hparams.temperature)
        if temperature > 0 and sample and score.rows is not None:
            probs = tempered_softmax(score.rows, temperature)
            verdict = verify_sample(tree.to(probs.device), probs, generator=self._generator)
        else:
            assert score.argmax is not None
            verdict = verify_greedy_argmax(tree.to(score.argmax.device), score.argmax)
        return [int(i) for i in verdict.accepted.tolist()]

    # ---------------------------------------------------------------------------- steps
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        token = self._common_step(batch)
        gto = self.gto_term(batch)
        loss = float(self.hparams.token_weight) * token.loss + float(self.hparams.omega) * gto.loss
        skipped = self.skip_nonfinite(loss)
        if skipped is not None:
            return skipped
        self._prefixes_seen += gto.prefixes
        self.log("train/loss", loss.detach(), prog_bar=True)
        self.log("train/loss_token", token.loss.detach())
        self._log_steps("train", token)
        self._log_gto("train", gto)
        self.log_lr()
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        token = self._common_step(batch)
        # the same prefixes at every validation and for every drafter: groups drawn from a
        # generator seeded by the batch index alone (validation batches are not shuffled)
        fixed = torch.Generator().manual_seed(VALIDATION_SEED + batch_idx)
        gto = self.gto_term(batch, statistics=True, generator=fixed)
        size = max(1, token.tokens)
        self.log("val/loss", token.loss, batch_size=size, sync_dist=True, prog_bar=True)
        self._log_steps("val", token, sync_dist=True)
        self._log_gto("val", gto, sync_dist=True)

    def _log_gto(self, stage: str, gto: GTOResult, **kwargs: Any) -> None:
        size = max(1, gto.prefixes)
        values = {
            "loss_gto": float(gto.loss.detach()),
            "reward": gto.reward,
            "reward_reference": gto.reference_reward,
            "reward_gap": gto.reward - gto.reference_reward,
            "accept_length": gto.accept_length,
            "accept_length_reference": gto.reference_accept_length,
            "clip_fraction": gto.clip_fraction,
            "ratio": gto.ratio_mean,
        }
        if gto.score_seconds > 0:
            values["score_trees_per_s"] = gto.trees_scored / gto.score_seconds
            values["score_tokens_per_s"] = gto.rows_scored / gto.score_seconds
        if gto.seconds > 0:
            values["gto_seconds"] = gto.seconds
        for name in ("pruned", "follows", "reference_pruned", "reference_follows"):
            value = getattr(gto, name)
            if value is not None:
                values[f"greedy_{name}"] = value
        for key, value in values.items():
            self.log(f"{stage}/{key}", value, batch_size=size, **kwargs)
        if stage == "train":
            self.log("train/prefixes", float(self._prefixes_seen))
            done = self._cached_sequences + self._scored_sequences
            if done:
                self.log("train/cached_fraction", self._cached_sequences / done)

    # ---------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Leave the reference out too: it is `drafter_init`, reloaded at construction."""
        super().on_save_checkpoint(checkpoint)
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if k.startswith("reference.")]:
            del state[key]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.setdefault("state_dict", {})
        for key, value in self.reference.state_dict(prefix="reference.").items():
            state.setdefault(key, value)

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            **super().checkpoint_state(),
            "prefixes_seen": self._prefixes_seen,
            "generator": self._generator.get_state(),
        }

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        super().load_checkpoint_state(state)
        self._prefixes_seen = int(state.get("prefixes_seen", 0))
        if "generator" in state:
            self._generator.set_state(state["generator"])


def _combine(parts: list[GTOResult], zero: Tensor, seconds: float) -> GTOResult:
    """One result for a batch: losses and statistics weighted by prefixes."""
    total = sum(p.prefixes for p in parts)

    def mean(name: str) -> float:
        return sum(getattr(p, name) * p.prefixes for p in parts) / total

    def optional(name: str) -> float | None:
        values = [(getattr(p, name), p.prefixes) for p in parts if getattr(p, name) is not None]
        if not values:
            return None
        return sum(v * n for v, n in values) / sum(n for _, n in values)

    loss = zero + sum(p.loss * (p.prefixes / total) for p in parts)
    return GTOResult(
        loss=loss,
        reward=mean("reward"),
        reference_reward=mean("reference_reward"),
        accept_length=mean("accept_length"),
        reference_accept_length=mean("reference_accept_length"),
        clip_fraction=mean("clip_fraction"),
        ratio_mean=mean("ratio_mean"),
        prefixes=total,
        trees_scored=sum(p.trees_scored for p in parts),
        rows_scored=sum(p.rows_scored for p in parts),
        score_seconds=sum(p.score_seconds for p in parts),
        seconds=seconds,
        pruned=optional("pruned"),
        follows=optional("follows"),
        reference_pruned=optional("reference_pruned"),
        reference_follows=optional("reference_follows"),
        accept_lengths=[n for p in parts for n in p.accept_lengths],
        rewards=[r for p in parts for r in p.rewards],
    )


def __getattr__(name: str) -> Any:
    # The old name, kept for one release: configs and checkpoints saved before the rename name
    # `lightning_spec.objectives.gto.GroupTreeOptimization`.
    if name == "GroupTreeOptimization":
        renamed(f"{__name__}.{name}", f"{__name__}.GTO")
        return GTO
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
