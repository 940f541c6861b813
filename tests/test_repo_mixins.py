"""No mixin class in ``src/ubep``: a class has one base at most, so what a class does is its own
body and the one class it refines, and a part it shares with another class is a collaborator
it holds (the DeepEP facades hold their call paths, ``ubep.torch.deep_ep_core``), handed what
it needs through public names (tests/test_repo_private_state.py).

The one exception is a base that a framework asks for beside the class's own: each name in
:data:`FRAMEWORK_BASES` says why. A class with several bases is allowed only when all of them
but one are on that list. The oracle is Python's own parser.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SRC = REPO_ROOT / "src" / "ubep"

# bases a class may take beside its own one base, as written in the source
FRAMEWORK_BASES = frozenset({
    # ubep's errors are the standard exceptions too, so that ``except ValueError`` (bad
    # input), ``except TimeoutError`` and ``except ConnectionError`` (a lost peer) catch them
    # (ubep.errors): the exception hierarchy is Python's, not a mixin of behaviour
    "ValueError", "builtins.TimeoutError", "ConnectionError",
    # typing's markers add no behaviour: a protocol or a generic class declares its type only
    "Protocol", "Generic",
})


def _base_name(base: ast.expr) -> str:
    """``Generic[T]`` -> ``Generic``; ``builtins.TimeoutError`` as written."""
    if isinstance(base, ast.Subscript):
        base = base.value
    return ast.unparse(base)


def several_bases(source: str, name: str) -> list[str]:
    """``name:line: Class(bases)`` of every class of ``source`` with more than one base, all
    but one of them outside :data:`FRAMEWORK_BASES` (keywords such as ``metaclass=`` are not
    bases)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef) or len(node.bases) < 2:
            continue
        own = [b for b in node.bases if _base_name(b) not in FRAMEWORK_BASES]
        if len(own) > 1:
            bases = ", ".join(ast.unparse(b) for b in node.bases)
            hits.append(f"{name}:{node.lineno}: {node.name}({bases})")
    return hits


def test_no_class_in_src_mixes_in_another() -> None:
    hits = [hit for path in sorted(SRC.rglob("*.py"))
            for hit in several_bases(path.read_text(), str(path.relative_to(REPO_ROOT)))]
    assert hits == [], "hold a collaborator instead of mixing a class in"


def test_every_framework_base_is_used() -> None:
    """An entry of the allowlist that no class takes any more goes."""
    used = {_base_name(b) for path in SRC.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) for b in node.bases}
    assert FRAMEWORK_BASES - used == set()


def test_the_checker_finds_a_mixin_and_allows_framework_bases() -> None:
    source = '''
class LowLatencyCalls:
    pass


class Buffer(LowLatencyCalls, InternodeCalls, metaclass=Meta):   # two mixins
    pass


class Refined(Buffer):                                            # one base: fine
    pass


class InvalidArgumentError(UbepError, ValueError):                # an exception: fine
    pass


class Result(Generic[T], Base):                                   # a generic: fine
    pass


class Engine(Protocol):
    pass


class Both(Engine, Refined, Protocol):                            # two of its own
    pass
'''
    assert several_bases(source, "m") == [
        "m:6: Buffer(LowLatencyCalls, InternodeCalls)",
        "m:26: Both(Engine, Refined, Protocol)",
    ]
