"""Conversation sources: ShareGPT (streamed), MT-Bench, HumanEval and generic JSONL.

Every source iterates :class:`Conversation` objects whose ``messages`` are plain
``{"role", "content"}`` dicts with roles in ``system``/``user``/``assistant``, ready for a chat
template. ``prompts()`` gives the opening of each conversation (a leading system message, if
any, plus the first user message) for generation and benchmarks.

Normalisation of multi-turn data (:func:`normalize_turns`), chosen so that every yielded
training conversation renders under strict chat templates and carries loss tokens:

* roles are mapped (``human``/``user``/``prompter`` -> user; ``gpt``/``assistant``/``chatgpt``/
  ``bing``/``bard``/``model``/``bot`` -> assistant; ``system`` -> system); an unknown role, a
  non-string value or a non-dict turn makes the whole record malformed (skipped and counted);
* turns whose content is empty or whitespace are dropped;
* a system turn is kept only at the very start (a later one makes the record malformed);
* assistant turns before the first user turn are dropped (ShareGPT V3 splits long chats into
  parts that may open with the model's reply, which has no prompt to condition on);
* consecutive turns of the same role are merged with a blank line, so roles alternate;
* a trailing user turn without an answer is dropped, and a record left with no assistant turn
  is skipped (``require_assistant=True``, the default for training data). Prompt-only records
  are kept when ``require_assistant=False`` (the default for :class:`JsonlSource`).

Why one file (~670 lines): every source is one small class behind the same interface
(`Conversation` records, the same warnings for malformed input), and the shared JSON reader
that makes a truncated file a clear error sits beside them.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

Message = dict[str, str]

ROLE_MAP: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "prompter": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "bot": "assistant",
}

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a single "
    "```python code block.\n\n```python\n{prompt}```"
)
"""Default user message for HumanEval: the bare prompt plus a short, model-neutral instruction
(a chat model asked nothing but raw code tends to answer with prose)."""


class DataWarning(UserWarning):
    """Data was recovered only partially (truncated file, malformed records skipped)."""


class MalformedRecord(ValueError):
    """One record cannot become a conversation; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Conversation:
    """One chat: an id, normalised messages and free-form metadata (category, task_id, ...)."""

    id: str
    messages: list[Message]
    meta: dict[str, Any] = field(default_factory=dict)

    def prompt(self) -> list[Message]:
        """Leading system message (if any) plus the first user message."""
        out: list[Message] = []
        for msg in self.messages:
            if msg["role"] == "system" and not out:
                out.append(dict(msg))
            elif msg["role"] == "user":
                out.append(dict(msg))
                return out
            else:
                break
        raise ValueError(f"conversation {self.id!r} has no opening user message")

    @property
    def num_assistant_turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "assistant")


@dataclass
class SourceStats:
    """What one pass over a file found: kept, skipped (by reason) and where it stopped."""

    records: int = 0
    conversations: int = 0
    turns_raw: int = 0
    turns: int = 0
    skipped: Counter = field(default_factory=Counter)
    stopped_at_byte: int | None = None
    stop_reason: str | None = None
    complete: bool = False

    @property
    def malformed(self) -> int:
        return sum(self.skipped.values())


# --------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------


def normalize_turns(
    turns: Any,
    *,
    role_key: str | None = None,
    content_key: str | None = None,
    require_assistant: bool = True,
) -> list[Message]:
    """Turn ShareGPT (``from``/``value``) or OpenAI (``role``/``content``) turns into alternating
    messages following the module's rules; raise :class:`MalformedRecord` if impossible."""
    if not isinstance(turns, list):
        raise MalformedRecord("conversation_not_a_list", type(turns).__name__)
    if not turns:
        raise MalformedRecord("empty_conversation")
    messages: list[Message] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise MalformedRecord("turn_not_an_object", f"turn {i}")
        rkey = role_key or ("from" if "from" in turn else "role")
        ckey = content_key or ("value" if "value" in turn else "content")
        role, content = turn.get(rkey), turn.get(ckey)
        if not isinstance(role, str) or not isinstance(content, str):
            raise MalformedRecord("turn_missing_fields", f"turn {i}")
        mapped = ROLE_MAP.get(role.strip().lower())
        if mapped is None:
            raise MalformedRecord("unknown_role", repr(role))
        if not content.strip():
            continue
        if mapped == "system":
            if messages:
                raise MalformedRecord("system_not_first", f"turn {i}")
        elif mapped == "assistant" and not any(m["role"] == "user" for m in messages):
            continue  # no prompt to condition on
        if messages and messages[-1]["role"] == mapped:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": mapped, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise MalformedRecord("no_user_turn")
    if require_assistant:
        while messages and messages[-1]["role"] == "user":
            messages.pop()
        if not any(m["role"] == "assistant" for m in messages):
            raise MalformedRecord("no_assistant_turn")
    elif any(m["role"] == "assistant" for m in messages):
        while messages[-1]["role"] == "user":
            messages.pop()
    return messages


