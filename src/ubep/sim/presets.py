"""The fabric presets as one table, and loading a calibrated fabric.

A fabric family is a topology function (:mod:`ubep.topology`), one row of :data:`PRESETS` and
one entry of ``calib.json`` (its constants with their kinds and sources; a family without
constants of its own names the family it borrows them from, ``same_as``). Everything that
branches on a family reads its row. Loading a fabric (:func:`load_fabric`) reads the data file
and nothing else: it imports neither the executors nor the workload.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..topology import Topology, cm384, host, nvl72, nvl576
from .assumed import apply_assumed
from .fabric import FabricModel

__all__ = ["CALIB_PATH", "FAMILIES", "FITTED_FAMILIES", "PRESETS", "Family", "Preset",
           "fabric_for", "load_calibration", "load_fabric", "preset", "topology_for", "use_fit"]

Family = str
"""A key of :data:`PRESETS`."""


@dataclass(frozen=True)
class Preset:
    """One fabric family.

    Attributes:
        family: its name (the ``--family`` of ``ubep sim``; its ``calib.json`` key).
        topology: ``(num_ranks, cores_per_rank or None) -> Topology``.
        max_ranks: the most ranks the paper's experiments run on it.
        fitted: it has constants of its own in calib.json (else ``same_as`` there).
        fits_assumed: UBEP's assumed constants are fitted on it (the training set's fabric).
        note: what the experiments print about it (an extrapolation says so); ``""``: none.
        wider: the family that models more ranks than ``max_ranks`` on the same constants
            (NVL72 -> NVL576); ``""``: none.
    """

    family: str
    topology: Callable[[int, int | None], Topology]
    max_ranks: int
    fitted: bool
    fits_assumed: bool = False
    note: str = ""
    wider: str = ""


def _cm384(ranks: int, cores: int | None) -> Topology:
    return cm384(ranks) if cores is None else cm384(ranks, cores_per_rank=cores)


def _nvl72(ranks: int, cores: int | None) -> Topology:
    return nvl72(ranks) if cores is None else nvl72(ranks, cores)


def _nvl576(ranks: int, cores: int | None) -> Topology:
    return nvl576(ranks) if cores is None else nvl576(ranks, cores)


PRESETS: dict[str, Preset] = {p.family: p for p in (
    Preset("cm384", _cm384, 384, fitted=True, fits_assumed=True),
    Preset("nvl72", _nvl72, 72, fitted=True, wider="nvl576"),
    Preset("nvl576", _nvl576, 576, fitted=False,
           note="NVL576 is an EXTRAPOLATION: no published measurement; NVL72 constants on a "
                "two-tier topology."),
    Preset("host", host, 64, fitted=True),
)}
FAMILIES: tuple[str, ...] = tuple(PRESETS)
FITTED_FAMILIES: tuple[str, ...] = tuple(f for f, p in PRESETS.items() if p.fitted)
"""Families with constants of their own (NVL576 borrows NVL72's)."""

CALIB_PATH = Path(str(resources.files("ubep.sim").joinpath("calib.json")))


def preset(family: str) -> Preset:
    """The row of ``family``; a clear error naming the argument otherwise."""
    row = PRESETS.get(family) if isinstance(family, str) else None
    if row is None:
        raise InvalidArgumentError("family", family, f"must be one of {FAMILIES}")
    return row


def topology_for(family: str, num_ranks: int, cores_per_rank: int | None = None) -> Topology:
    """The preset topology of ``family`` for ``num_ranks`` ranks."""
    return preset(family).topology(num_ranks, cores_per_rank)


_USE_FIT = [True]


def use_fit(flag: bool) -> None:
    """``False``: :func:`load_fabric` and ``calib.fabric_variants`` give the first-principles
    values of the assumed constants (``ubep sim all --no-fit``) instead of the fitted ones."""
    _USE_FIT[0] = bool(flag)


def fit_in_use() -> bool:
    return _USE_FIT[0]


@lru_cache(maxsize=4)
def _read(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def load_calibration(path: Path | None = None) -> dict[str, Any]:
    """The parsed calib.json (a fresh copy)."""
    return json.loads(json.dumps(_read(str(path or CALIB_PATH))))


def fabric_for(entry: dict[str, Any], name: str) -> FabricModel:
    values = {k: v["value"] for k, v in entry["constants"].items()}
    return FabricModel(name=name, **values)


def load_fabric(family: str, path: Path | None = None) -> FabricModel:
    """The calibrated :class:`FabricModel` of ``family`` (a key of :data:`PRESETS`)."""
    row = preset(family)
    fabrics = _read(str(path or CALIB_PATH))["fabrics"]
    if family not in fabrics:
        raise InvalidArgumentError("family", family, f"has no calib.json entry ({sorted(fabrics)})")
    entry = fabrics[family]
    if "same_as" in entry:
        return fabric_for(fabrics[entry["same_as"]], family)
    fabric = fabric_for(entry, family)
    if row.fits_assumed and not _USE_FIT[0]:
        fabric = apply_assumed(fabric, {})
    return fabric
