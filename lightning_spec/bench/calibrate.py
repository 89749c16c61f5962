"""Pick a tree policy for the device at hand from measured costs and measured acceptance.

On a GPU verifying 60 tokens costs about as much as verifying one, so big EAGLE-2 trees win; on
a CPU the target forward is compute-bound and grows with the number of verified tokens
(SmolLM2 on 2 cores: 56 ms for 1 token, 217 ms for 64), so small trees or short chains
win. Instead of guessing, calibrate:

1. `measure_verify_cost`: median time of one target forward of N new tokens (chain tree mask,
   the verification code path) after a cache of `context` tokens, for N in a size grid.
2. `measure_acceptance`: run the real decoder with a deep chain (chain:8) on a few prompts and
   record, at each depth d, how often the target's greedy token is the drafter's rank-r
   proposal given that drafts 1..d-1 were accepted (`AcceptanceProfile`); the top-1 column is
   the per-depth acceptance alpha_d. The drafting and bookkeeping times come from the same run.
3. `expected_speedup` / `suggest_policy`: the model below, evaluated for candidate policies.
   `rank_policies` is the one picker: the engine benches pick their draft length K with it too,
   from their own measured step costs (`bench.engines.pick_chain`, `bench.vllm_bench.pick_k`).

The model. At T = 0 one step commits its accepted drafts plus one bonus token, so

    speedup = E[tokens committed per step] / (time per step / time of one autoregressive step)
    E[tokens per step] = 1 + sum over tree nodes v of prod_{u on the path to v} p(depth_u, rank_u)
    time per step = verify_cost(N + 1) + draft_cost(depth) + overhead

where N is the number of tree nodes (+1 for the root token fed with them), p(d, r) is the
measured probability that the target's token at depth d is the drafter's rank-r child, and
one autoregressive step costs verify_cost(1). For a chain of k (every rank 0) this is the
familiar 1 + sum_{d=1..k} prod_{j<=d} alpha_j. Siblings are mutually exclusive at T = 0 (the
target has one greedy token), which is why their probabilities add. Approximations, stated:

* p(d, r) depends on the depth only, not on which ranks were taken above it: it is measured
  along top-1 chains and reused under rank-1, rank-2 ... parents. Given only per-depth alpha
  (no ranks), p(d, 0) = alpha_d and p(d, r > 0) = 0: the "best path" approximation, which
  credits a tree with nothing for its side branches (a lower bound for trees).
* Depths beyond the measured ones reuse the deepest measured row, and deep levels that few
  steps reached are shrunk toward the level above (pseudo-count 5, `shrink_toward_parent`).
* A dynamic tree (EAGLE-2) is modelled by the tree it would build if the drafter's scores were
  the measured acceptance probabilities: per level, the `top_k` best nodes are expanded into
  their `top_k` best ranks, and the `total_tokens - 1` best candidates are kept. This is
  optimistic when the drafter's confidence is poorly calibrated.
* Drafting costs one drafter call per depth level (k - 1 expansions plus the re-absorption of
  the committed tokens), each charged `draft_cost_per_depth` whatever its width. A block
  drafter (DFlash) drafts every depth in one forward: its measured step drafting time is charged
  once, whatever the depth (`draft_cost_model`), and only trees no deeper than its block are
  candidates.

Why one file (~700 lines): the cost curve, the acceptance profile, the rank paths and the
throughput model feed one decision (`--tree auto`) and share its assumptions; read apart, the
model's terms would be defined in one module and used in another.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_spec.decoding.build import (
    STATIC_TREES,
    ChainPolicy,
    DynamicTreePolicy,
    StaticTreePolicy,
    TreePolicy,
    as_batch_proposer,
    parse_tree_spec,
)
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.metrics import tau_from_records
from lightning_spec.models.cache import truncate_cache

__all__ = [
    "AcceptanceProfile",
    "DEFAULT_SIZES",
    "calibrate",
    "candidate_policies",
    "chain_acceptance",
    "draft_levels",
    "expected_speedup",
    "expected_tokens_per_step",
    "interpolate_cost",
    "measure_acceptance",
    "measure_autoregressive_step",
    "measure_verify_cost",
    "rank_paths",
    "rank_policies",
    "step_seconds",
    "suggest_policy",
]

DEFAULT_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
CLI_SIZES: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


# ------------------------------------------------------------------------------ verification cost
@torch.no_grad()
def measure_verify_cost(
    target: Any,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context: int = 256,
    repeats: int = 5,
    *,
    warmup: int = 2,
    seed: int = 0,
) -> dict[int, float]:
    """Median seconds of one target forward of N new tokens after `context` cached tokens.

    The forward goes through `TargetModel.forward` with a (chain) tree mask and explicit
    positions, exactly as a verification step does; the cache is cut back to `context` after
    each call. Sizes are visited in a rotated order on every repeat so a slow spell on a shared
    machine spreads over all sizes instead of hitting one. `warmup` rounds are discarded.
    """
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError("sizes must be positive integers")
    generator = torch.Generator().manual_seed(seed)
    device = target.device
    vocab = target.vocab_size
    prompt = torch.randint(0, vocab, (1, max(context, 1)), generator=generator).to(device)
    cache = target(prompt, output_features=False).cache
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for round_index in range(warmup + repeats):
        shift = round_index % len(sizes)
        for n in sizes[shift:] + sizes[:shift]:
            tokens = torch.randint(0, vocab, (1, n), generator=generator).to(device)
            positions = torch.arange(context, context + n, device=device).unsqueeze(0)
            mask = torch.ones(1, n, context + n, dtype=torch.bool)
            mask[0, :, context:] = torch.ones(n, n, dtype=torch.bool).tril()
            mask = mask.to(device)
            tic = time.perf_counter()
            target(tokens, position_ids=positions, tree_mask=mask, cache=cache)
            elapsed = time.perf_counter() - tic
            truncate_cache(cache, context)
            if round_index >= warmup:
                samples[n].append(elapsed)
    return {n: float(statistics.median(values)) for n, values in samples.items()}


@torch.no_grad()
def measure_autoregressive_step(
    target: Any, context: int = 256, repeats: int = 20, *, warmup: int = 3, seed: int = 0
) -> float:
    """Median seconds of one plain decoding step (one token, no tree mask) after `context`
    cached tokens: the unit of the speedup, as `autoregressive_generate` runs it."""
    generator = torch.Generator().manual_seed(seed)
    device = target.device
    prompt = torch.randint(0, target.vocab_size, (1, max(context, 1)), generator=generator)
    cache = target(prompt.to(device), output_features=False).cache
    samples = []
    for index in range(warmup + repeats):
        token = torch.randint(0, target.vocab_size, (1, 1), generator=generator).to(device)
        tic = time.perf_counter()
        target(token, cache=cache, output_features=False)
        elapsed = time.perf_counter() - tic
        truncate_cache(cache, context)
        if index >= warmup:
            samples.append(elapsed)
    return float(statistics.median(samples))


def interpolate_cost(cost_curve: dict[int, float], tokens: int) -> float:
    """Cost of a forward of `tokens` new tokens: linear between measured sizes, linear
    extrapolation from the two nearest sizes outside them.

    The curve is first made non-decreasing (running maximum): verifying more tokens never costs
    less, and on a noisy machine a lucky large size would otherwise look cheaper than a small one.
    """
    curve = sorted((int(n), float(s)) for n, s in cost_curve.items())
    if not curve:
        raise ValueError("empty cost curve")
    for i in range(1, len(curve)):
        curve[i] = (curve[i][0], max(curve[i][1], curve[i - 1][1]))
    if len(curve) == 1:
        return curve[0][1] * tokens / curve[0][0]
    for (n0, s0), (n1, s1) in zip(curve, curve[1:], strict=False):
        if n0 <= tokens <= n1:
            return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
    (n0, s0), (n1, s1) = curve[:2] if tokens < curve[0][0] else curve[-2:]
    return max(s0 + (s1 - s0) * (tokens - n0) / (n1 - n0), 0.0)


# ------------------------------------------------------------------------------ acceptance
@dataclass
class AcceptanceProfile:
    """Measured acceptance of a drafter against a target at T = 0.

    `rank_acceptance[d - 1][r]` = P(the target's greedy token at depth d is the drafter's rank-r
    proposal | drafts 1..d-1 accepted), measured along top-1 chains; `at_risk[d - 1]` counts the
    steps that reached depth d (the denominator).
    """

    rank_acceptance: list[list[float]]
    at_risk: list[int]
    steps: int = 0
    tau: float | None = None
    draft_seconds_per_depth: float = 0.0
    verify_seconds: float = 0.0
    overhead_seconds: float = 0.0
    num_prompts: int = 0
    probe: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def alpha(self) -> list[float]:
        """Per-depth acceptance alpha_d of the top-1 draft."""
        return [row[0] if row else 0.0 for row in self.rank_acceptance]

    @classmethod
    def from_alpha(cls, alpha: Sequence[float]) -> AcceptanceProfile:
        """A profile that knows only top-1 acceptance (the best-path approximation)."""
        return cls(rank_acceptance=[[float(a)] for a in alpha], at_risk=[0] * len(alpha))

    def probability(self, depth: int, rank: int) -> float:
        """p(depth, rank); deeper than measured reuses the deepest row, unknown ranks give 0."""
        if not self.rank_acceptance:
            return 0.0
        row = self.rank_acceptance[min(depth, len(self.rank_acceptance)) - 1]
        return float(row[rank]) if rank < len(row) else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["alpha"] = self.alpha
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AcceptanceProfile:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


class _RankRecorder:
    """Wraps the engine's (batch-1) proposer and keeps the top-`ranks` token ids of every row it
    hands to the policy, so a chain run also reveals where the target's token sat in q."""

    batch_size = 1

    def __init__(self, proposer: Any, ranks: int) -> None:
        self.proposer = as_batch_proposer(proposer)
        self.ranks = ranks
        self.rows: list[Tensor] = []

    def _keep(self, logprobs: Tensor) -> Tensor:
        row = logprobs.reshape(-1)
        self.rows.append(row.topk(min(self.ranks, row.numel())).indices.cpu())

    def root(self) -> Tensor:
        rows = self.proposer.root()  # [1, V]
        self._keep(rows[0])
        return rows

    def expand(self, trees: Any, nodes: Tensor) -> Tensor:
        rows = self.proposer.expand(trees, nodes)  # [1, 1, V]: a chain expands one node
        self._keep(rows[0, 0])
        return rows


