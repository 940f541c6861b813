"""The dispatch/combine a user writes today on top of an all-to-all: the peers' side of the race.

Runs inside the peer virtual environments (numpy plus mpi4py or torch; no ubep), so it imports
numpy only. Everything that moves bytes goes through an :class:`Exchange` (MPI ``Alltoall`` /
``Alltoallv``, or torch.distributed ``all_to_all_single``); everything else is plain numpy, written
the way a careful user would: buffers allocated once at their worst-case size and pre-faulted
(a fresh ``np.empty`` per call would page-fault at ~1.7 GB/s on this host and make the peers look
worse than they are), one ``np.take`` per pack, one exchange per tensor.

The results are those of ``ubep.reference`` bit for bit (tests/benchmarks/test_peers.py checks it):

* ``layout="expert"``: one row per valid ``(token, k)``. Sender: counts per expert (one
  ``Alltoall`` of ``[num_ranks, num_local_experts]``), pack rows in (expert, token) order, payload
  ``Alltoallv`` and a metadata ``Alltoallv`` (token, k, weight per row). The receiver gets
  (source, expert, token) blocks and reorders them to (expert, source, token), the order ubep
  hands to a grouped GEMM. Combine: undo the reorder, reverse ``Alltoallv``, then
  ``y[t] = sum_k w[t,k] * out(t,k)`` in float32, ascending ``k``, product rounded before the add.
* ``layout="rank"``: one row per (token, destination rank). Counts ``Alltoall`` of one int per
  rank, pack, payload and metadata (token, local expert ids, weights) ``Alltoallv``; rows arrive
  in (source rank, token) order, already the reference order. Combine: reverse ``Alltoallv`` and
  ``y[t] = sum over destination ranks ascending of the returned row``, float32.

Payloads are numpy storage arrays as in ``ubep.dtypes``: BF16 as ``uint16`` bit patterns, 1-byte
types as ``uint8``/``int8``, FP8 rows as ``uint8`` rows of values then scales (``x_width`` bytes,
wider than combine's ``hidden``); combine works on BF16, FP16 or FP32 expert outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = [
    "Exchange",
    "ExpertLayoutPeer",
    "PeerDispatch",
    "RankLayoutPeer",
    "decode_fields",
    "from_float32",
    "make_peer",
    "to_float32",
]


class Exchange(Protocol):
    """The collective calls a peer offers (implemented over MPI or torch.distributed)."""

    rank: int
    num_ranks: int

    def alltoall_counts(self, send: np.ndarray) -> np.ndarray:
        """``send [num_ranks, c]`` int64, row ``r`` to rank ``r``; returns the rows received."""
        ...

    def alltoallv_rows(
        self, send: np.ndarray, send_counts: np.ndarray, recv: np.ndarray, recv_counts: np.ndarray
    ) -> None:
        """Rows of a C-contiguous 2-D ``send`` go to each rank in blocks of ``send_counts[r]``
        rows; ``recv`` (preallocated, same row width) receives ``recv_counts[r]`` rows from
        each rank ``r`` in rank order."""
        ...

    def barrier(self) -> None: ...

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        """Element-wise maximum of a float64 array over all ranks (result on every rank)."""
        ...


# --- payload types (ubep.dtypes semantics, re-implemented: the peer venvs have no ubep) ------


def to_float32(arr: np.ndarray) -> np.ndarray:
    """Exact float32 values of a BF16 (``uint16``), FP16 or FP32 storage array."""
    if arr.dtype == np.uint16:
        return (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if arr.dtype in (np.float16, np.float32):
        return arr.astype(np.float32)
    raise TypeError(f"combine needs bf16 (uint16), float16 or float32 data, got {arr.dtype}")


def from_float32(arr: np.ndarray, storage: np.dtype) -> np.ndarray:
    """Round float32 to ``storage`` (BF16 bits as ``uint16``), nearest even; NaN stays NaN."""
    if storage != np.uint16:
        return arr.astype(storage)
    bits = np.ascontiguousarray(arr).view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    out = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(arr)
    if nan.any():  # rounding a NaN could carry into the exponent/sign: keep it a quiet NaN
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


# --- result --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PeerDispatch:
    """One rank's dispatch output; field names as ``ubep.reference.RefDispatchResult``.

    ``recv_topk_idx``/``recv_topk_weights`` follow the reference per layout (expert: ``[rows]``
    global expert ids; rank: ``[rows, num_topk]`` local ids, -1 elsewhere). Arrays are views into
    the peer's reusable buffers: valid until its next dispatch.
    """

    recv_x: np.ndarray
    recv_meta: np.ndarray  # int32 rows as received (already in recv_x's row order)
    num_recv_tokens_per_expert: np.ndarray
    num_recv_rows_per_rank: np.ndarray
    num_sent_rows: int
    recv_per_src_expert: np.ndarray | None = None  # expert layout: [src rank, local expert]

    @property
    def num_recv_rows(self) -> int:
        return int(self.recv_x.shape[0])


def _exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _prefault(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    # np.zeros may hand back untouched calloc pages; writing makes the first timed call fair.
    buf = np.empty(shape, dtype=dtype)
    buf.fill(0)
    return buf


def set_shape(peer: Any, ex: Exchange, num_experts: int, num_topk: int, hidden: int) -> None:
    """The shape attributes every peer (numpy or torch local work) keeps."""
    if num_experts % ex.num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a multiple of {ex.num_ranks}")
    peer.ex = ex
    peer.num_ranks = ex.num_ranks
    peer.num_experts = num_experts
    peer.local = num_experts // ex.num_ranks
    peer.num_topk = num_topk
    peer.hidden = hidden


class _PeerBase:
    """Buffers and shape bookkeeping shared by both layouts."""

    def __init__(
        self,
        ex: Exchange,
        *,
        num_experts: int,
        num_topk: int,
        max_tokens: int,
        hidden: int,
        x_dtype: np.dtype,
        out_dtype: np.dtype,
        x_width: int | None = None,
    ) -> None:
        set_shape(self, ex, num_experts, num_topk, hidden)
        self.x_dtype = np.dtype(x_dtype)
        self.out_dtype = np.dtype(out_dtype)
        # Dispatch rows may be wider than combine's (FP8: values + scales per row).
        x_width = hidden if x_width is None else x_width
        meta_width, max_send, max_recv = self._capacity(ex.num_ranks, max_tokens, num_topk)
        self._send_x = _prefault((max_send, x_width), self.x_dtype)
        self._recv_x = _prefault((max_recv, x_width), self.x_dtype)
        self._send_meta = _prefault((max_send, meta_width), np.int32)
        self._recv_meta = _prefault((max_recv, meta_width), np.int32)
        self._back_send = _prefault((max_recv, hidden), self.out_dtype)
        self._back_recv = _prefault((max_send, hidden), self.out_dtype)
        # The last dispatch's payload exchange and the last combine's send-back arguments
        # (for payload_exchange() and combine_exchange()).
        self._payload: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._back: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    @staticmethod
    def _capacity(num_ranks: int, max_tokens: int, num_topk: int) -> tuple[int, int, int]:
        """(metadata int32 per row, worst-case rows sent, worst-case rows received)."""
        raise NotImplementedError

    def payload_exchange(self) -> None:
        """Repeat only the last dispatch's payload exchange (diagnostic: the transport's share
        of dispatch, without counts, pack, metadata or reorder)."""
        if self._payload is None:
            raise RuntimeError("payload_exchange() needs a dispatch first")
        self.ex.alltoallv_rows(*self._payload)

    def combine_exchange(self) -> None:
        """Repeat only the last combine's send-back exchange (diagnostic, as payload_exchange)."""
        if self._back is None:
            raise RuntimeError("combine_exchange() needs a combine first")
        self.ex.alltoallv_rows(*self._back)

    @staticmethod
    def prepare(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        """The caller's arrays as this peer takes them (numpy: as they are)."""
        return arrays


class ExpertLayoutPeer(_PeerBase):
    """``layout="expert"`` over an :class:`Exchange` (module docstring)."""

    def __init__(self, ex: Exchange, **kw: Any) -> None:
        super().__init__(ex, **kw)
        # Alltoallv lands rows per source; the reorder to expert-major needs a second buffer.
        self._recv_stage = np.empty_like(self._recv_x)
        self._recv_stage.fill(0)

    @staticmethod
    def _capacity(num_ranks: int, max_tokens: int, num_topk: int) -> tuple[int, int, int]:
        # token, k, weight bits per row; one row per (token, k) pair
        return 3, max_tokens * num_topk, num_ranks * max_tokens * num_topk

    def dispatch(
        self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray
    ) -> PeerDispatch:
        # Layout: every valid (token, k) in (expert, token) order; experts are contiguous per
        # rank, so this is also (destination rank, expert, token).
        tok, kk = np.nonzero(topk_idx >= 0)
        expert = topk_idx[tok, kk]
        order = np.argsort(expert, kind="stable")
        tok, kk = tok[order], kk[order]
        per_expert = np.bincount(expert, minlength=self.num_experts).reshape(self.num_ranks, -1)
        send_counts = per_expert.sum(axis=1)
        recv_per_expert = self.ex.alltoall_counts(per_expert)  # [src, local expert]
        recv_counts = recv_per_expert.sum(axis=1)
        n_send, n_recv = len(tok), int(recv_counts.sum())

        send_x = self._send_x[:n_send]
        # mode="clip": indices are in range by construction, and the default "raise" mode
        # stages ``out`` through a temporary (3x slower here).
        np.take(x, tok, axis=0, out=send_x, mode="clip")
        meta = self._send_meta[:n_send]
        meta[:, 0] = tok
        meta[:, 1] = kk
        meta[:, 2] = topk_weights[tok, kk].view(np.int32)
        stage = self._recv_stage[:n_recv]
        stage_meta = self._recv_meta[:n_recv]
        self.ex.alltoallv_rows(send_x, send_counts, stage, recv_counts)
        self.ex.alltoallv_rows(meta, send_counts, stage_meta, recv_counts)
        self._payload = (send_x, send_counts, stage, recv_counts)

        # Receiver: (source, expert, token) blocks -> (expert, source, token).
        perm = _block_transpose(recv_per_expert)
        recv_x = self._recv_x[:n_recv]
        np.take(stage, perm, axis=0, out=recv_x, mode="clip")
        self._tok, self._send_counts, self._recv_counts = tok, send_counts, recv_counts
        self._perm = perm
        # Where each (token, k) row sits in the send order: combine's gather index.
        pos = np.full(topk_idx.shape, -1, dtype=np.int64)
        pos[tok, kk] = np.arange(n_send)
        self._pos, self._topk_weights = pos, topk_weights
        return PeerDispatch(
            recv_x=recv_x,
            recv_meta=stage_meta[perm],
            num_recv_tokens_per_expert=recv_per_expert.sum(axis=0),
            num_recv_rows_per_rank=recv_counts,
            num_sent_rows=n_send,
            recv_per_src_expert=recv_per_expert,
        )

    def combine(self, expert_out: np.ndarray) -> np.ndarray:
        """Reduce the expert outputs of the last dispatch's rows back onto this rank's tokens."""
        n_recv, n_send = len(self._perm), len(self._tok)
        back_send = self._back_send[:n_recv]
        back_send[self._perm] = expert_out  # undo the receive reorder: rows per source again
        back = self._back_recv[:n_send]
        self._back = (back_send, self._recv_counts, back, self._send_counts)
        self.ex.alltoallv_rows(*self._back)

        pos: np.ndarray = self._pos
        acc = np.zeros((pos.shape[0], self.hidden), dtype=np.float32)
        for k in range(pos.shape[1]):
            valid = pos[:, k] >= 0
            if valid.all():
                term = to_float32(back[pos[:, k]])
                term *= self._topk_weights[:, k, None]
                acc += term
            elif valid.any():
                rows = np.nonzero(valid)[0]
                term = to_float32(back[pos[rows, k]])
                term *= self._topk_weights[rows, k, None]
                acc[rows] += term
        return from_float32(acc, self.out_dtype)


class RankLayoutPeer(_PeerBase):
    """``layout="rank"`` over an :class:`Exchange` (module docstring)."""

    def __init__(self, ex: Exchange, **kw: Any) -> None:
        super().__init__(ex, **kw)
        self._token_meta = np.zeros((kw["max_tokens"], 1 + 2 * self.num_topk), dtype=np.int32)

    @staticmethod
    def _capacity(num_ranks: int, max_tokens: int, num_topk: int) -> tuple[int, int, int]:
        # token, local expert ids, weight bits per row; one row per (token, destination rank)
        return 1 + 2 * num_topk, max_tokens * num_ranks, num_ranks * max_tokens

    def dispatch(
        self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray
    ) -> PeerDispatch:
        num_tokens, k = topk_idx.shape
        owner = np.where(topk_idx >= 0, topk_idx // self.local, -1)
        in_rank = np.zeros((num_tokens, self.num_ranks + 1), dtype=bool)  # last column: masked
        in_rank[np.arange(num_tokens)[:, None], owner] = True
        dst, tok = np.nonzero(in_rank[:, : self.num_ranks].T)  # (destination, token) order
        send_counts = np.bincount(dst, minlength=self.num_ranks)
        recv_counts = self.ex.alltoall_counts(send_counts[:, None])[:, 0]
        n_send, n_recv = len(tok), int(recv_counts.sum())

        send_x = self._send_x[:n_send]
        np.take(x, tok, axis=0, out=send_x, mode="clip")
        # Metadata: one row per token (id, global expert ids, weight bits), gathered like x;
        # the receiver keeps only its own experts.
        table = self._token_meta[:num_tokens]
        table[:, 0] = np.arange(num_tokens)
        table[:, 1 : 1 + k] = topk_idx
        table[:, 1 + k :] = topk_weights.view(np.int32)
        meta = self._send_meta[:n_send]
        np.take(table, tok, axis=0, out=meta, mode="clip")
        recv_x = self._recv_x[:n_recv]
        recv_meta = self._recv_meta[:n_recv]
        self.ex.alltoallv_rows(send_x, send_counts, recv_x, recv_counts)
        self.ex.alltoallv_rows(meta, send_counts, recv_meta, recv_counts)
        self._payload = (send_x, send_counts, recv_x, recv_counts)

        local_ids = recv_meta[:, 1 : 1 + k]
        local_ids -= self.ex.rank * self.local
        elsewhere = (local_ids < 0) | (local_ids >= self.local)  # masked slots included
        local_ids[elsewhere] = -1
        recv_meta[:, 1 + k :][elsewhere] = 0  # +0.0f weight where the expert lives elsewhere
        per_expert = np.bincount(local_ids[~elsewhere], minlength=self.local)
        self._tok, self._dst_start = tok, _exclusive_cumsum(send_counts)
        self._send_counts, self._recv_counts = send_counts, recv_counts
        self._num_tokens = num_tokens
        return PeerDispatch(
            recv_x=recv_x,
            recv_meta=recv_meta,
            num_recv_tokens_per_expert=per_expert,
            num_recv_rows_per_rank=recv_counts,
            num_sent_rows=n_send,
        )

    def combine(self, expert_out: np.ndarray) -> np.ndarray:
        """Sum the rows sent back by each destination rank, ascending, onto this rank's tokens."""
        n_send = len(self._tok)
        back = self._back_recv[:n_send]
        self._back = (np.ascontiguousarray(expert_out), self._recv_counts, back, self._send_counts)
        self.ex.alltoallv_rows(*self._back)
        acc = np.zeros((self._num_tokens, self.hidden), dtype=np.float32)
        for d in range(self.num_ranks):
            lo, hi = self._dst_start[d], self._dst_start[d + 1]
            if hi > lo:
                tok = self._tok[lo:hi]  # distinct tokens: fancy-index += is a plain add
                acc[tok] += to_float32(back[lo:hi])
        return from_float32(acc, self.out_dtype)


def _block_transpose(counts: np.ndarray) -> np.ndarray:
    """Row permutation from (source, expert) blocks to (expert, source) blocks.

    ``counts[s, e]`` rows of block (s, e) lie in source-major order; the result lists, for the
    expert-major order, each row's index in the source-major one.
    """
    src_major_start = _exclusive_cumsum(counts.ravel())[:-1].reshape(counts.shape)
    cnt_t = counts.T.ravel()
    start_t = src_major_start.T.ravel()
    out_start = _exclusive_cumsum(cnt_t)
    total = int(out_start[-1])
    return np.repeat(start_t - out_start[:-1], cnt_t) + np.arange(total, dtype=np.int64)


def decode_fields(d: PeerDispatch, layout: str, rank: int, num_topk: int) -> dict[str, np.ndarray]:
    """The received metadata spelled as ``ubep.reference.RefDispatchResult`` fields.

    Not part of the timed path: a user reads these straight from ``recv_meta`` and the counts.
    """
    num_ranks = len(d.num_recv_rows_per_rank)
    meta = d.recv_meta
    if layout == "expert":
        counts = d.recv_per_src_expert
        if counts is None:
            raise ValueError("an expert-layout dispatch carries recv_per_src_expert")
        local = counts.shape[1]
        per_block = counts.T.ravel()  # (expert, source) blocks in receive order
        src = np.repeat(np.tile(np.arange(num_ranks), local), per_block)
        expert = np.repeat(rank * local + np.repeat(np.arange(local), num_ranks), per_block)
        return {
            "recv_src_rank": src.astype(np.int64),
            "recv_src_token": meta[:, 0].astype(np.int64),
            "recv_src_k": meta[:, 1].astype(np.int64),
            "recv_topk_idx": expert.astype(np.int64),
            "recv_topk_weights": np.ascontiguousarray(meta[:, 2]).view(np.float32),
        }
    idx = meta[:, 1 : 1 + num_topk].astype(np.int64)
    return {
        "recv_src_rank": np.repeat(np.arange(num_ranks), d.num_recv_rows_per_rank).astype(np.int64),
        "recv_src_token": meta[:, 0].astype(np.int64),
        "recv_src_k": np.argmax(idx >= 0, axis=1).astype(np.int64),
        "recv_topk_idx": idx,
        "recv_topk_weights": np.ascontiguousarray(meta[:, 1 + num_topk :]).view(np.float32),
    }


def make_peer(
    layout: str,
    ex: Exchange,
    *,
    num_experts: int,
    num_topk: int,
    max_tokens: int,
    hidden: int,
    x_dtype: np.dtype,
    out_dtype: np.dtype,
    x_width: int | None = None,
) -> ExpertLayoutPeer | RankLayoutPeer:
    """The peer implementation of ``layout`` (``"expert"`` or ``"rank"``); dispatch rows are
    ``x_width`` elements of ``x_dtype`` (default ``hidden``), combine rows ``hidden``."""
    if layout not in ("expert", "rank"):
        raise ValueError(f"layout={layout!r}: must be 'expert' or 'rank'")
    kw = {
        "num_experts": num_experts, "num_topk": num_topk, "max_tokens": max_tokens,
        "hidden": hidden, "x_dtype": x_dtype, "out_dtype": out_dtype, "x_width": x_width,
    }
    return ExpertLayoutPeer(ex, **kw) if layout == "expert" else RankLayoutPeer(ex, **kw)
