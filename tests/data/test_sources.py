"""Conversation sources: streaming ShareGPT recovery, normalisation, JSONL, benchmarks."""

from __future__ import annotations

import gzip
import json
import time
import warnings
from pathlib import Path

import pytest

from lightning_spec.data import sources
from lightning_spec.data.sources import (
    Conversation,
    DataWarning,
    HumanEvalSource,
    JsonlSource,
    MalformedRecord,
    MTBenchSource,
    ShareGPTSource,
    iter_json_values,
    load_source,
    normalize_turns,
)


def _record(i: int, text: str = "hello") -> dict:
    return {
        "id": f"r{i}",
        "conversations": [
            {"from": "human", "value": f"{text} question {i}"},
            {"from": "gpt", "value": f"{text} answer {i}"},
        ],
    }


def _dump(path: Path, records: list) -> str:
    text = json.dumps(records, indent=2, ensure_ascii=False)
    path.write_text(text, encoding="utf-8")
    return text


def _collect(source) -> tuple[list[Conversation], list[warnings.WarningMessage]]:  # noqa: ANN001
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convs = list(source)
    return convs, [w for w in caught if issubclass(w.category, DataWarning)]


# ------------------------------------------------------------------------------------------
# Streaming parser
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
def test_stream_matches_json_load_at_any_chunk_size(tmp_path: Path, chunk: int) -> None:
    values = [_record(i, 'ünïcödé ✓ \\ " ') for i in range(5)] + [1, -2.5e3, "s", None, [1, 2]]
    path = tmp_path / "a.json"
    _dump(path, values)
    stats = sources.SourceStats()
    assert list(iter_json_values(path, chunk_chars=chunk, stats=stats)) == values
    assert stats.complete and stats.stop_reason is None


def test_stream_reads_concatenated_and_newline_delimited_values(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n{"a": 2} 12345\n\n[3]\n')
    assert list(iter_json_values(path, chunk_chars=2)) == [{"a": 1}, {"a": 2}, 12345, [3]]


def test_stream_stops_at_truncation_with_exact_byte_offset(tmp_path: Path) -> None:
    records = [_record(i, "naïve ☃") for i in range(4)]
    text = json.dumps(records, ensure_ascii=False)
    third_start = text.index('{"id": "r3"')
    cut = text[: third_start + 40]
    path = tmp_path / "cut.json"
    path.write_bytes(cut.encode("utf-8"))
    stats = sources.SourceStats()
    assert list(iter_json_values(path, chunk_chars=16, stats=stats)) == records[:3]
    assert not stats.complete
    assert "truncated" in stats.stop_reason
    assert stats.stopped_at_byte == len(text[:third_start].encode("utf-8"))


# ------------------------------------------------------------------------------------------
# ShareGPT
# ------------------------------------------------------------------------------------------


def test_truncated_sharegpt_yields_complete_records_and_warns_once(tmp_path: Path) -> None:
    text = json.dumps([_record(i) for i in range(10)], indent=2)
    path = tmp_path / "sg.json"
    path.write_text(text[: text.index('"r7"') + 30])
    source = ShareGPTSource(path)
    convs, caught = _collect(source)
    assert [c.id for c in convs] == [f"r{i}" for i in range(7)]
    assert convs[0].messages == [
        {"role": "user", "content": "hello question 0"},
        {"role": "assistant", "content": "hello answer 0"},
    ]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "recovered 7 conversations" in message and "truncated" in message and "byte" in message
    assert source.stats.records == 7 and source.stats.turns_raw == 14
    # A second pass (and len) does not warn again.
    convs2, caught2 = _collect(source)
    assert len(convs2) == 7 and caught2 == []
    assert len(source) == 7


def test_garbage_in_the_middle_keeps_what_came_before(tmp_path: Path) -> None:
    good = json.dumps([_record(0), _record(1)])
    path = tmp_path / "g.json"
    path.write_text(good[:-1] + ', {"id": "bad", "conversations": [}}}]]] garbage' + good)
    source = ShareGPTSource(path)
    convs, caught = _collect(source)
    assert [c.id for c in convs] == ["r0", "r1"]
    assert len(caught) == 1 and "invalid JSON" in str(caught[0].message)
    assert source.stats.stopped_at_byte == len(good) + 1


@pytest.mark.parametrize(
    "content",
    [b"", b"   ", b"[]", b"\x00\xff\xfe garbage \x89PNG", b'[{"id": "x", "conv', b"{}", b"[1, 2"],
)
def test_nothing_recoverable_raises_value_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="no usable conversation"):
            list(ShareGPTSource(path))


