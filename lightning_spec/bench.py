"""`lightning-spec bench`: acceptance length and wall-clock speedup, side by side with baselines.

One run measures, on the same prompts, with the same target, dtype, thread count, max new
tokens and temperature:

* ``autoregressive``: our own KV-cache loop (`autoregressive_generate`), the losslessness
  reference and the speed baseline;
* ``hf_generate``: Hugging Face ``generate`` (greedy, or plain sampling at T > 0);
* ``hf_prompt_lookup``: Hugging Face prompt-lookup decoding (n-gram drafts copied from the
  prompt, no drafter model), a strong free baseline on inputs that get quoted back;
* ``speculative``: our `SpeculativeDecoder` with the chosen drafter(s) and tree policy.

Honest-measurement rules from MEASURING.md, enforced here rather than remembered: methods are
interleaved per prompt (every method runs on prompt i before any runs on prompt i + 1, and the
order rotates from prompt to prompt so drift and cache warmth do not favour one method), warm-up
prompts run first and are discarded, threads are pinned and recorded, the load average is read
before starting (a loud warning when another job is running), speedups are medians of per-prompt
ratios and ratios of totals with 95% bootstrap intervals over prompts, and greedy equality with
the target is checked in the same run (`mismatches`, with the position and the target's top-2
logit gap when it happens, so a floating-point near-tie is told apart from a bug).

tau = tokens committed per target verification (accepted drafts + 1 bonus token), pooled over
steps; the prefill's first token is not a verification. For HF prompt lookup tau is estimated
as new tokens / target forwards (counted by a forward hook: HF merges the prefill into the first
verification).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_spec import stats
from lightning_spec.decoding.build import TreePolicy, parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder, autoregressive_generate

__all__ = [
    "BASELINES",
    "METHODS",
    "REQUIRED_ROW_KEYS",
    "git_commit",
    "load_prompts",
    "machine_info",
    "main",
    "resolve_drafter",
    "run_bench",
    "summarize",
    "to_markdown",
    "write_outputs",
]

METHODS: tuple[str, ...] = ("autoregressive", "hf_generate", "hf_prompt_lookup", "speculative")
BASELINES: tuple[str, ...] = ("autoregressive", "hf_generate", "hf_prompt_lookup")
REQUIRED_ROW_KEYS: tuple[str, ...] = (
    "method",
    "dataset",
    "category",
    "temperature",
    "tau",
    "tau_ci",
    "alpha",
    "tokens_per_second",
    "speedup_vs_autoregressive",
    "speedup_vs_autoregressive_ci",
    "speedup_vs_hf_generate",
    "speedup_vs_hf_prompt_lookup",
    "mismatches",
    "num_prompts",
    "new_tokens",
)
"""Every row carries these keys (None where a quantity does not apply)."""
TAU_NOTE = (
    "tau = tokens committed per target verification (accepted draft tokens + 1 bonus/correction "
    "token), pooled over verification steps; the prefill's first token is not counted."
)
PromptItem = tuple[list[int], dict[str, Any]]


# ---------------------------------------------------------------------------------- machine
def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:  # pragma: no cover - not available on every platform
        return (float("nan"),) * 3


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def machine_info(dtype: str = "fp32") -> dict[str, Any]:
    """Cores, threads, dtype, versions and the load average *before* the run starts.

    `busy` follows MEASURING.md: the 1-minute load, less one runnable task for this process,
    above half the cores means another job shares the CPU and timings will be noisy.
    """
    import transformers

    load = load_average()
    cores = _cores()
    threshold = 0.5 * cores
    return {
        "cores": cores,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "dtype": dtype,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average": [round(x, 2) for x in load],
        "load_threshold": threshold,
        "busy": bool(load[0] - 1.0 > threshold),
    }


def warn_if_busy(machine: dict[str, Any]) -> bool:
    """Print a loud warning when the load average says another job is running."""
    if not machine.get("busy"):
        return False
    load = machine["load_average"][0]
    bar = "!" * 78
    print(
        f"{bar}\nWARNING: 1-minute load average {load:.2f} on {machine['cores']} cores: another "
        f"job is using this machine (threshold: {machine['load_threshold']:.1f} beyond this "
        "process).\nWall-clock numbers from this run are NOT publishable (MEASURING.md); ratios "
        f"are still interleaved, but expect noise. Recorded in the JSON as machine.busy.\n{bar}",
        file=sys.stderr,
    )
    return True


def git_commit() -> str | None:
    """HEAD of the repository holding this package (with '-dirty' when files are modified)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------------- loading
