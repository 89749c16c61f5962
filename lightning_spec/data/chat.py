"""Render conversations with the target's own chat template, with an assistant-token loss mask.

A drafter must see exactly the token stream the target sees at inference, so rendering always
goes through ``tokenizer.apply_chat_template``. The loss mask is 1 on the tokens the assistant
produces: its content plus its end-of-turn token(s) (e.g. ``<|im_end|>``), never the role
header (``<|im_start|>assistant\\n``) nor the whitespace a template puts between turns.

How the assistant spans are found (character offsets in the rendered text):

1. For assistant message ``i``, the prefix ``messages[:i]`` rendered with
   ``add_generation_prompt=True`` ends where the assistant's content starts, and
   ``messages[:i + 1]`` rendered without it ends after its end-of-turn. Both must be prefixes
   of the full rendering ("prefix consistency").
2. Where that fails (templates that render earlier turns differently, or ignore
   ``add_generation_prompt``), the content is searched in the full text after the previous
   span, and a known end-of-turn marker right after it is included.

Tokens are then mapped to spans with the fast tokenizer's offset mapping (a token belongs to a
span if it starts inside it); slow tokenizers tokenise the prefix texts instead and check that
the ids of each prefix are a prefix of the full ids.

Text formats (`set_text_format`, `text_format_of`): a tokenizer with a chat template is
rendered with it (``template``). One without (a base model) is rendered as plain text by default
(``plain``: :data:`PLAIN_TEXT_TEMPLATE`, each turn's text as it is, the answer as the prompt's
continuation), which is what such a model was trained on and will be served with; the made-up
role format :data:`FALLBACK_CHAT_TEMPLATE` (``<|role|>\\ncontent{eos}\\n``, ``roles``) only
when asked for with ``text_format="chat"``; ``"plain"`` forces plain text even with a template.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

Message = dict[str, str]

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token or '' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The role format asked for with ``text_format="chat"`` on a tokenizer without a chat
template: ``<|user|>\\nHi\\n<|assistant|>\\nHello</s>\\n``. The markers are plain text to such
a tokenizer; only ``eos_token`` is special."""

PLAIN_TEXT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ message['content'] }}{{ eos_token or '' }}{{ '\\n\\n' }}"
    "{% else %}{{ message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
)
"""Plain-text continuation (base models): ``Hi\\nHello</s>\\n\\n``; a prompt is its text and a
newline, the answer continues it."""

TEXT_FORMATS = ("auto", "chat", "plain")
_ATTR = "_lightning_spec_text_format"
_ANNOUNCED: set[int] = set()

_END_MARKERS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
)


@dataclass
class RenderedConversation:
    """Token ids of a rendered chat and a same-length 0/1 mask of assistant (trained) tokens."""

    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def set_text_format(tokenizer: Any, text_format: str) -> None:
    """Ask for a text format (``auto``, ``chat`` or ``plain``; see the module docstring)."""
    if text_format not in TEXT_FORMATS:
        raise ValueError(f"text_format must be one of {TEXT_FORMATS}, got {text_format!r}")
    setattr(tokenizer, _ATTR, text_format)


def text_format_of(tokenizer: Any) -> str:
    """The format `tokenizer` renders with: ``template``, ``roles`` or ``plain``."""
    requested = getattr(tokenizer, _ATTR, "auto")
    if requested == "plain":
        return "plain"
    if has_chat_template(tokenizer):
        return "template"
    if requested == "chat":
        return "roles"
    if id(tokenizer) not in _ANNOUNCED:
        _ANNOUNCED.add(id(tokenizer))
        log.info(
            "the tokenizer has no chat template: rendering plain-text continuation (a base "
            "model); text_format='chat' gives a made-up role format instead"
        )
    return "plain"


def _render(
    tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool = False
) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    text_format = text_format_of(tokenizer)
    if text_format == "roles":
        kwargs["chat_template"] = FALLBACK_CHAT_TEMPLATE
    elif text_format == "plain":
        kwargs["chat_template"] = PLAIN_TEXT_TEMPLATE
    text = tokenizer.apply_chat_template(list(messages), **kwargs)
    if not isinstance(text, str):  # pragma: no cover - defensive across versions
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


def _encode(tokenizer: Any, text: str, offsets: bool = False) -> Any:
    # The template already holds every special token (BOS included, if the model wants one).
    return tokenizer(
        text,
        add_special_tokens=False,
        return_offsets_mapping=offsets,
        return_attention_mask=False,
    )


def _end_markers(tokenizer: Any) -> list[str]:
    markers = [m for m in (getattr(tokenizer, "eos_token", None),) if isinstance(m, str) and m]
    markers += [m for m in _END_MARKERS if m not in markers]
    return markers


def _span_by_search(tokenizer: Any, text: str, content: str, cursor: int) -> tuple[int, int] | None:
    """Fallback: locate ``content`` after ``cursor`` and extend over an end-of-turn marker."""
    needle = content.strip()
    if not needle:
        return None
    start = text.find(needle, cursor)
    if start < 0:
        return None
    end = start + len(needle)
    rest = text[end:]
    stripped = rest.lstrip(" \t")
    for marker in _end_markers(tokenizer):
        if stripped.startswith(marker):
            end += len(rest) - len(stripped) + len(marker)
            break
    return start, end


