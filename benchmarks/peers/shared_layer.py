"""The packages every peer venv shares with the interpreter that builds it (torch and numpy).

torch is most of a peer venv's size and of its build time (pip unpacks about a gigabyte per
venv). When the interpreter building the peer venvs (the repository's .venv) already has the
pinned torch, a directory of symlinks to that torch, numpy and their requirements (the
"layer") is made once, and each peer venv reads it through a ``.pth`` file: pip then finds the
pins satisfied and installs only the peer's own packages (its MPI wheel and mpi4py).

A ``.pth`` entry comes after the venv's own site-packages on ``sys.path``, so a package pip
did install into the peer venv always wins over the layer. Only the named distributions and
what they require go into the layer, never the building venv's MPI wheel or mpi4py, which
would clash with the peer's own.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
from pathlib import Path

__all__ = ["PTH_NAME", "SHARED", "layer_for", "top_level_entries"]

# The distributions the layer holds when the building interpreter has them at these versions.
SHARED: dict[str, str] = {"torch": "2.13.0+cpu", "numpy": ""}  # "" = any installed version
PTH_NAME = "ubep-peers-shared.pth"
LAYER_DIR = "_shared"
_REQ_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: list[str]) -> dict[str, md.Distribution]:
    """``names`` and the installed distributions they require, extras left out. Other
    markers are not evaluated: a requirement installed here joins (harmless, as the peer's
    own copy of a package comes first), one not installed is skipped."""
    found: dict[str, md.Distribution] = {}
    todo = [(name, True) for name in names]
    while todo:
        name, named = todo.pop()
        if _key(name) in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if named:
                raise
            continue
        found[_key(name)] = dist
        for line in dist.requires or []:
            req = _REQ_NAME.match(line)
            if req is not None and "extra" not in line.partition(";")[2]:
                todo.append((req.group(0), False))
    return found


def top_level_entries(dist: md.Distribution) -> set[str]:
    """The names a distribution puts directly in site-packages (packages, modules,
    its .dist-info), from its RECORD; scripts outside site-packages are left out."""
    entries = set()
    for f in dist.files or []:
        first = Path(str(f)).parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            entries.add(first)
    return entries


def _site_packages(dist: md.Distribution) -> Path:
    return Path(str(dist.locate_file(""))).resolve()


def layer_for(root: Path) -> Path | None:
    """Make (or refresh) the layer under ``root`` and return it; None when this interpreter
    does not have the pinned versions (each peer venv then installs its own)."""
    try:
        dists = _closure(list(SHARED))
    except md.PackageNotFoundError:
        return None
    for name, version in SHARED.items():
        if version and dists[_key(name)].version != version:
            return None
    layer = root / LAYER_DIR
    if layer.exists():
        shutil.rmtree(layer)
    layer.mkdir(parents=True)
    for dist in dists.values():
        site = _site_packages(dist)
        for entry in top_level_entries(dist):
            if (site / entry).exists():
                (layer / entry).symlink_to(site / entry)
    return layer