def load_bench_target(spec: str, dtype: str) -> Any:
    """The target, shared in-process (`load_target`)."""
    from lightning_spec.models.target import load_target

    return load_target(spec, dtype=dtype)


def load_prompts(
    spec: str,
    tokenizer: Any,
    limit: int | None = None,
    selection: str = "stratified",
) -> tuple[str, list[PromptItem]]:
    """(dataset name, [(prompt ids, meta)]) for ``mtbench``, ``humaneval`` or a JSONL path.

    With `limit` and ``selection="stratified"``, prompts are taken round-robin over categories
    (MT-Bench stores its 80 questions in blocks of 10 per category, so the first 20 would be
    writing and roleplay only); ``"first"`` takes the first `limit` in file order.
    """
    from lightning_spec.data.chat import render_prompt
    from lightning_spec.data.sources import load_source

    if tokenizer is None:
        raise ValueError("the target has no tokenizer: cannot render benchmark prompts")
    if selection not in ("stratified", "first"):
        raise ValueError(f"selection must be stratified or first, got {selection!r}")
    source = load_source(spec, limit=None if selection == "stratified" else limit)
    conversations = list(source)
    key = spec.strip().lower().replace("-", "").replace("_", "")
    name = key if key in ("mtbench", "humaneval") else Path(spec).name.split(".")[0]
    if limit is not None and selection == "stratified":
        conversations = _stratified(conversations, limit)
    items: list[PromptItem] = []
    for conversation in conversations:
        meta = {"id": conversation.id, "category": conversation.meta.get("category")}
        items.append((render_prompt(tokenizer, conversation.prompt()), meta))
    return name, items


def _stratified(conversations: list[Any], limit: int) -> list[Any]:
    groups: dict[Any, list[int]] = {}
    for index, conversation in enumerate(conversations):
        groups.setdefault(conversation.meta.get("category"), []).append(index)
    chosen: list[int] = []
    depth = 0
    while len(chosen) < min(limit, len(conversations)):
        for indices in groups.values():
            if depth < len(indices) and len(chosen) < limit:
                chosen.append(indices[depth])
        depth += 1
    return [conversations[i] for i in sorted(chosen)]


def resolve_drafter(
    spec: str,
    target: Any,
    *,
    draft_vocab_size: int | None = None,
    bigram_limit: int = 2000,
    seed: int = 0,
) -> Any:
    """A drafter from a CLI spec: a drafter folder, ``random`` (untrained EAGLE-3 head),
    ``self`` (the target drafting for itself) or ``bigram:<drafter folder | data source>``."""
    from lightning_spec.models.drafters import bigram  # noqa: F401  (registers "bigram")
    from lightning_spec.models.drafters.base import CONFIG_NAME, load_drafter

    if spec == "random":
        from lightning_spec.models.drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter.from_target(target, draft_vocab_size=draft_vocab_size, seed=seed)
    if spec == "self":
        from lightning_spec.models.drafters.standalone import StandaloneDrafter

        return StandaloneDrafter.from_model(target.model, target_name=str(target.name))
    if spec.startswith("bigram:"):
        source = spec.split(":", 1)[1]
        if (Path(source) / CONFIG_NAME).is_file():
            return load_drafter(source, device=target.device)
        return build_bigram(source, target, limit=bigram_limit)
    if (Path(spec) / CONFIG_NAME).is_file():
        drafter = load_drafter(spec, device=target.device)
        return drafter.to(target.dtype)
    raise ValueError(
        f"unknown drafter {spec!r}: use a drafter folder, random, self or bigram:<folder|data>"
    )


