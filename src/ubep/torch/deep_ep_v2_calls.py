"""DeepEP V2's ``dispatch`` and ``combine`` on ubep: argument checks, the rows' two trips
through ubep's engines, and the outputs (the mixin :class:`V2Calls` of
:class:`ubep.torch.deep_ep_v2.ElasticBuffer` and ``EPBuffer``).

Every row moves through a ubep ``layout="rank"`` dispatch of raw bytes (``uint8`` rows: the
token's BF16 or FP8 bytes, then its scale bytes), so FP8 values and any 4-byte scale format
(FP32 or packed UE8M0) arrive bit for bit. The combine moves rows back the same way, one more
rank-layout dispatch whose "expert" is the token's source rank, and each source reduces its
rows in the order :mod:`ubep.torch.deep_ep_v2_layout` documents (DeepEP's reference order).

A call exchanges nothing of its own: the tokens every rank sends every rank come with the
dispatch's result (``num_sent_rows_per_rank``, from the engine's count round). A rank whose
arguments fail its local checks announces the failure through the backend its peers' call
goes through (:func:`ubep.torch.deep_ep_agree.reject_call`), so a bad argument on one rank
raises on every rank before any row moves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ._convert import from_numpy, to_numpy
from .backend import issue_dispatch
from .deep_ep_agree import checked
from .deep_ep_types import EventHandle, EventOverlap
from .deep_ep_v2_layout import (
    Received,
    SourceRoute,
    received,
    reduce_at_source,
    reduce_local,
    source_route,
    worst_case_rows,
)
from .deep_ep_v2_types import EPHandle

__all__ = ["V2Calls"]

# the integer type of each element size: rows are gathered as bits
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SF_PACKS_ALIGNMENT = 4  # DeepEP's kNumAlignedSFPacks: the TMA-aligned column-major scale layout


@dataclass(frozen=True)
class _Route:
    """What combine needs of one dispatch (kept in the handle)."""

    rec: Received
    src: SourceRoute
    hidden: int


@dataclass(frozen=True)
class _DispatchArgs:
    """One rank's checked dispatch arguments."""

    x: torch.Tensor
    sf: torch.Tensor | None
    payload: np.ndarray  # [num_tokens, bytes] uint8: x's bytes then sf's
    idx: np.ndarray
    topk_idx: torch.Tensor
    weights: np.ndarray
    with_weights: bool
    num_experts: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    do_cpu_sync: bool
    do_expand: bool
    src: SourceRoute


