"""The repository's layering: docs/architecture.md's packages and what they may import."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stdlib_operator_module_is_not_shadowed() -> None:
    # A root-level ``operator`` package would shadow the stdlib module for pytest and
    # everything else started from the repo root.
    out = subprocess.run(
        [sys.executable, "-c", "import operator, sys; print(operator.__file__); "
         "print(operator.itemgetter(1)([0, 7]))"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    path, value = out.stdout.split()
    assert value == "7"
    assert "site-packages" not in path and str(ROOT) not in path, path
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_worker_library_imports_only_the_stdlib() -> None:
    code = """
import importlib, json, pkgutil, sys
before = set(sys.modules)  # what site/.pth files imported already
import kelastic
names = [m.name for m in pkgutil.iter_modules(kelastic.__path__, "kelastic.")]
for name in names:
    if name != "kelastic.__main__":
        importlib.import_module(name)
top = sorted({m.split(".")[0] for m in set(sys.modules) - before})
std = set(sys.stdlib_module_names) | {"kelastic", "__main__", "_distutils_hack", "__mp_main__"}
third = [m for m in top if m not in std and not m.startswith("_")]
print(json.dumps({"modules": names, "third_party": third}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert "kelastic.contract" in doc["modules"]
    assert doc["third_party"] == []


def test_packages_live_one_level_down() -> None:
    for folder, pkg in (("worker_lib", "kelastic"), ("sidecar", "kelastic_sidecar"),
                        ("operator", "kelastic_operator")):  # fmt: skip
        assert (ROOT / folder / pkg / "__init__.py").exists()
        assert (ROOT / folder / pkg / "py.typed").exists()


#: The product's packages (docs/architecture.md's table) whose sizes are bounded.
PACKAGES = ("worker_lib/kelastic", "etcd_client/kelastic_etcd", "sidecar/kelastic_sidecar",
            "operator/kelastic_operator")  # fmt: skip
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 120
MAX_MODULE_LINES = 400
#: What a longer module's docstring says, then why it is one cohesive thing.
WHY_LONG = re.compile(r"Over ~400 lines (because|as one cohesive thing)\b(?P<why>.*)", re.S)


def _sizes() -> tuple[list[str], list[str], list[str]]:
    """(classes, functions, modules) over the bounds, as ``path:line name (N lines)``."""
    classes: list[str] = []
    functions: list[str] = []
    modules: list[str] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            source = path.read_text()
            tree = ast.parse(source, str(rel))
            lines = len(source.splitlines())
            if lines > MAX_MODULE_LINES:
                found = WHY_LONG.search(ast.get_docstring(tree) or "")
                if found is None or len(found["why"].strip(" :\n")) < 40:
                    modules.append(f"{rel} ({lines} lines)")
            for node in ast.walk(tree):
                if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                assert node.end_lineno is not None
                size = node.end_lineno - node.lineno + 1  # decorators not counted
                where = f"{rel}:{node.lineno} {node.name} ({size} lines)"
                if isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                    classes.append(where)
                elif not isinstance(node, ast.ClassDef) and size > MAX_FUNCTION_LINES:
                    functions.append(where)
    return classes, functions, modules


def test_no_class_function_or_module_outgrows_its_bound() -> None:
    """No class over 400 lines, no function over 120; a module over ~400 lines
    is one cohesive thing and its docstring says why ("Over ~400 lines because ..." or
    "Over ~400 lines as one cohesive thing: ...", with the reason)."""
    classes, functions, modules = _sizes()
    assert not classes, f"classes over {MAX_CLASS_LINES} lines (split them): {classes}"
    assert not functions, f"functions over {MAX_FUNCTION_LINES} lines: {functions}"
    assert not modules, (
        f"modules over {MAX_MODULE_LINES} lines whose docstring does not say why they are one "
        f"cohesive thing ('Over ~400 lines because ...'; or split them): {modules}"
    )


def test_the_size_check_sees_what_it_bounds() -> None:
    """The walk covers the four packages (subpackages included); the docstring rule wants
    the phrase and a reason."""
    seen = {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert "sidecar/kelastic_sidecar/timer/server.py" in seen
    assert "operator/kelastic_operator/local/runner.py" in seen
    assert "etcd_client/kelastic_etcd/call.py" in seen
    assert WHY_LONG.search("Over ~400 lines because it is the protocol's whole vocabulary")
    assert not WHY_LONG.search("A long module.")


# ------------------------------------------------------------------ the import graph
#: The packages whose module imports may form no cycle (folder, import name).
GRAPH_PACKAGES = (("worker_lib", "kelastic"), ("etcd_client", "kelastic_etcd"),
                  ("sidecar", "kelastic_sidecar"), ("operator", "kelastic_operator"))  # fmt: skip
#: The sidecar's longest chain of module imports, in modules (it was 13).
MAX_SIDECAR_DEPTH = 7
#: Known cycles, each to be broken where it lives (none left: the worker library's session
#: and wrapper, which imported each other inside functions, share kelastic.inprocess.call).
KNOWN_CYCLES: frozenset[tuple[str, ...]] = frozenset()


def _modules(folder: str, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's ``__init__``)."""
    out: dict[str, tuple[Path, bool]] = {}
    base = ROOT / folder
    for path in sorted((base / package).rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (never executed)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def _import_graph(
    modules: dict[str, tuple[Path, bool]], *, runtime: bool, through_faces: bool
) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (anywhere in it: at the top or
    inside a function).

    Args:
        runtime: leave out the imports inside ``if TYPE_CHECKING:`` (never executed).
        through_faces: an import of a name from a package's ``__init__`` (its public
            face, which only re-exports) counts as an import of the module that
            defines the name: a face is no layer of code.
    """
    trees = {m: ast.parse(path.read_text()) for m, (path, _) in modules.items()}

    def resolve(module: str, name: str) -> str:
        """The module a face's ``name`` comes from (the face itself when it defines it)."""
        for node in trees[module].body:
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 1
                and node.module
                and any((alias.asname or alias.name) == name for alias in node.names)
            ):
                source = f"{module}.{node.module}"
                if source in modules:
                    return resolve(source, name) if modules[source][1] else source
        return module

    graph: dict[str, set[str]] = {}
    for module, (_, is_package) in modules.items():
        tree = trees[module]
        package = module if is_package else module.rpartition(".")[0]
        skip = _type_checking_nodes(tree) if runtime else set()
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                names = []
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    if name in modules:
                        names.append(name)  # a submodule
                    elif through_faces and base in modules and modules[base][1]:
                        names.append(resolve(base, alias.name))
                    else:
                        names.append(base)
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports (``a`` imports ``b`` imports ...), in modules; the
    graph has no cycle."""
    memo: dict[str, list[str]] = {}

    def chain(v: str) -> list[str]:
        if v not in memo:
            memo[v] = [v, *max((chain(w) for w in graph[v]), key=len, default=[])]
        return memo[v]

    return max((chain(v) for v in sorted(graph)), key=len)


def test_no_import_cycle_in_the_four_packages() -> None:
    """No module imports itself through others, counting every import (at the
    top, inside functions, and for type checking only) and every package face."""
    cycles = []
    for folder, package in GRAPH_PACKAGES:
        graph = _import_graph(_modules(folder, package), runtime=False, through_faces=False)
        cycles += _cycles(graph)
    assert set(cycles) <= KNOWN_CYCLES, f"import cycles: {cycles}"


def test_the_sidecars_import_chains_are_short() -> None:
    """The sidecar's longest chain of module imports (what Python runs when it
    imports the first) has at most MAX_SIDECAR_DEPTH modules; it had 13, mostly a chain of
    wrappers. Imports for type checking only are no chain (never executed), and a
    package's face adds no layer (it re-exports)."""
    graph = _import_graph(_modules("sidecar", "kelastic_sidecar"), runtime=True, through_faces=True)
    assert not _cycles(graph)
    chain = _longest_chain(graph)
    assert len(chain) <= MAX_SIDECAR_DEPTH, " -> ".join(chain)


def test_the_sidecars_packages_meet_through_their_faces() -> None:
    """A module of the sidecar imports another package's modules only through
    that package's ``__init__`` (``kelastic_sidecar.timer``, not its ``.table``)."""
    modules = _modules("sidecar", "kelastic_sidecar")
    graph = _import_graph(modules, runtime=False, through_faces=False)
    inside = []
    for module, targets in graph.items():
        home = module if modules[module][1] else module.rpartition(".")[0]
        for target in targets:
            owner = target.rpartition(".")[0]
            foreign = not (home == owner or home.startswith(owner + "."))
            if owner != "kelastic_sidecar" and not modules[target][1] and foreign:
                inside.append(f"{module} -> {target}")
    assert not inside, inside


def test_the_graph_checks_see_what_they_bound() -> None:
    """The graph is the one measured: the sidecar's entry point reaches its packages,
    a face's name resolves to its module, and a cycle or a long chain is found."""
    modules = _modules("sidecar", "kelastic_sidecar")
    graph = _import_graph(modules, runtime=True, through_faces=True)
    assert "kelastic_sidecar.timer.server" in graph["kelastic_sidecar.wiring"]
    assert "kelastic_sidecar.timer" not in graph["kelastic_sidecar.wiring"]
    faces = _import_graph(modules, runtime=False, through_faces=False)
    assert "kelastic_sidecar.timer" in faces["kelastic_sidecar.wiring"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [("a", "b", "c")]
    assert _longest_chain({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == ["a", "b", "c"]
