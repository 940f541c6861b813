"""No module reaches into another class's private state: the engine a Buffer drives, the routing
it applies and the id its ranks agreed on (``_engine``, ``_route*``, ``_uid*``) are read and
written only by the class that owns them, through ``self``. A collaborator is handed what it
needs (``StepKeeping(buf, engine, uid)``), a layer above calls public names (``Buffer.uid``,
``Buffer(..., routing=...)``).

The oracle is Python's own parser: an attribute of one of those names is allowed only as
``self.<name>`` (or ``cls.<name>``) inside a class that owns it (assigns it on ``self``, gives
it a value in its body or lists it in ``__slots__``, or defines it as a method; a mixin's bare
annotation owns nothing). Anything else, a module-level helper taking the object as an argument
or ``self.inner.<name>``, is a side door.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SRC = REPO_ROOT / "src" / "ubep"
# what the rule guards: the names the grep `\._engine\.\|\._route\|\._uid` finds
PRIVATE_STATE = re.compile(r"_engine|_route\w*|_uid\w*")
# files allowed to reach past their owner: none (an entry would go once its file has no hit,
# and test_no_known_exception_is_stale says so)
KNOWN_SIDE_DOORS: frozenset[str] = frozenset()


def _owned(cls: ast.ClassDef) -> set[str]:
    """The names ``cls`` owns: assigned on ``self`` (or ``cls``) in its body, given a value at
    class level, listed in ``__slots__``, or defined as methods (a bare annotation, a mixin's
    or a protocol's, owns nothing)."""
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(stmt.name)
        elif (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
              and stmt.value is not None):  # a bare annotation declares, it does not own
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "__slots__" and isinstance(stmt.value, ast.Tuple | ast.List):
                        names.update(e.value for e in stmt.value.elts
                                     if isinstance(e, ast.Constant) and isinstance(e.value, str))
    for node in _walk_own(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return names


def _walk_own(cls: ast.ClassDef) -> Iterable[ast.AST]:
    """The nodes of ``cls``'s body, not those of classes nested in it."""
    todo: list[ast.AST] = list(cls.body)
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.ClassDef))


def side_doors(source: str, name: str) -> list[str]:
    """``name:line: expression`` of every access in ``source`` to a private-state attribute
    from outside the class that owns it."""
    tree = ast.parse(source)
    hits: list[str] = []

    def visit(node: ast.AST, owned: set[str] | None) -> None:
        if isinstance(node, ast.ClassDef):
            owned = _owned(node)
        if isinstance(node, ast.Attribute) and PRIVATE_STATE.fullmatch(node.attr):
            mine = (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                    and owned is not None and node.attr in owned)
            if not mine:
                hits.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, owned)

    visit(tree, None)
    return hits


def _source_hits() -> dict[str, list[str]]:
    """Repo-relative path -> its side doors, for every module of ``src/ubep`` that has one."""
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(REPO_ROOT))
        hits = side_doors(path.read_text(), rel)
        if hits:
            found[rel] = hits
    return found


def test_no_module_reaches_into_another_class_private_state() -> None:
    hits = _source_hits()
    assert [h for path, found in hits.items() if path not in KNOWN_SIDE_DOORS
            for h in found] == []


def test_no_known_exception_is_stale() -> None:
    stale = KNOWN_SIDE_DOORS - set(_source_hits())
    assert stale == set(), f"no side door left in {sorted(stale)}: drop it from KNOWN_SIDE_DOORS"


def test_the_checker_finds_each_kind_of_side_door() -> None:
    source = '''
class Owner:
    __slots__ = ("_uid",)

    def __init__(self, engine):
        self._engine = engine
        self._route = None

    def run(self, other):
        self._engine.go()                 # its own: fine
        other._engine.go()                # another object's
        return self._uid, (lambda: self._route)()


class Stranger:
    _uid: int

    def peek(self, buf):
        self.inner = buf
        return self.inner._route, self._engine, self._uid   # through a holder; never set


def helper(buf):
    buf._uid_seen = buf._uid              # a module-level function reaching in
    return buf._routed_dispatch()
'''
    assert side_doors(source, "m") == [
        "m:11: other._engine",
        "m:20: self.inner._route", "m:20: self._engine", "m:20: self._uid",
        "m:24: buf._uid_seen", "m:24: buf._uid",
        "m:25: buf._routed_dispatch",
    ]
