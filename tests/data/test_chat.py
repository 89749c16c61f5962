"""Chat rendering and the assistant loss mask, on a tokenizer built here (no downloads) and, as a
slow test, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from lightning_spec.data import chat
from lightning_spec.data.chat import (
    PLAIN_TEXT_TEMPLATE,
    RenderedConversation,
    render_conversation,
    render_prompt,
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama-3 style: BOS once, header tokens, stripped content, <|eot_id|> end of turn.
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# Ignores add_generation_prompt entirely (some community templates do).
NO_GEN_PROMPT = (
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + ':\\n' + message['content'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
)

# The header counts the messages, so a prefix never renders like the start of the full text.
PREFIX_INCONSISTENT = "{{ '[' + (messages | length) | string + ' turns]\\n' }}" + CHATML

SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
]

CORPUS = [
    "You are a helpful assistant. What is the capital of France? Paris is the capital.",
    "hello world, how are you today? I am fine, thanks. The quick brown fox jumps.",
    "def add(a, b):\n    return a + b\n# user assistant system ### : [ ] 0123456789",
]

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
    {"role": "user", "content": "And 2 + 2?"},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
]


def _make_tokenizer(template: str | None):  # noqa: ANN202
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[:5],
    )
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def tokenizers_by_template() -> dict:
    return {
        name: _make_tokenizer(t)
        for name, t in [
            ("chatml", CHATML),
            ("llama3", LLAMA3),
            ("nogen", NO_GEN_PROMPT),
            ("inconsistent", PREFIX_INCONSISTENT),
            ("none", None),
        ]
    }


def _masked_text(tok, rendered: RenderedConversation) -> list[str]:  # noqa: ANN001
    """Decode each contiguous run of masked tokens."""
    runs: list[list[int]] = []
    prev = 0
    for tid, m in zip(rendered.input_ids, rendered.loss_mask, strict=True):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(tid)
        prev = m
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


EXPECTED_END = {
    "chatml": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "nogen": "\n</s>",
    "inconsistent": "<|im_end|>",
    "none": "</s>",
}


@pytest.mark.parametrize("name", list(EXPECTED_END))
@pytest.mark.parametrize("method", ["auto", "prefix"])
def test_mask_covers_exactly_assistant_content_and_end_token(
    tokenizers_by_template: dict, name: str, method: str
) -> None:
    tok = tokenizers_by_template[name]
    rendered = render_conversation(tok, MESSAGES, method=method)
    assert len(rendered.input_ids) == len(rendered.loss_mask) == len(rendered)
    assert set(rendered.loss_mask) == {0, 1}
    answers = [m["content"] for m in MESSAGES if m["role"] == "assistant"]
    assert _masked_text(tok, rendered) == [a + EXPECTED_END[name] for a in answers]
    # The ids are exactly the template's text tokenised (no extra BOS, nothing dropped).
    template = tok.chat_template or PLAIN_TEXT_TEMPLATE  # no template: plain text (base model)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, chat_template=template)
    assert rendered.input_ids == tok(text, add_special_tokens=False)["input_ids"]


def test_header_and_user_tokens_are_never_masked(tokenizers_by_template: dict) -> None:
    tok = tokenizers_by_template["chatml"]
    rendered = render_conversation(tok, MESSAGES)
    masked = {t for t, m in zip(rendered.input_ids, rendered.loss_mask, strict=True) if m}
    assert tok.convert_tokens_to_ids("<|im_start|>") not in masked
    # Everything unmasked decodes to the prompt side: system, user turns and role headers.
    unmasked = tok.decode(
        [t for t, m in zip(rendered.input_ids, rendered.loss_mask, strict=True) if not m]
    )
    assert "Paris" not in unmasked and "return" not in unmasked
    assert "France" in unmasked and unmasked.count("<|im_start|>assistant\n") == 2


def test_offsets_and_prefix_methods_agree(tokenizers_by_template: dict) -> None:
    tok = tokenizers_by_template["chatml"]
    odd = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "  spaced answer\n"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": ""},
    ]
    for messages in (MESSAGES, odd):
        a = render_conversation(tok, messages, method="offsets")
        b = render_conversation(tok, messages, method="prefix")
        assert a.input_ids == b.input_ids
        assert a.loss_mask == b.loss_mask
    # An empty answer still trains its end-of-turn token.
    assert _masked_text(tok, a)[-1] == "<|im_end|>"


def test_max_length_truncates_both(tokenizers_by_template: dict) -> None:
    tok = tokenizers_by_template["chatml"]
    full = render_conversation(tok, MESSAGES)
    short = render_conversation(tok, MESSAGES, max_length=10)
    assert short.input_ids == full.input_ids[:10] and short.loss_mask == full.loss_mask[:10]
    with pytest.raises(ValueError):
        render_conversation(tok, [])
    with pytest.raises(ValueError):
        render_conversation(tok, MESSAGES, method="magic")


@pytest.mark.parametrize("name", ["chatml", "llama3", "none"])
def test_render_prompt_ends_with_the_assistant_header(
    tokenizers_by_template: dict, name: str
) -> None:
    tok = tokenizers_by_template[name]
    prompt = MESSAGES[:2]
    ids = render_prompt(tok, prompt)
    text = tok.decode(ids)
    header = {
        "chatml": "<|im_start|>assistant\n",
        "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "none": "?\n",  # plain text: the prompt's last line, then the continuation
    }[name]
    assert text.endswith(header)
    assert "capital of France" in text
    # The prompt is a token-prefix of the full conversation rendering (what the target sees).
    full = render_conversation(tok, MESSAGES[:3])
    assert full.input_ids[: len(ids)] == ids
    assert not any(full.loss_mask[: len(ids)])


def test_without_a_chat_template_plain_text_is_the_default(tokenizers_by_template: dict) -> None:
    """A base model (no template) is trained and served on plain-text continuation; the
    made-up role format only when asked for; plain text can be forced over a template."""
    import copy

    tok = copy.deepcopy(tokenizers_by_template["none"])
    assert not chat.has_chat_template(tok) and chat.text_format_of(tok) == "plain"
    rendered = render_conversation(tok, MESSAGES[1:3])
    assert tok.decode(rendered.input_ids) == (
        "What is the capital of France?\nParis is the capital.</s>\n\n"
    )
    masked = tok.decode(
        [t for t, m in zip(rendered.input_ids, rendered.loss_mask, strict=True) if m]
    )
    assert masked == "Paris is the capital.</s>"  # the answer, the prompt's continuation
    prompt = render_prompt(tok, MESSAGES[1:2])
    assert tok.decode(prompt) == "What is the capital of France?\n"
    assert rendered.input_ids[: len(prompt)] == prompt
    chat.set_text_format(tok, "chat")
    assert chat.text_format_of(tok) == "roles"
    text = tok.decode(render_conversation(tok, MESSAGES[1:3]).input_ids)
    assert (
        text
        == "<|user|>\nWhat is the capital of France?\n<|assistant|>\nParis is the capital.</s>\n"
    )
    templated = copy.deepcopy(tokenizers_by_template["chatml"])
    assert chat.text_format_of(templated) == "template"
    chat.set_text_format(templated, "plain")
    assert chat.text_format_of(templated) == "plain"
    with pytest.raises(ValueError, match="text_format"):
        chat.set_text_format(templated, "markdown")


@pytest.mark.slow
def test_real_smollm2_tokenizer_on_sharegpt() -> None:
    from transformers import AutoTokenizer

    from lightning_spec.data.assets import default_target_path
    from lightning_spec.data.sources import ShareGPTSource

    tok = AutoTokenizer.from_pretrained(default_target_path())
    assert chat.has_chat_template(tok)
    checked = 0
    for conv in ShareGPTSource(limit=40):
        a = render_conversation(tok, conv.messages)
        b = render_conversation(tok, conv.messages, method="prefix")
        assert a.input_ids == b.input_ids
        # Allow boundary tokens that straddle header/content to differ by method, nothing else.
        assert sum(x != y for x, y in zip(a.loss_mask, b.loss_mask, strict=True)) <= 2
        runs = _masked_text(tok, a)
        answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        assert len(runs) == len(answers)
        for run, answer in zip(runs, answers, strict=True):
            assert run.endswith("<|im_end|>")
            assert run[: -len("<|im_end|>")].strip() == answer.strip()
        checked += 1
    assert checked == 40
    ids = render_prompt(tok, [{"role": "user", "content": "Hi"}])
    assert tok.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