class RankProbePolicy:
    """`ChainPolicy(depth)` that records the drafter's top ranks at every depth of every step."""

    def __init__(self, depth: int = 8, ranks: int = 8) -> None:
        self.chain = ChainPolicy(depth)
        self.ranks = ranks
        self.steps: list[list[Tensor]] = []

    @property
    def max_nodes(self) -> int:
        return self.chain.max_nodes

    @property
    def max_depth(self) -> int:
        return self.chain.max_depth

    def needs_draft_probs(self, temperature: float) -> bool:
        return self.chain.needs_draft_probs(temperature)

    def build_batch(
        self,
        proposer: Any,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        keep_draft_probs: bool = False,
    ) -> list[DraftTree]:
        recorder = _RankRecorder(proposer, self.ranks)
        trees = self.chain.build_batch(
            recorder,
            temperature=temperature,
            generator=generator,
            keep_draft_probs=keep_draft_probs,
        )
        self.steps.append(recorder.rows)
        return trees

    def build(self, proposer: Any, **kwargs: Any) -> DraftTree:
        return self.build_batch(proposer, **kwargs)[0]


def rank_counts(
    records: Sequence[Any], ranked: Sequence[Sequence[Tensor]], depth: int, ranks: int
) -> tuple[list[list[int]], list[int]]:
    """Count, per depth, the steps at risk and the rank of the target's token among the
    drafter's top ranks. `ranked[i][d - 1]` are the top ids at depth d of step i."""
    hits = [[0] * ranks for _ in range(depth)]
    at_risk = [0] * depth
    for record, rows in zip(records, ranked, strict=True):
        accepted = int(record.accept_length)
        argmax = record.target_argmax.tolist()  # row d-1 = the target's token at depth d
        for d in range(1, min(depth, len(rows)) + 1):
            if accepted < d - 1:
                break
            at_risk[d - 1] += 1
            top = rows[d - 1].tolist()
            wanted = argmax[d - 1]
            if wanted in top:
                hits[d - 1][top.index(wanted)] += 1
    return hits, at_risk


