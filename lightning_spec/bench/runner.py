"""The bench runner: acceptance length and wall-clock speedup, side by side with baselines.

One run measures, on the same prompts, with the same target, dtype, thread count, max new
tokens and temperature:

* ``autoregressive``: our own KV-cache loop (`autoregressive_generate`), the losslessness
  reference and the speed baseline;
* ``hf_generate``: Hugging Face ``generate`` (greedy, or plain sampling at T > 0) on the target
  as loaded: what a user has. When the run optimises the target (``bench --prepack``), this
  method switches the optimisation off for its own calls (`models.packed.packing`), so the
  default path and the optimised one are measured side by side on one loaded model;
* ``hf_generate_optimized``: the same HF ``generate`` on the optimised target our decoder runs
  (only with an optimised target): the kernel gain apart from the algorithmic one;
* ``hf_prompt_lookup``: Hugging Face prompt-lookup decoding (n-gram drafts copied from the
  prompt, no drafter model), a strong free baseline on inputs that get quoted back;
* ``speculative``: our `SpeculativeDecoder` with the chosen drafter(s) and tree policy.

Honest-measurement rules (docs/benchmarking.md), enforced here rather than remembered: methods are
interleaved per prompt (every method runs on prompt i before any runs on prompt i + 1, and the
order rotates from prompt to prompt so drift and cache warmth do not favour one method), warm-up
prompts run first and are discarded, threads are pinned and recorded, the load average is read
before starting (a loud warning when another job is running), speedups are medians of per-prompt
ratios and ratios of totals with 95% bootstrap intervals over prompts, and greedy equality with
the target is checked in the same run (`mismatches`, with the position and the target's top-2
logit gap when it happens, so a floating-point near-tie is told apart from a bug).

Every method also reports the time to its first new token (``first_token_seconds``: the
prefill forward and the first choice; for HF the moment its streamer receives the first token).

tau = tokens committed per target verification (accepted drafts + 1 bonus token), pooled over
steps; the prefill's first token is not a verification. For HF prompt lookup tau is estimated
as new tokens / target forwards (counted by a forward hook: HF merges the prefill into the first
verification).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_spec.bench.machine import load_average, machine_info
from lightning_spec.bench.report import BASELINES, clean_floats, summarize
from lightning_spec.decoding.build import TreePolicy, parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate
from lightning_spec.metrics import attempted_depth
from lightning_spec.specs import PromptItem

__all__ = [
    "HF_METHODS",
    "METHODS",
    "MethodResult",
    "default_methods",
    "first_difference",
    "mismatch_detail",
    "run_bench",
]

METHODS: tuple[str, ...] = (
    "autoregressive",
    "hf_generate",
    "hf_generate_optimized",
    "hf_prompt_lookup",
    "speculative",
)
HF_METHODS: tuple[str, ...] = ("hf_generate", "hf_generate_optimized", "hf_prompt_lookup")


# ---------------------------------------------------------------------------------- methods
@dataclass
class MethodResult:
    """One method on one prompt."""

    tokens: list[int]
    seconds: float
    forwards: int | None = None
    steps: int | None = None
    committed: int | None = None
    accept_lengths: list[int] = field(default_factory=list)
    tree_depths: list[int] = field(default_factory=list)
    split: dict[str, float] = field(default_factory=dict)
    """Seconds by phase (prefill, draft, verify, update) for the speculative decoder."""
    first_token_seconds: float | None = None
    """From the call to the first new token (time to first token)."""


class _ForwardCounter:
    """Counts calls of the HF model's forward (HF prompt lookup's verifications)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *args: Any) -> None:
        self.count += 1

    def remove(self) -> None:
        self.handle.remove()