def test_malformed_records_are_skipped_and_counted(tmp_path: Path) -> None:
    records = [
        _record(0),
        {"id": "no-conv"},
        {"id": "wrong-type", "conversations": "text"},
        {"id": "empty", "conversations": []},
        {"id": "unknown-role", "conversations": [{"from": "alien", "value": "x"}]},
        {"id": "bad-turn", "conversations": [{"from": "human", "value": 3}]},
        {"id": "only-human", "conversations": [{"from": "human", "value": "hi"}]},
        "not an object",
        _record(1),
    ]
    path = tmp_path / "m.json"
    _dump(path, records)
    source = ShareGPTSource(path)
    convs, caught = _collect(source)
    assert [c.id for c in convs] == ["r0", "r1"]
    assert dict(source.stats.skipped) == {
        "missing_conversations": 1,
        "conversation_not_a_list": 1,
        "empty_conversation": 1,
        "unknown_role": 1,
        "turn_missing_fields": 1,
        "no_assistant_turn": 1,
        "record_not_an_object": 1,
    }
    assert source.stats.malformed == 7
    assert len(caught) == 1 and "skipped 7" in str(caught[0].message)


def test_limit_and_missing_id(tmp_path: Path) -> None:
    records = [_record(i) for i in range(6)]
    del records[2]["id"]
    path = tmp_path / "x.json"
    _dump(path, records)
    assert [c.id for c in ShareGPTSource(path)][2] == "x-2"
    limited = ShareGPTSource(path, limit=4)
    assert len(list(limited)) == 4 and len(limited) == 4
    assert len(limited.prompts()) == 4


# ------------------------------------------------------------------------------------------
# Normalisation rules
# ------------------------------------------------------------------------------------------


def _turns(*pairs: tuple[str, str]) -> list[dict]:
    return [{"from": r, "value": v} for r, v in pairs]


def test_normalize_maps_roles_and_alternates() -> None:
    out = normalize_turns(
        _turns(
            ("system", "be nice"),
            ("gpt", "orphan reply"),  # before any user turn: dropped
            ("human", "q1"),
            ("user", "q1 more"),  # merged into q1
            ("chatgpt", "a1"),
            ("bing", ""),  # empty: dropped
            ("human", "q2"),
            ("bard", "a2"),
            ("human", "unanswered"),  # trailing user turn: dropped
        )
    )
    assert out == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "q1\n\nq1 more"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]


def test_normalize_accepts_openai_style_and_prompt_only() -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert normalize_turns(msgs) == msgs
    assert normalize_turns(msgs[:1], require_assistant=False) == msgs[:1]
    with pytest.raises(MalformedRecord) as info:
        normalize_turns(msgs[:1])
    assert info.value.reason == "no_assistant_turn"


@pytest.mark.parametrize(
    ("turns", "reason"),
    [
        (_turns(("human", "q"), ("system", "late"), ("gpt", "a")), "system_not_first"),
        (_turns(("gpt", "a only")), "no_user_turn"),
        ([{"from": "human"}], "turn_missing_fields"),
        (["text"], "turn_not_an_object"),
    ],
)
def test_normalize_rejects(turns: list, reason: str) -> None:
    with pytest.raises(MalformedRecord) as info:
        normalize_turns(turns)
    assert info.value.reason == reason


def test_conversation_prompt_keeps_system_and_first_user_turn() -> None:
    conv = Conversation(
        "c",
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"},
        ],
    )
    assert conv.prompt() == conv.messages[:2]
    assert conv.num_assistant_turns == 1
    with pytest.raises(ValueError):
        Conversation("x", [{"role": "assistant", "content": "a"}]).prompt()


# ------------------------------------------------------------------------------------------
# JSONL, MT-Bench, HumanEval, load_source
# ------------------------------------------------------------------------------------------