def shrink_toward_parent(
    hits: Sequence[Sequence[int]], at_risk: Sequence[int], prior_strength: float = 5.0
) -> list[list[float]]:
    """p(d, r) = (hits + m * p(d - 1, r)) / (at_risk + m), m = `prior_strength`; depth 1 is
    the plain frequency. A depth no step reached inherits its parent's rates instead of 0, and a
    1-of-1 fluke at depth 7 does not become a certainty."""
    table: list[list[float]] = []
    for row, count in zip(hits, at_risk, strict=True):
        if not table:
            table.append([h / count if count else 0.0 for h in row])
            continue
        parent = table[-1]
        table.append(
            [
                (h + prior_strength * p) / (count + prior_strength)
                if count + prior_strength > 0
                else p
                for h, p in zip(row, parent, strict=True)
            ]
        )
    return table


@torch.no_grad()
def measure_acceptance(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    *,
    depth: int = 8,
    ranks: int = 8,
    max_new_tokens: int = 64,
    stop_on_eos: bool = True,
    prior_strength: float = 5.0,
) -> AcceptanceProfile:
    """Run the decoder with a `chain:depth` probe on `prompts` (token ids) at T = 0.

    Returns per-depth, per-rank acceptance and the measured drafting time per depth level
    (median draft time of a step / depth: a chain step makes depth - 1 expansions and one
    re-absorption), median verification time and per-step overhead (cache bookkeeping plus the
    decoder loop outside draft/verify/update). Deep levels are reached by few steps, so their
    rates are shrunk toward the level above (`shrink_toward_parent`).
    """
    from lightning_spec.decoding.engine import SpeculativeDecoder

    probe = RankProbePolicy(depth, ranks)
    decoder = SpeculativeDecoder(target, drafter, probe)
    records: list[Any] = []
    ranked: list[list[Tensor]] = []
    draft, verify, overhead = [], [], []
    for prompt in prompts:
        probe.steps = []
        result = decoder.generate(list(prompt), max_new_tokens, stop_on_eos=stop_on_eos)
        records.extend(result.records)
        ranked.extend(probe.steps[: len(result.records)])
        timed = sum(sum(r.timings.values()) for r in result.records)
        loop = max(result.total_seconds - result.prefill_seconds - timed, 0.0)
        for record in result.records:
            if "draft" in record.timings:
                draft.append(record.timings["draft"])
            verify.append(record.timings.get("verify", 0.0))
            overhead.append(record.timings.get("update", 0.0) + loop / len(result.records))
    hits, at_risk = rank_counts(records, ranked, depth, ranks)
    table = shrink_toward_parent(hits, at_risk, prior_strength)
    return AcceptanceProfile(
        rank_acceptance=table,
        at_risk=at_risk,
        steps=len(records),
        tau=tau_from_records(records),
        draft_seconds_per_depth=(statistics.median(draft) / depth) if draft else 0.0,
        verify_seconds=statistics.median(verify) if verify else 0.0,
        overhead_seconds=statistics.median(overhead) if overhead else 0.0,
        num_prompts=len(prompts),
        probe=f"chain:{depth}",
    )