def build_bigram(source: str, target: Any, *, limit: int = 2000) -> Any:
    """Count bigrams over `limit` conversations of a data source, rendered with the target's
    chat template (what the target actually sees)."""
    from lightning_spec.data.chat import render_conversation
    from lightning_spec.data.sources import load_source
    from lightning_spec.models.drafters.bigram import BigramDrafter

    if target.tokenizer is None:
        raise ValueError("building a bigram drafter from data needs the target's tokenizer")
    tic = time.perf_counter()
    conversations = load_source(source, limit=limit)
    sequences = (
        render_conversation(target.tokenizer, conv.messages).input_ids for conv in conversations
    )
    drafter = BigramDrafter.from_sequences(
        sequences, target.vocab_size, target_model=str(target.name), source=source
    )
    print(
        f"bigram drafter: {drafter.config['num_tokens']} tokens from {source} "
        f"({time.perf_counter() - tic:.1f} s)",
        file=sys.stderr,
    )
    return drafter.to(target.device)


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


class _ForwardCounter:
    """Counts calls of the HF model's forward (HF prompt lookup's verifications)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *args: Any) -> None:
        self.count += 1

    def remove(self) -> None:
        self.handle.remove()


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
        policy: TreePolicy | None,
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
            name: SpeculativeDecoder(target, drafter, policy, temperature=temperature)
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
            tic = time.perf_counter()
            tokens = autoregressive_generate(
                self.target,
                prompt,
                limit,
                temperature=self.temperature,
                generator=self._generator(index),
                stop_on_eos=self.stop_on_eos,
            )
            _sync(device)
            return MethodResult(tokens, time.perf_counter() - tic)
        if method in ("hf_generate", "hf_prompt_lookup"):
            return self._run_hf(prompt, index, limit, lookup=method == "hf_prompt_lookup")
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
                split=split,
                steps=len(result.records),
                committed=sum(len(r.committed) for r in result.records),
                accept_lengths=[int(r.accept_length) for r in result.records],
                tree_depths=[int(r.tree.max_depth) for r in result.records],
            )
        raise ValueError(f"unknown method {method!r}")

    @torch.no_grad()
    def _run_hf(self, prompt: list[int], index: int, limit: int, *, lookup: bool) -> MethodResult:
        from transformers import GenerationConfig

        model = self.target.model
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
        try:
            with _plain_generation_defaults(model):
                tic = time.perf_counter()
                output = model.generate(
                    ids, attention_mask=torch.ones_like(ids), generation_config=config
                )
                _sync(self.target.device)
                seconds = time.perf_counter() - tic
        finally:
            counter.remove()
        tokens = output[0, len(prompt) :].tolist()
        return MethodResult(tokens, seconds, forwards=counter.count)


def _first_difference(reference: Sequence[int], output: Sequence[int]) -> int | None:
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
    position = _first_difference(reference, output)
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
    policy: TreePolicy | str | None,
    datasets: dict[str, list[PromptItem]],
    *,
    methods: Sequence[str] = METHODS,
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
    ``speculative:<label>``). `datasets` maps a name to (prompt ids, meta) pairs; a meta
    ``category`` gives per-category rows. Returns ``{"config", "rows", "per_prompt"}``.
    """
    if order not in ("rotate", "fixed"):
        raise ValueError("order must be rotate or fixed")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    tree_spec = policy if isinstance(policy, str) else _policy_spec(policy)
    if isinstance(policy, str):
        policy = parse_tree_spec(policy)
    if drafter is None:
        drafters: dict[str, Any] = {}
    elif isinstance(drafter, dict):
        drafters = {f"speculative:{label}": d for label, d in drafter.items()}
    else:
        drafters = {"speculative": drafter}
    if "speculative" in methods and (not drafters or policy is None):
        raise ValueError("the speculative method needs a drafter and a tree policy")
    names = _method_names(methods, list(drafters) if "speculative" in methods else [])
    runner = _Runner(
        target,
        drafters if "speculative" in methods else {},
        policy,
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
                # The target's own greedy output: our autoregressive loop or HF greedy
                # `generate` when either ran (equal token for token, tests/models), else one
                # extra greedy decode.
                if "autoregressive" in results:
                    reference = results["autoregressive"].tokens
                elif "hf_generate" in results:
                    reference = results["hf_generate"].tokens
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
    return _clean({"config": run_config, "rows": rows, "per_prompt": per_prompt})


def _policy_spec(policy: TreePolicy | None) -> str | None:
    if policy is None:
        return None
    from lightning_spec.decoding.build import ChainPolicy, DynamicTreePolicy

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
    return entry


@contextlib.contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Any]:
    """``advance(description)`` over a bar of prompts (plain lines off a terminal; a no-op
    when disabled)."""
    from lightning_spec.progress import progress_bar

    with progress_bar("bench", enabled=enabled) as bar:
        task = bar.add_task("prompts", total=total)
        yield lambda description: bar.update(task, advance=1, description=description)