def test_jsonl_source_mixed_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "a"}], "id": 7, "tag": "t"}),
        json.dumps({"conversations": _turns(("human", "b"), ("gpt", "c"))}),
        json.dumps({"prompt": "d", "system": "sys"}),
        "{broken json",
        json.dumps({"unrelated": 1}),
        json.dumps({"prompt": ""}),
        "",
        json.dumps([1, 2]),
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    source = JsonlSource(path)
    convs, caught = _collect(source)
    assert [c.id for c in convs] == ["7", "d-1", "d-2"]
    assert convs[0].meta["tag"] == "t"
    assert convs[2].messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "d"},
    ]
    assert source.stats.malformed == 4
    assert len(caught) == 1 and "skipped 4" in str(caught[0].message)
    assert source.prompts()[1] == [{"role": "user", "content": "b"}]
    assert len(source) == 3

    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert len(load_source(str(gz))) == 3
        assert len(JsonlSource(path, require_assistant=True)) == 1


def test_load_source_dispatch(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    _dump(path, [_record(0)])
    assert isinstance(load_source(str(path)), ShareGPTSource)
    jl = tmp_path / "s.jsonl"
    jl.write_text(json.dumps({"prompt": "p"}) + "\n")
    assert isinstance(load_source(str(jl), limit=1), JsonlSource)
    with pytest.raises(FileNotFoundError):
        load_source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown data source"):
        load_source("wikipedia")


def test_mtbench_and_humaneval_from_small_files(tmp_path: Path) -> None:
    mt = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["w1", "w2"]},
        {"question_id": 111, "category": "math", "turns": ["m1", "m2"], "reference": ["4"]},
    ]
    mt.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    src = MTBenchSource(mt)
    assert len(src) == 2 and src.categories == ["math", "writing"]
    assert src.prompts() == [
        [{"role": "user", "content": "w1"}],
        [{"role": "user", "content": "m1"}],
    ]
    assert src[1].meta == {
        "source": "mtbench",
        "question_id": 111,
        "category": "math",
        "turns": ["m1", "m2"],
        "reference": ["4"],
    }
    two = MTBenchSource(mt, turns=2, categories=["math"])
    assert [m["content"] for m in two[0].messages] == ["m1", "m2"] and len(two) == 1
    with pytest.raises(ValueError):
        MTBenchSource(mt, turns=3)

    he = tmp_path / "he.jsonl.gz"
    rows = [{"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f"}]
    he.write_bytes(gzip.compress((json.dumps(rows[0]) + "\n").encode()))
    h = HumanEvalSource(he)
    content = h[0].messages[0]["content"]
    assert content.startswith("Complete the following Python function")
    assert "```python\ndef f():\n```" in content
    assert h[0].meta["task_id"] == "HumanEval/0" and h[0].id == "HumanEval/0"
    assert HumanEvalSource(he, instruction="{prompt}")[0].messages[0]["content"] == "def f():\n"


# ------------------------------------------------------------------------------------------
# The real packaged data (network on first use; cached in the default cache afterwards)
# ------------------------------------------------------------------------------------------


def test_real_mtbench_and_humaneval() -> None:
    mt = MTBenchSource()
    assert len(mt) == 80
    counts: dict[str, int] = {}
    for conv in mt:
        counts[conv.meta["category"]] = counts.get(conv.meta["category"], 0) + 1
        assert len(conv.meta["turns"]) == 2 and len(conv.messages) == 1
    assert counts == {
        c: 10
        for c in (
            "writing",
            "roleplay",
            "reasoning",
            "math",
            "coding",
            "extraction",
            "stem",
            "humanities",
        )
    }
    he = HumanEvalSource()
    assert len(he) == 164
    assert he[163].meta["task_id"] == "HumanEval/163"
    assert all(p[0]["role"] == "user" for p in he.prompts())


def test_real_sharegpt_recovers_the_truncated_file() -> None:
    from lightning_spec.data.assets import asset_path

    path = asset_path("sharegpt")
    start = time.perf_counter()
    source = ShareGPTSource(path)
    convs, caught = _collect(source)
    elapsed = time.perf_counter() - start
    stats = source.stats
    # The numbers documented for the packaged (truncated) file.
    assert stats.records == 17_671
    assert stats.turns_raw == 129_071
    assert stats.stopped_at_byte == 125_506_645
    assert len(convs) == stats.conversations == 17_671 - stats.malformed
    assert 17_000 < len(convs) < 17_671
    assert len(caught) == 1 and "17671 complete records" in str(caught[0].message)
    for conv in convs[:500]:
        roles = [m["role"] for m in conv.messages]
        body = roles[1:] if roles[0] == "system" else roles
        assert body[0] == "user" and body[-1] == "assistant"
        assert all(a != b for a, b in zip(body, body[1:], strict=False))
    assert elapsed < 30
    assert len(source) == len(convs)
