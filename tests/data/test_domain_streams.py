"""Narrow-domain streams: built from a (fake) standard library in source order, served in file
order by `build_stream` and `lightning-spec online --stream`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_spec.cli import online as online_cli
from lightning_spec.data.domain_streams import build_domain, stdlib_functions
from lightning_spec.online.stream import Segment, build_stream

LONG = "This docstring has well over fifteen words so that it counts as a documented public function here."


def _fake_stdlib(root: Path) -> Path:
    (root / "zeta").mkdir(parents=True)
    (root / "alpha").mkdir()
    (root / "test").mkdir()
    (root / "alpha" / "__init__.py").write_text(
        f'def second():\n    """{LONG}"""\n    return 2\n\n'
        f'def first_in_file():\n    """{LONG}"""\n    return 1\n'
    )
    (root / "alpha" / "_private.py").write_text(f'def hidden():\n    """{LONG}"""\n    return 0\n')
    (root / "zeta" / "mod.py").write_text(
        'def short():\n    """Too short."""\n    return 0\n\n'
        f'def _private():\n    """{LONG}"""\n    return 0\n\n'
        f'class Tool:\n    def run(self, x):\n        """{LONG}"""\n        y = x + 1\n        return y\n\n'
        f'def only_doc():\n    """{LONG}"""\n'
    )
    (root / "test" / "test_x.py").write_text(f'def test_a():\n    """{LONG}"""\n    return 0\n')
    return root


def test_stdlib_functions_in_source_order(tmp_path: Path) -> None:
    found = stdlib_functions(root=_fake_stdlib(tmp_path))
    names = [f"{f.module}.{f.qualname}" for f in found]
    # packages by path, functions by line; private, short, test and doc-only ones left out
    assert names == ["alpha.second", "alpha.first_in_file", "zeta.mod.Tool.run"]
    assert found[2].code == "def run(self, x):\n    y = x + 1\n    return y"
    assert found[0].package == "alpha" and found[0].doc == LONG


def test_the_real_stdlib_gives_a_thousand_requests_per_domain() -> None:
    doc2code = build_domain("py-doc2code")
    assert len(doc2code) >= 1000
    assert doc2code[0]["prompt"].startswith("Please generate code based on the following doc:\n")
    assert [r["module"] for r in doc2code] == sorted(
        (r["module"] for r in doc2code), key=[r["module"] for r in doc2code].index
    )  # modules stay contiguous: one package after another
    code2doc = build_domain("py-code2doc")
    assert len(code2doc) >= 1000 and "```python\n" in code2doc[0]["prompt"]
    with pytest.raises(ValueError, match="unknown domain"):
        build_domain("gsm8k")


def _jsonl(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(count)))
    return path


def test_source_order_streams(tmp_path: Path, data_helpers) -> None:
    tokenizer = data_helpers.make_chat_tokenizer()
    stream = _jsonl(tmp_path / "s.jsonl", 12)
    ordered = build_stream(tokenizer, [Segment(str(stream), 5, "source", skip=3)])
    assert [r.id for r in ordered] == ["q3", "q4", "q5", "q6", "q7"]
    whole = build_stream(tokenizer, [Segment(str(stream), 0, "source")])
    assert [r.id for r in whole] == [f"q{i}" for i in range(12)]
    shuffled = build_stream(tokenizer, [Segment(str(stream), 12)], seed=1)
    assert sorted(r.id for r in shuffled) == sorted(r.id for r in whole)
    assert [r.id for r in shuffled] != [r.id for r in whole]
    with pytest.raises(ValueError, match="after skipping 10"):
        build_stream(tokenizer, [Segment(str(stream), 5, "source", skip=10)])
    with pytest.raises(ValueError, match="skip needs order"):
        build_stream(tokenizer, [Segment(str(stream), 5, skip=2)])


def test_online_cli_takes_a_stream_file(tmp_path: Path, capsys) -> None:
    config = tmp_path / "online.yaml"
    config.write_text("drafter: some/folder\nstream: " + str(_jsonl(tmp_path / "s.jsonl", 3)) + "\n")
    loaded = online_cli.load_config(config)
    assert loaded["stream"] == [{"source": str(tmp_path / "s.jsonl"), "count": 0, "order": "source"}]
    assert online_cli.main(["--config", str(config), "--stream", str(tmp_path / "missing.jsonl")]) == 2
    assert "no stream file" in capsys.readouterr().err