# ------------------------------------------------------------------------------ the model
RankPath = tuple[int, ...]


def _as_profile(acceptance: AcceptanceProfile | Sequence[float]) -> AcceptanceProfile:
    if isinstance(acceptance, AcceptanceProfile):
        return acceptance
    return AcceptanceProfile.from_alpha(list(acceptance))


def _as_policy(policy: TreePolicy | str) -> TreePolicy:
    return parse_tree_spec(policy) if isinstance(policy, str) else policy


def rank_paths(
    policy: TreePolicy | str | Sequence[RankPath], acceptance: AcceptanceProfile | Sequence[float]
) -> list[RankPath]:
    """The tree shape a policy verifies, as rank paths (e.g. ``(0, 1)`` = the second child of
    the first child). Dynamic trees are modelled as described in the module docstring."""
    if not isinstance(policy, (str, ChainPolicy, StaticTreePolicy, DynamicTreePolicy)):
        paths = [tuple(int(r) for r in path) for path in policy]  # explicit shape
        return paths
    policy = _as_policy(policy)
    if isinstance(policy, ChainPolicy):
        return [(0,) * d for d in range(1, policy.k + 1)]
    if isinstance(policy, StaticTreePolicy):
        return [tuple(path) for path in policy.paths]
    if isinstance(policy, DynamicTreePolicy):
        return _dynamic_shape(policy, _as_profile(acceptance))
    raise TypeError(f"cannot model the shape of {type(policy).__name__}")