class _Deferred:
    """A deferred epilogue: runs once, on the first wait or before the buffer's next call."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._run: Callable[[], Any] | None = run
        self._value: Any = None

    def __call__(self) -> Any:
        run, self._run = self._run, None
        if run is not None:
            self._value = run()
        return self._value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tensor(value: Any, name: str, dim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(name, type(value).__name__, "must be a torch.Tensor")
    if value.device.type != "cpu":
        raise InvalidArgumentError(name, str(value.device), "must be a CPU tensor")
    if value.dim() != dim:
        raise InvalidArgumentError(name, tuple(value.shape), f"must be {dim}-D")
    return value


def _as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Byte rows ``[n, width]`` (a column slice of wider rows too) seen as ``dtype``, a view
    where torch can make one (torch cannot view an empty strided slice)."""
    n, width = raw.shape
    if n == 0:
        return torch.zeros((0, width // torch.empty(0, dtype=dtype).element_size()), dtype=dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    if raw.stride(1) == 1 and raw.stride(0) % size == 0 and raw.storage_offset() % size == 0:
        return raw.view(dtype)
    return raw.contiguous().view(dtype)


def _wait(event: Any) -> None:
    wait = getattr(event, "current_stream_wait", None)
    if wait is not None:
        wait()


class V2Calls:
    """``dispatch``/``combine`` of the V2 buffers (a mixin: the buffer sets these)."""

    rank_idx: int
    num_ranks: int
    num_max_tokens_per_rank: int
    allow_multiple_reduction: bool
    _v1: Any
    _uid: object
    _pending: list[_Deferred]
    _check_alive: Callable[[], None]
    _resolve_num_sms: Callable[[int | None, int, int], int]

    # ------------------------------------------------------------------ dispatch
    def _v2_dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, stats: Any,
                     num_experts: Any, num_max_tokens_per_rank: Any, expert_alignment: Any,
                     num_sms: int, previous_event: Any, before_epilogue: Any, async_: bool,
                     allocate_on_comm_stream: bool, handle: Any, do_cpu_sync: Any,
                     do_expand: bool, do_zero_padding: bool, emit_expert_ids: bool,
                     col_major_sf: bool, defer_epilogue: bool,
                     refused: InvalidArgumentError | None = None) -> Any:
        """The V2 dispatch (both APIs' keywords, resolved by the caller); ``refused``: an error
        the API raises for a keyword it refuses, raised here on every rank."""
        self._flush()

        def check() -> _DispatchArgs:
            if refused is not None:
                raise refused
            return self._check_dispatch(
                x, topk_idx, topk_weights, stats, num_experts, num_max_tokens_per_rank,
                expert_alignment, previous_event, async_, allocate_on_comm_stream, handle,
                do_cpu_sync, do_expand, do_zero_padding, emit_expert_ids, defer_epilogue)

        args = checked(check, lambda: self._dispatch_backend(
            x, topk_idx, handle, num_experts, num_max_tokens_per_rank))
        if previous_event is not None:
            _wait(previous_event)
        # the rows travel as bytes: the call's signature carries x's dtype (deep_ep_checks)
        self._v1._gate.note("v2_dispatch", getattr(x[0] if isinstance(x, tuple) else x,
                                                   "dtype", None))
        backend = self._v1._backend("rank", args.payload.shape[1], args.idx.shape[1],
                                    args.num_experts, torch.uint8, args.num_max_tokens_per_rank)
        call = issue_dispatch(backend, args.payload, args.idx, args.weights, split=defer_epilogue)
        sms = handle.num_sms if handle is not None else self._resolve_num_sms(
            num_sms, args.num_experts, args.idx.shape[1])

        # [source rank, destination rank] tokens: the engine's count round carries them
        return self._epilogue(call, before_epilogue, defer_epilogue, lambda res: (
            self._dispatch_outputs(args, res, np.asarray(res.num_sent_rows_per_rank,
                                                         dtype=np.int64), stats, handle, sms,
                                   emit_expert_ids, col_major_sf)))

    def _dispatch_backend(self, x: Any, topk_idx: Any, handle: Any, num_experts: Any,
                          num_max_tokens_per_rank: Any) -> Any:
        """The backend a well-formed dispatch of these shapes goes through (the peers' one,
        where a local check refused this rank's call): rows of a BF16 ``x``'s bytes, or of an
        FP8 ``x``'s and its 4-byte scales'."""
        x_t, sf = x if isinstance(x, tuple) else (x, None)
        width = 2 * int(x_t.shape[1]) if sf is None else int(x_t.shape[1]) + 4 * int(sf.shape[1])
        if isinstance(handle, EPHandle):
            topk_idx, num_experts = handle.topk_idx, handle.num_experts
            num_max_tokens_per_rank = handle.num_max_tokens_per_rank
        if num_max_tokens_per_rank is None:
            num_max_tokens_per_rank = self.num_max_tokens_per_rank
        # signed as the good call signs it (the peers' move to it matches this rank's)
        self._v1._gate.note("v2_dispatch", getattr(x_t, "dtype", None))
        return self._v1._backend("rank", width, int(topk_idx.shape[1]), int(num_experts),
                                 torch.uint8, int(num_max_tokens_per_rank))

    def _check_dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, stats: Any,
                        num_experts: Any, num_max_tokens_per_rank: Any, expert_alignment: Any,
                        previous_event: Any, async_: bool, allocate_on_comm_stream: bool,
                        handle: Any, do_cpu_sync: Any, do_expand: bool, do_zero_padding: bool,
                        emit_expert_ids: bool, defer_epilogue: bool) -> _DispatchArgs:
        self._check_alive()
        self._check_stream_keywords(previous_event, async_, allocate_on_comm_stream,
                                    defer_epilogue)
        if do_zero_padding and not do_expand:
            raise InvalidArgumentError("do_zero_padding", True, "needs do_expand=True (as DeepEP)")
        if emit_expert_ids and (not do_expand or handle is not None):
            raise InvalidArgumentError("emit_expert_ids", True,
                                       "needs do_expand=True and a dispatch without handle=")
        if handle is not None:
            self._check_handle(handle)
            if topk_idx is not None:
                raise InvalidArgumentError("topk_idx", "given",
                                           "must be None with handle= (the handle's is reused)")
            if do_cpu_sync:
                raise InvalidArgumentError("do_cpu_sync", True,
                                           "a cached dispatch (handle=) has no CPU sync")
            for name, given, held in (
                ("num_experts", num_experts, handle.num_experts),
                ("expert_alignment", expert_alignment, handle.expert_alignment),
                ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                 handle.num_max_tokens_per_rank),
                ("do_expand", do_expand, handle.do_expand),
            ):
                if given is not None and given != held:
                    raise InvalidArgumentError(name, given,
                                               f"differs from the handle's {held}")
            topk_idx = handle.topk_idx
            num_experts, expert_alignment = handle.num_experts, handle.expert_alignment
            num_max_tokens_per_rank, do_cpu_sync = handle.num_max_tokens_per_rank, False
        if num_max_tokens_per_rank is None:
            num_max_tokens_per_rank = self.num_max_tokens_per_rank
        expert_alignment = 1 if expert_alignment is None else expert_alignment
        do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        if not _is_int(num_max_tokens_per_rank) or num_max_tokens_per_rank < 1:
            raise InvalidArgumentError(
                "num_max_tokens_per_rank", num_max_tokens_per_rank,
                "must be a positive int: pass it to the buffer's constructor or to dispatch")
        if not _is_int(num_experts) or num_experts < 1 or num_experts % self.num_ranks:
            raise InvalidArgumentError(
                "num_experts", num_experts,
                f"must be a positive multiple of num_ranks={self.num_ranks} (dispatch keyword)")
        if not _is_int(expert_alignment) or expert_alignment < 1:
            raise InvalidArgumentError("expert_alignment", expert_alignment, "must be an int >= 1")
        x_t, sf = (x if isinstance(x, tuple) else (x, None))
        x_t = _tensor(x_t, "x", 2)
        num_tokens = int(x_t.shape[0])
        if num_tokens > num_max_tokens_per_rank:
            raise InvalidArgumentError(
                "x", f"{num_tokens} tokens",
                f"exceeds num_max_tokens_per_rank={num_max_tokens_per_rank}: raise "
                "num_max_tokens_per_rank (constructor or dispatch keyword)")
        payload = self._payload(x_t, sf)
        topk = _tensor(topk_idx, "topk_idx", 2)
        if topk.dtype != torch.int64 or topk.shape[0] != num_tokens:
            raise InvalidArgumentError(
                "topk_idx", f"{tuple(topk.shape)} {topk.dtype}",
                f"must be [num_tokens={num_tokens}, num_topk] deep_ep.topk_idx_t (torch.int64)")
        idx = np.ascontiguousarray(to_numpy(topk, argument="topk_idx"), dtype=np.int64)
        if idx.size and (idx.min() < -1 or idx.max() >= num_experts):
            raise InvalidArgumentError("topk_idx", "out of range",
                                       f"entries must be -1 or in [0, num_experts={num_experts})")
        weights = np.zeros(idx.shape, dtype=np.float32)
        if topk_weights is not None:
            w = _tensor(topk_weights, "topk_weights", 2)
            if w.dtype != torch.float32 or tuple(w.shape) != idx.shape:
                raise InvalidArgumentError(
                    "topk_weights", f"{tuple(w.shape)} {w.dtype}",
                    f"must be {idx.shape} torch.float32 like topk_idx")
            weights = np.where(idx >= 0, to_numpy(w, argument="topk_weights"), 0.0).astype(
                np.float32)
        if stats is not None:
            s = _tensor(stats, "cumulative_local_expert_recv_stats", 1)
            if s.dtype != torch.int32 or s.shape[0] != num_experts // self.num_ranks:
                raise InvalidArgumentError(
                    "cumulative_local_expert_recv_stats", f"{tuple(s.shape)} {s.dtype}",
                    f"must be [num_local_experts={num_experts // self.num_ranks}] torch.int32")
        return _DispatchArgs(
            x_t, sf, payload, idx, topk, weights, topk_weights is not None, num_experts,
            num_max_tokens_per_rank, expert_alignment, do_cpu_sync, bool(do_expand),
            source_route(idx, num_experts, self.num_ranks))

    @staticmethod
    def _payload(x: torch.Tensor, sf: Any) -> np.ndarray:
        """``[num_tokens, bytes]`` uint8: each token's values, then its scales."""
        if sf is None:
            if x.dtype != torch.bfloat16:
                raise InvalidArgumentError(
                    "x", str(x.dtype), "must be torch.bfloat16, or an FP8 pair (x "
                    "torch.float8_e4m3fn, sf) for an FP8 dispatch (as DeepEP's V2 dispatch)")
            return to_numpy(x.contiguous().view(torch.uint8), argument="x")
        if x.element_size() != 1 or not x.dtype.is_floating_point:
            raise InvalidArgumentError("x", str(x.dtype),
                                       "an FP8 dispatch's x must be torch.float8_e4m3fn")
        sf = _tensor(sf, "sf", 2)
        if sf.shape[0] != x.shape[0] or sf.element_size() != 4:
            raise InvalidArgumentError(
                "sf", f"{tuple(sf.shape)} {sf.dtype}",
                f"must be [num_tokens={x.shape[0]}, packs] of 4-byte scales (torch.float32, or "
                "torch.int32 packed UE8M0)")
        scales = sf.contiguous().view(torch.uint8).reshape(x.shape[0], 4 * sf.shape[1])
        raw = torch.cat([x.contiguous().view(torch.uint8), scales], dim=1)
        return to_numpy(raw, argument="x")

    def _dispatch_outputs(self, args: _DispatchArgs, res: Any, sent: np.ndarray, stats: Any,
                          handle: EPHandle | None, num_sms: int, emit_expert_ids: bool,
                          col_major_sf: bool) -> tuple[Any, Any, Any, EPHandle]:
        R = self.num_ranks
        L, K = args.num_experts // R, args.idx.shape[1]
        A, T_max = args.expert_alignment, args.num_max_tokens_per_rank
        rec = received(res.recv_src_rank, res.recv_src_token, res.recv_topk_idx, R, L, K, A)
        n = rec.num_rows
        # the engine's rows as they landed (views, no copy): the outputs gather them through
        # rec.order into tensors of their own
        raw = from_numpy(np.asarray(res.recv_x)).reshape(n, args.payload.shape[1])
        x_bytes = args.x.shape[1] * args.x.element_size()
        rows = _as(raw[:, :x_bytes], args.x.dtype)
        sf_rows = None if args.sf is None else _as(raw[:, x_bytes:], args.sf.dtype)
        w = from_numpy(np.asarray(res.recv_topk_weights, dtype=np.float32)).reshape(n, K)
        worst, worst_expanded = worst_case_rows(R, T_max, K, L, A)
        if handle is not None:
            n_out, expanded_rows = handle.num_recv_tokens, handle.num_expanded_tokens
        elif args.do_cpu_sync:
            n_out, expanded_rows = n, int(rec.aligned.sum())
        else:
            n_out, expanded_rows = worst, worst_expanded
        if stats is not None:
            stats += torch.from_numpy(rec.counts.astype(np.int32))
        out_rows = expanded_rows if args.do_expand else n_out
        sel = self._row_selection(rec, args.do_expand, out_rows)  # source row of each output row
        recv_x, recv_topk_idx, recv_topk_weights = self._recv_tensors(
            args, rec, sel, (rows, sf_rows, w), col_major_sf)
        if handle is None:
            handle = self._new_handle(args, rec, sent, n_out, expanded_rows, num_sms,
                                      emit_expert_ids, sel)
        elif handle.num_valid_recv_tokens != n:  # the same routing moves the same rows
            raise InvalidArgumentError("handle", "stale", "its routing no longer matches")
        return recv_x, recv_topk_idx, recv_topk_weights, handle

    @staticmethod
    def _recv_tensors(args: _DispatchArgs, rec: Received, sel: np.ndarray,
                      received_rows: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
                      col_major_sf: bool) -> tuple[Any, Any, Any]:
        """``(recv_x, recv_topk_idx, recv_topk_weights)`` of ``sel``'s rows (zeros elsewhere);
        ``received_rows`` are in the engine's order, ``rec.order`` maps the receive order to it."""
        rows, sf_rows, w = received_rows
        out_rows, K = sel.shape[0], args.idx.shape[1]
        ok = sel >= 0
        at = np.nonzero(ok)[0]  # the output rows that hold a received row
        row = sel[ok] // K if args.do_expand else sel[ok]  # ... which, in the receive order
        engine_row = torch.from_numpy(rec.order[row])
        prefix = at.size == 0 or int(at[-1]) == at.size - 1  # rows [0, m), zeros after

        def place(t: torch.Tensor) -> torch.Tensor:
            bits = t.view(_BITS[t.element_size()])  # FP8 types have no index kernels
            out = torch.empty((out_rows, *t.shape[1:]), dtype=bits.dtype)
            if prefix:
                torch.index_select(bits, 0, engine_row, out=out[: at.size])
                out[at.size:].zero_()
            else:
                out.zero_()
                out.index_copy_(0, torch.from_numpy(at), bits.index_select(0, engine_row))
            return out.view(t.dtype)

        recv_x: Any = place(rows)
        if sf_rows is not None:
            recv_sf = place(sf_rows)
            if col_major_sf:  # DeepEP's TMA-aligned column-major scale layout
                stride = -(-out_rows // _SF_PACKS_ALIGNMENT) * _SF_PACKS_ALIGNMENT
                col = torch.empty_strided(tuple(recv_sf.shape), (1, stride), dtype=recv_sf.dtype)
                col.copy_(recv_sf)
                recv_sf = col
            recv_x = (recv_x, recv_sf)
        recv_topk_idx = recv_topk_weights = None
        if args.do_expand:
            if args.with_weights:
                recv_topk_weights = torch.zeros(out_rows, dtype=torch.float32)
                flat = torch.from_numpy(rec.order[row] * K + sel[ok] % K)
                recv_topk_weights[torch.from_numpy(at)] = w.reshape(-1)[flat]
        else:
            recv_topk_idx = torch.full((out_rows, K), -1, dtype=torch.int64)
            recv_topk_idx[: rec.num_rows] = torch.from_numpy(rec.local_idx)
            if args.with_weights:
                recv_topk_weights = place(w)
        return recv_x, recv_topk_idx, recv_topk_weights

    @staticmethod
    def _row_selection(rec: Received, do_expand: bool, out_rows: int) -> np.ndarray:
        """``[out_rows]``: the received row (compact) or ``row * num_topk + slot`` (expanded) each
        output row holds, -1 for padding."""
        sel = np.full(out_rows, -1, dtype=np.int64)
        if not do_expand:
            sel[: rec.num_rows] = np.arange(rec.num_rows)
            return sel
        rows, ks = np.nonzero(rec.slots >= 0)
        sel[rec.slots[rows, ks]] = rows * rec.slots.shape[1] + ks
        return sel

    def _new_handle(self, args: _DispatchArgs, rec: Received, sent: np.ndarray, n_out: int,
                    expanded_rows: int, num_sms: int, emit_expert_ids: bool,
                    sel: np.ndarray) -> EPHandle:
        me, K = self.rank_idx, args.idx.shape[1]
        n = rec.num_rows
        first_of_rank = np.concatenate([[0], np.cumsum(rec.rows_per_rank)[:-1]])
        meta = np.full((n_out, K + 2), -1, dtype=np.int32)
        meta[:n, 0] = rec.src_rank * args.num_max_tokens_per_rank + rec.src_token
        meta[:n, 1] = np.arange(n) - first_of_rank[rec.src_rank]
        if args.do_expand:
            meta[:n, 2:] = rec.slots
        # dst_buffer_slot_idx: token t's row on the rank owning slot k = the rows that rank got
        # from lower ranks + t's place among this rank's tokens sent there.
        before = np.cumsum(sent, axis=0) - sent  # [src, dst]: rows dst got from ranks < src
        dst_slot = np.full(args.idx.shape, -1, dtype=np.int32)
        for r, tokens in enumerate(args.src.tokens_to):
            place = np.full(args.idx.shape[0], -1, dtype=np.int64)
            place[tokens] = before[me, r] + np.arange(tokens.size)
            hit = args.src.owner == r
            dst_slot[hit] = np.broadcast_to(place[:, None], hit.shape)[hit]
        psum = (rec.start + rec.counts) if args.do_expand else np.cumsum(rec.aligned)
        expert_ids = None
        if emit_expert_ids:
            ids = np.full(expanded_rows, -1, dtype=np.int32)
            ok = sel >= 0
            flat = rec.local_idx.reshape(-1)
            ids[ok] = flat[sel[ok]]
            expert_ids = torch.from_numpy(ids)
        return EPHandle(
            owner=self._uid, do_expand=args.do_expand, num_experts=args.num_experts,
            expert_alignment=args.expert_alignment,
            num_max_tokens_per_rank=args.num_max_tokens_per_rank, num_sms=num_sms,
            topk_idx=args.topk_idx, num_recv_tokens=n_out, num_expanded_tokens=expanded_rows,
            num_recv_tokens_per_expert_list=(
                [int(c) for c in rec.aligned] if args.do_cpu_sync else []),
            psum_num_recv_tokens_per_scaleup_rank=torch.from_numpy(
                np.cumsum(rec.rows_per_rank).astype(np.int32)),
            psum_num_recv_tokens_per_expert=torch.from_numpy(psum.astype(np.int32)),
            num_unaligned_recv_tokens_per_expert=torch.from_numpy(rec.counts.astype(np.int32)),
            recv_src_metadata=torch.from_numpy(meta),
            dst_buffer_slot_idx=torch.from_numpy(dst_slot),
            recv_expert_ids=expert_ids,
            route=_Route(rec, args.src, int(args.x.shape[1])),
        )

    # ------------------------------------------------------------------ combine
    def _v2_combine(self, x: Any, handle: Any, topk_weights: Any, bias: Any,
                    previous_event: Any, before_epilogue: Any, async_: bool,
                    allocate_on_comm_stream: bool, defer_epilogue: bool) -> Any:
        self._flush()
        biases = checked(
            lambda: self._check_combine(x, handle, topk_weights, bias, previous_event, async_,
                                        allocate_on_comm_stream, defer_epilogue),
            lambda: self._combine_backend(handle, 2 * handle._route.hidden + (
                4 * handle._topk_idx.shape[1] if topk_weights is not None else 0)))
        if previous_event is not None:
            _wait(previous_event)
        route: _Route = handle._route
        rows, reverse_idx, row_bytes = self._rows_back(x, handle, topk_weights)
        backend = self._combine_backend(handle, rows.shape[1])
        call = issue_dispatch(backend, rows, reverse_idx, np.zeros(reverse_idx.shape, np.float32),
                              split=defer_epilogue)

        return self._epilogue(call, before_epilogue, defer_epilogue, lambda res: (
            self._combine_outputs(res, handle, route, row_bytes, topk_weights is not None,
                                  biases)))

    def _combine_backend(self, handle: EPHandle, width: int) -> Any:
        """The backend the rows of ``handle``'s combine go back through (``width`` bytes a
        row): one row per (token, destination) pair, or per (token, slot) pair when an expanded
        combine sends a row per slot."""
        R, K = self.num_ranks, handle._topk_idx.shape[1]
        capacity = R * handle.num_max_tokens_per_rank
        if handle.do_expand and not self.allow_multiple_reduction:
            capacity *= min(K, handle.num_experts // R)
        return self._v1._backend("rank", width, 1, R, torch.uint8, capacity)

    def _check_combine(self, x: Any, handle: Any, topk_weights: Any, bias: Any,
                       previous_event: Any, async_: bool, allocate_on_comm_stream: bool,
                       defer_epilogue: bool) -> tuple[torch.Tensor, ...]:
        self._check_alive()
        self._check_stream_keywords(previous_event, async_, allocate_on_comm_stream,
                                    defer_epilogue)
        self._check_handle(handle)
        handle.check_topk_idx()
        x = _tensor(x, "x", 2)
        if x.dtype != torch.bfloat16:
            raise InvalidArgumentError("x", str(x.dtype),
                                       "must be torch.bfloat16 (DeepEP's V2 combine)")
        hidden = handle._route.hidden
        rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        allowed = {rows} if handle.do_expand else {rows, handle.num_valid_recv_tokens}
        if x.shape[0] not in allowed or x.shape[1] != hidden:
            raise InvalidArgumentError(
                "x", tuple(x.shape), f"must be [{rows}, {hidden}] like the dispatch's recv_x")
        if topk_weights is not None:
            w = _tensor(topk_weights, "topk_weights", 1 if handle.do_expand else 2)
            want = (x.shape[0],) if handle.do_expand else (x.shape[0], handle._topk_idx.shape[1])
            if w.dtype != torch.float32 or tuple(w.shape) != want:
                raise InvalidArgumentError("topk_weights", f"{tuple(w.shape)} {w.dtype}",
                                           f"must be {want} torch.float32")
            if handle.do_expand and not self.allow_multiple_reduction:
                raise InvalidArgumentError(
                    "topk_weights", "given",
                    "an expanded combine returns weights only with allow_multiple_reduction=True "
                    "(the buffer's constructor keyword), as DeepEP")
        biases = bias if isinstance(bias, tuple) else (() if bias is None else (bias,))
        if len(biases) > 2:
            raise InvalidArgumentError("bias", len(biases), "takes one tensor or a pair")
        num_tokens = int(handle._topk_idx.shape[0])
        for b in biases:
            b = _tensor(b, "bias", 2)
            if b.dtype != x.dtype or tuple(b.shape) != (num_tokens, hidden):
                raise InvalidArgumentError("bias", f"{tuple(b.shape)} {b.dtype}",
                                           f"must be [{num_tokens}, {hidden}] {x.dtype}")
        return tuple(biases)

    def _rows_back(self, x: torch.Tensor, handle: EPHandle,
                   topk_weights: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray, int]:
        """The rows this rank returns, each to its token's source rank: ``(bytes [m, width],
        destination [m, 1], bytes of the BF16 part)``. Rows for one source follow the receive
        order (and slot order), which is the order the source expects them in."""
        rec: Received = handle._route.rec
        n, dest = rec.num_rows, rec.src_rank
        if not handle.do_expand:
            rows, w = x[:n], (None if topk_weights is None else topk_weights[:n])
        elif self.allow_multiple_reduction:
            rows = reduce_local(x, rec.slots)
            w = None
            if topk_weights is not None:
                ok = torch.from_numpy(rec.slots >= 0)
                w = torch.where(ok, topk_weights[torch.from_numpy(np.maximum(rec.slots, 0))], 0.0)
        else:
            r, k = np.nonzero(rec.slots >= 0)
            rows, w, dest = x[torch.from_numpy(rec.slots[r, k])], None, rec.src_rank[r]
        parts = [rows.contiguous().view(torch.uint8)]
        if w is not None:
            w_bytes = w.float().contiguous().view(torch.uint8)
            parts.append(w_bytes.reshape(rows.shape[0], 4 * w.shape[1]))
        raw = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        return (to_numpy(raw.contiguous()), np.ascontiguousarray(dest[:, None], dtype=np.int64),
                int(parts[0].shape[1]))

    def _combine_outputs(self, res: Any, handle: EPHandle, route: _Route, row_bytes: int,
                         with_weights: bool, biases: tuple[torch.Tensor, ...]
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        src = route.src
        T, K = src.owner.shape
        sender = np.asarray(res.recv_src_rank, dtype=np.int64)
        order = np.lexsort((np.asarray(res.recv_src_token), sender))
        width = row_bytes + (4 * K if with_weights else 0)
        # the engine's rows as they landed (no copy): every row below is read through ``order``
        raw = from_numpy(np.asarray(res.recv_x)).reshape(len(order), width)
        first = np.searchsorted(sender[order], np.arange(self.num_ranks))  # first from each
        per_pair = handle.do_expand and not self.allow_multiple_reduction
        row_of = np.full((T, K), -1, dtype=np.int64)  # the returned row each slot reads
        for r in range(self.num_ranks):
            if per_pair:  # one row per (token, slot) owned by r, tokens then slots ascending
                t, k = np.nonzero(src.owner == r)
                row_of[t, k] = first[r] + np.arange(t.size)
            else:  # one row per token sent to r, ascending
                place = np.full(T, -1, dtype=np.int64)
                place[src.tokens_to[r]] = first[r] + np.arange(src.tokens_to[r].size)
                hit = src.owner == r
                row_of[hit] = np.broadcast_to(place[:, None], (T, K))[hit]
        engine_row = np.where(row_of >= 0, order[np.maximum(row_of, 0)] if order.size else 0, -1)
        use = (src.owner >= 0) if per_pair else src.last
        combined_x = reduce_at_source(_as(raw[:, :row_bytes], torch.bfloat16), engine_row, use,
                                      biases, torch.bfloat16)
        combined_w = None
        if with_weights:
            w_rows = _as(raw[:, row_bytes:], torch.float32)
            combined_w = torch.zeros((T, K), dtype=torch.float32)
            ok = src.owner >= 0
            t, k = np.nonzero(ok)
            combined_w[torch.from_numpy(t), torch.from_numpy(k)] = w_rows[
                torch.from_numpy(engine_row[t, k]), torch.from_numpy(k)]
        return combined_x, combined_w

    # ------------------------------------------------------------------ shared
    def _check_handle(self, handle: Any) -> None:
        if not isinstance(handle, EPHandle):
            raise InvalidArgumentError("handle", type(handle).__name__,
                                       "must be the EPHandle a dispatch of this buffer returned")
        if handle._owner is not self._uid:
            raise InvalidArgumentError("handle", "foreign",
                                       "comes from another buffer (or one since destroyed)")

    @staticmethod
    def _check_stream_keywords(previous_event: Any, async_: bool, allocate_on_comm_stream: bool,
                               defer_epilogue: bool) -> None:
        if previous_event is not None and not allocate_on_comm_stream:
            raise InvalidArgumentError(
                "previous_event", "given", "needs allocate_on_comm_stream=True (as DeepEP)")
        if defer_epilogue and not async_:
            raise InvalidArgumentError(
                "defer_epilogue", True, "needs async_with_compute_stream=True (as DeepEP)")

    def _epilogue(self, call: Any, before_epilogue: Any, defer: bool,
                  outputs: Callable[[Any], tuple[Any, ...]]) -> Any:
        """A call's epilogue: its receive half (``call.hook()``), then ``before_epilogue``
        waited for, then the API's ``outputs`` of the result; run now (the outputs and a done
        event) or, with ``defer``, at the first ``wait()`` of the event returned."""

        def epilogue() -> tuple[Any, ...]:
            res = call.hook()
            if before_epilogue is not None:
                _wait(before_epilogue)
            return outputs(res)

        if defer:
            return self._defer(epilogue)
        return (*epilogue(), EventOverlap(EventHandle()))

    def _defer(self, run: Callable[[], Any]) -> EventOverlap:
        deferred = _Deferred(run)
        self._pending.append(deferred)
        event = EventOverlap(EventHandle())
        event.register_hook_after_wait(deferred)
        return event

    def _flush(self) -> None:
        """Finish deferred epilogues before the next call (their wait() still returns them)."""
        pending, self._pending[:] = list(self._pending), []
        for deferred in pending:
            deferred()