class _FirstTokenClock:
    """An HF streamer that only notes when the first new token arrives.

    `generate` puts the prompt first, then the new tokens as they are chosen (prompt lookup puts
    each verified block): the second `put` is the first token.
    """

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _plain_generation_defaults(model: torch.nn.Module) -> Iterator[None]:
    """Swap the model's generation config for an empty one during our `generate` call.

    HF fills every field we leave at its default from the model's own generation config: a
    checkpoint shipping ``repetition_penalty`` or ``do_sample=True`` would silently change the
    "greedy" baseline, and an EOS we leave unset would come back. Nothing leaks this way.
    """
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class _Runner:
    """Runs each method on one prompt; owns the decoders, the seeds and the forward counter."""

    def __init__(
        self,
        target: Any,
        drafters: dict[str, Any],
        policies: dict[str, TreePolicy],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        stop_on_eos: bool,
        prompt_lookup_num_tokens: int,
        max_matching_ngram_size: int,
    ) -> None:
        self.target = target
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed
        self.stop_on_eos = stop_on_eos
        self.lookup = (prompt_lookup_num_tokens, max_matching_ngram_size)
        self.decoders = {
            name: SpeculativeDecoder(target, drafter, policies[name], temperature=temperature)
            for name, drafter in drafters.items()
        }
        eos = sorted(target.eos_token_ids)
        tokenizer = target.tokenizer
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_token_id = pad if pad is not None else (eos[0] if eos else 0)
        self.eos = eos

    def _generator(self, index: int) -> torch.Generator:
        return torch.Generator(device=self.target.device).manual_seed(self.seed + index)

    def run(
        self, method: str, prompt: list[int], index: int, max_new_tokens: int | None = None
    ) -> MethodResult:
        limit = max_new_tokens or self.max_new_tokens
        device = self.target.device
        _sync(device)
        if method == "autoregressive":
            timings: dict[str, float] = {}
            tic = time.perf_counter()
            tokens = autoregressive_generate(
                self.target,
                prompt,
                limit,
                temperature=self.temperature,
                generator=self._generator(index),
                stop_on_eos=self.stop_on_eos,
                timings=timings,
            )
            _sync(device)
            return MethodResult(
                tokens, time.perf_counter() - tic, first_token_seconds=timings.get("first_token")
            )
        if method in HF_METHODS:
            return self._run_hf(prompt, index, limit, method)
        if method in self.decoders:
            decoder = self.decoders[method]
            tic = time.perf_counter()
            result = decoder.generate(
                prompt, limit, generator=self._generator(index), stop_on_eos=self.stop_on_eos
            )
            _sync(device)
            seconds = time.perf_counter() - tic
            split = {"prefill": result.prefill_seconds}
            for record in result.records:
                for phase, value in record.timings.items():
                    split[phase] = split.get(phase, 0.0) + value
            return MethodResult(
                result.tokens,
                seconds,
                first_token_seconds=result.prefill_seconds,
                split=split,
                steps=len(result.records),
                committed=sum(len(r.committed) for r in result.records),
                accept_lengths=[int(r.accept_length) for r in result.records],
                tree_depths=[attempted_depth(r) for r in result.records],
            )
        raise ValueError(f"unknown method {method!r}")

    @torch.no_grad()
    def _run_hf(self, prompt: list[int], index: int, limit: int, method: str) -> MethodResult:
        from transformers import GenerationConfig

        from lightning_spec.models.packed import packing

        model = self.target.model
        lookup = method == "hf_prompt_lookup"
        # hf_generate is the default path a user has: the optimisation is switched off for it
        # (a no-op on a target that was not optimised); the other HF methods run as loaded.
        optimised = method != "hf_generate"
        sampling = self.temperature > 0
        options: dict[str, Any] = {
            "max_new_tokens": limit,
            "do_sample": sampling,
            "eos_token_id": self.eos if self.stop_on_eos else None,
            "pad_token_id": self.pad_token_id,
        }
        if sampling:
            options.update(temperature=self.temperature, top_k=0, top_p=1.0)
        if lookup:
            options.update(
                prompt_lookup_num_tokens=self.lookup[0], max_matching_ngram_size=self.lookup[1]
            )
        config = GenerationConfig(**options)
        ids = torch.tensor([prompt], device=self.target.device)
        torch.manual_seed(self.seed + index)  # HF samples from the global generator
        counter = _ForwardCounter(model)
        clock = _FirstTokenClock()
        try:
            with _plain_generation_defaults(model), packing(model, optimised):
                tic = time.perf_counter()
                output = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=config,
                    streamer=clock,
                )
                _sync(self.target.device)
                seconds = time.perf_counter() - tic
        finally:
            counter.remove()
        tokens = output[0, len(prompt) :].tolist()
        first = None if clock.first is None else clock.first - tic
        return MethodResult(tokens, seconds, forwards=counter.count, first_token_seconds=first)