def _dynamic_shape(policy: DynamicTreePolicy, profile: AcceptanceProfile) -> list[RankPath]:
    """EAGLE-2's expansion with measured acceptance as the scores (see the module docstring)."""
    k = policy.top_k
    candidates: list[tuple[float, RankPath]] = [(profile.probability(1, r), (r,)) for r in range(k)]
    frontier = candidates[:]
    for level in range(2, policy.depth + 1):
        frontier = sorted(frontier, key=lambda c: -c[0])[:k]
        children = [
            (value * profile.probability(level, r), path + (r,))
            for value, path in frontier
            for r in range(k)
        ]
        candidates.extend(children)
        frontier = children
    # Stable: ties keep creation order, which lists parents before their children.
    order = sorted(range(len(candidates)), key=lambda i: -candidates[i][0])
    kept = sorted(order[: policy.total_tokens - 1])
    paths = [candidates[i][1] for i in kept]
    present = set(paths)
    # Zero-probability ties could drop an ancestor; keep the shape a tree.
    return [p for p in paths if all(p[:i] in present for i in range(1, len(p)))]


def expected_tokens_per_step(
    policy: TreePolicy | str | Sequence[RankPath],
    acceptance: AcceptanceProfile | Sequence[float],
) -> float:
    """1 + sum over nodes of the product of p(depth, rank) along the node's path."""
    profile = _as_profile(acceptance)
    total = 1.0
    for path in rank_paths(policy, profile):
        value = 1.0
        for depth, rank in enumerate(path, start=1):
            value *= profile.probability(depth, rank)
        total += value
    return total


def _draft_cost(draft_cost_per_depth: float | Sequence[float], depth: int) -> float:
    if isinstance(draft_cost_per_depth, (int, float)):
        return float(draft_cost_per_depth) * depth
    costs = list(draft_cost_per_depth)
    if not costs:
        return 0.0
    costs += [costs[-1]] * max(depth - len(costs), 0)
    return float(sum(costs[:depth]))


def draft_levels(policy: TreePolicy | str | Sequence[RankPath]) -> int:
    """Drafter calls per step: the policy's depth (k - 1 expansions + one re-absorption for a
    chain; a dynamic tree expands every level even when the kept tree is shallower)."""
    if isinstance(policy, (str, ChainPolicy, StaticTreePolicy, DynamicTreePolicy)):
        return int(_as_policy(policy).max_depth)
    return max((len(tuple(path)) for path in policy), default=0)


