"""No import cycles between our modules, lazy (function-level) imports included.

The modules are read, not imported: every `import` / `from ... import` statement of every file
under the installed package roots (pyproject's `package-dir`: lightning_spec/, callbacks/,
export/, kernels/) becomes an edge, wherever it sits (module level, inside a function, under
`try`). Only `if TYPE_CHECKING:` blocks are skipped: they never run. An import of a name from a
package points at the submodule when the name is one (`from lightning_spec import bench` ->
`lightning_spec.bench`), else at the package itself. A lazy import hides a cycle from Python,
not from the design (docs/architecture.md, "The floors"), so it counts.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str
    """`path:line` of the import statement."""


def package_roots(root: Path = ROOT) -> dict[str, Path]:
    """Installed package name -> its folder, from pyproject's `[tool.setuptools] package-dir`."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: root / folder for name, folder in setuptools["package-dir"].items()}


def module_files(roots: Mapping[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package roots."""
    modules: dict[str, Path] = {}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree`, at any depth, except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of our modules (None: not ours)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_edges(modules: Mapping[str, Path]) -> list[Edge]:
    edges: list[Edge] = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        package = module if is_package else module.rpartition(".")[0]
        where_prefix = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            where = f"{where_prefix}:{node.lineno}"
            if isinstance(node, ast.Import):
                targets = [_known(alias.name, modules) for alias in node.names]
            else:
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [
                    f"{base}.{alias.name}"
                    if f"{base}.{alias.name}" in modules
                    else _known(base, modules)
                    for alias in node.names
                ]
            for target in dict.fromkeys(targets):
                if target is not None and target != module:
                    edges.append(Edge(module, target, where))
    return edges


def cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        # Iterative depth-first search: (node, iterator over its successors).
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def describe(component: list[str], edges: Iterable[Edge]) -> str:
    """The component's modules and the import statements that tie them together."""
    members = set(component)
    lines = [" <-> ".join(component)]
    for edge in sorted(edges, key=lambda e: (e.source, e.target, e.where)):
        if edge.source in members and edge.target in members:
            lines.append(f"    {edge.source} -> {edge.target}  ({edge.where})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- tests
def test_the_walker_sees_every_package_root_and_lazy_imports() -> None:
    modules = module_files(package_roots())
    for name in (
        "lightning_spec",
        "lightning_spec.cli",
        "lightning_spec.callbacks",
        "lightning_spec.export",
        "lightning_spec.kernels",
    ):
        assert name in modules
    edges = import_edges(modules)
    # RegisterDrafter imports the registry inside `register` (a lazy import): still an edge.
    assert any(
        (e.source, e.target) == ("lightning_spec.callbacks.registry", "lightning_spec.registry")
        for e in edges
    )
    assert all(e.target in modules and e.source in modules for e in edges)


def test_cycle_finder_on_a_hand_made_graph() -> None:
    edges = [
        Edge("a", "b", "a.py:1"),
        Edge("b", "c", "b.py:1"),
        Edge("c", "a", "c.py:9"),
        Edge("c", "d", "c.py:2"),
        Edge("d", "e", "d.py:1"),
        Edge("e", "d", "e.py:5"),
        Edge("f", "a", "f.py:1"),
    ]
    assert cycles(edges) == [["a", "b", "c"], ["d", "e"]]
    assert cycles(edges[:2]) == []
    assert "c -> a  (c.py:9)" in describe(["a", "b", "c"], edges)


def test_relative_and_package_imports_resolve(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg import sub\n")
    (package / "sub" / "__init__.py").write_text("from .leaf import x\n")
    (package / "sub" / "leaf.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    import pkg.other\n"
        "def f():\n    from .. import other\n"
    )
    (package / "other.py").write_text("from pkg.sub import leaf\n")
    modules = module_files({"pkg": package})
    found = {(e.source, e.target) for e in import_edges(modules)}
    assert found == {
        ("pkg", "pkg.sub"),
        ("pkg.sub", "pkg.sub.leaf"),
        ("pkg.sub.leaf", "pkg.other"),
        ("pkg.other", "pkg.sub.leaf"),
    }
    assert cycles(import_edges(modules)) == [["pkg.other", "pkg.sub.leaf"]]


def test_no_import_cycles() -> None:
    modules = module_files(package_roots())
    edges = import_edges(modules)
    found = cycles(edges)
    assert not found, "import cycles (lazy imports included):\n" + "\n".join(
        describe(component, edges) for component in found
    )
