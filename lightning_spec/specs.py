"""Strings to things: the one place that turns a command-line spec into a target, a drafter, a
prompt set or a tree policy.

Every command (`generate`, `bench`, `calibrate`, `promote`) and every script takes the same
spellings, so a drafter that works with `lightning-spec bench --drafter X` works with
`lightning-spec generate --drafter X` too:

* target (`resolve_target`): ``smollm2`` / ``default`` (the embedded default target, fetched
  into the asset cache), a Hugging Face model folder (config.json + weights + tokenizer), a
  ``.gguf`` file, or a hub id. Loaded once per process (`models.target.load_target`).
* drafter (`resolve_drafter`): a drafter folder, ``random``, ``self``, ``bigram:<drafter
  folder>`` or ``bigram:<data source>``.
* prompt set (`load_prompts`): ``mtbench``, ``humaneval`` or a ``.jsonl`` path, rendered with
  the target's chat template; `limit` prompts picked round-robin over categories or in file
  order.
* tree policy (`resolve_tree`): ``chain:K``, ``static:NAME``, ``static:[(0,), (1,), ...]`` or
  ``dynamic:DEPTH,TOP_K,TOTAL_TOKENS`` (`decoding.build.parse_tree_spec`).

Heavy libraries are imported inside the functions: importing this module stays cheap. Nothing
here imports the CLI; the CLI imports this.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

__all__ = [
    "PromptItem",
    "build_bigram",
    "load_prompts",
    "resolve_drafter",
    "resolve_target",
    "resolve_tree",
]

PromptItem = tuple[list[int], dict[str, Any]]
"""One prompt: its token ids (chat template applied) and meta (`id`, `category`)."""


# ---------------------------------------------------------------------------------- targets
def resolve_target(spec: str, dtype: str = "float32") -> Any:
    """A `TargetModel` from ``smollm2`` / ``default``, a model folder, a ``.gguf`` file or a hub
    id, in `dtype` (``float32`` / ``fp32``, ``bf16`` / ``bfloat16``); one instance per spec and
    dtype in the process (`load_target`)."""
    from lightning_spec.models.target import load_target

    return load_target(spec, dtype=dtype)


# ---------------------------------------------------------------------------------- drafters
def resolve_drafter(
    spec: str,
    target: Any,
    *,
    draft_vocab_size: int | None = None,
    bigram_limit: int = 2000,
    seed: int = 0,
) -> Any:
    """A drafter for `target` from a spec:

    * a drafter folder (config.json + model.safetensors, `Drafter.save_pretrained`): loaded on
      the target's device, cast to the target's dtype;
    * ``random``: an untrained EAGLE-3 head sized like the target (`draft_vocab_size` draft
      tokens, default the whole vocabulary; weights from `seed`), in eval mode: the baseline an
      untrained drafter gives;
    * ``self``: the target drafting for itself (`StandaloneDrafter` over the target's own LM):
      every draft is accepted at T=0, an upper bound on tau;
    * ``bigram:<drafter folder>``: a saved `BigramDrafter`;
    * ``bigram:<data source>`` (``sharegpt``, ``mtbench``, a ``.jsonl`` path...): a bigram
      drafter counted over `bigram_limit` conversations of that source (`build_bigram`).

    Anything else is a ValueError naming the accepted forms.
    """
    from lightning_spec.models.drafters import bigram  # noqa: F401  (registers "bigram")
    from lightning_spec.models.drafters.base import CONFIG_NAME, load_drafter

    if spec == "random":
        from lightning_spec.models.drafters.eagle3 import Eagle3Drafter

        drafter = Eagle3Drafter.from_target(target, draft_vocab_size=draft_vocab_size, seed=seed)
        return drafter.eval()
    if spec == "self":
        from lightning_spec.models.drafters.standalone import StandaloneDrafter

        return StandaloneDrafter.from_model(target.model, target_name=str(target.name))
    if spec.startswith("bigram:"):
        source = spec.split(":", 1)[1]
        if (Path(source) / CONFIG_NAME).is_file():
            return load_drafter(source, device=target.device)
        return build_bigram(source, target, limit=bigram_limit)
    if (Path(spec) / CONFIG_NAME).is_file():
        from lightning_spec.models.fingerprint import check_drafter_target

        drafter = load_drafter(spec, device=target.device)
        check_drafter_target(drafter, target)  # a drafter of another target: refused, named
        drafter = drafter.to(target.dtype)
        drafter.bind_target(target)
        return drafter
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


# ---------------------------------------------------------------------------------- prompts
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


# ---------------------------------------------------------------------------------- trees
def resolve_tree(spec: str) -> Any:
    """A `TreePolicy` from ``chain:K``, ``static:NAME`` (a `STATIC_TREES` name),
    ``static:[(0,), (1,), (0, 0)]`` (explicit rank paths) or ``dynamic:DEPTH,TOP_K,TOTAL``.
    ``auto`` is not a policy: `lightning-spec bench --tree auto` calibrates first."""
    from lightning_spec.decoding.build import parse_tree_spec

    return parse_tree_spec(spec)