# ---------------------------------------------------------------------------------- summary
def summarize(
    per_prompt: list[dict[str, Any]],
    methods: Sequence[str],
    *,
    temperature: float,
    tree: str | None = None,
    resamples: int = 2000,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per (dataset, category or overall, method); see the module docstring."""
    rows: list[dict[str, Any]] = []
    datasets = list(dict.fromkeys(entry["dataset"] for entry in per_prompt))
    for dataset in datasets:
        entries = [e for e in per_prompt if e["dataset"] == dataset]
        groups: list[tuple[str | None, list[dict[str, Any]]]] = [(None, entries)]
        categories = sorted({e["category"] for e in entries if e.get("category") is not None})
        groups += [(c, [e for e in entries if e.get("category") == c]) for c in categories]
        for category, group in groups:
            for method in methods:
                rows.append(
                    _row(
                        group,
                        method,
                        methods,
                        dataset,
                        category,
                        temperature,
                        tree,
                        resamples,
                        seed,
                    )
                )
    return rows


def _row(
    group: list[dict[str, Any]],
    method: str,
    methods: Sequence[str],
    dataset: str,
    category: str | None,
    temperature: float,
    tree: str | None,
    resamples: int,
    seed: int,
) -> dict[str, Any]:
    results = [entry["methods"][method] for entry in group]
    tokens = [r["new_tokens"] for r in results]
    seconds = [r["seconds"] for r in results]
    rates = [t / s for t, s in zip(tokens, seconds, strict=True) if s > 0]
    speculative = method.startswith("speculative")
    row: dict[str, Any] = {
        "method": method,
        "dataset": dataset,
        "category": category,
        "temperature": temperature,
        "tree": tree if speculative else None,
        "tau": None,
        "tau_ci": None,
        "tau_note": None,
        "alpha": None,
    }
    if speculative:
        row.update(
            stats.tau_summary(
                [r["committed_by_verification"] for r in results],
                [r["verifications"] for r in results],
                resamples=resamples,
                seed=seed,
            )
        )
        row["tau_note"] = "measured: committed tokens / verification steps"
        row["alpha"] = stats.per_depth_acceptance(
            [a for r in results for a in r["accept_lengths"]],
            [d for r in results for d in r["tree_depths"]],
        )
    elif method == "hf_prompt_lookup":
        row.update(
            stats.tau_summary(
                tokens, [r["target_forwards"] for r in results], resamples=resamples, seed=seed
            )
        )
        row["tau_note"] = "estimated: new tokens / target forwards (forward hook)"
    row["tokens_per_second"] = stats.median(rates)
    row["tokens_per_second_total"] = stats.ratio_of_sums(tokens, seconds)
    for baseline in BASELINES:
        key = f"speedup_vs_{baseline}"
        summary: dict[str, Any] = {
            "median": None,
            "median_ci": None,
            "total": None,
            "total_ci": None,
        }
        if baseline in methods:
            base = [entry["methods"][baseline] for entry in group]
            summary = stats.speedup_summary(
                tokens,
                seconds,
                [b["new_tokens"] for b in base],
                [b["seconds"] for b in base],
                resamples=resamples,
                seed=seed,
            )
        row[key] = summary["median"]
        row[f"{key}_ci"] = summary["median_ci"]
        row[f"{key}_total"] = summary["total"]
        row[f"{key}_total_ci"] = summary["total_ci"]
    greedy = temperature == 0
    details = [
        {"index": entry["index"], "id": entry["id"], **result["mismatch"]}
        for entry, result in zip(group, results, strict=True)
        if result.get("mismatch")
    ]
    row["mismatches"] = len(details) if greedy else None
    row["mismatch_details"] = details if greedy else None
    row["num_prompts"] = len(group)
    row["new_tokens"] = sum(tokens)
    row["seconds"] = sum(seconds)
    if speculative:
        row["verifications"] = sum(r["verifications"] for r in results)
        phases: dict[str, float] = {}
        for result in results:
            for phase, value in (result.get("seconds_by_phase") or {}).items():
                phases[phase] = phases.get(phase, 0.0) + value
        phases["other"] = max(row["seconds"] - sum(phases.values()), 0.0)
        # Where the time goes (everything is charged: drafting, verification, bookkeeping).
        row["time_fraction"] = {
            k: round(v / row["seconds"], 4) if row["seconds"] else None for k, v in phases.items()
        }
    return row


def _clean(value: Any) -> Any:
    """NaN/inf -> None so the JSON stays strict (json.dumps(allow_nan=False))."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


# ---------------------------------------------------------------------------------- reporting
def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ci(interval: Sequence[float] | None, digits: int = 2) -> str:
    return "" if not interval else f" [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"


def _speedup_cell(row: dict[str, Any], baseline: str) -> str:
    key = f"speedup_vs_{baseline}"
    if row.get(key) is None or row["method"] == baseline:
        return "-"
    return f"{row[key]:.2f}{_ci(row.get(key + '_ci'))} / {_num(row.get(key + '_total'))}"


def to_markdown(result: dict[str, Any]) -> str:
    """The table a BENCHMARKS.md section pastes, with its command-independent context."""
    config = result["config"]
    machine = config.get("machine", {})
    lines = [
        f"Target {config.get('target')}, dtype {config.get('dtype')}, tree "
        f"{config.get('tree')}, T={config.get('temperature')}, max new tokens "
        f"{config.get('max_new_tokens')}, drafter(s) {config.get('drafter')}, commit "
        f"{config.get('commit')}.",
        f"Machine: {machine.get('cores')} cores ({machine.get('processor')}), torch threads "
        f"{machine.get('torch_threads')}, load average before {machine.get('load_average')} "
        f"after {machine.get('load_average_end')}"
        + (" -- BUSY: timings not publishable." if machine.get("busy") else "."),
        f"Methods interleaved per prompt ({config.get('order')} order), "
        f"{config.get('warmup')} warm-up prompt(s) discarded.",
        "",
        TAU_NOTE + " alpha_j = P(draft j accepted | drafts 1..j-1 accepted). HF prompt lookup tau "
        "is estimated as new tokens / target forwards.",
        "Speedup cells: median of per-prompt tokens/s ratios [95% bootstrap CI over prompts] / "
        "ratio of total tokens/s. Mismatches: prompts whose output differs from the target's own "
        "greedy decode (T=0 only).",
        "",
        "| dataset | category | method | tau [95% CI] | alpha_1.. | tok/s (median) | tok/s (total) "
        "| speedup vs autoregressive | vs HF generate | vs HF prompt lookup | mismatches | prompts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        alpha = row.get("alpha")
        alpha_text = " ".join(_num(a) for a in alpha) if alpha else "-"
        tau = "-" if row.get("tau") is None else f"{row['tau']:.2f}{_ci(row.get('tau_ci'))}"
        if row["method"] == "hf_prompt_lookup" and row.get("tau") is not None:
            tau += " (est.)"
        mismatches = "n/a" if row.get("mismatches") is None else str(row["mismatches"])
        lines.append(
            f"| {row['dataset']} | {row['category'] or 'all'} | {row['method']} | {tau} | "
            f"{alpha_text} | {_num(row.get('tokens_per_second'), 1)} | "
            f"{_num(row.get('tokens_per_second_total'), 1)} | "
            f"{_speedup_cell(row, 'autoregressive')} | {_speedup_cell(row, 'hf_generate')} | "
            f"{_speedup_cell(row, 'hf_prompt_lookup')} | {mismatches} | {row['num_prompts']} |"
        )
    mismatched = [
        (row, d)
        for row in result["rows"]
        if row["category"] is None
        for d in (row.get("mismatch_details") or [])
    ]
    if mismatched:
        lines += ["", "Greedy mismatches (first differing position; target top-2 logit gap):", ""]
        for row, d in mismatched:
            lines.append(
                f"- {row['dataset']} {row['method']} prompt {d['index']} ({d['id']}): position "
                f"{d['position']}, expected {d['expected']} got {d['got']}, top-2 gap "
                f"{d['top2_gap']:.2e}{' (near tie)' if d.get('near_tie') else ''}"
            )
    return "\n".join(lines) + "\n"


def dumps_result(result: dict[str, Any]) -> str:
    """Strict JSON (no NaN): config and rows indented, one line per prompt so the raw file
    stays small enough to commit next to BENCHMARKS.md and diffs line up by prompt."""
    result = _clean(result)
    parts = []
    for key, value in result.items():
        if key == "per_prompt":
            lines = ",\n".join("    " + json.dumps(entry, allow_nan=False) for entry in value)
            body = "[\n" + lines + "\n  ]" if value else "[]"
        else:
            body = json.dumps(value, indent=2, allow_nan=False).replace("\n", "\n  ")
        parts.append(f"  {json.dumps(key)}: {body}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_outputs(result: dict[str, Any], output: str | Path) -> tuple[Path, Path]:
    """Write the JSON and, next to it, the markdown table (same name, .md)."""
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_result(result))
    markdown = path.with_suffix(".md")
    markdown.write_text(to_markdown(result))
    return path, markdown


# ---------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-spec bench",
        description="Measure tau, per-depth acceptance and wall-clock speedup of speculative "
        "decoding against autoregressive decoding, HF generate and HF prompt lookup, "
        "interleaved per prompt.",
    )
    parser.add_argument("--target", default="smollm2", help="smollm2, a model folder or hub id")
    parser.add_argument(
        "--drafter",
        action="append",
        default=None,
        help="drafter folder, random, self or bigram:<folder|data source>; repeat to compare "
        "several drafters in one interleaved run",
    )
    parser.add_argument(
        "--dataset",
        action="append",
        default=None,
        help="mtbench, humaneval or a .jsonl path; repeatable or comma-separated (default mtbench)",
    )
    parser.add_argument("--limit", type=int, default=None, help="prompts per dataset")
    parser.add_argument(
        "--selection",
        default="stratified",
        choices=["stratified", "first"],
        help="how --limit picks prompts: round-robin over categories, or file order",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--tree",
        default="chain:4",
        help="chain:K, dynamic:DEPTH,TOP_K,TOTAL, static:NAME, or auto (calibrate first)",
    )
    parser.add_argument(
        "--calibration", default=None, help="with --tree auto: reuse a calibrate JSON"
    )
    parser.add_argument(
        "--calibrate-prompts", type=int, default=3, help="with --tree auto: acceptance probe size"
    )
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (recorded)")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {','.join(METHODS)}",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="prompts run first and discarded")
    parser.add_argument("--order", default="rotate", choices=["rotate", "fixed"])
    parser.add_argument("--ignore-eos", action="store_true", help="always decode max-new-tokens")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    parser.add_argument("--max-matching-ngram-size", type=int, default=2)
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="for --drafter random")
    parser.add_argument("--bigram-limit", type=int, default=2000, help="conversations counted")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--output", default=None, help="JSON path; the .md goes next to it")
    parser.add_argument("--require-idle", action="store_true", help="exit 3 when the CPU is busy")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _split(values: Sequence[str] | None, default: str) -> list[str]:
    out = [part.strip() for value in (values or [default]) for part in value.split(",")]
    return [part for part in out if part]


