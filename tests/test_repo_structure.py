"""The tree keeps the shape docs/ARCHITECTURE.md draws.

Four rules, each checked from the source itself (the oracle is Python's own parser):

* no circle between modules of ``ubep`` or ``benchmarks``, through any import that can run (a
  lazy import inside a function counts: it hides a circle, it does not open it; one under
  ``TYPE_CHECKING`` never runs);
* the core (every ``ubep`` module outside the torch layer) never imports the torch layer or the
  source tree's ``benchmarks``, lazily or not; ``ubep.torch_bridge`` is the one door to
  ``ubep.torch`` and ``ubep.deep_ep`` is the documented re-export of the facade;
* every ``ubep`` module stands on one of the package's :data:`FLOORS` and imports only its own
  floor and those below, but for the one arrow up that :data:`UPWARD` names (the torch door);
  a package stands on one floor whole (no entry places a module inside another entry's
  package), and the door is one-way: the torch layer never reaches its own package back
  through it;
* no source file over :data:`MAX_LINES` lines.

Each checker is also run on a small made-up tree that breaks its rule, so a checker that went
blind fails here too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 800
SOURCE_SUFFIXES = (".py", ".pyi", ".c", ".h")
# the torch layer and the modules allowed to reach it
TORCH_LAYER = ("ubep.torch", "ubep.deep_ep")
TORCH_DOOR = "ubep.torch_bridge"
FORBIDDEN_FROM_CORE = ("ubep.torch", "ubep.deep_ep", "benchmarks")


# The package's floors, bottom first (docs/ARCHITECTURE.md "Floors"): a module may import
# modules of its own floor and of the floors below. An entry places a module and, if it is a
# package, its submodules (the root ``ubep`` places only its ``__init__``); the longest entry
# that names a module decides its floor.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vocabulary", ("ubep.errors", "ubep.modes", "ubep.dtypes", "ubep.topology", "ubep.env",
                    "ubep.closing", "ubep.expert_map", "ubep.quant")),
    ("models and formats", ("ubep.routing", "ubep.sched", "ubep.config", "ubep.m2n", "ubep.flags",
                            "ubep.trace")),
    ("contract", ("ubep.plane", "ubep.handle", "ubep.torch_bridge")),
    ("oracle", ("ubep.reference", "ubep.testing")),
    ("transports", ("ubep.runtime", "ubep.mpi", "ubep.triton")),
    ("buffer", ("ubep.buffer",)),
    ("user", ("ubep", "ubep.__main__", "ubep.cli", "ubep.demo", "ubep.doctor", "ubep.deep_ep",
              "ubep.torch", "ubep.sim", "ubep.tools", "ubep.vllm")),
)
# the arrows allowed up a floor, (importer, the entry that places what it imports): one, the
# core's door to the optional torch layer
UPWARD = {(TORCH_DOOR, "ubep.torch")}


def floor_entry(module: str, floors: Iterable[tuple[str, Iterable[str]]] = FLOORS
                ) -> tuple[int, str] | None:
    """(floor index, entry) of the longest entry of ``floors`` that names ``module``."""
    best: tuple[int, str] | None = None
    for level, (_, entries) in enumerate(floors):
        for entry in entries:
            names = module == entry or ("." in entry and module.startswith(entry + "."))
            if names and (best is None or len(entry) > len(best[1])):
                best = (level, entry)
    return best


def upward_arrows(graph: Mapping[str, set[str]],
                  floors: Iterable[tuple[str, Iterable[str]]] = FLOORS
                  ) -> set[tuple[str, str]]:
    """(importer, entry of the imported module) of every import from a lower floor up to a
    higher one, between modules the floors place."""
    floors = tuple(floors)
    out = set()
    for module, targets in graph.items():
        here = floor_entry(module, floors)
        for target in targets:
            there = floor_entry(target, floors)
            if here is not None and there is not None and there[0] > here[0]:
                out.add((module, there[1]))
    return out


def split_packages(floors: Iterable[tuple[str, Iterable[str]]] = FLOORS
                   ) -> list[tuple[str, str]]:
    """(package entry, entry inside it) pairs: a package whose modules stand on two floors (the
    root ``ubep``, which places only its ``__init__``, excepted)."""
    entries = [e for _, names in floors for e in names if e != "ubep"]
    return sorted((outer, inner) for outer in entries for inner in entries
                  if inner.startswith(outer + "."))


def back_through_the_door(graph: Mapping[str, set[str]]) -> list[tuple[str, str]]:
    """(torch-layer module, door) pairs: the torch layer importing the core's door to itself."""
    return sorted((module, target) for module, targets in graph.items()
                  if _in(module, TORCH_LAYER) for target in targets if target == TORCH_DOOR)