def assistant_spans(
    tokenizer: Any, messages: Sequence[Message]
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return the text plus the ``[start, end)`` character span of every
    assistant turn (content + end-of-turn, without header or trailing whitespace)."""
    text = _render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        span: tuple[int, int] | None = None
        try:
            before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
            after = _render(tokenizer, messages[: i + 1])
        except Exception as exc:  # templates may reject partial conversations
            log.debug("prefix render failed (%s); searching the content instead", exc)
            before = after = None
        if (
            before is not None
            and after is not None
            and text.startswith(before)
            and text.startswith(after)
            and cursor <= len(before) < len(after)
        ):
            header_only = i and before == _render(tokenizer, messages[:i])
            if header_only:
                # add_generation_prompt was ignored: the header is inside [before, after).
                found = _span_by_search(tokenizer, text, msg["content"], len(before))
                span = (found[0], len(after)) if found and found[0] < len(after) else None
            else:
                span = (len(before), len(after))
        if span is None:
            span = _span_by_search(tokenizer, text, msg["content"], cursor)
            if span is None:
                log.warning("could not locate assistant turn %d in the rendered text", i)
                continue
        start, end = span
        while end > start and text[end - 1].isspace():
            end -= 1
        if end > start:
            spans.append((start, end))
            cursor = end
    return text, spans


def _mask_from_offsets(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    mask = [0] * len(offsets)
    j = 0
    for t, (start, _end) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        if j < len(spans) and spans[j][0] <= start < spans[j][1]:
            mask[t] = 1
    return mask


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _mask_from_prefixes(
    tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """Slow-tokenizer path: the tokens of ``text[:boundary]`` for every span boundary.

    Where a token straddles a boundary the prefix ids stop matching the full ids; the boundary
    then falls at the longest common prefix, so a straddling token is never trained on.
    """
    ids = list(_encode(tokenizer, text)["input_ids"])
    mask = [0] * len(ids)
    for start, end in spans:
        lo_ids = list(_encode(tokenizer, text[:start])["input_ids"])
        hi_ids = list(_encode(tokenizer, text[:end])["input_ids"])
        lo, hi = _common_prefix(ids, lo_ids), _common_prefix(ids, hi_ids)
        if lo != len(lo_ids) or hi != len(hi_ids):
            log.debug("tokenisation is not prefix-consistent at an assistant boundary")
            if lo != len(lo_ids):
                lo += 1  # the first differing token straddles the start: leave it unmasked
        for t in range(lo, hi):
            mask[t] = 1
    return ids, mask


def render_conversation(
    tokenizer: Any,
    messages: Sequence[Message],
    max_length: int | None = None,
    *,
    method: str = "auto",
) -> RenderedConversation:
    """Tokenise a chat with the tokenizer's template and mark the assistant tokens.

    ``max_length`` keeps the first ``max_length`` tokens (a truncated final answer keeps its
    partial loss). ``method`` is ``"auto"`` (offsets on fast tokenizers, else prefixes),
    ``"offsets"`` or ``"prefix"``.
    """
    if method not in ("auto", "offsets", "prefix"):
        raise ValueError(f"unknown method {method!r}")
    if not messages:
        raise ValueError("cannot render an empty conversation")
    text, spans = assistant_spans(tokenizer, messages)
    use_offsets = method == "offsets" or (method == "auto" and getattr(tokenizer, "is_fast", False))
    ids: list[int] | None = None
    if use_offsets:
        try:
            enc = _encode(tokenizer, text, offsets=True)
        except NotImplementedError:  # slow tokenizers cannot return offsets
            if method == "offsets":
                raise
        else:
            ids = list(enc["input_ids"])
            mask = _mask_from_offsets([tuple(o) for o in enc["offset_mapping"]], spans)
    if ids is None:
        ids, mask = _mask_from_prefixes(tokenizer, text, spans)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return RenderedConversation(input_ids=ids, loss_mask=mask)


def render_prompt(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of ``messages`` followed by the assistant header (``add_generation_prompt``),
    i.e. what the target is fed before it generates the answer."""
    if not messages:
        raise ValueError("cannot render an empty prompt")
    text = _render(tokenizer, messages, add_generation_prompt=True)
    return list(_encode(tokenizer, text)["input_ids"])


def render_prompt_masked(tokenizer: Any, messages: Sequence[Message]) -> RenderedConversation:
    """`render_prompt`'s ids of ``messages`` with a loss mask on the assistant turns among them
    (the mask `render_conversation` gives the same messages; the assistant header at the end is
    0): the prompt of a later turn whose earlier answers are training targets too, as in
    multi-turn regeneration. Tokens past the point where the two renderings stop agreeing (the
    trailing header) are never marked."""
    ids = render_prompt(tokenizer, messages)
    if not any(message["role"] == "assistant" for message in messages):
        return RenderedConversation(input_ids=ids, loss_mask=[0] * len(ids))
    full = render_conversation(tokenizer, messages)
    shared = _common_prefix(ids, full.input_ids)
    return RenderedConversation(
        input_ids=ids, loss_mask=full.loss_mask[:shared] + [0] * (len(ids) - shared)
    )
