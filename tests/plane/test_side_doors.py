"""No side doors past the data-plane contract where the contract has a door: the Triton
adapter (``triton/plane.py``) reaches its engine through public names only and sets none of
its attributes; the trace recorder reaches a Buffer's engine through ``Buffer.engine`` and the
contract's methods only; the host adapter forwards nothing it does not define."""

from __future__ import annotations

import ast
from pathlib import Path

import ubep
from ubep.plane.host import HostEngine

SRC = Path(ubep.__file__).resolve().parent


def _attributes(path: Path, owner: str) -> tuple[list[str], list[str]]:
    """(names read of ``self.<owner>``, names assigned on it) in the module at ``path``."""
    read, written = [], []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == owner):
            (written if isinstance(node.ctx, ast.Store) else read).append(node.attr)
    return read, written


def test_the_triton_adapter_uses_public_engine_methods_only() -> None:
    read, written = _attributes(SRC / "triton" / "plane.py", "engine")
    assert read, "the adapter reaches its engine as self.engine"
    assert [n for n in read if n.startswith("_")] == []
    assert written == []


def test_the_recorder_asks_the_engine_through_the_contract() -> None:
    text = (SRC / "trace" / "recorder.py").read_text()
    assert "._engine" not in text
    read, _ = _attributes(SRC / "trace" / "recorder.py", "engine")
    assert set(read) <= {"trace_enable", "trace_spans"}, read


def test_the_host_adapter_forwards_nothing_it_does_not_define() -> None:
    assert "__getattr__" not in vars(HostEngine)
