"""The names of ubep's modes, in one place: engines, sync modes, layouts, scheduling policies and
payload types, as ``Literal`` types and as tuples in their canonical order, plus the one
enumeration of the valid engine x sync x layout x dtype combinations that tests, the MPI
selftest, the soak and the peers benchmark run.

Pure Python (no numpy, no torch): everything that validates or enumerates a mode name imports it
from here. The native codes of these names (their position in the tuples) are
:mod:`ubep.runtime.abi`'s business.

The one rule between the axes: SP needs a bit pattern the payload never holds (its sentinel), so
it runs only with float payloads (:func:`supports`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast, get_args

__all__ = [
    "BUFFER_LAYOUTS",
    "DTYPE_NAMES",
    "ENGINES",
    "FLOAT_DTYPE_NAMES",
    "INTEGRITY",
    "LAYOUTS",
    "PEER_LOSS",
    "POLICIES",
    "QUANTS",
    "SYNCS",
    "DTypeName",
    "Engine",
    "Integrity",
    "Layout",
    "Mode",
    "PeerLoss",
    "Policy",
    "Quant",
    "Sync",
    "SyncChoice",
    "dtypes_for",
    "enumerate_modes",
    "supports",
]

Engine = Literal["asp", "bsp"]
"""``asp``: UBEP's task graph (counts, then sends as soon as they are known); ``bsp``: the
CANN-EP-style baseline (phases separated by global barriers)."""

Sync = Literal["sw", "tff", "dc", "sp"]
"""How a receiver learns that rows arrived (docs/FORMATS.md): stop-and-wait flag, token-flag
fusion, data checksum, sentinel polling."""

Layout = Literal["expert", "rank", "expert_padded"]
"""``expert``: one received row per (token, expert), packed; ``rank``: one per (token,
destination rank); ``expert_padded``: the rows of ``expert`` at DeepEP's low-latency places,
``[num_local_experts, max_tokens_per_rank * num_ranks]`` slots, expert ``e``'s rows in the
first ``num_recv_tokens_per_expert[e]`` slots of its block (ubep.reference)."""

Policy = Literal["expert_contiguous", "balanced", "hierarchical"]
"""Token schedulers of the ASP send cores (ubep.sched)."""

PeerLoss = Literal["raise", "mask"]
"""What a Buffer does when a peer dies or stops answering: ``raise`` on every rank (the Buffer
refuses until resynced), or ``mask`` the peer on every survivor and keep serving
(``ubep.buffer.elastic``)."""

Integrity = Literal["off", "checksum"]
"""End-to-end integrity of the rows (docs/INTEGRITY.md): ``off``, or ``checksum``: a 64-bit
checksum per row written by its sender and checked by its receiver, dispatch and combine."""

Quant = Literal["e4m3", "int8"]
"""Formats of quantised dispatch (ubep.quant): FP8 E4M3 or INT8, one float32 scale per 128
channels."""

SyncChoice = Literal["auto", "sw", "tff", "dc", "sp"]
"""What ``BufferConfig.sync`` takes: a :data:`Sync` or ``auto`` (the fastest on the machine)."""

DTypeName = Literal["bf16", "fp16", "fp32", "int8", "uint8"]
"""Payload types (ubep.dtypes); 1-byte types carry FP8 / W8A8 data."""

ENGINES: tuple[Engine, ...] = get_args(Engine)
SYNCS: tuple[Sync, ...] = get_args(Sync)
BUFFER_LAYOUTS: tuple[Layout, ...] = get_args(Layout)
"""Every layout a ``BufferConfig`` takes (their native codes are their places here)."""
LAYOUTS: tuple[Layout, ...] = ("expert", "rank")
"""The layouts of the mode matrix (:func:`enumerate_modes`, the soak, the peers): the padded
layout moves the rows of ``expert`` to other places, so it is the conformance suite's
(tests/plane) and the low-latency facade's, not another axis of every matrix."""
POLICIES: tuple[Policy, ...] = get_args(Policy)
PEER_LOSS: tuple[PeerLoss, ...] = get_args(PeerLoss)
INTEGRITY: tuple[Integrity, ...] = get_args(Integrity)
DTYPE_NAMES: tuple[DTypeName, ...] = get_args(DTypeName)
QUANTS: tuple[Quant, ...] = get_args(Quant)
FLOAT_DTYPE_NAMES: tuple[DTypeName, ...] = ("bf16", "fp16", "fp32")


def supports(sync: str, dtype: str) -> bool:
    """Whether sync mode ``sync`` can carry payload type ``dtype`` (SP: float types only)."""
    return sync != "sp" or dtype in FLOAT_DTYPE_NAMES


def dtypes_for(sync: str) -> tuple[DTypeName, ...]:
    """The payload types ``sync`` can carry, in :data:`DTYPE_NAMES` order."""
    return tuple(d for d in DTYPE_NAMES if supports(sync, d))


@dataclass(frozen=True)
class Mode:
    """One engine x sync x layout x dtype combination, written ``engine:sync:layout:dtype``."""

    engine: Engine
    sync: Sync
    layout: Layout
    dtype: DTypeName

    @classmethod
    def parse(cls, text: str) -> Mode:
        """``"asp:dc:expert:bf16"`` -> ``Mode``; anything else is an ``InvalidArgumentError``
        naming ``modes``."""
        from .errors import InvalidArgumentError

        parts = text.split(":")
        if len(parts) != 4:
            raise InvalidArgumentError("modes", text, "must be engine:sync:layout:dtype")
        engine, sync, layout, dtype = parts
        for what, value, options in (("engine", engine, ENGINES), ("sync", sync, SYNCS),
                                     ("layout", layout, LAYOUTS), ("dtype", dtype, DTYPE_NAMES)):
            if value not in options:
                raise InvalidArgumentError("modes", text, f"{what} must be one of {options}")
        return cls(cast(Engine, engine), cast(Sync, sync), cast(Layout, layout),
                   cast(DTypeName, dtype))

    def __str__(self) -> str:
        return f"{self.engine}:{self.sync}:{self.layout}:{self.dtype}"


def enumerate_modes(
    *,
    engines: Sequence[Engine] = ENGINES,
    syncs: Sequence[Sync] = SYNCS,
    layouts: Sequence[Layout] = LAYOUTS,
    dtypes: Sequence[DTypeName] = DTYPE_NAMES,
    rotate_dtypes: bool = False,
) -> list[Mode]:
    """The valid modes over the given axes (default: all of them), in product order (engine,
    then sync, then layout, then dtype), SP only with float payloads.

    ``rotate_dtypes``: one dtype per engine x sync x layout instead of every one, taken in turn
    from ``dtypes`` (an SP mode whose turn falls on a 1-byte type gets the first float type of
    ``dtypes``), so that every sync sees float and 1-byte payloads at a fraction of the full
    product's cost.
    """
    if not rotate_dtypes:
        return [Mode(e, s, lay, d) for e, s, lay, d in itertools.product(engines, syncs, layouts,
                                                                         dtypes)
                if supports(s, d)]
    turn = itertools.cycle(dtypes)
    first_float = next((d for d in dtypes if d in FLOAT_DTYPE_NAMES), None)
    out = []
    for e, s, lay in itertools.product(engines, syncs, layouts):
        d = next(turn)
        if not supports(s, d):
            if first_float is None:
                continue
            d = first_float
        out.append(Mode(e, s, lay, d))
    return out
