"""A stream's greedy answers, generated once in batches and cached: every strategy replays them.

At T = 0 what a request commits does not depend on the drafter (it is the target's greedy
answer), so a long stream need not be decoded once per strategy: the answers are generated
once, `batch_size` prompts at a time (HF batch decode, several times the speed of batch-1
decoding on a CPU), each cut to its batch-1 greedy prefix (batched arithmetic may break a
near-tie differently; `decoding.replay.greedy_prefix`), and kept in a JSONL file keyed by
request id and a digest of its prompt (two streams whose ids collide can share a cache). `run_stream(continuations=...)` then serves each request by exact replay
(`decoding.replay.replay_greedy`): the records, hence tau and the feedback the strategies learn
from, are the ones live decoding would give on that text (tests compare them). Only time is not
replayed: tokens/s comes from a live run (`lightning-spec online` without ``replay``).

The file starts with a header line (target fingerprint, max_new_tokens) and is appended and
fsynced batch by batch, so a killed generation resumes with what it wrote; a header that does
not match refuses the file (another target or answer length).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_spec.io import atomic_path

__all__ = ["seed_continuations", "stream_continuations"]


def _header(target: Any, max_new_tokens: int) -> dict[str, Any]:
    from lightning_spec.models.fingerprint import cached_target_fingerprint

    return {"header": True, "target": cached_target_fingerprint(target), "max_new_tokens": max_new_tokens}


def _read(path: Path, header: dict[str, Any]) -> dict[str, list[int]]:
    if not path.is_file():
        return {}
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return {}
    found = json.loads(lines[0])
    if {k: found.get(k) for k in header} != header:
        raise ValueError(
            f"{path} holds answers of another target or length ({found.get('max_new_tokens')} "
            "new tokens): remove it or name another replay cache"
        )
    cached: dict[str, list[int]] = {}
    for line in lines[1:]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill: its request is generated again
        # rows before the prompt digest was recorded are found by id alone
        key = _key(row["id"], row["prompt_sha"]) if "prompt_sha" in row else str(row["id"])
        cached[key] = [int(t) for t in row["tokens"]]
    return cached


def _prompt_sha(prompt: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in prompt]).encode()).hexdigest()[:16]


def _key(request_id: object, prompt_sha: str) -> str:
    """A cache entry is one request id WITH its prompt: two streams sharing a cache whose ids
    collide (two files both numbered from 0) never replay each other's answers."""
    return f"{request_id}\t{prompt_sha}"


def _lookup(cached: dict[str, list[int]], request: Any) -> list[int] | None:
    found = cached.get(_key(request.id, _prompt_sha(request.prompt)))
    return found if found is not None else cached.get(str(request.id))


@torch.no_grad()
def _checked_row(target: Any, request: Any, answer: Sequence[int]) -> dict[str, Any]:
    """A cache row for `answer`, cut at its first token that is not `target`'s argmax (one
    teacher-forced pass): batched decoding, or another machine, can break a near-tie
    differently from this target's batch-1 greedy decoding."""
    from lightning_spec.decoding.replay import greedy_prefix, text_pass

    answer = [int(t) for t in answer]
    keep = len(answer)
    if answer:
        ids = torch.tensor([list(request.prompt) + answer], device=target.device)
        text = text_pass(target, ids, len(request.prompt), features=False)
        keep = greedy_prefix(target, text, answer)
    return {"id": str(request.id), "prompt_sha": _prompt_sha(request.prompt),
            "tokens": answer[:keep], "cut": keep < len(answer)}  # fmt: skip


def stream_continuations(
    target: Any,
    requests: Sequence[Any],
    *,
    max_new_tokens: int,
    cache: str | Path,
    batch_size: int = 32,
    progress: bool = True,
) -> list[list[int]]:
    """The greedy answer of every request (`Request`: ``id``, ``prompt``), cut to its batch-1
    greedy prefix; from `cache` where it has them, generated (and appended) otherwise."""
    from lightning_spec.data.regenerate import greedy_answers

    path = Path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = _header(target, int(max_new_tokens))
    cached = _read(path, header)
    if not path.is_file() or not path.read_text().strip():
        path.write_text(json.dumps(header) + "\n")
    missing = [r for r in requests if _lookup(cached, r) is None]
    by_id = sum(1 for r in requests if _key(r.id, _prompt_sha(r.prompt)) not in cached
                and str(r.id) in cached)  # fmt: skip
    if progress and by_id:
        print(f"[continuations] {by_id} of {len(requests)} answers in {path} are rows written "
              "before prompt digests, matched by request id alone (a stream whose ids collide "
              "with another's would replay its answers: name a fresh replay_cache to be sure)",
              flush=True)  # fmt: skip
    if progress and missing:
        print(f"[continuations] {len(missing)} of {len(requests)} greedy answers not in {path}: "
              f"generating them, {batch_size} prompts a batch", flush=True)  # fmt: skip
    for begin in range(0, len(missing), batch_size * 4):
        chunk = missing[begin : begin + batch_size * 4]
        answers = greedy_answers(
            target, [r.prompt for r in chunk], max_new_tokens=max_new_tokens, batch_size=batch_size
        )
        lines = []
        for request, answer in zip(chunk, answers, strict=True):
            row = _checked_row(target, request, answer)
            cached[_key(row["id"], row["prompt_sha"])] = row["tokens"]
            lines.append(json.dumps(row))
        with open(path, "a") as handle:
            handle.write("".join(line + "\n" for line in lines))
            handle.flush()
            os.fsync(handle.fileno())
        if progress:
            print(f"[continuations] {begin + len(chunk)}/{len(missing)} generated", flush=True)
    return [_lookup(cached, r) for r in requests]


def seed_continuations(
    target: Any,
    requests: Sequence[Any],
    answers: Sequence[Sequence[int] | None],
    *,
    max_new_tokens: int,
    cache: str | Path,
) -> tuple[int, int]:
    """Write known greedy `answers` (one per request, None where unknown) into a new `cache`
    that `stream_continuations` then reads instead of generating: e.g. the per-prompt text of an
    earlier T = 0 bench run on a machine whose cache is gone. Each answer is checked against
    `target` by one teacher-forced pass and cut at its first token that is not the argmax (a
    near-tie another machine broke differently). Returns (answers written, answers cut)."""
    path = Path(cache)
    if path.is_file() and path.read_text().strip():
        raise FileExistsError(f"{path} exists: remove it to seed it anew")
    lines, cut = [json.dumps(_header(target, int(max_new_tokens)))], 0
    for request, answer in zip(requests, answers, strict=True):
        if answer is None:
            continue  # generated by the next stream_continuations
        row = _checked_row(target, request, [int(t) for t in answer][:max_new_tokens])
        cut += row["cut"]
        lines.append(json.dumps(row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text("".join(line + "\n" for line in lines))
    return len(lines) - 1, cut