# --------------------------------------------------------------------------------------------
# Streaming JSON
# --------------------------------------------------------------------------------------------


class _StreamEnd(Exception):
    """Internal: the value stream stopped early (truncation or garbage)."""


def _open_text(path: Path) -> IO[str]:
    """Open text (gzip-aware); invalid UTF-8 becomes U+FFFD so garbage is a parse error, not a
    crash."""
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def iter_json_values(
    path: str | Path,
    *,
    chunk_chars: int = 1 << 20,
    max_value_chars: int = 64 << 20,
    stats: SourceStats | None = None,
) -> Iterator[Any]:
    """Stream the values of a top-level JSON array, or of concatenated/newline-delimited JSON,
    without loading the file: ``json.JSONDecoder.raw_decode`` over a growing buffer.

    A value that fails to parse is retried with more data until EOF (or until it exceeds
    ``max_value_chars``); then the stream stops there, and ``stats`` records the byte offset and
    the reason. Everything complete before that point is yielded.
    """
    decoder = json.JSONDecoder()
    stats = stats if stats is not None else SourceStats()
    ws = " \t\r\n"
    with _open_text(Path(path)) as fh:
        buf = ""
        pos = 0
        base_bytes = 0  # UTF-8 bytes of text already dropped from the front of buf
        eof = False

        def fill() -> bool:
            nonlocal buf, pos, base_bytes, eof
            if eof:
                return False
            chunk = fh.read(chunk_chars)
            if not chunk:
                eof = True
                return False
            if pos > 0:
                base_bytes += len(buf[:pos].encode("utf-8", errors="replace"))
                buf = buf[pos:]
                pos = 0
            buf += chunk
            return True

        def byte_offset(at: int) -> int:
            return base_bytes + len(buf[:at].encode("utf-8", errors="replace"))

        def skip(chars: str) -> bool:
            """Advance past ``chars``; False at EOF."""
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf):
                    return True
                if not fill():
                    return False

        def stop(reason: str) -> None:
            stats.stopped_at_byte = byte_offset(pos)
            stats.stop_reason = reason

        if not skip(ws + "\ufeff"):
            stop("empty file")
            return
        in_array = buf[pos] == "["
        if in_array:
            pos += 1
        separators = ws + "," if in_array else ws
        while True:
            if not skip(separators):
                if in_array:
                    stop("end of file inside the top-level array (file truncated)")
                else:
                    stats.complete = True
                return
            if in_array and buf[pos] == "]":
                stats.complete = True
                return
            while True:
                try:
                    value, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as exc:
                    if len(buf) - pos < max_value_chars and fill():
                        continue
                    if eof:
                        cut = (
                            exc.msg.startswith("Unterminated string") or not buf[exc.pos :].strip()
                        )
                        if cut:
                            stop("the file ends inside a record (truncated)")
                        else:
                            stop(f"invalid JSON ({exc.msg} at byte {byte_offset(exc.pos)})")
                    else:
                        stop(f"unparseable value longer than {max_value_chars} chars: {exc.msg}")
                    return
                # A value ending at the buffer edge may continue, and a number cut anywhere in
                # its exponent ("2.5e" + "3") parses "fine" but short: look further ahead.
                is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
                near_edge = len(buf) - end < (32 if is_number else 1)
                if near_edge and not eof and fill():
                    continue
                break
            pos = end
            yield value


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------