def _drafter_label(spec: str, parts: int = 1) -> str:
    """A short method label for a --drafter value: its last `parts` path components."""
    if spec in ("random", "self"):
        return spec
    prefix, path = ("bigram:", spec.split(":", 1)[1]) if spec.startswith("bigram:") else ("", spec)
    tail = Path(path).parts[-parts:]
    return prefix + ("/".join(tail) if tail else spec)


def drafter_labels(specs: Sequence[str]) -> list[str]:
    """Unique labels for the --drafter values, as short as possible.

    Two runs' `drafter/last` folders must not collapse into one `speculative:last` method (the
    second would silently replace the first): colliding labels take more path components
    (`a/drafter/last`, `b/drafter/last`). The same drafter given twice is an error.
    """
    if len(set(specs)) != len(specs):
        raise ValueError("bench: the same --drafter was given twice")
    parts = [1] * len(specs)
    while True:
        labels = [_drafter_label(spec, n) for spec, n in zip(specs, parts, strict=True)]
        clashes = {label for label in labels if labels.count(label) > 1}
        if not clashes:
            return labels
        grown = False
        for index, label in enumerate(labels):
            if label in clashes and parts[index] < len(Path(specs[index]).parts):
                parts[index] += 1
                grown = True
        if not grown:  # e.g. `x` and `./x`: distinct strings, same components
            return [f"{label}#{i}" if label in clashes else label for i, label in enumerate(labels)]


