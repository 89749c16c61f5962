"""Narrow-domain request streams built offline from the Python standard library.

OnlineSpec's published gains come from ONE narrow domain per stream, served in dataset order
(CodeSearchNet-Python, Spider, GSM8K, finance QA: docs/methods/onlinespec.md): consecutive
requests share vocabulary, idioms and often a repository, so what the drafter learns from one
round pays in the next. The standard library is real code with real documentation that every
machine with Python has, so two such domains can be built here without a download:

* ``py-doc2code`` (the CodeSearchNet analogue): every public function and method with a
  docstring of at least `min_words` words; prompt = "Please generate code based on the
  following doc:" + the docstring (OnlineSPEC's CodeSearchNet prompt).
* ``py-code2doc`` (the reverse task): the same functions' source, docstring removed; prompt =
  "Write the docstring for this Python function:" + the code.

Order is source order: packages and modules alphabetically by path, functions by line, so a
stream walks ``asyncio`` then ``concurrent`` then ``email`` ... (locality, as in the papers).
The stdlib's own tests and site-packages are left out. The result depends on the Python
version (recorded in every row); ``python -m lightning_spec.data.domain_streams --domain
py-doc2code --out stream.jsonl`` writes one stream as JSONL (``{"id", "prompt", ...}``), which
`lightning-spec online --stream FILE.jsonl` serves in file order.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DOMAINS", "StdlibFunction", "build_domain", "stdlib_functions"]

DOC2CODE = "Please generate code based on the following doc:\n"
CODE2DOC = "Write the docstring for this Python function:\n```python\n{code}\n```"
DOMAINS = ("py-doc2code", "py-code2doc")
SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class StdlibFunction:
    """One documented public function or method of the standard library."""

    module: str
    qualname: str
    line: int
    doc: str
    code: str  # the function's source without its docstring

    @property
    def package(self) -> str:
        return self.module.split(".")[0]


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _without_docstring(source: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    lines = source.splitlines()
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    end = node.end_lineno or node.lineno
    doc = node.body[0]
    if len(node.body) < 2:
        return None  # only a docstring: nothing to generate
    kept = lines[start : doc.lineno - 1] + lines[(doc.end_lineno or doc.lineno) : end]
    return textwrap.dedent("\n".join(kept)).strip("\n")


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Public module-level functions and public methods of public classes, in line order."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    yield f"{node.name}.{item.name}", item


def stdlib_functions(min_words: int = 15, root: str | Path | None = None) -> list[StdlibFunction]:
    """Every documented public function of the standard library under `root`, source order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found: list[StdlibFunction] = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # lib2to3 fixtures and the like: not parseable by this Python
        module = _module_name(root, path)
        if any(part.startswith("_") for part in module.split(".")):
            continue
        for qualname, node in _functions(tree):
            doc = ast.get_docstring(node)
            if not doc or len(doc.split()) < min_words:
                continue
            code = _without_docstring(source, node)
            if code is None:
                continue
            found.append(StdlibFunction(module, qualname, node.lineno, doc.strip(), code))
    return found


def build_domain(domain: str, *, min_words: int = 15, max_code_lines: int = 60) -> list[dict]:
    """The rows of one domain stream, in source order (see the module docstring)."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}: choose one of {DOMAINS}")
    python = ".".join(map(str, sys.version_info[:3]))
    rows = []
    for fn in stdlib_functions(min_words):
        if domain == "py-doc2code":
            prompt = DOC2CODE + fn.doc
        else:
            if fn.code.count("\n") + 1 > max_code_lines:
                continue
            prompt = CODE2DOC.format(code=fn.code)
        rows.append(
            {
                "id": f"{domain}:{fn.module}.{fn.qualname}",
                "prompt": prompt,
                "domain": domain,
                "package": fn.package,
                "module": fn.module,
                "qualname": fn.qualname,
                "python": python,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_spec.data.domain_streams",
        description="Write a narrow-domain request stream (JSONL, source order) built from the "
        "Python standard library.",
    )
    parser.add_argument("--domain", choices=DOMAINS, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--min-words", type=int, default=15)
    args = parser.parse_args(argv)
    rows = build_domain(args.domain, min_words=args.min_words)
    from lightning_spec.io import atomic_write_text

    atomic_write_text(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    packages = len({r["package"] for r in rows})
    print(f"wrote {len(rows)} {args.domain} requests from {packages} packages to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
