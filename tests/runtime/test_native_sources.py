"""The native core's files have one list: docs/ARCHITECTURE.md's table ("Native core"). The
build takes every C file of the folder (setup.py lists none), so the table must name exactly
the folder's files, and the C files must not include one another in a circle (the kernels' pair
aside: kernels.c and kernels_x86.c share kernels.h)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_repo_structure import circles

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "src" / "ubep" / "runtime" / "native"


def _table_files() -> set[str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Native core", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names.update(re.findall(r"`([a-z_0-9]+\.[ch])`", first))
    return names


def test_the_docs_table_names_every_native_file_and_no_other() -> None:
    on_disk = {p.name for p in NATIVE.iterdir() if p.suffix in (".c", ".h")}
    assert len(on_disk) > 20, "the native folder moved"
    assert _table_files() == on_disk


def _calls_across(path: Path, defined: dict[str, str]) -> set[str]:
    """The files whose non-static functions ``path`` calls."""
    body = path.read_text()
    return {defined[name] for name in re.findall(r"\b([a-z_0-9]+)\(", body)
            if name in defined and defined[name] != path.name}


def test_no_circle_between_the_c_files_but_the_kernels() -> None:
    # a function defined (not static) at the start of a line: `type name(args) {`
    pattern = re.compile(r"^[a-z_][a-z_0-9 \*]*?\b([a-z_0-9]+)\([^;]*\)\s*\{", re.M)
    defined: dict[str, str] = {}
    for path in NATIVE.glob("*.c"):
        for m in pattern.finditer(path.read_text()):
            if not m.group(0).startswith("static"):
                defined.setdefault(m.group(1), path.name)
    graph = {p.name: _calls_across(p, defined) for p in NATIVE.glob("*.c")}
    assert [sorted(c) for c in circles(graph)] in ([], [["kernels.c", "kernels_x86.c"]])
