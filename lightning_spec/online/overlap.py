"""Is a request stream inside the drafter's training set? An exact and an n-gram check.

Online learning is judged on requests the drafter never trained on: a stream's prompts
must not be in the drafter's training set, and that is checked, not assumed. A stream built from
the items *after* a warm start's (``skip: 800``) is disjoint by construction only if nothing
shifted the two selections (a prompt filtered out of the stream for its length moves every later
item), and a ShareGPT-trained drafter may have seen a standard-library docstring that somebody
pasted into a chat. So the check reads the real training selection (the first ``count``
conversations of each training source, as the data module takes them) and reports, per stream
request:

* ``same_id``: the request's id is a training conversation's id in the same source file;
* ``exact``: its prompt, whitespace-normalised, equals a training prompt;
* ``ngram``: it shares a run of `n` words (default 13, the contamination test of the GPT-3
  paper) with any message of any training conversation: prompt or answer.

The stream's n-grams are indexed and the training text is scanned once, so memory follows the
stream (thousands of prompts), not the training set (ShareGPT's millions of words).

``python -m lightning_spec.online.overlap --stream S.jsonl --skip 800 --count 1200 --train
S.jsonl:800 --train sharegpt:4500`` prints the report; `lightning-spec online` runs the same check
before serving when the drafter's folder says what it trained on (``training_state.json``, written
by `DrafterCheckpoint`) or the config names it (``train_data``), and refuses a stream whose
prompts the drafter trained on.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "TrainingSelection",
    "check_overlap",
    "drafter_training_data",
    "parse_selection",
    "stream_prompts",
]

_WORD = re.compile(r"\w+")

TrainingSelection = dict[str, Any]  # {"source": spec, "count": first N conversations or None}


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _grams(words: Sequence[str], n: int) -> set[int]:
    """Hashes of the word n-grams of `words` (the whole text when it is shorter than n)."""
    if not words:
        return set()
    if len(words) <= n:
        return {hash(tuple(words))}
    return {hash(tuple(words[i : i + n])) for i in range(len(words) - n + 1)}


def _normal(text: str) -> str:
    return " ".join(text.split())


def _user_text(conversation: Any) -> str:
    return "\n".join(m["content"] for m in conversation.prompt() if m["role"] == "user")


def _same_source(a: str, b: str) -> bool:
    """Two source specs name the same data (paths compared resolved, names case-blind)."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.is_file() and pb.is_file():
        return pa.resolve() == pb.resolve()
    return a.strip().lower() == b.strip().lower()


def stream_prompts(requests: Iterable[Any]) -> list[tuple[str, str, str]]:
    """(source, id, user prompt text) of each stream request (`online.stream.Request`), read
    back from the request's source, since the requests hold rendered token ids."""
    from lightning_spec.data.sources import load_source

    requests = list(requests)
    texts: dict[str, dict[str, str]] = {}
    for source in {r.domain for r in requests}:
        texts[source] = {str(c.id): _user_text(c) for c in load_source(source)}
    return [(r.domain, r.id, texts[r.domain].get(r.id, "")) for r in requests]


def check_overlap(
    stream: Sequence[tuple[str, str, str]],
    training: Sequence[TrainingSelection],
    *,
    n: int = 13,
) -> dict[str, Any]:
    """The overlap of `stream` ((source, id, prompt) triples) with the first ``count``
    conversations of each training source (see the module docstring)."""
    from lightning_spec.data.sources import load_source

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    index: dict[int, set[int]] = {}
    for position, (_, _, text) in enumerate(stream):
        for gram in _grams(_words(text), n):
            index.setdefault(gram, set()).add(position)
    prompts = {_normal(text): position for position, (_, _, text) in enumerate(stream)}
    same_id: set[int] = set()
    exact: set[int] = set()
    ngram: set[int] = set()
    scanned = []
    for selection in training:
        spec, count = str(selection["source"]), selection.get("count")
        ids = {str(i): p for p, (s, i, _) in enumerate(stream) if _same_source(s, spec)}
        conversations = 0
        for conversation in load_source(spec, limit=count):
            if count is not None and conversations >= int(count):
                break
            conversations += 1
            if str(conversation.id) in ids:
                same_id.add(ids[str(conversation.id)])
            try:
                hit = prompts.get(_normal(_user_text(conversation)))
            except ValueError:  # no opening user message: nothing to compare as a prompt
                hit = None
            if hit is not None:
                exact.add(hit)
            for message in conversation.messages:
                for gram in _grams(_words(message["content"]), n):
                    ngram.update(index.get(gram, ()))
        scanned.append({"source": spec, "count": count, "conversations": conversations})
    ids_of = lambda found: sorted(stream[p][1] for p in found)  # noqa: E731
    return {
        "requests": len(stream),
        "n": n,
        "training": scanned,
        "same_id": ids_of(same_id),
        "exact": ids_of(exact),
        "ngram": ids_of(ngram),
        "ngram_share": len(ngram) / max(1, len(stream)),
    }


def drafter_training_data(folder: str | Path) -> list[TrainingSelection] | None:
    """What a drafter folder says it trained on (its own data and its `drafter_init`'s), or None
    when the folder, or one it started from, predates that record."""
    try:
        state = json.loads((Path(folder) / "training_state.json").read_text())
    except (OSError, ValueError):
        return None
    data = state.get("training_data")
    if not isinstance(data, list) or not data or any(d.get("source") is None for d in data):
        return None  # no record, or a step of the drafter's chain did not record its data
    return [dict(d) for d in data]


def parse_selection(text: str) -> TrainingSelection:
    """``SOURCE[:COUNT]`` (``sharegpt:4500``, ``runs/streams/x.jsonl:800``) as a selection."""
    source, _, count = text.rpartition(":")
    if source and count.isdigit():
        return {"source": source, "count": int(count)}
    return {"source": text, "count": None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", required=True, help="the stream's JSONL (served in file order)")
    parser.add_argument("--skip", type=int, default=0, help="the stream starts after N prompts")
    parser.add_argument("--count", type=int, default=0, help="the stream's length (0: the rest)")
    parser.add_argument("--train", action="append", default=[], metavar="SOURCE[:COUNT]",
                        help="a training selection: the first COUNT conversations of SOURCE")  # fmt: skip
    parser.add_argument("--drafter", help="read the training selections from this folder")
    parser.add_argument("--target", default="smollm2", help="for the stream's length filter")
    parser.add_argument("-n", type=int, default=13, help="words per n-gram")
    args = parser.parse_args(argv)
    training = [parse_selection(t) for t in args.train]
    if args.drafter:
        recorded = drafter_training_data(args.drafter)
        if recorded is None:
            parser.error(f"{args.drafter} does not record its training data: pass --train")
        training += recorded
    if not training:
        parser.error("name the training data: --train SOURCE[:COUNT] or --drafter FOLDER")
    from lightning_spec import specs
    from lightning_spec.online.stream import Segment, build_stream

    target = specs.resolve_target(args.target, "fp32")
    requests = build_stream(
        target.tokenizer, [Segment(args.stream, args.count, "source", args.skip)]
    )
    report = check_overlap(stream_prompts(requests), training, n=args.n)
    print(json.dumps(report, indent=2))
    return 1 if report["same_id"] or report["exact"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
