"""UBEP's hierarchical token-level scheduler: every send core gets an equal number of units *and*
an equal mix of hop distances, ``v[j,h] <= ceil(V_h/n)`` for every core ``j`` and hop class
``h`` (loads within one, on the same cores as ``balanced``).

How ``hierarchical`` is built, and why the hop bound always holds:

1. Expert remapping by logical matrix transposition (:func:`remapped_expert_order`): experts
   are written row by row into an ``n x ceil(E/n)`` virtual matrix and read column by column.
2. The units are sorted into one *hop-major* sequence: hop class 0's units, then class 1's, ...;
   inside a class by (remapped expert, token). Each (class, remapped expert) run is a "virtual
   expert" with a prefix count, which is what the quaternary search walks.
3. Per-core hop quotas (:func:`hop_quotas`): ``V_h = n*q_h + r_h``; every core takes ``q_h``
   units of class ``h``; the leftovers of all classes are dealt out cyclically, class after
   class. Core ``j`` then sends, of every class, one contiguous chunk of that class's run, right
   after the chunks of cores ``< j``; the chunk starts are located by quaternary search
   (:func:`hierarchical_slices`), so a core on the device needs only the prefix counts, its own
   index and ``O(H log4(H*E))`` vector steps.

The bound holds for *every* input, both layouts, any ``n`` and any number of hop classes: a class
has ``r_h < n`` leftovers, dealt to distinct cores, so ``v[j,h] <= q_h + 1 = ceil(V_h/n)``, and the
cyclic deal gives every core ``floor(R/n)`` or ``ceil(R/n)`` leftovers (``R = sum r_h``). What it
does *not* hold for is the paper's literal construction (transposition, then contiguous slices of a
single expert-ordered sequence): a slice there holds whatever experts are adjacent in the remapped
order. E.g. on CM384 EP256 (48 cores, 6 columns) the 15 one-hop experts of a node sit 2-3
*consecutively* in each column's read-out, so with 128 uniform tokens x top-8 one slice holds 12-17
one-hop units where ``ceil(V_1/n) = 2`` (see the test ``test_literal_construction_breaks_bound``).
The transposition is kept because it fixes the order *inside* a hop class (which experts a core
visits: ids ``ceil(E/n)`` apart rather than one block); it does not affect objective (1),
which only sees hop classes.

Issue order inside a core (``hierarchical`` only; the baselines keep ``(expert, token)``): farthest
hop first, i.e. non-increasing RTT, ties by hop class, then the sequence order. A core issues back
to back, so it finishes at ``max_i (S_i + RTT_i)`` (``S_i``: issue time up to unit ``i``);
non-increasing RTT minimises that (Jackson's rule), letting the far units' round trips overlap the
issue of the near ones. Objective (1) is the order-free bound ``sum l + max RTT`` of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import InvalidArgumentError
from ..topology import Topology
from .partition import _positive_int
from .search import _search_many
from .units import SendUnits

__all__ = [
    "HierarchicalSlices",
    "hierarchical",
    "hierarchical_slices",
    "hop_issue_rank",
    "hop_quotas",
    "remapped_expert_order",
]


@lru_cache(maxsize=1024)
def remapped_expert_order(num_experts: int, num_rows: int) -> np.ndarray:
    """Expert remapping by logical matrix transposition.

    Experts fill a virtual ``num_rows x ceil(E/num_rows)`` matrix row by row (row ``j`` = the
    experts core ``j`` would own under ``expert_contiguous``); reading it column by column gives
    the remapped order. Returns ``rpos [E]``: the remapped position of each expert.
    """
    _positive_int("num_experts", num_experts)
    _positive_int("num_rows", num_rows)
    cols = -(-num_experts // num_rows)
    grid = np.arange(num_rows * cols, dtype=np.int64).reshape(num_rows, cols)
    read = grid.T.ravel()
    read = read[read < num_experts]
    rpos = np.empty(num_experts, dtype=np.int64)
    rpos[read] = np.arange(num_experts)
    rpos.flags.writeable = False
    return rpos


@dataclass(frozen=True)
class HierarchicalSlices:
    """Where every send core's slice lies in the hop-major remapped unit sequence.

    The sequence lists hop class 0's units, then hop class 1's, ...; inside a class units go by
    (remapped expert, token). ``virtual expert`` ``h*E + rpos[e]`` indexes that sequence's expert
    runs; ``prefix [H*E+1]`` are their prefix counts.

    Attributes:
        quota: ``[n, H]`` units of hop class ``h`` that core ``j`` sends (``v[j, h]``).
        start: ``[n, H]`` global sequence index where that chunk starts.
        start_expert, start_offset: ``[n, H]`` the quaternary-search answer for ``start``:
            virtual expert and offset inside its token run (``H*E, 0`` = end of the sequence).
        search_steps: lockstep rounds the vectorised search took.
        prefix: ``[H*E+1]`` prefix counts of the virtual experts.
    """

    quota: np.ndarray
    start: np.ndarray
    start_expert: np.ndarray
    start_offset: np.ndarray
    search_steps: int
    prefix: np.ndarray


def hop_quotas(units_per_hop: np.ndarray, n: int) -> np.ndarray:
    """``[n, H]`` per-core hop quotas: loads differ by <= 1 and ``v[j,h] <= ceil(V_h/n)``.

    ``V_h = n*q_h + r_h``. Every core takes ``q_h`` units of class ``h``; the ``R = sum r_h``
    leftovers are dealt out cyclically, class after class, continuing where the last class
    stopped: leftover number ``p`` goes to core ``p mod n``. A class has ``r_h < n`` leftovers,
    so no core gets two of one class (hence the hop bound), and the cyclic deal gives each core
    ``floor(R/n)`` or ``ceil(R/n)`` of them, the first ``R mod n = U mod n`` cores the extra one
    (hence loads within one, on the same cores as ``balanced``).
    """
    _positive_int("n", n)
    v = np.asarray(units_per_hop)
    if v.ndim != 1 or (v.size and v.dtype.kind not in "iu") or np.any(v < 0):
        raise InvalidArgumentError("units_per_hop", v, "must be 1-D non-negative integers")
    v = v.astype(np.int64)
    q, r = np.divmod(v, n)
    first = np.cumsum(r) - r  # number of the first leftover of each class
    return q[None, :] + _dealt_to(first, r, n)


def _dealt_to(first: np.ndarray, count: np.ndarray, n: int) -> np.ndarray:
    """``[n, H]`` 1 where core ``j`` receives one of leftovers ``[first_h, first_h + count_h)``."""
    j = np.arange(n, dtype=np.int64)[:, None]
    # Leftover p goes to core p mod n; count < n, so core j gets at most one of each class: the
    # one with p = j (mod n) inside the window, if any.
    offset = (j - first[None, :]) % n
    return (offset < count[None, :]).astype(np.int64)


def hierarchical_slices(units_per_virtual_expert: np.ndarray, num_hops: int, n: int,
                        num_experts: int) -> HierarchicalSlices:
    """Per-core chunks of the hop-major remapped sequence (module docstring, steps 2-3).

    ``units_per_virtual_expert [H*E]`` counts units per (hop class, remapped expert). Core ``j``
    sends, for each class ``h``, the contiguous chunk of ``v[j, h]`` units that starts after the
    chunks of cores ``< j`` (see :func:`hop_quotas`). Each chunk start is a global index; the
    vectorised quaternary search turns it into (virtual expert, offset), what a core on the
    device would compute on its own from the prefix counts.
    """
    _positive_int("num_hops", num_hops)
    _positive_int("num_experts", num_experts)
    counts = np.asarray(units_per_virtual_expert)
    if counts.shape != (num_hops * num_experts,) or (counts.size and counts.dtype.kind not in "iu"):
        raise InvalidArgumentError(
            "units_per_virtual_expert", counts.shape, "must be [num_hops * num_experts] integers"
        )
    counts = counts.astype(np.int64)
    per_hop = counts.reshape(num_hops, num_experts).sum(axis=1)
    quota = hop_quotas(per_hop, n)
    hop_start = np.cumsum(per_hop) - per_hop
    start = hop_start[None, :] + (np.cumsum(quota, axis=0) - quota)
    prefix = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=prefix[1:])
    expert, offset, steps = _search_many(prefix, "prefix", counts.size, start.ravel())
    return HierarchicalSlices(
        quota=quota,
        start=start,
        start_expert=expert.reshape(start.shape),
        start_offset=offset.reshape(start.shape),
        search_steps=steps,
        prefix=prefix,
    )


def hierarchical(
    units: SendUnits, n: int, num_experts: int, topology: Topology
) -> tuple[np.ndarray, np.ndarray]:
    """``(order, core)``: the remapped hop-major sequence cut by hop quota, farthest hop first
    inside each core (module docstring)."""
    num_hops = topology.num_hops
    rpos = remapped_expert_order(num_experts, n)
    virtual = units.hop * num_experts + rpos[units.expert]
    # Stable: inside one virtual expert the canonical order keeps tokens ascending.
    seq = np.argsort(virtual, kind="stable")
    counts = np.bincount(virtual, minlength=num_hops * num_experts)
    slices = hierarchical_slices(counts, num_hops, n, num_experts)
    # A core reads its chunk from (virtual expert, offset), as it would on the device: the
    # chunk's first unit sits at prefix[expert] + offset of the hop-major sequence. Chunk starts
    # in sequence order (hop-major, core-minor) are non-decreasing, so the chunk of position p
    # is the last start <= p (an empty chunk shares its start with the next one).
    chunk_start = (slices.prefix[slices.start_expert] + slices.start_offset).T.ravel()
    chunk = np.searchsorted(chunk_start, np.arange(units.num_units), side="right") - 1
    core = chunk % n
    hop = chunk // n
    key = core * num_hops + hop_issue_rank(topology)[hop]
    issue = np.argsort(key, kind="stable")
    return seq[issue], core[issue]


@lru_cache(maxsize=256)
def hop_issue_rank(topology: Topology) -> np.ndarray:
    """Issue rank of each hop class inside a core: largest latency first (ties: larger hop).

    A core issues its units back to back, each taking ``l`` to issue and completing ``RTT`` after
    that, so the core finishes at ``max_i (S_i + RTT_i)`` with ``S_i`` the issue time up to and
    including unit ``i``. Issuing in order of non-increasing RTT minimises this (Jackson's rule
    for one machine with delivery times); objective (1), ``sum l + max RTT``, is its bound for
    any order.
    """
    lat = np.asarray(topology.latency_ns, dtype=np.float64)
    order = np.lexsort((-np.arange(lat.size), -lat))
    rank = np.empty(lat.size, dtype=np.int64)
    rank[order] = np.arange(lat.size)
    rank.flags.writeable = False
    return rank