def main(argv: list[str] | None = None) -> int:
    """`lightning-spec bench`; returns 0, 1 when greedy outputs mismatched, 3 when busy and
    --require-idle was given."""
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    machine = machine_info(args.dtype)
    if warn_if_busy(machine) and args.require_idle:
        return 3
    methods = _split([args.methods], ",".join(METHODS))
    dataset_specs = _split(args.dataset, "mtbench")
    drafter_specs = args.drafter or []
    if "speculative" in methods and not drafter_specs:
        print("bench: --drafter is required for the speculative method", file=sys.stderr)
        return 2
    target = load_bench_target(args.target, args.dtype)
    datasets: dict[str, list[PromptItem]] = {}
    for spec in dataset_specs:
        name, items = load_prompts(spec, target.tokenizer, args.limit, args.selection)
        datasets[name] = items
    drafters = {}
    if "speculative" in methods:
        try:
            labels = drafter_labels(drafter_specs)
        except ValueError as error:
            print(error, file=sys.stderr)
            return 2
        for label, spec in zip(labels, drafter_specs, strict=True):
            drafters[label] = resolve_drafter(
                spec,
                target,
                draft_vocab_size=args.draft_vocab_size,
                bigram_limit=args.bigram_limit,
                seed=args.seed,
            )
    config: dict[str, Any] = {
        "flags": dict(vars(args)),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "commit": git_commit(),
        "machine": machine,
        "drafter": drafter_specs,
        "threads": args.threads,
    }
    tree = args.tree
    if "speculative" in methods and tree == "auto":
        tree, calibration = _auto_tree(args, target, drafters, datasets)
        config["calibration"] = calibration
    result = run_bench(
        target,
        (drafters if len(drafters) > 1 else next(iter(drafters.values()))) if drafters else None,
        tree if "speculative" in methods else None,
        datasets,
        methods=methods,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        warmup=args.warmup,
        order=args.order,
        stop_on_eos=not args.ignore_eos,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        max_matching_ngram_size=args.max_matching_ngram_size,
        bootstrap_resamples=args.bootstrap,
        progress=not args.no_progress,
        config=config,
    )
    markdown = to_markdown(result)
    print(markdown)
    if args.output:
        json_path, md_path = write_outputs(result, args.output)
        print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    mismatched = sum(row["mismatches"] or 0 for row in result["rows"] if row["category"] is None)
    if mismatched:
        print(f"bench: {mismatched} greedy mismatch(es); see the table", file=sys.stderr)
    return 1 if mismatched else 0


def _auto_tree(
    args: argparse.Namespace,
    target: Any,
    drafters: dict[str, Any],
    datasets: dict[str, list[PromptItem]],
) -> tuple[str, dict[str, Any]]:
    """`--tree auto`: one policy for all drafters, from a saved or fresh calibration of the
    first drafter (the same policy for every method keeps the comparison fair)."""
    from lightning_spec import calibrate

    if args.calibration:
        data = json.loads(Path(args.calibration).read_text())
        spec, speedup, table = calibrate.suggestion_from_calibration(data)
        calibration = {"source": args.calibration, "suggestion": spec, "expected_speedup": speedup}
    else:
        first = next(iter(datasets.values()))
        prompts = [ids for ids, _ in first[: args.calibrate_prompts]]
        drafter = next(iter(drafters.values()))
        calibration = calibrate.calibrate(
            target, drafter, prompts, max_new_tokens=args.max_new_tokens, seed=args.seed
        )
        spec = calibration["suggestion"]["policy"]
        speedup = calibration["suggestion"]["expected_speedup"]
    print(f"bench: --tree auto -> {spec} (modelled speedup {speedup:.2f}x)", file=sys.stderr)
    return spec, calibration


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
