"""A request stream with domain shifts: ordered segments of prompts from several sources.

OnlineSpec is judged on streams whose topic drifts (chat, then code, then maths): a `Segment`
names a prompt source (``sharegpt``, ``mtbench``, ``humaneval`` or a JSONL path) and how many
requests it contributes; segments follow each other in the given order, and prompts inside a
segment are shuffled with the stream's seed (a second seed is a second stream of the same mix),
or, with ``order: source``, taken as the first `count` in the source's own order: the regime the
OnlineSpec papers serve (one narrow domain in dataset order, so consecutive requests share
vocabulary and idioms; `data.domain_streams` builds such streams). A `count` of 0 with
``order: source`` takes the whole source.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Request", "Segment", "build_stream"]


@dataclass(frozen=True)
class Segment:
    source: str
    count: int
    order: str = "shuffle"  # "shuffle" (with the stream's seed) | "source" (file order)
    skip: int = 0  # with order "source": start after the first `skip` items (a warm start's)


@dataclass(frozen=True)
class Request:
    index: int
    domain: str
    id: str
    prompt: list[int]


def build_stream(
    tokenizer: Any,
    segments: Sequence[Segment],
    *,
    seed: int = 0,
    max_prompt_tokens: int = 1024,
    exclude: set[tuple[str, str]] | None = None,
) -> list[Request]:
    """The stream's requests in serving order. Prompts longer than `max_prompt_tokens` and
    (source, id) pairs in `exclude` (a held-out probe) are left out; a segment the source
    cannot fill is an error that says so."""
    from lightning_spec import specs

    if not segments:
        raise ValueError("a stream needs at least one segment")
    generator = random.Random(seed)
    requests: list[Request] = []
    for segment in segments:
        if segment.order not in ("shuffle", "source"):
            raise ValueError(f"segment {segment.source!r}: order must be shuffle or source")
        whole = segment.order == "source" and segment.count == 0
        if segment.count < 1 and not whole:
            raise ValueError(f"segment {segment.source!r}: count must be >= 1")
        if segment.skip < 0 or (segment.skip and segment.order != "source"):
            raise ValueError(f"segment {segment.source!r}: skip needs order: source and >= 0")
        small = segment.source.strip().lower() in ("mtbench", "mt-bench", "humaneval")
        is_file = segment.source.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".json"))
        limit = None if small or is_file else max(4 * segment.count, 200)  # ShareGPT: not all 17k
        _, items = specs.load_prompts(segment.source, tokenizer, limit, "first")
        held_out = {i for src, i in (exclude or set()) if src == segment.source}
        items = [
            item
            for item in items
            if len(item[0]) <= max_prompt_tokens and str(item[1].get("id")) not in held_out
        ]
        if segment.order == "source":
            items = items[segment.skip :]
        count = len(items) if whole else segment.count
        if len(items) < count or count == 0:
            raise ValueError(
                f"segment {segment.source!r} asks for {count or 'all'} prompts, the source has "
                f"{len(items)} of at most {max_prompt_tokens} tokens"
                + (f" after skipping {segment.skip}" if segment.skip else "")
            )
        if segment.order == "source":
            chosen = list(range(count))
        else:
            chosen = generator.sample(range(len(items)), count)
        for position in chosen:
            prompt, meta = items[position]
            requests.append(
                Request(len(requests), segment.source, str(meta.get("id")), list(prompt))
            )
    return requests