_WARNED: set[tuple[str, int, int]] = set()


def _warn_once(path: Path, message: str) -> None:
    """One warning per file version (path, size, mtime), however often it is iterated."""
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        key = (str(path), -1, -1)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, DataWarning, stacklevel=3)


def _resolve(path: str | Path | None, asset: str, cache_dir: str | Path | None) -> Path:
    if path is not None:
        return Path(path)
    from lightning_spec.data.assets import asset_path

    return asset_path(asset, cache_dir=cache_dir)


class _FileSource:
    """Shared machinery: streaming pass, stats, cached length, warnings and the empty check."""

    path: Path
    limit: int | None

    def __init__(self) -> None:
        self._len: int | None = None
        self.stats = SourceStats()

    def _records(self, stats: SourceStats) -> Iterator[Any]:
        raise NotImplementedError

    def _convert(self, record: Any, index: int, stats: SourceStats) -> Conversation:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Conversation]:
        stats = SourceStats()
        self.stats = stats
        for index, record in enumerate(self._records(stats)):
            if self.limit is not None and stats.conversations >= self.limit:
                self._len = stats.conversations
                return
            stats.records += 1
            try:
                conv = self._convert(record, index, stats)
            except MalformedRecord as exc:
                stats.skipped[exc.reason] += 1
                continue
            stats.conversations += 1
            stats.turns += len(conv.messages)
            yield conv
        self._finish(stats)

    def _finish(self, stats: SourceStats) -> None:
        self._len = stats.conversations
        log.info(
            "%s: %d conversations (%d turns) from %d records; %d skipped",
            self.path.name,
            stats.conversations,
            stats.turns,
            stats.records,
            stats.malformed,
        )
        if stats.conversations == 0:
            reasons = ", ".join(f"{k}={v}" for k, v in stats.skipped.most_common()) or "none"
            where = (
                f"; parsing stopped at byte {stats.stopped_at_byte}" if stats.stop_reason else ""
            )
            raise ValueError(
                f"{self.path}: no usable conversation recovered from {stats.records} records "
                f"(skipped: {reasons}){where}"
                + (f" ({stats.stop_reason})" if stats.stop_reason else "")
            )
        if stats.stop_reason or stats.skipped:
            parts = [f"{self.path.name}: recovered {stats.conversations} conversations"]
            parts.append(f"from {stats.records} complete records ({stats.turns_raw} turns)")
            if stats.stop_reason:
                parts.append(f"- stopped at byte {stats.stopped_at_byte}: {stats.stop_reason}")
            if stats.skipped:
                detail = ", ".join(f"{k}={v}" for k, v in sorted(stats.skipped.items()))
                parts.append(f"- skipped {stats.malformed} ({detail})")
            _warn_once(self.path, " ".join(parts))

    def __len__(self) -> int:
        """Number of conversations; the first call for a file source costs one parsing pass."""
        if self._len is None:
            for _ in self:
                pass
        assert self._len is not None
        return self._len

    def prompts(self) -> list[list[Message]]:
        """Opening messages (system + first user turn) of every conversation."""
        return [conv.prompt() for conv in self]


