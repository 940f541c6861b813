"""The peers' local work in torch ops: what an MoE user writes around an all-to-all.

The same dispatch/combine as benchmarks/peers/kernels.py (same exchanges, same row orders, same
results: ``ubep.reference`` bit for bit, tests/benchmarks/test_peers.py), with pack, reorder and
reduce done the way a torch MoE layer does them: ``index_select`` to pack, reorder and undo the
reorder, and the weighted reduce as the rows widened to float32
(``copy_``) times their weights (``mul_``, product rounded to float32), one ``index_add_`` into a
float32 accumulator, then one cast to the output type. The numpy kernels stay as the extra rows
``<peer>-numpy``; these are ``<peer>-torch``.

Bit-exactness with the reference rests on the order of the adds: on the CPU ``index_add_`` adds
the source rows one after the other in index order, so the rows are fed to it in the order the
reference adds them (expert layout: ascending ``k`` per token; rank layout: ascending
destination rank, which is already the send order). Nothing here depends on the thread count:
the element-wise ops round each element alone and ``index_add_`` is sequential over rows.

Buffers are numpy storage arrays (BF16 as ``uint16`` bits, as kernels.py) shared with torch
views, so the exchange (numpy buffers for mpi4py, ``torch.from_numpy`` for gloo) and the torch
ops see the same memory with no copy; all are allocated once at their worst-case size and
pre-faulted. Imported only where torch is importable (driver.py checks).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from benchmarks.peers.kernels import Exchange, PeerDispatch, _prefault, set_shape

__all__ = [
    "TorchExpertLayoutPeer",
    "TorchFp8Quantiser",
    "TorchQuantisingPeer",
    "TorchRankLayoutPeer",
    "as_torch",
    "make_torch_peer",
    "make_torch_quantising_peer",
]


def as_torch(arr: np.ndarray) -> torch.Tensor:
    """A torch view (no copy) of a numpy storage array; BF16 ``uint16`` bits become bfloat16."""
    if arr.dtype == np.uint16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """The numpy storage view (no copy) of a tensor made by :func:`as_torch`."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class _Buf:
    """A pre-faulted numpy buffer and its torch view (the same memory)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype | type) -> None:
        self.np = _prefault(shape, dtype)
        self.t = as_torch(self.np)


class _TorchPeerBase:
    """Buffers and bookkeeping shared by both layouts (as kernels._PeerBase)."""

    META_WIDTH = 0

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
        x_width = hidden if x_width is None else x_width  # FP8 rows: values + scales
        max_send, max_recv = self._capacity(ex.num_ranks, max_tokens, num_topk)
        self._send_x = _Buf((max_send, x_width), np.dtype(x_dtype))
        self._recv_x = _Buf((max_recv, x_width), np.dtype(x_dtype))
        self._send_meta = _Buf((max_send, self.META_WIDTH), np.int32)
        self._recv_meta = _Buf((max_recv, self.META_WIDTH), np.int32)
        self._back_send = _Buf((max_recv, hidden), np.dtype(out_dtype))
        self._back_recv = _Buf((max_send, hidden), np.dtype(out_dtype))
        self._gathered = _Buf((max_send, hidden), np.dtype(out_dtype))  # rows in add order
        self._terms = _Buf((max_send, hidden), np.float32)  # weighted rows, float32
        self._acc = _Buf((max_tokens, hidden), np.float32)
        self._out = _Buf((max_tokens, hidden), np.dtype(out_dtype))
        self._payload: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._back: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    @staticmethod
    def _capacity(num_ranks: int, max_tokens: int, num_topk: int) -> tuple[int, int]:
        """(worst-case rows sent, worst-case rows received)."""
        raise NotImplementedError

    @staticmethod
    def prepare(*arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The caller's tensors as a torch user holds them (views, outside the timed region)."""
        return tuple(as_torch(np.ascontiguousarray(a)) for a in arrays)

    def payload_exchange(self) -> None:
        """Repeat only the last dispatch's payload exchange (the transport's share)."""
        if self._payload is None:
            raise RuntimeError("payload_exchange() needs a dispatch first")
        self.ex.alltoallv_rows(*self._payload)

    def combine_exchange(self) -> None:
        """Repeat only the last combine's send-back exchange (the transport's share)."""
        if self._back is None:
            raise RuntimeError("combine_exchange() needs a combine first")
        self.ex.alltoallv_rows(*self._back)

    def _reduce(self, index: torch.Tensor, num_tokens: int) -> np.ndarray:
        """``index_add_`` the float32 terms (already in add order) onto the tokens, one cast."""
        acc = self._acc.t[:num_tokens]
        acc.zero_()
        acc.index_add_(0, index, self._terms.t[: len(index)])
        out = self._out.t[:num_tokens]
        out.copy_(acc)  # the one rounding to the output type (nearest even)
        return self._out.np[:num_tokens]


