"""The sync modes live in one table: no module of ``ubep.triton`` but ``sync.py`` names one
(so no ``if`` on a mode's name can hide in a kernel or in the host code), and every row of the
table is a distinct, complete protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import ubep.triton
from ubep.modes import SYNCS
from ubep.triton.sync import (
    BATCH_NONE,
    ROW_NONE,
    ROW_SENTINEL,
    SYNC_TABLE,
)

PACKAGE = Path(ubep.triton.__file__).parent


def test_no_module_but_the_table_names_a_sync_mode() -> None:
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "sync.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in SYNCS:
                offenders.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert not offenders, offenders


def test_every_mode_has_one_complete_row() -> None:
    assert tuple(SYNC_TABLE) == SYNCS
    rows = list(SYNC_TABLE.values())
    keys = {(r.dispatch_row, r.dispatch_batch, r.combine_row, r.combine_batch) for r in rows}
    assert len(keys) == len(rows)  # no two modes are the same protocol
    for r in rows:
        # each direction has a way to learn that rows arrived
        assert (r.dispatch_row, r.dispatch_batch) != (ROW_NONE, BATCH_NONE), r
        assert (r.combine_row, r.combine_batch) != (ROW_NONE, BATCH_NONE), r
        assert r.armed == (ROW_SENTINEL in (r.dispatch_row, r.combine_row))
