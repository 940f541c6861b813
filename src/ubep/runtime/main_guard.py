"""Whether ``ubep.launch`` is called from under the ``if __name__ == "__main__":`` guard.

``ubep.launch`` spawns its ranks (``multiprocessing``'s ``spawn``), and each rank runs the
caller's script again as ``__mp_main__`` to find the function it is given. A call at the top
level of that script, outside the guard, then runs again in every rank: multiprocessing fails
there with an error about its bootstrapping phase that does not say what to change. This check
reads the script once in the caller, before any process starts, and names the line instead.
"""

from __future__ import annotations

import ast
import sys
from types import FrameType

from ..errors import UbepError

__all__ = ["check_main_guard"]


def check_main_guard(frame: FrameType | None) -> None:
    """Raise :class:`~ubep.UbepError` if the top-level statement of the main script that led
    to ``frame`` (the caller of ``ubep.launch``) is not under the ``__main__`` guard.

    A main module without a source file (``python -c``, an interactive session, a notebook) is
    not run again by the ranks, so there is nothing to check."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:
        return
    line = _top_level_line(frame, vars(main))
    if line is None:
        return  # called from an import the script made: that module is not run again by name
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return  # a script ubep cannot read: multiprocessing's own error stays the last word
    if not _guarded(tree.body, line):
        raise UbepError(
            f"ubep.launch was called at the top level of {path} (line {line}) without the "
            f'`if __name__ == "__main__":` guard: every rank process imports that script again '
            f"and would launch again. Put the call (or the code that leads to it) under "
            f'`if __name__ == "__main__":`.'
        )


def _top_level_line(frame: FrameType | None, main_globals: dict[str, object]) -> int | None:
    """The line of the main script's module-level code on ``frame``'s stack."""
    while frame is not None:
        if frame.f_globals is main_globals and frame.f_code.co_name == "<module>":
            return frame.f_lineno
        frame = frame.f_back
    return None


def _guarded(body: list[ast.stmt], line: int) -> bool:
    """Whether ``line`` lies in the body of an ``if __name__ == "__main__":`` of module-level
    code (inside a ``try``, ``with`` or another ``if`` too)."""
    for node in body:
        if not node.lineno <= line <= (node.end_lineno or node.lineno):
            continue
        if isinstance(node, ast.If) and _is_main_test(node.test):
            return any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in node.body)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return False
        blocks = [getattr(node, f, None) for f in ("body", "orelse", "finalbody")]
        blocks += [h.body for h in getattr(node, "handlers", [])]
        return any(_guarded(b, line) for b in blocks if isinstance(b, list))
    return False


def _is_main_test(test: ast.expr) -> bool:
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_main_test(v) for v in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1