class TorchExpertLayoutPeer(_TorchPeerBase):
    """``layout="expert"``: one row per valid (token, k), received in (expert, source) order."""

    META_WIDTH = 3  # token, k, weight bits per row

    def __init__(self, ex: Exchange, **kw: Any) -> None:
        super().__init__(ex, **kw)
        self._recv_stage = _Buf(self._recv_x.np.shape, self._recv_x.np.dtype)
        self._stage_meta = _Buf(self._recv_meta.np.shape, np.int32)

    @staticmethod
    def _capacity(num_ranks: int, max_tokens: int, num_topk: int) -> tuple[int, int]:
        return max_tokens * num_topk, num_ranks * max_tokens * num_topk

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> PeerDispatch:
        num_tokens, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        sel = torch.nonzero(flat >= 0).squeeze(1)  # valid (token, k), token-major
        expert, order = torch.sort(flat.index_select(0, sel), stable=True)
        sel = sel.index_select(0, order)  # (expert, token) order = (dst rank, expert, token)
        tok = torch.div(sel, k, rounding_mode="floor")
        kk = sel - tok * k
        per_expert = torch.bincount(expert, minlength=self.num_experts).view(self.num_ranks, -1)
        send_counts = per_expert.sum(dim=1).numpy()
        recv_per_expert = self.ex.alltoall_counts(per_expert.numpy())  # [src, local expert]
        recv_counts = recv_per_expert.sum(axis=1)
        n_send, n_recv = len(sel), int(recv_counts.sum())

        torch.index_select(x, 0, tok, out=self._send_x.t[:n_send])
        weights = topk_weights.reshape(-1).index_select(0, sel)
        meta = self._send_meta.t[:n_send]
        meta[:, 0] = tok
        meta[:, 1] = kk
        meta[:, 2] = weights.view(torch.int32)
        send_x, stage = self._send_x.np[:n_send], self._recv_stage.np[:n_recv]
        self.ex.alltoallv_rows(send_x, send_counts, stage, recv_counts)
        self.ex.alltoallv_rows(
            self._send_meta.np[:n_send], send_counts, self._stage_meta.np[:n_recv], recv_counts
        )
        self._payload = (send_x, send_counts, stage, recv_counts)

        # Receiver: (source, expert, token) blocks -> (expert, source, token).
        perm = _block_transpose(torch.from_numpy(recv_per_expert))
        torch.index_select(self._recv_stage.t[:n_recv], 0, perm, out=self._recv_x.t[:n_recv])
        torch.index_select(self._stage_meta.t[:n_recv], 0, perm, out=self._recv_meta.t[:n_recv])
        # Combine's add order: each token's rows by ascending k (the reference's order).
        k_major = torch.argsort(kk * num_tokens + tok)
        self._perm, self._k_major = perm, k_major
        self._unperm = torch.empty_like(perm)
        self._unperm[perm] = torch.arange(n_recv)
        self._tok_k = tok.index_select(0, k_major)
        self._w_k = weights.index_select(0, k_major).unsqueeze(1)
        self._counts = (send_counts, recv_counts)
        self._num_tokens = num_tokens
        return PeerDispatch(
            recv_x=self._recv_x.np[:n_recv],
            recv_meta=self._recv_meta.np[:n_recv],
            num_recv_tokens_per_expert=recv_per_expert.sum(axis=0),
            num_recv_rows_per_rank=recv_counts,
            num_sent_rows=n_send,
            recv_per_src_expert=recv_per_expert,
        )

    def combine(self, expert_out: torch.Tensor) -> np.ndarray:
        """Reduce the expert outputs of the last dispatch's rows back onto this rank's tokens.

        Returns a view into a reusable buffer: valid until the next combine.
        """
        send_counts, recv_counts = self._counts
        n_recv, n_send = len(self._perm), len(self._k_major)
        # Undo the receive reorder (rows per source again) as a gather by the inverse
        # permutation: index_copy_ (the scatter) measured 8x slower here (~750 vs ~90 us).
        torch.index_select(expert_out, 0, self._unperm, out=self._back_send.t[:n_recv])
        back = self._back_recv.np[:n_send]
        self._back = (self._back_send.np[:n_recv], recv_counts, back, send_counts)
        self.ex.alltoallv_rows(*self._back)
        # The send-back rows in add order, widened to float32, times their weights (product
        # rounded to float32). copy_ + mul_ rather than one mixed-type torch.mul(out=): the
        # mixed-type kernel measured 2x slower here (~400 vs ~200 us at 1024 x 2048).
        rows = self._gathered.t[:n_send]
        torch.index_select(self._back_recv.t[:n_send], 0, self._k_major, out=rows)
        terms = self._terms.t[:n_send]
        terms.copy_(rows)
        terms.mul_(self._w_k)
        return self._reduce(self._tok_k, self._num_tokens)


