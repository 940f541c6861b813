"""Appendix A: how many of a rank's cores count tokens and how many send them.

Model (paper eqs. 2-4, with the linear F and G it assumes)::

    T_count(n_c) = beta  * N_exp       / n_c       + b_count
    T_token(n_c) = alpha * K_top * B_sz / (n - n_c) + b_token
    n_c* = argmin over integer n_c in [1, n-1] of max(T_count, T_token)

``partition`` solves the min-max exactly by evaluating every integer ``n_c`` (``T_count`` falls
and ``T_token`` rises with ``n_c``, so this is also the integer next to the crossing point) and
also reports the paper's closed-form approximation (8), ``n_c ~ (beta/alpha) * n * N_exp /
(K_top * B_sz)``, which assumes ``n - n_c ~ n`` and zero constant overheads.

The constants are *model parameters*, not measurements: ``alpha`` is the time one send core takes
per (token, k) unit and ``beta`` the time one count core takes per expert (count, publish, prefix
sum). The defaults (100 ns per unit: a 7 KB token at ~70 GB/s per core; 50 ns per expert: one
pipelined remote count store) are illustrative orders of magnitude for a CM384-class die, chosen
so that the model gives a handful of count cores at EP256 / 128 tokens / top-8 and one at EP16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError

__all__ = [
    "DEFAULT_ALPHA_NS",
    "DEFAULT_BETA_NS",
    "CorePartition",
    "PartitionSweep",
    "partition",
    "partition_sweep",
]

DEFAULT_ALPHA_NS = 100.0
DEFAULT_BETA_NS = 50.0


@dataclass(frozen=True)
class CorePartition:
    """Optimal split of ``num_count_cores + num_send_cores`` cores and the model's times.

    ``approx_num_count_cores`` is the paper's approximation (8) (a real number, not clamped).
    """

    num_count_cores: int
    num_send_cores: int
    t_count_ns: float
    t_token_ns: float
    approx_num_count_cores: float

    @property
    def t_dispatch_ns(self) -> float:
        """The slower group: what the min-max minimises."""
        return max(self.t_count_ns, self.t_token_ns)


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(name, value, f"must be an integer >= {minimum}")
    return int(value)


def _nonneg(name: str, value: object, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise InvalidArgumentError(name, value, "must be a number")
    v = float(value)
    if not np.isfinite(v) or v < 0 or (strict and v == 0):
        bound = "> 0" if strict else ">= 0"
        raise InvalidArgumentError(name, value, f"must be finite and {bound}")
    return v


def partition(
    num_cores: int,
    num_experts: int,
    num_topk: int,
    batch_size: int,
    *,
    alpha: float = DEFAULT_ALPHA_NS,
    beta: float = DEFAULT_BETA_NS,
    b_count: float = 0.0,
    b_token: float = 0.0,
) -> CorePartition:
    """Exact integer solution of min over ``n_c`` of ``max(T_count, T_token)`` (see module doc).

    Ties go to the smaller ``n_c`` (more send cores).
    """
    n = _positive_int("num_cores", num_cores, 2)
    n_exp = _positive_int("num_experts", num_experts)
    k_top = _positive_int("num_topk", num_topk)
    b_sz = _positive_int("batch_size", batch_size)
    a = _nonneg("alpha", alpha, strict=True)
    b = _nonneg("beta", beta, strict=True)
    bc = _nonneg("b_count", b_count)
    bt = _nonneg("b_token", b_token)
    n_c = np.arange(1, n, dtype=np.float64)
    t_count = b * n_exp / n_c + bc
    t_token = a * k_top * b_sz / (n - n_c) + bt
    best = int(np.argmin(np.maximum(t_count, t_token)))  # first minimum = smallest n_c
    return CorePartition(
        num_count_cores=best + 1,
        num_send_cores=n - best - 1,
        t_count_ns=float(t_count[best]),
        t_token_ns=float(t_token[best]),
        approx_num_count_cores=(b / a) * n * n_exp / (k_top * b_sz),
    )


@dataclass(frozen=True)
class PartitionSweep:
    """Appendix C.3-style sweep: optimal count-core group size vs ranks and batch size.

    Arrays are ``[len(num_ranks), len(batch_sizes)]``.
    """

    num_cores: int
    num_ranks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    num_experts: np.ndarray
    num_count_cores: np.ndarray
    approx_num_count_cores: np.ndarray
    t_dispatch_ns: np.ndarray

    def rows(self) -> list[tuple[int, int, int, int, float, float]]:
        """``(num_ranks, batch_size, num_experts, num_count_cores, approx, t_dispatch_ns)``."""
        out = []
        for i, r in enumerate(self.num_ranks):
            for j, bsz in enumerate(self.batch_sizes):
                out.append((r, bsz, int(self.num_experts[i]), int(self.num_count_cores[i, j]),
                            float(self.approx_num_count_cores[i, j]),
                            float(self.t_dispatch_ns[i, j])))
        return out


def partition_sweep(
    num_cores: int,
    num_ranks: Sequence[int],
    batch_sizes: Sequence[int],
    *,
    experts_per_rank: int = 1,
    num_topk: int = 8,
    alpha: float = DEFAULT_ALPHA_NS,
    beta: float = DEFAULT_BETA_NS,
    b_count: float = 0.0,
    b_token: float = 0.0,
) -> PartitionSweep:
    """:func:`partition` per (ranks, batch size); ``num_experts = ranks * experts_per_rank``."""
    if not len(num_ranks):
        raise InvalidArgumentError("num_ranks", num_ranks, "needs at least one entry")
    if not len(batch_sizes):
        raise InvalidArgumentError("batch_sizes", batch_sizes, "needs at least one entry")
    per_rank = _positive_int("experts_per_rank", experts_per_rank)
    ranks = tuple(_positive_int("num_ranks", r) for r in num_ranks)
    batches = tuple(_positive_int("batch_sizes", b) for b in batch_sizes)
    shape = (len(ranks), len(batches))
    count = np.zeros(shape, dtype=np.int64)
    approx = np.zeros(shape)
    t = np.zeros(shape)
    for i, r in enumerate(ranks):
        for j, bsz in enumerate(batches):
            p = partition(num_cores, r * per_rank, num_topk, bsz, alpha=alpha, beta=beta,
                          b_count=b_count, b_token=b_token)
            count[i, j], approx[i, j], t[i, j] = (
                p.num_count_cores, p.approx_num_count_cores, p.t_dispatch_ns
            )
    return PartitionSweep(
        num_cores=int(num_cores),
        num_ranks=ranks,
        batch_sizes=batches,
        num_experts=np.asarray(ranks, dtype=np.int64) * per_rank,
        num_count_cores=count,
        approx_num_count_cores=approx,
        t_dispatch_ns=t,
    )
