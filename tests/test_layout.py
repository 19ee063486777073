"""The layout rules of core/ (issue 10), checked by reading the source with ``ast``:

* no import circle among core/ modules, imports inside functions included (those under
  ``if TYPE_CHECKING:`` never run, so they are not edges);
* nothing under core/engine/ imports an HTTP library or core.server (the engine floor is
  torch, never HTTP);
* nothing in core/ imports core_plugins (core depends on the plugin contract, never on a
  built-in plugin's internals);
* no module in core/ is longer than MAX_LINES.

``from core.x import y`` is an edge to ``core.x.y`` when ``y`` is a submodule, else to
``core.x``; a package's implicit import of its parents is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"
MAX_LINES = 650
HTTP_LIBS = ("starlette", "hypercorn", "msgspec", "prometheus_client")


def module_files(pkg_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package directory."""
    base = pkg_dir.parent
    out = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported dotted name, line) for every runtime import in the file, at any depth,
    relative imports resolved, ``from a import b`` resolved to ``a.b`` when that is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip = _type_checking_nodes(tree)
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in modules else base, node.lineno))
    return out


def import_graph(pkg_dir: Path) -> tuple[dict[str, set[str]], dict[str, list[tuple[str, int]]]]:
    """(edges among the package's own modules, every import of every module)."""
    modules = module_files(pkg_dir)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    raw: dict[str, list[tuple[str, int]]] = {}
    for name, path in modules.items():
        raw[name] = imports_of(name, path, modules)
        for target, _ in raw[name]:
            while target and target not in modules:  # `import core.x.y.attr`-style names: nearest module
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph, raw


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path whose last node is its first) per strongly connected component
    with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    n = stack.pop()
                    on_stack.discard(n)
                    scc.append(n)
                    if n == node:
                        break
                if len(scc) > 1:
                    sccs.append(sorted(scc))
    return [_cycle_in(scc, graph) for scc in sccs]


def _cycle_in(scc: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    members, start = set(scc), scc[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {scc}")  # an SCC of size > 1 always has one


# --------------------------------------------------------------------------- the rules


def test_no_import_cycle_among_core_modules():
    graph, _ = import_graph(CORE)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in core/ (function-level imports count):\n" + "\n".join(
        "  " + " -> ".join(c) for c in cycles)


def test_engine_never_imports_http_or_the_server():
    _, raw = import_graph(CORE)
    bad = [f"{mod} imports {target} (line {line})" for mod, imps in sorted(raw.items()) if mod.startswith("core.engine")
           for target, line in imps
           if target.split(".")[0] in HTTP_LIBS or target == "core.server" or target.startswith("core.server.")]
    assert not bad, "the engine floor must not depend on HTTP:\n  " + "\n  ".join(bad)


def test_core_never_imports_builtin_plugins():
    _, raw = import_graph(CORE)
    bad = [f"{mod} imports {target} (line {line})" for mod, imps in sorted(raw.items())
           for target, line in imps if target.split(".")[0] == "core_plugins"]
    assert not bad, "core/ must not depend on core_plugins:\n  " + "\n  ".join(bad)


def test_no_core_module_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in sorted(CORE.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# --------------------------------------------------------------------------- the checker itself


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_checker_finds_a_cycle_hidden_in_a_function_and_reports_its_path(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",  # b is a submodule: edge a -> b
        "pkg/b.py": "def f():\n    from pkg.sub.c import thing\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from .. import a\nthing = 1\n",  # relative: edge c -> a
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nimport pkg.b.f\n",
    })
    graph, raw = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.b"}  # the TYPE_CHECKING import is not an edge; pkg.b.f resolves to pkg.b
    assert ("pkg.sub.c", 2) in raw["pkg.b"]
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_checker_passes_a_layered_package(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from pkg.low import x\n",
        "pkg/low.py": "x = 1\n",
        "pkg/high.py": "from pkg import low\nfrom pkg import x\n",  # x is not a module: edge to the package
    })
    graph, _ = import_graph(pkg)
    assert graph == {"pkg": {"pkg.low"}, "pkg.low": set(), "pkg.high": {"pkg.low", "pkg"}}
    assert find_cycles(graph) == []