class TorchRankLayoutPeer(_TorchPeerBase):
    """``layout="rank"``: one row per (token, destination rank), in (source, token) order."""

    def __init__(self, ex: Exchange, **kw: Any) -> None:
        self.META_WIDTH = 1 + 2 * kw["num_topk"]  # token, global expert ids, weight bits
        super().__init__(ex, **kw)
        max_tokens = kw["max_tokens"]
        self._in_rank = torch.zeros((max_tokens, self.num_ranks + 1), dtype=torch.bool)
        self._table = torch.zeros((max_tokens, self.META_WIDTH), dtype=torch.int32)
        self._table[:, 0] = torch.arange(max_tokens, dtype=torch.int32)

    @staticmethod
    def _capacity(num_ranks: int, max_tokens: int, num_topk: int) -> tuple[int, int]:
        return max_tokens * num_ranks, num_ranks * max_tokens

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> PeerDispatch:
        num_tokens, k = topk_idx.shape
        # Destination rank per slot; masked slots land in the spare last column.
        owner = torch.where(topk_idx >= 0, torch.div(topk_idx, self.local, rounding_mode="floor"),
                            self.num_ranks)
        in_rank = self._in_rank[:num_tokens]
        in_rank.zero_()
        in_rank.scatter_(1, owner, True)
        pairs = torch.nonzero(in_rank[:, : self.num_ranks].t())  # (destination, token) order
        dst, tok = pairs[:, 0], pairs[:, 1]
        send_counts = torch.bincount(dst, minlength=self.num_ranks).numpy()
        recv_counts = self.ex.alltoall_counts(send_counts[:, None])[:, 0]
        n_send, n_recv = len(tok), int(recv_counts.sum())

        torch.index_select(x, 0, tok, out=self._send_x.t[:n_send])
        table = self._table[:num_tokens]
        table[:, 1 : 1 + k] = topk_idx
        table[:, 1 + k :] = topk_weights.view(torch.int32)
        torch.index_select(table, 0, tok, out=self._send_meta.t[:n_send])
        send_x, recv_x = self._send_x.np[:n_send], self._recv_x.np[:n_recv]
        self.ex.alltoallv_rows(send_x, send_counts, recv_x, recv_counts)
        self.ex.alltoallv_rows(
            self._send_meta.np[:n_send], send_counts, self._recv_meta.np[:n_recv], recv_counts
        )
        self._payload = (send_x, send_counts, recv_x, recv_counts)

        recv_meta = self._recv_meta.t[:n_recv]
        local_ids = recv_meta[:, 1 : 1 + k]
        local_ids -= self.ex.rank * self.local
        elsewhere = (local_ids < 0) | (local_ids >= self.local)  # masked slots included
        local_ids.masked_fill_(elsewhere, -1)
        recv_meta[:, 1 + k :].masked_fill_(elsewhere, 0)  # +0.0f weight for other ranks' experts
        per_expert = torch.bincount(local_ids[~elsewhere], minlength=self.local)
        self._tok, self._counts, self._num_tokens = tok, (send_counts, recv_counts), num_tokens
        return PeerDispatch(
            recv_x=recv_x,
            recv_meta=self._recv_meta.np[:n_recv],
            num_recv_tokens_per_expert=per_expert.numpy(),
            num_recv_rows_per_rank=recv_counts,
            num_sent_rows=n_send,
        )

    def combine(self, expert_out: torch.Tensor) -> np.ndarray:
        """Sum the rows sent back by each destination rank, ascending, onto this rank's tokens.

        Returns a view into a reusable buffer: valid until the next combine.
        """
        send_counts, recv_counts = self._counts
        n_send = len(self._tok)
        self._back = (as_numpy(expert_out), recv_counts, self._back_recv.np[:n_send], send_counts)
        self.ex.alltoallv_rows(*self._back)
        # Rows come back in (destination, token) order: index_add_ adds them in that order,
        # so each token sums its destination ranks ascending, as the reference.
        self._terms.t[:n_send].copy_(self._back_recv.t[:n_send])
        return self._reduce(self._tok, self._num_tokens)