def step_seconds(
    policy: TreePolicy | str | Sequence[RankPath],
    cost_curve: dict[int, float],
    draft_cost_per_depth: float | Sequence[float],
    overhead: float = 0.0,
    acceptance: AcceptanceProfile | Sequence[float] | None = None,
) -> float:
    """verify_cost(N + 1) + draft_cost(draft levels) + overhead for the policy's tree."""
    nodes = len(rank_paths(policy, acceptance if acceptance is not None else []))
    return (
        interpolate_cost(cost_curve, nodes + 1)
        + _draft_cost(draft_cost_per_depth, draft_levels(policy))
        + float(overhead)
    )


def expected_speedup(
    policy: TreePolicy | str | Sequence[RankPath],
    acceptance: AcceptanceProfile | Sequence[float],
    cost_curve: dict[int, float],
    draft_cost_per_depth: float | Sequence[float],
    overhead: float = 0.0,
    autoregressive_seconds: float | None = None,
) -> float:
    """speedup = E[tokens per step] / (time per step / time of one autoregressive step).

    `policy` is a policy, a spec string or an explicit list of rank paths; `acceptance` an
    `AcceptanceProfile` or per-depth alpha (the best-path approximation for trees); one
    autoregressive step costs `autoregressive_seconds` (measured by
    `measure_autoregressive_step`), else `cost_curve` at 1 token. See the module docstring.
    """
    tokens = expected_tokens_per_step(policy, acceptance)
    seconds = step_seconds(policy, cost_curve, draft_cost_per_depth, overhead, acceptance)
    autoregressive = autoregressive_seconds or interpolate_cost(cost_curve, 1)
    return tokens / (seconds / autoregressive)


def candidate_policies(max_nodes: int = 64) -> list[str]:
    """Default search space: chains 1..8, the built-in static trees, a grid of dynamic trees."""
    specs = [f"chain:{k}" for k in range(1, 9)]
    specs += [f"static:{name}" for name in sorted(STATIC_TREES)]
    for depth in (2, 3, 4, 5, 6, 7):
        for top_k in (2, 3, 4, 8):
            for total in (4, 6, 8, 12, 16, 24, 32, 48, 64):
                if total - 1 <= max_nodes and total - 1 <= top_k + (depth - 1) * top_k**2:
                    specs.append(f"dynamic:{depth},{top_k},{total}")
    return specs


def chain_acceptance(alphas: Sequence[float | None], depth: int) -> AcceptanceProfile:
    """Per-depth acceptance alpha_1 .. alpha_depth as a profile: depths never measured (None, or
    beyond the list) count as 0, so a chain deeper than the measurement earns nothing there."""
    measured = [float(a or 0.0) for a in list(alphas)[:depth]]
    return AcceptanceProfile.from_alpha(measured + [0.0] * max(depth - len(measured), 0))


def rank_policies(
    acceptance: AcceptanceProfile | Sequence[float],
    candidates: Sequence[str],
    seconds_per_step: Callable[[str], float],
    autoregressive_seconds: float,
    *,
    rounded: bool = False,
) -> list[dict[str, Any]]:
    """The one draft-length (and tree) picker: every candidate's expected speedup, best first.

    speedup = E[tokens committed per step] / (seconds per step / `autoregressive_seconds`),
    E[tokens] from `acceptance` (`expected_tokens_per_step`; for ``chain:K`` the familiar
    1 + sum_j prod_{i <= j} alpha_i). Where a step's seconds come from is the caller's
    `seconds_per_step(spec)`: modelled from our decoder's cost curve (`suggest_policy`, behind
    ``--tree auto``), from llama.cpp's cost of a forward of K + 1 tokens plus the drafting
    (`bench.engines.pick_chain`), or measured per K on vLLM (`bench.vllm_bench.pick_k`). Among
    equals the smaller tree comes first (less memory, less variance). `rounded`: the figures
    rounded for a report (tokens and speedup to 4 places, seconds to 6) and ranked as rounded.
    """
    profile = _as_profile(acceptance)
    table = []
    for spec in candidates:
        paths = rank_paths(spec, profile)
        tokens = expected_tokens_per_step(paths, profile)
        seconds = seconds_per_step(spec)
        speedup = tokens / (seconds / autoregressive_seconds)
        if rounded:
            tokens, seconds, speedup = round(tokens, 4), round(seconds, 6), round(speedup, 4)
        table.append(
            {
                "policy": spec,
                "nodes": len(paths),
                "depth": draft_levels(spec),
                "expected_tokens_per_step": tokens,
                "step_seconds": seconds,
                "expected_speedup": speedup,
            }
        )
    if not table:
        raise ValueError("no candidate policies")
    table.sort(key=lambda row: (-row["expected_speedup"], row["nodes"]))
    return table


