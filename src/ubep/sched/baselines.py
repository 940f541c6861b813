"""The baseline schedulers of the send cores: the units of one rank, cut without regard to hop
distance.

* ``expert_contiguous`` (the CANN-EP baseline): send core ``j`` owns the experts
  ``[floor(j*E/n), floor((j+1)*E/n))`` and sends every unit of its experts, in
  ``(expert, token)`` order. Loads follow the routing: hot experts pile onto few cores.
* ``balanced`` (UBEP without mapping): the units in ``(expert, token)`` order are cut into ``n``
  contiguous slices; the first ``U mod n`` cores get ``ceil(U/n)`` units, the rest
  ``floor(U/n)``. Topology-agnostic; issue order stays ``(expert, token)``.

In the rank layout the "expert" of a unit is its ``send_expert`` (the token's lowest-k expert on
that rank), so expert ownership and ``(expert, token)`` order are defined the same way.
"""

from __future__ import annotations

import numpy as np

from .units import SendUnits

__all__ = ["balanced", "equal_bounds", "expert_contiguous", "expert_token_order"]


def expert_contiguous(
    units: SendUnits, n: int, num_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """CANN-EP: send core ``j`` owns a contiguous block of experts; ``(order, core)``."""
    order = expert_token_order(units)
    starts = (np.arange(n, dtype=np.int64) * num_experts) // n
    owner = np.searchsorted(starts, np.arange(num_experts), side="right") - 1
    return order, owner[units.expert[order]]


def balanced(units: SendUnits, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Equal contiguous slices of the ``(expert, token)`` sequence; ``(order, core)``."""
    order = expert_token_order(units)
    bounds = equal_bounds(units.num_units, n)
    core = np.searchsorted(bounds[1:], np.arange(units.num_units), side="right")
    return order, core


def expert_token_order(units: SendUnits) -> np.ndarray:
    """Permutation into ``(send_expert, token)`` order (canonical order already is, for layout
    ``expert``; the rank layout is ``(dst_rank, token)`` and needs a stable sort)."""
    if units.num_units < 2 or np.all(units.expert[1:] >= units.expert[:-1]):
        return np.arange(units.num_units)
    return np.argsort(units.expert, kind="stable")


def equal_bounds(total: int, n: int) -> np.ndarray:
    """``[n+1]`` slice bounds: the first ``total mod n`` slices get one unit more."""
    j = np.arange(n + 1, dtype=np.int64)
    q, r = divmod(total, n)
    return j * q + np.minimum(j, r)
