"""RELIABILITY.md promises that every fault row names a test in the default CI suite. This
keeps the promise checkable: each cited test exists (by its AST, so a renamed test breaks
here, not silently in the doc) and is not marked slow (the default suite deselects those)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`|`::(\w+)`")


def _rows() -> list[tuple[str, str]]:
    """(fault, test column) of every table row under a fault heading."""
    rows = []
    for line in (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] not in ("fault", "---") and not cells[0].startswith("-"):
            rows.append((cells[0], cells[-1]))
    return rows


def _cited(column: str) -> list[tuple[str, str | None]]:
    """(file, test or None for the whole file); a bare `::name` continues the last file."""
    cited: list[tuple[str, str | None]] = []
    last = None
    for match in CITE.finditer(column):
        if match.group(1):
            last = match.group(1)
            cited.append((last, match.group(2)))
        elif last is not None:
            cited.append((last, match.group(3)))
    return cited


def _slow_marked(node: ast.AST) -> bool:
    return any("slow" in ast.unparse(decorator) for decorator in node.decorator_list)


def _tests_of(path: Path) -> tuple[dict[str, ast.FunctionDef], bool]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module_slow = any(
        isinstance(node, ast.Assign)
        and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
        and "slow" in ast.unparse(node.value)
        for node in tree.body
    )
    tests = {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }
    return tests, module_slow


def test_every_reliability_row_names_tests_of_the_default_suite() -> None:
    rows = _rows()
    assert len(rows) >= 30, "the fault tables were not found"
    problems = []
    for fault, column in rows:
        cited = _cited(column)
        if not cited:
            problems.append(f"{fault!r}: names no test")
        for file, name in cited:
            path = ROOT / file
            if not path.is_file():
                problems.append(f"{fault!r}: {file} does not exist")
                continue
            tests, module_slow = _tests_of(path)
            if module_slow:
                problems.append(f"{fault!r}: {file} is marked slow (not in the default suite)")
            if name is None:
                if not tests:
                    problems.append(f"{fault!r}: {file} holds no test")
            elif name not in tests:
                problems.append(f"{fault!r}: {file}::{name} does not exist")
            elif _slow_marked(tests[name]):
                problems.append(f"{fault!r}: {file}::{name} is marked slow")
    assert not problems, "\n".join(problems)


def test_the_citation_parser_reads_continuations() -> None:
    column = "`tests/a.py::test_x`, `::test_y`, `tests/b.py` (both tests)"
    assert _cited(column) == [("tests/a.py", "test_x"), ("tests/a.py", "test_y"),
                              ("tests/b.py", None)]  # fmt: skip