def suggest_policy(
    acceptance: AcceptanceProfile | Sequence[float],
    cost_curve: dict[int, float],
    draft_cost_per_depth: float | Sequence[float],
    candidates: Sequence[str] | None = None,
    overhead: float = 0.0,
    autoregressive_seconds: float | None = None,
) -> tuple[str, float, list[dict[str, Any]]]:
    """(best spec, its expected speedup, table of every candidate, best first): `rank_policies`
    with each step's seconds modelled by `step_seconds` from the cost curve."""
    profile = _as_profile(acceptance)
    autoregressive = autoregressive_seconds or interpolate_cost(cost_curve, 1)
    table = rank_policies(
        profile,
        candidates or candidate_policies(),
        lambda spec: step_seconds(spec, cost_curve, draft_cost_per_depth, overhead, profile),
        autoregressive,
        rounded=True,
    )
    return table[0]["policy"], table[0]["expected_speedup"], table


# ------------------------------------------------------------------------------ all together
def calibrate(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    *,
    sizes: Sequence[int] = CLI_SIZES,
    context: int = 256,
    repeats: int = 5,
    depth: int = 8,
    ranks: int = 8,
    max_new_tokens: int = 64,
    candidates: Sequence[str] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Cost curve + acceptance profile + suggestion, as one JSON-ready dict."""
    tic = time.perf_counter()
    slots = block_slots(drafter)
    if slots is not None:  # a block drafter cannot draft deeper than its block
        depth = min(depth, slots)
        candidates = [
            c for c in (candidates or candidate_policies()) if _as_policy(c).max_depth <= slots
        ]
    curve = measure_verify_cost(target, sizes, context, repeats, seed=seed)
    step = measure_autoregressive_step(target, context, seed=seed)
    profile = measure_acceptance(
        target, drafter, prompts, depth=depth, ranks=ranks, max_new_tokens=max_new_tokens
    )
    draft_cost = draft_cost_model(profile, slots)
    spec, speedup, table = suggest_policy(
        profile,
        curve,
        draft_cost,
        candidates,
        profile.overhead_seconds,
        autoregressive_seconds=step,
    )
    return {
        "cost_curve": {str(n): s for n, s in curve.items()},
        "autoregressive_step_seconds": step,
        "context": context,
        "repeats": repeats,
        "acceptance": profile.to_dict(),
        "draft_seconds_per_depth": profile.draft_seconds_per_depth,
        "draft_cost": draft_cost,
        "block_slots": slots,
        "overhead_seconds": profile.overhead_seconds,
        "suggestion": {"policy": spec, "expected_speedup": speedup},
        "candidates": list(candidates) if candidates else None,
        "table": table,
        "seconds": time.perf_counter() - tic,
    }


def suggestion_from_calibration(
    calibration: dict[str, Any], candidates: Sequence[str] | None = None
) -> tuple[str, float, list[dict[str, Any]]]:
    """Re-run `suggest_policy` on a saved `calibrate` result (its JSON), over the candidates
    it was calibrated with unless others are given."""
    data = calibration.get("calibration", calibration)
    candidates = candidates or data.get("candidates")
    curve = {int(n): float(s) for n, s in data["cost_curve"].items()}
    profile = AcceptanceProfile.from_dict(data["acceptance"])
    return suggest_policy(
        profile,
        curve,
        data.get("draft_cost", profile.draft_seconds_per_depth),
        candidates,
        profile.overhead_seconds,
        autoregressive_seconds=data.get("autoregressive_step_seconds"),
    )


def block_slots(drafter: Any) -> int | None:
    """Tokens a block drafter drafts per forward (block size - 1); None for other drafters."""
    if not getattr(drafter, "drafts_blocks", False):
        return None
    return int(drafter.block_size) - 1


def draft_cost_model(profile: AcceptanceProfile, slots: int | None) -> float | list[float]:
    """Per-depth drafting seconds for `step_seconds`: the probe's time per level, or for a
    block drafter its whole step drafting time at the first level and nothing deeper."""
    if slots is None:
        return profile.draft_seconds_per_depth
    depth = int(profile.probe.split(":")[1]) if profile.probe else 1
    return [profile.draft_seconds_per_depth * depth] + [0.0] * max(slots - 1, 0)


def format_report(result: dict[str, Any], top: int = 10) -> str:
    """Markdown: the cost curve, acceptance per depth, the best candidates."""
    curve = {int(n): s for n, s in result["cost_curve"].items()}
    one = curve.get(1) or interpolate_cost(curve, 1)
    lines = [
        f"Verification cost (target forward of N new tokens after {result['context']} cached "
        f"tokens, median of {result['repeats']}):",
        "",
        "| N | " + " | ".join(str(n) for n in curve) + " |",
        "|---|" + "---|" * len(curve),
        "| ms | " + " | ".join(f"{1000 * s:.1f}" for s in curve.values()) + " |",
        "| x one token | " + " | ".join(f"{s / one:.2f}" for s in curve.values()) + " |",
        "",
    ]
    step = result.get("autoregressive_step_seconds")
    if step:
        lines += [f"One plain autoregressive step (no tree mask): {1000 * step:.1f} ms.", ""]
    if "acceptance" not in result:
        return "\n".join(lines)
    acceptance = result["acceptance"]
    alpha = acceptance.get("alpha") or []
    lines += [
        f"Acceptance ({acceptance.get('probe')}, {acceptance.get('num_prompts')} prompts, "
        f"{acceptance.get('steps')} steps, tau {_fmt(acceptance.get('tau'))} = tokens committed "
        "per verification incl. the bonus token):",
        "",
        "| depth | " + " | ".join(str(d) for d in range(1, len(alpha) + 1)) + " |",
        "|---|" + "---|" * len(alpha),
        "| alpha (top-1) | " + " | ".join(_fmt(a) for a in alpha) + " |",
        "| any of top ranks | "
        + " | ".join(_fmt(sum(row)) for row in acceptance.get("rank_acceptance", []))
        + " |",
        "| steps at risk | " + " | ".join(str(n) for n in acceptance.get("at_risk", [])) + " |",
        "",
        f"Drafting {1000 * result['draft_seconds_per_depth']:.2f} ms per depth level, overhead "
        f"{1000 * result['overhead_seconds']:.2f} ms per step.",
        "",
        "| policy | nodes | depth | E[tokens/step] | ms/step | expected speedup |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["table"][:top]:
        lines.append(
            f"| {row['policy']} | {row['nodes']} | {row['depth']} | "
            f"{row['expected_tokens_per_step']:.2f} | {1000 * row['step_seconds']:.1f} | "
            f"{row['expected_speedup']:.2f} |"
        )
    suggestion = result["suggestion"]
    lines += [
        "",
        f"Suggested tree: {suggestion['policy']} (expected speedup "
        f"{suggestion['expected_speedup']:.2f}x over autoregressive decoding, model estimate).",
    ]
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return (
        "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"
    )