def first_difference(reference: Sequence[int], output: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (a length difference counts);
    None when they are equal."""
    for position, (a, b) in enumerate(zip(reference, output, strict=False)):
        if a != b:
            return position
    if len(reference) != len(output):
        return min(len(reference), len(output))
    return None


@torch.no_grad()
def mismatch_detail(
    target: Any, prompt: list[int], reference: list[int], output: list[int]
) -> dict[str, Any] | None:
    """Where `output` leaves the target's greedy `reference`, and how close the call was.

    The target's top-2 logits at that position come from one uncached forward over prompt +
    reference prefix; a gap near zero means the two decoders rounded a near-tie differently
    (batched verification and one-token steps sum in different orders), not a logic error.
    """
    position = first_difference(reference, output)
    if position is None:
        return None
    context = torch.tensor([prompt + list(reference[:position])], device=target.device)
    logits = target(context, output_features=False, use_cache=False).logits[0, -1].float()
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    tolerance = 1e-3 if target.dtype == torch.float32 else 0.25
    expected = reference[position] if position < len(reference) else None
    got = output[position] if position < len(output) else None
    return {
        "position": position,
        "expected": expected,
        "got": got,
        "top2_tokens": [int(t) for t in top.indices.tolist()],
        "top2_logits": [float(v) for v in top.values.tolist()],
        "top2_gap": gap,
        "expected_minus_got_logit": (
            float(logits[expected] - logits[got])
            if expected is not None and got is not None
            else None
        ),
        "near_tie": gap < tolerance,
    }


# ---------------------------------------------------------------------------------- the run
def default_methods(target: Any) -> list[str]:
    """Every method that applies: `hf_generate_optimized` only when the target is optimised."""
    from lightning_spec.models.packed import is_prepacked

    optimised = is_prepacked(target.model)
    return [m for m in METHODS if m != "hf_generate_optimized" or optimised]


def _method_names(methods: Sequence[str], drafter_names: Sequence[str]) -> list[str]:
    names: list[str] = []
    for method in methods:
        if method == "speculative":
            names.extend(drafter_names)
        elif method in BASELINES:
            names.append(method)
        else:
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if len(set(names)) != len(names):
        raise ValueError(f"methods listed twice: {methods}")
    return names


def run_bench(
    target: Any,
    drafter: Any | dict[str, Any] | None,
    policy: TreePolicy | str | Sequence[TreePolicy | str] | Mapping[str, Any] | None,
    datasets: dict[str, list[PromptItem]],
    *,
    methods: Sequence[str] | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    warmup: int = 1,
    order: str = "rotate",
    stop_on_eos: bool = True,
    prompt_lookup_num_tokens: int = 10,
    max_matching_ngram_size: int = 2,
    bootstrap_resamples: int = 2000,
    progress: bool = False,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Measure every method on every prompt, interleaved per prompt, and summarise.

    `drafter` is one drafter (method ``speculative``) or a dict label -> drafter (methods
    ``speculative:<label>``), run under each tree of `policy` (one, or several side by side:
    methods ``<name>@<tree spec>``), or, with `policy` a dict label -> tree(s), each drafter
    under its own trees (methods ``speculative:<label>@<tree spec>``: `bench --tree auto` gives
    every drafter the tree calibrated for it); `methods` defaults to `default_methods(target)`. `datasets` maps a name to (prompt ids, meta) pairs; a meta
    ``category`` gives per-category rows. Returns ``{"config", "rows", "per_prompt"}``.
    """
    if order not in ("rotate", "fixed"):
        raise ValueError("order must be rotate or fixed")
    methods = default_methods(target) if methods is None else list(methods)
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    by_label = _per_drafter_policies(policy, drafter)
    if by_label is not None:
        policies = {spec: p for table in by_label.values() for spec, p in table.items()}
        tree_spec = " | ".join(f"{label}: {spec}" for label, t in by_label.items() for spec in t)
    else:
        policies = _policies(policy)
        tree_spec = " | ".join(policies) if policies else None
    if drafter is None:
        drafters: dict[str, Any] = {}
    elif isinstance(drafter, dict):
        drafters = {f"speculative:{label}": d for label, d in drafter.items()}
    else:
        drafters = {"speculative": drafter}
    if "speculative" in methods and (not drafters or not policies):
        raise ValueError("the speculative method needs a drafter and a tree policy")
    if by_label is not None:  # each drafter under its own trees
        pairs = [(label, spec, p) for label, t in by_label.items() for spec, p in t.items()]
        method_policies = {f"speculative:{label}@{spec}": p for label, spec, p in pairs}
        drafters = {f"speculative:{label}@{spec}": drafter[label] for label, spec, _ in pairs}
    else:
        if len(policies) > 1:  # every drafter under every tree: `<method>@<tree spec>`
            drafters = {f"{name}@{spec}": d for name, d in drafters.items() for spec in policies}
        method_policies = {
            name: policies[name.rpartition("@")[2]]
            if len(policies) > 1
            else next(iter(policies.values()))
            for name in drafters
        }
    names = _method_names(methods, list(drafters) if "speculative" in methods else [])
    from lightning_spec.models.packed import is_prepacked

    optimised = is_prepacked(target.model)
    if "hf_generate_optimized" in names:
        if not optimised:
            raise ValueError(
                "hf_generate_optimized needs an optimised target (bench --prepack); without "
                "one it would only repeat hf_generate"
            )
    runner = _Runner(
        target,
        drafters if "speculative" in methods else {},
        method_policies,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        stop_on_eos=stop_on_eos,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        max_matching_ngram_size=max_matching_ngram_size,
    )
    greedy = temperature == 0
    all_items = [
        (name, i, item) for name, items in datasets.items() for i, item in enumerate(items)
    ]
    machine = (config or {}).get("machine") or machine_info(str(target.dtype).split(".")[-1])
    tic = time.perf_counter()
    # Warm-up: the first prompts through every method, results discarded.
    for w, (_, _, (prompt, _)) in enumerate(all_items[:warmup]):
        for method in names:
            runner.run(method, prompt, 1_000_000 + w, max_new_tokens=min(max_new_tokens, 32))
    warmup_seconds = time.perf_counter() - tic
    per_prompt: list[dict[str, Any]] = []
    with _progress(progress, len(all_items)) as advance:
        for counter, (dataset, index, (prompt, meta)) in enumerate(all_items):
            shift = counter % len(names) if order == "rotate" else 0
            run_order = names[shift:] + names[:shift]
            results = {method: runner.run(method, prompt, counter) for method in run_order}
            reference = None
            if greedy:
                # The target's own greedy output, as the target runs (optimised when it is): our
                # autoregressive loop or HF greedy `generate` on that target when either ran
                # (equal token for token, tests/models), else one extra greedy decode.
                same_target = "hf_generate_optimized" if optimised else "hf_generate"
                if "autoregressive" in results:
                    reference = results["autoregressive"].tokens
                elif same_target in results:
                    reference = results[same_target].tokens
                else:
                    reference = autoregressive_generate(
                        target, prompt, max_new_tokens, stop_on_eos=stop_on_eos
                    )
            entry = {
                "dataset": dataset,
                "index": index,
                "id": meta.get("id"),
                "category": meta.get("category"),
                "prompt_tokens": len(prompt),
                "order": run_order,
                "methods": {},
            }
            for method in names:
                result = results[method]
                detail = None
                if reference is not None and method != "autoregressive":
                    detail = mismatch_detail(target, prompt, reference, result.tokens)
                if optimised and method == "hf_generate":
                    # The default path is another numerics (the same fp32 weights, another
                    # GEMM order): where its greedy output leaves the optimised target's is a
                    # property of the optimisation, reported apart, not a losslessness failure.
                    entry["methods"][method] = _result_entry(result, None, greedy)
                    entry["methods"][method]["optimised_divergence"] = detail
                    continue
                entry["methods"][method] = _result_entry(result, detail, greedy)
            per_prompt.append(entry)
            advance(f"{dataset} {index + 1}/{len(datasets[dataset])}")
    machine = dict(machine)
    machine["load_average_end"] = [round(x, 2) for x in load_average()]
    machine["torch_threads"] = torch.get_num_threads()
    run_config = {
        **(config or {}),
        "methods": names,
        "tree": tree_spec,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "warmup": warmup,
        "warmup_seconds": round(warmup_seconds, 3),
        "order": order,
        "stop_on_eos": stop_on_eos,
        "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
        "max_matching_ngram_size": max_matching_ngram_size,
        "bootstrap_resamples": bootstrap_resamples,
        "target": str(getattr(target, "name", "")),
        "dtype": str(target.dtype).replace("torch.", ""),
        "datasets": {name: len(items) for name, items in datasets.items()},
        "seconds": round(time.perf_counter() - tic, 3),
    }
    run_config["machine"] = machine
    rows = summarize(
        per_prompt,
        names,
        temperature=temperature,
        tree=run_config["tree"],
        resamples=bootstrap_resamples,
        seed=seed,
    )
    return clean_floats({"config": run_config, "rows": rows, "per_prompt": per_prompt})


def _per_drafter_policies(policy: Any, drafter: Any) -> dict[str, dict[str, TreePolicy]] | None:
    """label -> (spec -> policy) when `policy` gives each drafter its own trees, else None."""
    if not isinstance(policy, Mapping):
        return None
    if not isinstance(drafter, dict) or set(policy) != set(drafter):
        raise ValueError("per-drafter trees need exactly one entry per drafter label")
    return {label: _policies(policy[label]) for label in drafter}


def _policies(
    policy: TreePolicy | str | Sequence[TreePolicy | str] | None,
) -> dict[str, TreePolicy]:
    """Spec -> policy for one tree, a spec, or several (benched side by side)."""
    if policy is None:
        return {}
    items = [policy] if isinstance(policy, str) or not isinstance(policy, Sequence) else policy
    out: dict[str, TreePolicy] = {}
    for item in items:
        spec = item.strip() if isinstance(item, str) else _policy_spec(item)
        if spec in out:
            raise ValueError(f"tree {spec!r} listed twice")
        out[str(spec)] = parse_tree_spec(item) if isinstance(item, str) else item
    return out


def _policy_spec(policy: TreePolicy | None) -> str | None:
    if policy is None:
        return None
    from lightning_spec.decoding.build import ChainPolicy, DynamicTreePolicy
    from lightning_spec.decoding.lookup import LookupPolicy

    if isinstance(policy, LookupPolicy):
        lookup = policy.lookup
        reach = f",{policy.min_reach:g}" if policy.min_reach > 0 else ""
        return f"{_policy_spec(policy.base)}+lookup:{lookup.max_ngram},{lookup.num_tokens}{reach}"  # type: ignore[arg-type]
    if isinstance(policy, ChainPolicy):
        return f"chain:{policy.k}"
    if isinstance(policy, DynamicTreePolicy):
        return f"dynamic:{policy.depth},{policy.top_k},{policy.total_tokens}"
    return repr(policy)


def _result_entry(result: MethodResult, detail: dict[str, Any] | None, greedy: bool) -> dict:
    entry: dict[str, Any] = {
        "new_tokens": len(result.tokens),
        "seconds": result.seconds,
        "tokens_per_second": len(result.tokens) / result.seconds if result.seconds > 0 else None,
        "tokens": result.tokens,
        "mismatch": detail,
        "matches_reference": (detail is None) if greedy else None,
    }
    if result.forwards is not None:
        entry["target_forwards"] = result.forwards
    if result.steps is not None:
        entry["verifications"] = result.steps
        entry["committed_by_verification"] = result.committed
        entry["tau"] = result.committed / result.steps if result.steps else None
        entry["accept_lengths"] = result.accept_lengths
        entry["tree_depths"] = result.tree_depths
        entry["seconds_by_phase"] = {k: round(v, 6) for k, v in result.split.items()}
    if result.first_token_seconds is not None:
        entry["first_token_seconds"] = result.first_token_seconds
    return entry


@contextlib.contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Any]:
    """``advance(description)`` over a bar of prompts (plain lines off a terminal; a no-op
    when disabled)."""
    from lightning_spec.progress import progress_bar

    with progress_bar("bench", enabled=enabled) as bar:
        task = bar.add_task("prompts", total=total)
        yield lambda description: bar.update(task, advance=1, description=description)