def _module_files() -> dict[str, Path]:
    """Module name -> file, for the ``ubep`` package and the ``benchmarks`` tree."""
    found: dict[str, Path] = {}
    for root, top in ((REPO_ROOT / "src", REPO_ROOT / "src" / "ubep"),
                      (REPO_ROOT, REPO_ROOT / "benchmarks")):
        for path in top.rglob("*.py"):
            if "results" in path.relative_to(top).parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: Iterable[ast.stmt], *, into_functions: bool) -> Iterator[ast.stmt]:
    """The statements that can run: every block but ``if TYPE_CHECKING``; with
    ``into_functions=False`` only those that run when the module loads (functions' bodies
    excluded, classes' bodies included)."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.orelse, into_functions=into_functions)
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not into_functions:
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                inner = [b for b in block if isinstance(b, ast.stmt)]
                for handler in block:
                    if isinstance(handler, ast.ExceptHandler):
                        inner.extend(handler.body)
                yield from _statements(inner, into_functions=into_functions)


def _targets(module: str, is_package: bool, node: ast.stmt, known: Iterable[str]) -> list[str]:
    """The modules of ``known`` an import statement of ``module`` names (``from pkg import name``
    names ``pkg.name`` when that is a module, else ``pkg``)."""
    names = set(known)
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    out = []
    for alias in node.names:
        full = f"{base}.{alias.name}"
        if full in names:
            out.append(full)
        elif base in names:
            out.append(base)
    return out


def import_graph(sources: Mapping[str, tuple[str, bool]], *, load_time_only: bool
                 ) -> dict[str, set[str]]:
    """Module -> modules it imports, from ``{module: (source text, is_package)}``."""
    graph: dict[str, set[str]] = {}
    for module, (text, is_package) in sources.items():
        tree = ast.parse(text)
        nodes = _statements(tree.body, into_functions=not load_time_only)
        graph[module] = {
            t for node in nodes for t in _targets(module, is_package, node, sources)
            if t != module
        }
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                    found.append(sorted(component))
    return found


def _in(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def core_reaches_torch(graph: Mapping[str, set[str]]) -> list[tuple[str, str]]:
    """(core module, forbidden module) pairs: the core importing the torch layer or benchmarks."""
    return sorted(
        (module, target)
        for module, targets in graph.items()
        if _in(module, ("ubep",)) and not _in(module, TORCH_LAYER) and module != TORCH_DOOR
        for target in targets if _in(target, FORBIDDEN_FROM_CORE)
    )


def _repo_sources() -> dict[str, tuple[str, bool]]:
    return {
        module: (path.read_text(), path.name == "__init__.py")
        for module, path in _module_files().items()
    }


def long_files(paths: Iterable[Path], limit: int, root: Path = REPO_ROOT
               ) -> list[tuple[str, int]]:
    """(path under ``root``, lines) of every file over ``limit`` lines."""
    out = []
    for path in paths:
        lines = path.read_text(errors="replace").count("\n")
        if lines > limit:
            out.append((str(path.relative_to(root)), lines))
    return sorted(out)


def _source_files() -> Iterator[Path]:
    for top in ("src", "benchmarks", "tests"):
        for path in (REPO_ROOT / top).rglob("*"):
            rel = path.relative_to(REPO_ROOT).parts
            if path.suffix in SOURCE_SUFFIXES and "results" not in rel and "build" not in rel:
                yield path


def test_no_circle_between_modules() -> None:
    graph = import_graph(_repo_sources(), load_time_only=False)
    assert len(graph) > 80, "the module scan found too little: the tree moved"
    assert circles(graph) == []


def test_core_never_imports_the_torch_layer_or_benchmarks() -> None:
    graph = import_graph(_repo_sources(), load_time_only=False)
    assert any(_in(t, ("ubep.torch",)) for t in graph[TORCH_DOOR]), (
        "the bridge no longer reaches the torch layer: the rule checks nothing"
    )
    assert core_reaches_torch(graph) == []


def test_every_module_sits_on_one_floor() -> None:
    modules = [m for m in _module_files() if _in(m, ("ubep",))]
    entries = [e for _, names in FLOORS for e in names]
    assert len(entries) == len(set(entries)), "an entry stands on two floors"
    assert [m for m in modules if floor_entry(m) is None] == [], "modules on no floor"
    placed = {found[1] for m in modules if (found := floor_entry(m)) is not None}
    assert set(entries) - placed == set(), "entries that place no module (stale names)"


def test_only_the_torch_door_goes_up_a_floor() -> None:
    graph = import_graph(_repo_sources(), load_time_only=False)
    assert upward_arrows(graph) == UPWARD


def test_each_package_stands_on_one_floor() -> None:
    assert split_packages() == []


def test_the_torch_door_is_one_way() -> None:
    graph = import_graph(_repo_sources(), load_time_only=False)
    assert back_through_the_door(graph) == []


def test_no_source_file_over_the_limit() -> None:
    assert long_files(_source_files(), MAX_LINES) == []


# The checkers on made-up trees that break each rule.

_CIRCLE = {
    "ubep": ("from . import a\n", True),
    "ubep.a": ("from .b import thing\n", False),
    "ubep.b": ("from ubep import a\n", False),
    "ubep.c": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n", False),
    "ubep.d": ("def f():\n    from . import c\n", False),
}


def test_circle_checker_follows_imports_that_can_run() -> None:
    graph = import_graph(_CIRCLE, load_time_only=True)
    assert graph["ubep.a"] == {"ubep.b"}  # `from .b import thing`: the module b
    assert graph["ubep.b"] == {"ubep.a"}  # `from ubep import a`: the submodule a
    assert graph["ubep.c"] == set() and graph["ubep.d"] == set()
    assert circles(graph) == [["ubep.a", "ubep.b"]]  # the package only imports a: no circle
    lazy = import_graph(_CIRCLE, load_time_only=False)
    assert lazy["ubep.c"] == set() and lazy["ubep.d"] == {"ubep.c"}


def test_torch_checker_sees_lazy_imports_and_allows_the_bridge() -> None:
    tree = {
        "ubep.core": ("def f():\n    import ubep.torch.group\n", False),
        "ubep.torch_bridge": ("def g():\n    from .torch import group\n", False),
        "ubep.torch": ("", True),
        "ubep.torch.group": ("from ubep import core\n", False),
        "ubep.tool": ("import benchmarks.harness\n", False),
        "benchmarks.harness": ("", False),
    }
    graph = import_graph(tree, load_time_only=False)
    assert core_reaches_torch(graph) == [
        ("ubep.core", "ubep.torch.group"), ("ubep.tool", "benchmarks.harness"),
    ]


def test_floor_checker_finds_an_arrow_up_and_no_other() -> None:
    floors = (("low", ("ubep.a", "ubep.pkg")), ("high", ("ubep", "ubep.b", "ubep.pkg.top")))
    tree = {
        "ubep": ("from . import a\n", True),  # down: the root's own entry
        "ubep.a": ("def f():\n    from . import b\n", False),  # up, lazily
        "ubep.b": ("from .pkg import low\nfrom .pkg import top\n", False),  # down, sideways
        "ubep.pkg": ("", True),
        "ubep.pkg.low": ("from . import top\n", False),  # up: the longer entry places top
        "ubep.pkg.top": ("from ubep import a\n", False),
        "ubep.c": ("", False),  # on no floor (the root places only its __init__)
    }
    graph = import_graph(tree, load_time_only=False)
    assert floor_entry("ubep.pkg.top", floors) == (1, "ubep.pkg.top")
    assert floor_entry("ubep.pkg.low", floors) == (0, "ubep.pkg")
    assert floor_entry("ubep.c", floors) is None
    assert upward_arrows(graph, floors) == {("ubep.a", "ubep.b"),
                                            ("ubep.pkg.low", "ubep.pkg.top")}


def test_split_and_door_checkers_find_what_breaks_them() -> None:
    floors = (("low", ("ubep.a", "ubep.pkg")), ("high", ("ubep", "ubep.pkg.top", "ubep.b")))
    assert split_packages(floors) == [("ubep.pkg", "ubep.pkg.top")]
    tree = {
        "ubep.torch_bridge": ("def g():\n    from .torch import group\n", False),
        "ubep.torch": ("", True),
        "ubep.torch.group": ("from ubep import core\n", False),
        "ubep.torch.ops": ("def f():\n    from ..torch_bridge import g\n", False),
        "ubep.core": ("", False),
    }
    graph = import_graph(tree, load_time_only=False)
    assert back_through_the_door(graph) == [("ubep.torch.ops", "ubep.torch_bridge")]


def test_length_checker_counts_lines(tmp_path: Path) -> None:
    short, long = tmp_path / "short.c", tmp_path / "long.c"
    short.write_text("x\n" * 3)
    long.write_text("x\n" * 4)
    assert long_files([short, long], 3, root=tmp_path) == [("long.c", 4)]
