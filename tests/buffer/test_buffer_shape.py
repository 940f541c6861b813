"""The Buffer's shape: its jobs are objects it holds (no base classes), the masking Buffer is a
Buffer, and the contract stays the one door of ``ubep.plane`` (parsed from the source, the
oracle being Python's own parser and the class objects)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import ubep
from ubep.buffer import Buffer
from ubep.buffer.elastic import MaskingBuffer

BUFFER_DIR = Path(inspect.getfile(Buffer)).parent


def test_buffer_has_at_most_20_methods_in_its_mro() -> None:
    names = {n for c in Buffer.__mro__ if c is not object for n, v in vars(c).items()
             if inspect.isfunction(v) or isinstance(v, (property, staticmethod, classmethod))}
    assert len(names) <= 20, sorted(names)


def test_no_buffer_class_inherits_another() -> None:
    for path in BUFFER_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert all(b in ("Protocol", "Generic") for b in bases), (path.name, node.name,
                                                                          bases)


def test_the_masking_buffer_is_a_buffer() -> None:
    assert issubclass(MaskingBuffer, ubep.Buffer)
    assert Buffer.masking_class is MaskingBuffer


def test_dispatch_and_combine_each_have_one_engine_door() -> None:
    """Every engine call of the Buffer's calls goes through ``dispatch`` / ``combine`` of the
    engine (``fast`` is the same engine, offered unchecked arrays first)."""
    tree = ast.parse((BUFFER_DIR / "buffer.py").read_text())
    calls: dict[str, set[str]] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in ("dispatch", "_dispatch", "combine",
                                                           "_combine"):
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, (ast.Name, ast.Attribute))):
                    owner = ast.unparse(node.func.value)
                    if owner in ("fast", "self._engine", "self._fast"):
                        calls.setdefault(fn.name.strip("_"), set()).add(node.func.attr)
    assert calls == {"dispatch": {"dispatch"}, "combine": {"combine"}}
