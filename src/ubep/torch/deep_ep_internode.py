"""DeepEP's internode normal mode on ubep: ``internode_dispatch`` / ``internode_combine``.

DeepEP moves a token to another node over RDMA to the rank of the same local index, which
forwards it over NVLink; its handle describes both stages. ubep moves every row straight from
its source rank to its destination rank through the group's engine: the MPI engine (RMA)
between hosts of a ``ubep.mpi`` group, loads and stores inside a host. So internode calls are
the normal-mode calls (``layout="rank"``), with DeepEP's internode handle
(:class:`~ubep.torch.deep_ep_types.InternodeHandle`) built from where the rows went: "RDMA
ranks" are hosts. ``dispatch``/``combine`` take this path by themselves when the group spans
hosts (as DeepEP's do when it has more than one RDMA rank); on one host it is one "RDMA rank".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from .deep_ep_types import EventOverlap, InternodeHandle, NormalHandle, _Layout

if TYPE_CHECKING:
    from .deep_ep_core import FacadeCore

__all__ = ["InternodePath", "hosts_of"]


def hosts_of(group: Any, num_ranks: int) -> np.ndarray:
    """``[num_ranks]`` host index of every rank (a ``ubep.mpi`` group's, possibly virtual,
    hosts; every other group is one host)."""
    host_of = getattr(group, "host_of", None)
    if host_of is None:
        return np.zeros(num_ranks, dtype=np.int64)
    return np.asarray(host_of, dtype=np.int64)


class InternodePath:
    """DeepEP's internode pair, held by a :class:`ubep.torch.deep_ep.Buffer` (its
    ``internode_*`` methods call this one's, handing it their normal-mode call, which moves
    the rows) over the facade's core (:class:`.deep_ep_core.FacadeCore`: the ranks' hosts and
    the exchange of every rank's destinations)."""

    def __init__(self, core: FacadeCore) -> None:
        self.core = core
        self.rank = core.rank
        self.group_size = core.group_size
        self.host_of = core.host_of

    def dispatch(
        self,
        normal_dispatch: Callable[..., Any],
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: InternodeHandle | None,
        num_tokens_per_rank: torch.Tensor | None,
        num_tokens_per_rdma_rank: torch.Tensor | None,
        is_token_in_rank: torch.Tensor | None,
        num_tokens_per_expert: torch.Tensor | None,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        expert_alignment: int,
        async_finish: bool,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, Any,
               EventOverlap]:
        """``internode_dispatch`` (the facade's docstring) through ``normal_dispatch``."""
        if handle is not None:
            if not isinstance(handle, InternodeHandle):
                raise InvalidArgumentError(
                    "handle", type(handle).__name__,
                    "must be the handle an internode dispatch returned")
            out: tuple[Any, ...] = normal_dispatch(
                x, handle.base, topk_idx=topk_idx, topk_weights=topk_weights,
                async_finish=async_finish)
            return out
        recv, recv_idx, recv_w, counts, base, event = normal_dispatch(
            x, None, _Layout(num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert), topk_idx=topk_idx,
            topk_weights=topk_weights, expert_alignment=expert_alignment,
            async_finish=async_finish)
        return recv, recv_idx, recv_w, counts, self._internode_handle(base), event

    @staticmethod
    def combine(
        normal_combine: Callable[..., Any],
        x: torch.Tensor,
        handle: InternodeHandle,
        topk_weights: torch.Tensor | None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
        async_finish: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """``internode_combine`` (the facade's docstring) through ``normal_combine``."""
        if not isinstance(handle, InternodeHandle):
            raise InvalidArgumentError(
                "handle", type(handle).__name__,
                "must be the handle an internode dispatch returned")
        out: tuple[torch.Tensor, torch.Tensor | None, EventOverlap] = normal_combine(
            x, handle.base, topk_weights, bias, async_finish)
        return out

    def _internode_handle(self, base: NormalHandle) -> InternodeHandle:
        """DeepEP's internode handle of a finished rank-layout dispatch (collective: every
        rank's per-token destinations are gathered, for the NVL heads and source metadata)."""
        in_rank = base.is_token_in_rank.numpy()
        to_host = self.core.tokens_per_host(in_rank)
        column = base.rank_prefix_matrix[:, self.rank].numpy().astype(np.int64)
        per_src = np.diff(column, prepend=0)  # rows from each source rank
        from_host = np.bincount(self.host_of, weights=per_src,
                                minlength=self.core.num_hosts)
        # every rank's tokens, as the list of ranks each went to
        dests = self.core.exchange.allgather([np.flatnonzero(row).tolist() for row in in_rank])
        n = base.num_recv_rows
        src_rank = np.repeat(np.arange(self.group_size), per_src)
        src_token = base.recv_src_idx[:n].numpy().astype(np.int64)
        meta, nvl_head = self._landing(dests, base.rank_prefix_matrix.numpy(), src_rank,
                                       src_token)
        return InternodeHandle(
            is_token_in_rank=base.is_token_in_rank,
            rdma_channel_prefix_matrix=_i32(to_host.sum(axis=0)[:, None]),
            gbl_channel_prefix_matrix=_i32(in_rank.sum(axis=0)[:, None]),
            recv_rdma_channel_prefix_matrix=_i32(from_host[:, None]),
            recv_rdma_rank_prefix_sum=_i32(np.cumsum(from_host)),
            recv_gbl_channel_prefix_matrix=_i32((column - per_src)[:, None]),
            recv_gbl_rank_prefix_sum=_i32(column),
            recv_src_meta=torch.from_numpy(meta.view(np.uint8).reshape(n, 8).copy()),
            send_rdma_head=_i32(np.where(to_host, np.cumsum(to_host, axis=0) - 1, -1)),
            send_nvl_head=_i32(nvl_head),
            base=base,
        )

    def _landing(
        self, dests: list[Any], prefix: np.ndarray, src_rank: np.ndarray, src_token: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """For each received row (source rank, source token): ``[n, 2]`` int32 (source host,
        bits of this host's ranks that got the token) and ``[n, P]`` the token's row at each
        rank of this host, -1 where it did not go. ``prefix``: the full rank_prefix_matrix."""
        local = np.flatnonzero(self.host_of == self.host_of[self.rank])
        n = len(src_rank)
        meta = np.zeros((n, 2), dtype=np.int32)
        head = np.full((n, len(local)), -1, dtype=np.int64)
        meta[:, 0] = self.host_of[src_rank]
        for s in np.unique(src_rank):
            went = np.zeros((len(dests[s]), self.group_size), dtype=bool)
            for t, ranks in enumerate(dests[s]):
                went[t, ranks] = True
            rows = np.flatnonzero(src_rank == s)
            for j, p in enumerate(local):
                mask = went[:, p]
                before = np.cumsum(mask) - 1  # the token's index among s's tokens sent to p
                start = int(prefix[s - 1, p]) if s > 0 else 0
                hit = mask[src_token[rows]]
                meta[rows[hit], 1] |= np.int32(1 << j)
                head[rows[hit], j] = start + before[src_token[rows[hit]]]
        return meta, head


def _i32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