class ShareGPTSource(_FileSource):
    """ShareGPT-format conversations (``[{"id", "conversations": [{"from", "value"}]}]``).

    The file is streamed (never loaded whole), and a truncated or damaged file yields every
    complete record before the damage plus one :class:`DataWarning` (the packaged ShareGPT V3
    file stops mid-record). ``path=None`` uses the cached ``sharegpt`` asset.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        cache_dir: str | Path | None = None,
        limit: int | None = None,
        *,
        require_assistant: bool = True,
    ) -> None:
        super().__init__()
        self.path = _resolve(path, "sharegpt", cache_dir)
        self.limit = limit
        self.require_assistant = require_assistant

    def _records(self, stats: SourceStats) -> Iterator[Any]:
        return iter_json_values(self.path, stats=stats)

    def _convert(self, record: Any, index: int, stats: SourceStats) -> Conversation:
        if not isinstance(record, dict):
            raise MalformedRecord("record_not_an_object")
        turns = record.get("conversations", record.get("conversation"))
        if turns is None:
            raise MalformedRecord("missing_conversations")
        if isinstance(turns, list):
            stats.turns_raw += len(turns)
        messages = normalize_turns(turns, require_assistant=self.require_assistant)
        rid = record.get("id")
        conv_id = str(rid) if isinstance(rid, (str, int)) else f"{self.path.stem}-{index}"
        return Conversation(conv_id, messages, {"source": "sharegpt", "index": index})


class JsonlSource(_FileSource):
    """Generic JSON Lines (``.jsonl`` or ``.jsonl.gz``). Each line is one of:

    * ``{"messages": [{"role", "content"}, ...]}`` (OpenAI style),
    * ``{"conversations": [{"from", "value"}, ...]}`` (ShareGPT style),
    * ``{"prompt": "...", "system": "..." (optional)}`` (a prompt-only conversation).

    Other keys go to ``meta``. Bad lines are skipped and counted, with one warning per file.
    """

    def __init__(
        self,
        path: str | Path,
        cache_dir: str | Path | None = None,
        limit: int | None = None,
        *,
        require_assistant: bool = False,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.limit = limit
        self.require_assistant = require_assistant

    def _records(self, stats: SourceStats) -> Iterator[Any]:
        with _open_text(self.path) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    yield MalformedRecord("invalid_json", f"line {lineno}")
        stats.complete = True

    def _convert(self, record: Any, index: int, stats: SourceStats) -> Conversation:
        if isinstance(record, MalformedRecord):
            raise record
        if not isinstance(record, dict):
            raise MalformedRecord("record_not_an_object")
        meta = {k: v for k, v in record.items() if k not in ("messages", "conversations", "prompt")}
        if "messages" in record or "conversations" in record:
            turns = record.get("messages", record.get("conversations"))
            if isinstance(turns, list):
                stats.turns_raw += len(turns)
            messages = normalize_turns(turns, require_assistant=self.require_assistant)
        elif "prompt" in record:
            prompt, system = record["prompt"], record.get("system")
            if not isinstance(prompt, str) or not prompt.strip():
                raise MalformedRecord("bad_prompt")
            if self.require_assistant:
                raise MalformedRecord("no_assistant_turn")
            messages = []
            if isinstance(system, str) and system.strip():
                messages.append({"role": "system", "content": system})
            messages.append({"role": "user", "content": prompt})
            stats.turns_raw += len(messages)
        else:
            raise MalformedRecord("no_messages_conversations_or_prompt")
        rid = record.get("id")
        conv_id = str(rid) if isinstance(rid, (str, int)) else f"{self.path.stem}-{index}"
        meta.setdefault("source", "jsonl")
        return Conversation(conv_id, messages, meta)


class _MemorySource:
    """Small benchmark sets: parsed once into memory, so ``len`` is free."""

    conversations: list[Conversation]

    def __iter__(self) -> Iterator[Conversation]:
        return iter(self.conversations)

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, index: int) -> Conversation:
        return self.conversations[index]

    def prompts(self) -> list[list[Message]]:
        """First user turn of every item, as a message list for ``render_prompt``."""
        return [conv.prompt() for conv in self.conversations]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    bad = 0
    with _open_text(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    if bad:
        _warn_once(path, f"{path.name}: skipped {bad} unparseable lines, kept {len(rows)}")
    return rows


class MTBenchSource(_MemorySource):
    """MT-Bench questions (80 by default: 10 in each of 8 categories, two turns each).

    ``messages`` holds the first ``turns`` user turns (``turns=2`` gives two consecutive user
    messages: a multi-turn runner must insert the model's first answer between them). ``meta``
    keeps ``question_id``, ``category``, both ``turns`` and any ``reference`` answers, so
    benchmarks can report per category.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        cache_dir: str | Path | None = None,
        turns: int = 1,
        *,
        categories: Iterable[str] | None = None,
        limit: int | None = None,
    ) -> None:
        if turns not in (1, 2):
            raise ValueError(f"turns must be 1 or 2, got {turns}")
        self.path = _resolve(path, "mtbench", cache_dir)
        self.turns = turns
        wanted = set(categories) if categories is not None else None
        convs: list[Conversation] = []
        skipped = 0
        for row in _read_jsonl(self.path):
            qturns = row.get("turns")
            if (
                not isinstance(qturns, list)
                or not qturns
                or not all(isinstance(t, str) and t.strip() for t in qturns)
            ):
                skipped += 1
                continue
            category = str(row.get("category", "unknown"))
            if wanted is not None and category not in wanted:
                continue
            meta: dict[str, Any] = {
                "source": "mtbench",
                "question_id": row.get("question_id"),
                "category": category,
                "turns": list(qturns),
            }
            if "reference" in row:
                meta["reference"] = row["reference"]
            messages = [{"role": "user", "content": t} for t in qturns[:turns]]
            convs.append(Conversation(f"mtbench-{row.get('question_id')}", messages, meta))
        if skipped:
            _warn_once(self.path, f"{self.path.name}: skipped {skipped} malformed questions")
        if limit is not None:
            convs = convs[:limit]
        if not convs:
            raise ValueError(f"{self.path}: no MT-Bench questions found")
        self.conversations = convs

    @property
    def categories(self) -> list[str]:
        return sorted({c.meta["category"] for c in self.conversations})