def _block_transpose(counts: torch.Tensor) -> torch.Tensor:
    """Row permutation from (source, expert) blocks to (expert, source) blocks (as kernels.py):
    for each row of the expert-major order, its index in the source-major one."""
    flat = counts.reshape(-1)
    src_major_start = (torch.cumsum(flat, 0) - flat).view(counts.shape)
    cnt_t = counts.t().reshape(-1)
    start_t = src_major_start.t().reshape(-1)
    out_start = torch.cumsum(cnt_t, 0) - cnt_t
    total = int(flat.sum())
    return torch.repeat_interleave(start_t - out_start, cnt_t) + torch.arange(total)


FP8_BLOCK = 128  # channels per scale (ubep.quant.QUANT_BLOCK; no ubep in the peer venvs)
FP8_MAX = 448.0  # largest float8_e4m3fn magnitude
AMAX_FLOOR = 1e-4  # a block's amax floor (DeepEP's; rounded to float32 by clamp_min)


def fp8_row_width(hidden: int) -> int:
    """Bytes of one packed FP8 row: the values, then the float32 scales (ubep.quant.row_bytes)."""
    return hidden + 4 * (hidden // FP8_BLOCK)


class TorchFp8Quantiser:
    """Per-token, per-128-channel E4M3 quantisation in torch ops, into packed rows (the E4M3
    values, then the float32 scales' bytes), the layout the FP8 peers move.

    What a torch MoE user writes (DeepEP's ``per_token_cast_to_fp8``), with ``ubep.quant``'s
    rules so the bytes are ubep's bit for bit (the check compares them): ``amax`` of ``|x|`` per
    block, ``scale = max(amax, 1e-4) / 448`` and ``x / scale`` as float32 *divisions* (DeepEP
    multiplies by ``448 / amax``, one rounding more), then ``float8_e4m3fn``'s
    round-to-nearest-even cast (saturating, as ubep's). NaN inputs are outside the benchmark
    (torch keeps a NaN's sign, ubep does not). Buffers allocated once, as the peers' others.
    """

    def __init__(self, max_tokens: int, hidden: int) -> None:
        if hidden % FP8_BLOCK:
            raise ValueError(f"hidden={hidden} must be a multiple of {FP8_BLOCK}")
        self.hidden = hidden
        self.width = fp8_row_width(hidden)
        self._packed = _Buf((max_tokens, self.width), np.uint8)
        self._xf = _Buf((max_tokens, hidden), np.float32)
        self._absx = _Buf((max_tokens, hidden), np.float32)
        self._scales = _Buf((max_tokens, hidden // FP8_BLOCK), np.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Quantise BF16 ``x [t, hidden]``; returns the packed rows ``uint8 [t, width]`` (a view
        into a reusable buffer, valid until the next call)."""
        t, nb = x.shape[0], self.hidden // FP8_BLOCK
        xf = self._xf.t[:t]
        xf.copy_(x)  # exact: every BF16 value is a float32
        absx = self._absx.t[:t]
        torch.abs(xf, out=absx)
        scales = self._scales.t[:t]
        torch.amax(absx.view(t, nb, FP8_BLOCK), dim=-1, out=scales)
        scales.clamp_min_(AMAX_FLOOR).div_(FP8_MAX)
        xf.view(t, nb, FP8_BLOCK).div_(scales.unsqueeze(-1))
        packed = self._packed.t[:t]
        packed[:, : self.hidden].view(torch.float8_e4m3fn).copy_(xf)
        packed[:, self.hidden :].view(torch.float32).copy_(scales)
        return packed


class TorchQuantisingPeer:
    """The whole FP8 dispatch of a torch user: quantise BF16 x (:class:`TorchFp8Quantiser`),
    then the torch peer's dispatch of the packed rows; combine is the inner peer's (BF16)."""

    def __init__(self, inner: TorchExpertLayoutPeer | TorchRankLayoutPeer, max_tokens: int,
                 hidden: int) -> None:
        self.inner = inner
        self.quantise = TorchFp8Quantiser(max_tokens, hidden)

    prepare = staticmethod(_TorchPeerBase.prepare)

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> PeerDispatch:
        return self.inner.dispatch(self.quantise(x), topk_idx, topk_weights)

    def combine(self, expert_out: torch.Tensor) -> np.ndarray:
        return self.inner.combine(expert_out)

    def payload_exchange(self) -> None:
        self.inner.payload_exchange()

    def combine_exchange(self) -> None:
        self.inner.combine_exchange()


def make_torch_quantising_peer(layout: str, ex: Exchange, **kw: Any) -> TorchQuantisingPeer:
    """:class:`TorchQuantisingPeer` of ``layout``; keywords as ``make_torch_peer`` with ``hidden``
    the BF16 width (the packed rows' width follows from it)."""
    packed = {"x_dtype": np.dtype(np.uint8), "x_width": fp8_row_width(kw["hidden"])}
    inner = make_torch_peer(layout, ex, **(kw | packed))
    return TorchQuantisingPeer(inner, kw["max_tokens"], kw["hidden"])


def make_torch_peer(
    layout: str, ex: Exchange, **kw: Any
) -> TorchExpertLayoutPeer | TorchRankLayoutPeer:
    """The torch implementation of ``layout`` (keywords as ``kernels.make_peer``)."""
    if layout not in ("expert", "rank"):
        raise ValueError(f"layout={layout!r}: must be 'expert' or 'rank'")
    return TorchExpertLayoutPeer(ex, **kw) if layout == "expert" else TorchRankLayoutPeer(ex, **kw)