class HumanEvalSource(_MemorySource):
    """HumanEval problems (164) as one-turn chats.

    The user message is ``instruction.format(prompt=problem["prompt"])`` (default
    :data:`HUMANEVAL_INSTRUCTION`; pass ``instruction="{prompt}"`` for the bare code prompt).
    ``meta`` keeps ``task_id``, ``entry_point`` and the raw ``prompt``.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        cache_dir: str | Path | None = None,
        limit: int | None = None,
        *,
        instruction: str = HUMANEVAL_INSTRUCTION,
    ) -> None:
        if "{prompt}" not in instruction:
            raise ValueError("instruction must contain a {prompt} placeholder")
        self.path = _resolve(path, "humaneval", cache_dir)
        convs: list[Conversation] = []
        skipped = 0
        for row in _read_jsonl(self.path):
            prompt, task_id = row.get("prompt"), row.get("task_id")
            if not isinstance(prompt, str) or not prompt.strip() or not isinstance(task_id, str):
                skipped += 1
                continue
            meta = {
                "source": "humaneval",
                "task_id": task_id,
                "entry_point": row.get("entry_point"),
                "prompt": prompt,
            }
            content = instruction.replace("{prompt}", prompt)
            convs.append(Conversation(task_id, [{"role": "user", "content": content}], meta))
        if skipped:
            _warn_once(self.path, f"{self.path.name}: skipped {skipped} malformed problems")
        if limit is not None:
            convs = convs[:limit]
        if not convs:
            raise ValueError(f"{self.path}: no HumanEval problems found")
        self.conversations = convs


Source = ShareGPTSource | JsonlSource | MTBenchSource | HumanEvalSource


def load_source(spec: str, cache_dir: str | Path | None = None, limit: int | None = None) -> Source:
    """Map ``"sharegpt"``, ``"mtbench"``, ``"humaneval"`` or a ``.jsonl``/``.json`` path to a
    source (a ``.json`` file is read as ShareGPT)."""
    key = spec.strip().lower()
    if key == "sharegpt":
        return ShareGPTSource(cache_dir=cache_dir, limit=limit)
    if key in ("mtbench", "mt-bench", "mt_bench"):
        return MTBenchSource(cache_dir=cache_dir, limit=limit)
    if key in ("humaneval", "human-eval", "human_eval"):
        return HumanEvalSource(cache_dir=cache_dir, limit=limit)
    path = Path(spec).expanduser()
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        if not path.is_file():
            raise FileNotFoundError(f"no such JSONL file: {path}")
        return JsonlSource(path, limit=limit)
    if name.endswith((".json", ".json.gz")):
        if not path.is_file():
            raise FileNotFoundError(f"no such JSON file: {path}")
        return ShareGPTSource(path, limit=limit)
    raise ValueError(
        f"unknown data source {spec!r}: use sharegpt, mtbench, humaneval or a .jsonl/.json path"
    )
