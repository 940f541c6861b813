"""DeepEP V2's ``dispatch`` and ``combine`` on ubep: argument checks, the rows' two trips
through ubep's engines, and the outputs (:class:`V2Path`, held by
:class:`ubep.torch.deep_ep_v2.ElasticBuffer` and ``EPBuffer``).

Every row moves through a ubep ``layout="rank"`` dispatch of raw bytes (``uint8`` rows: the
token's BF16 or FP8 bytes, then its scale bytes), so FP8 values and any 4-byte scale format
(FP32 or packed UE8M0) arrive bit for bit. The combine is that Buffer's own combine (its
``combine_dtype`` is BF16): on two ranks the core's sum is DeepEP's reference order
(:mod:`ubep.torch.deep_ep_v2_layout`), elsewhere the combine hands back the unreduced rows and
each source adds them in that order (``V2Path.combine`` says when and why).

A call exchanges nothing of its own: the tokens every rank sends every rank come with the
dispatch's result (``num_sent_rows_per_rank``, from the engine's count round). A rank whose
arguments fail its local checks announces the failure through the backend its peers' call
goes through (:func:`ubep.torch.deep_ep_agree.reject_call`), so a bad argument on one rank
raises on every rank before any row moves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..runtime.abi import DTYPES, native_or_none
from ._convert import BITS_OF_SIZE, from_numpy, to_numpy
from .backend import issue_combine, issue_dispatch
from .deep_ep_agree import checked
from .deep_ep_types import EventHandle, EventOverlap
from .deep_ep_v2_layout import (
    Received,
    SourceRoute,
    masked_weights,
    received,
    reduce_at_source,
    reduce_local,
    source_route,
    worst_case_rows,
)
from .deep_ep_v2_types import EPHandle

if TYPE_CHECKING:
    from .deep_ep_core import FacadeCore

__all__ = ["DEFAULT_NUM_SMS", "V2Path", "resolve_num_sms"]

DEFAULT_NUM_SMS = 20  # what get_theoretical_num_sms answers on CPU (V1 Buffer.num_sms too)

_SF_PACKS_ALIGNMENT = 4  # DeepEP's kNumAlignedSFPacks: the TMA-aligned column-major scale layout


class _Back(NamedTuple):
    """The Buffer a dispatch went through, whose combine brings its rows back."""

    backend: Any  # the facade's backend of that Buffer
    inner: Any  # the dispatch's ubep handle
    width: int  # the Buffer's row: bytes of a dispatched row, BF16 values of a combined one
    sent: np.ndarray  # [source, destination] rows of the dispatch (every rank's same)


class _Route(NamedTuple):
    """What combine needs of one dispatch (kept in the handle)."""

    rec: Received
    src: SourceRoute
    hidden: int
    back: _Back
    in_order: bool  # the engine's rows are in the receive order (rec.order is the identity)
    first: tuple[int, ...]  # receive rows [first[s], first[s + 1]) came from rank s
    owner: object  # the V2Path whose buffer made the handle, until its destroy


class _BackPlan(NamedTuple):
    """Where the rows a combine sends back lie in the combine rows of the dispatch's Buffer
    (``width`` BF16 values: ``per_call = width // hidden`` blocks of ``hidden``), the same on
    every rank: it follows from what every rank's call has alike (the handle's routing kind,
    the buffer's ``allow_multiple_reduction``, the number of ranks), never from a rank's own
    ``bias`` or ``topk_weights`` (a combine carries no signature that would catch a mismatch).

    * ``per_slot`` (an expanded combine without ``allow_multiple_reduction``): the row of
      (token, slot ``k``) in block ``k``, ``num_blocks = num_topk``;
    * otherwise one row per (token, rank): with ``sum_block`` (1 or 2 ranks and room for two
      blocks) every rank's row in block 0, which the core's combine sums in DeepEP's order,
      and the rows from the other rank in block 1; without it the rows of rank ``d`` for source
      ``s`` in block ``(d - s - 1) % num_ranks``; a source's own rows stay there.
    """

    per_slot: bool
    sum_block: bool
    num_blocks: int
    per_call: int

    @property
    def num_calls(self) -> int:
        return -(-self.num_blocks // self.per_call)


def _back_plan(num_ranks: int, num_topk: int, width: int, hidden: int,
               per_slot: bool) -> _BackPlan:
    per_call = width // hidden  # >= 1: a BF16 row's bytes are 2 hidden, an FP8 row's more
    if per_slot:
        return _BackPlan(True, False, num_topk, per_call)
    sum_block = num_ranks == 1 or (num_ranks == 2 and per_call >= 2)
    return _BackPlan(False, sum_block, int(sum_block) + num_ranks - 1, per_call)


class _DispatchArgs(NamedTuple):
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


def resolve_num_sms(num_sms: int | None) -> int:
    """A call's ``num_sms``: ``get_theoretical_num_sms``'s where 0 or None, else aligned to 2
    (as DeepEP)."""
    if not num_sms:
        return DEFAULT_NUM_SMS
    return int(num_sms) + int(num_sms) % 2


class V2Path:
    """``dispatch``/``combine`` of the V2 buffers, held by each (their calls of those names hand
    theirs to this one's) over the core of the V1 ``Buffer`` they are built over
    (:class:`.deep_ep_core.FacadeCore`: its Buffers per shape, the call gate, the weights'
    way back); with the deferred epilogues in flight and whose handles it takes."""

    def __init__(self, core: FacadeCore, num_max_tokens_per_rank: int,
                 allow_multiple_reduction: bool) -> None:
        self.core = core
        self.rank_idx = core.rank
        self.num_ranks = core.group_size
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.allow_multiple_reduction = allow_multiple_reduction
        self.destroyed = False
        self._gate = core.gate
        self._backend = core.backends.get
        self._pending: list[_Deferred] = []
        self._owner = object()  # handles made from now on are this buffer's

    def check_alive(self) -> None:
        if self.destroyed:
            raise InvalidArgumentError("self", "destroyed", "this buffer was destroyed")

    def close(self) -> None:
        """The buffer was destroyed: later calls raise, earlier handles are refused."""
        self._owner = object()
        self.destroyed = True

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, stats: Any,
                     num_experts: Any, num_max_tokens_per_rank: Any, expert_alignment: Any,
                     num_sms: int, previous_event: Any, before_epilogue: Any, async_: bool,
                     allocate_on_comm_stream: bool, handle: Any, do_cpu_sync: Any,
                     do_expand: bool, do_zero_padding: bool, emit_expert_ids: bool,
                     col_major_sf: bool, defer_epilogue: bool,
                     refused: InvalidArgumentError | None = None) -> Any:
        """The V2 dispatch (both APIs' keywords, resolved by the caller); ``refused``: an error
        the API raises for a keyword it refuses, raised here on every rank."""
        self.flush()

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
        self._gate.note("v2_dispatch", getattr(x[0] if isinstance(x, tuple) else x, "dtype", None))
        backend = self._backend("rank", args.payload.shape[1], args.idx.shape[1],
                                args.num_experts, torch.uint8, args.num_max_tokens_per_rank,
                                combine_dtype=torch.bfloat16)
        call = issue_dispatch(backend, args.payload, args.idx, args.weights, split=defer_epilogue)
        sms = handle.num_sms if handle is not None else resolve_num_sms(num_sms)

        # [source rank, destination rank] tokens: the engine's count round carries them
        return self._epilogue(call, before_epilogue, defer_epilogue, lambda res: (
            self._dispatch_outputs(args, res, np.asarray(res.num_sent_rows_per_rank,
                                                         dtype=np.int64), stats, handle, sms,
                                   emit_expert_ids, col_major_sf, backend)))

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
        self._gate.note("v2_dispatch", getattr(x_t, "dtype", None))
        return self._backend("rank", width, int(topk_idx.shape[1]), int(num_experts),
                             torch.uint8, int(num_max_tokens_per_rank),
                             combine_dtype=torch.bfloat16)

    def _check_dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, stats: Any,
                        num_experts: Any, num_max_tokens_per_rank: Any, expert_alignment: Any,
                        previous_event: Any, async_: bool, allocate_on_comm_stream: bool,
                        handle: Any, do_cpu_sync: Any, do_expand: bool, do_zero_padding: bool,
                        emit_expert_ids: bool, defer_epilogue: bool) -> _DispatchArgs:
        self.check_alive()
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
        w_np = None
        if topk_weights is not None:
            w = _tensor(topk_weights, "topk_weights", 2)
            if w.dtype != torch.float32 or tuple(w.shape) != idx.shape:
                raise InvalidArgumentError(
                    "topk_weights", f"{tuple(w.shape)} {w.dtype}",
                    f"must be {idx.shape} torch.float32 like topk_idx")
            w_np = to_numpy(w, argument="topk_weights")
        weights = masked_weights(idx, w_np, num_experts)  # and the ids' range, in one pass
        if weights is None:
            raise InvalidArgumentError("topk_idx", "out of range",
                                       f"entries must be -1 or in [0, num_experts={num_experts})")
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
                          col_major_sf: bool, backend: Any) -> tuple[Any, Any, Any, EPHandle]:
        R = self.num_ranks
        L, K = args.num_experts // R, args.idx.shape[1]
        A, T_max = args.expert_alignment, args.num_max_tokens_per_rank
        rec = received(res.recv_src_rank, res.recv_src_token, res.recv_topk_idx, R, L, K, A)
        n = rec.num_rows
        if handle is not None:
            n_out, expanded_rows = handle.num_recv_tokens, handle.num_expanded_tokens
        elif args.do_cpu_sync:
            n_out, expanded_rows = n, int(rec.aligned.sum())
        else:
            n_out, expanded_rows = worst_case_rows(R, T_max, K, L, A)
        if stats is not None:
            stats += torch.from_numpy(rec.counts.astype(np.int32))
        out_rows = expanded_rows if args.do_expand else n_out
        in_order = rec.in_order

        def selection() -> np.ndarray:  # source row of each output row
            return self._row_selection(rec, args.do_expand, out_rows)

        x_bytes = args.x.shape[1] * args.x.element_size()
        if (in_order and not args.do_expand and out_rows == n and args.sf is None
                and x_bytes == args.payload.shape[1]):
            # the engine's rows are the outputs as they lie (the receive order, no padding,
            # no scales): owned copies of them (local_idx is the record's own: the handle
            # keeps it)
            recv_x: Any = torch.from_numpy(np.array(res.recv_x).reshape(n, x_bytes)).view(
                args.x.dtype) if n else args.x.new_empty((0, args.x.shape[1]))  # (no view of 0)
            recv_topk_idx = torch.from_numpy(rec.local_idx.copy())
            recv_topk_weights = torch.from_numpy(np.array(
                res.recv_topk_weights, dtype=np.float32).reshape(n, K)) if (
                    args.with_weights) else None
        else:
            # the engine's rows as they landed (views, no copy): the outputs gather them
            # through rec.order into tensors of their own
            raw = from_numpy(np.asarray(res.recv_x)).reshape(n, args.payload.shape[1])
            rows = _as(raw[:, :x_bytes], args.x.dtype)
            sf_rows = None if args.sf is None else _as(raw[:, x_bytes:], args.sf.dtype)
            w = from_numpy(np.asarray(res.recv_topk_weights, dtype=np.float32)).reshape(n, K)
            recv_x, recv_topk_idx, recv_topk_weights = self._recv_tensors(
                args, rec, selection(), (rows, sf_rows, w), col_major_sf)
        if handle is None:
            back = _Back(backend, res.handle, int(args.payload.shape[1]), sent)
            handle = self._new_handle(args, rec, sent, n_out, expanded_rows, num_sms,
                                      emit_expert_ids, selection, back, in_order)
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
            bits = t.view(BITS_OF_SIZE[t.element_size()])  # FP8 types have no index kernels
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
                    selection: Callable[[], np.ndarray], back: _Back,
                    in_order: bool) -> EPHandle:
        me, n = self.rank_idx, rec.num_rows
        first = [0]  # each source rank's first receive row, then n
        for rows in rec.rows_per_rank.tolist():
            first.append(first[-1] + rows)
        shape, T_max, expand = args.idx.shape, args.num_max_tokens_per_rank, args.do_expand
        src = args.src

        def metadata() -> torch.Tensor:
            meta = np.full((n_out, shape[1] + 2), -1, dtype=np.int32)
            meta[:n, 0] = rec.src_rank * T_max + rec.src_token
            meta[:n, 1] = np.arange(n) - np.asarray(first[:-1])[rec.src_rank]
            if expand:
                meta[:n, 2:] = rec.slots
            return torch.from_numpy(meta)

        def slots() -> torch.Tensor:
            # token t's row on the rank owning slot k = the rows that rank got from lower ranks
            # + t's place among this rank's tokens sent there
            before = np.cumsum(sent, axis=0) - sent  # [src, dst]: rows dst got from ranks < src
            dst_slot = np.full(shape, -1, dtype=np.int32)
            for r, tokens in enumerate(src.tokens_to):
                place = np.full(shape[0], -1, dtype=np.int64)
                place[tokens] = before[me, r] + np.arange(tokens.size)
                hit = src.owner == r
                dst_slot[hit] = np.broadcast_to(place[:, None], hit.shape)[hit]
            return torch.from_numpy(dst_slot)

        def psum_per_expert() -> torch.Tensor:
            psum = (rec.start + rec.counts) if expand else np.cumsum(rec.aligned)
            return torch.from_numpy(psum.astype(np.int32))

        def expert_ids() -> torch.Tensor | None:
            if not emit_expert_ids:
                return None
            sel = selection()
            ids = np.full(expanded_rows, -1, dtype=np.int32)
            ok = sel >= 0
            ids[ok] = rec.local_idx.reshape(-1)[sel[ok]]
            return torch.from_numpy(ids)

        return EPHandle(
            do_expand=args.do_expand, num_experts=args.num_experts,
            expert_alignment=args.expert_alignment,
            num_max_tokens_per_rank=args.num_max_tokens_per_rank, num_sms=num_sms,
            topk_idx=args.topk_idx, num_recv_tokens=n_out, num_expanded_tokens=expanded_rows,
            num_recv_tokens_per_expert_list=rec.aligned.tolist() if args.do_cpu_sync else [],
            num_valid_recv_tokens=n,
            psum_num_recv_tokens_per_scaleup_rank=lambda: torch.tensor(first[1:],
                                                                       dtype=torch.int32),
            psum_num_recv_tokens_per_expert=psum_per_expert,
            num_unaligned_recv_tokens_per_expert=lambda: torch.from_numpy(
                rec.counts.astype(np.int32)),
            recv_src_metadata=metadata, dst_buffer_slot_idx=slots, recv_expert_ids=expert_ids,
            route=_Route(rec, args.src, int(args.x.shape[1]), back, in_order, tuple(first),
                         self._owner),
        )

    # ------------------------------------------------------------------ combine
    def combine(self, x: Any, handle: Any, topk_weights: Any, bias: Any,
                    previous_event: Any, before_epilogue: Any, async_: bool,
                    allocate_on_comm_stream: bool, defer_epilogue: bool) -> Any:
        """The rows go back through the core's combine on the Buffer the dispatch used (its
        ``combine_dtype`` BF16, its row ``width`` bytes = BF16 values; :class:`_BackPlan`),
        no dispatch and no count round of its own.

        DeepEP sums a token's terms in FP32 from the bias (or +0.0) in slot order and rounds
        once. The core sums one row per (token, rank) from +0.0 over the ranks ascending and
        rounds once: the same bits whenever a token has at most two terms, as on two ranks
        (two terms commute; a zero term leaves a sum that started at +0.0 as it was). There,
        without ``bias``, the core's sum is the result. Elsewhere (more ranks, ``bias``, an
        expanded combine with a row per slot) the order differs, so the combine hands back the
        unreduced rows, one block each (a block's sum over the ranks adds zeros to the one
        rank's row there: the row itself), and :func:`.deep_ep_v2_layout.reduce_at_source`
        adds them in DeepEP's order (a row per (token, rank): with this rank's own rows, which
        never leave it). A row's
        -0.0 comes back +0.0 (the core's sum starts at +0.0); that changes a result only where
        the bias sum is -0.0 and every one of the token's ``num_topk`` terms is -0.0.
        ``topk_weights`` come back by :func:`.deep_ep_agree.sum_at_sources` (each rank's
        weights at its own slots, zeros elsewhere: the sum gathers them)."""
        self.flush()
        biases = checked(
            lambda: self._check_combine(x, handle, topk_weights, bias, previous_event, async_,
                                        allocate_on_comm_stream, defer_epilogue),
            lambda: self._combine_on(handle))
        if previous_event is not None:
            _wait(previous_event)
        route: _Route = handle.dispatch_route
        plan = _back_plan(self.num_ranks, int(handle.topk_idx.shape[1]), route.back.width,
                          route.hidden, handle.do_expand and not self.allow_multiple_reduction)
        own = None  # one row per (token, rank), the receive order: this rank's term of each
        if not plan.per_slot:
            n = route.rec.num_rows
            own = reduce_local(x, route.rec.slots) if handle.do_expand else x[:n]
        calls = []
        for i in range(plan.num_calls):  # the last call's receive half may be deferred
            backend = self._combine_on(handle)
            stage = self._stage(backend, route)
            self._fill(stage, i, x, own, route, plan)
            calls.append(issue_combine(backend, stage, route.back.inner,
                                       split=defer_epilogue and i == plan.num_calls - 1))

        def outputs(last: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            ys = [call.hook() for call in calls[:-1]] + [last]
            combined_x = self._combined_x(ys, route, plan, own, biases)
            combined_w = None
            if topk_weights is not None:
                combined_w = self._combined_weights(handle, route, topk_weights)
            return combined_x, combined_w

        return self._epilogue(calls[-1], before_epilogue, defer_epilogue, outputs)

    def _combine_on(self, handle: EPHandle) -> Any:
        """The backend of ``handle``'s dispatch, taking the next call (a combine)."""
        backend = handle.dispatch_route.back.backend
        if not self.core.local:  # the in-process world has no gate
            self._gate.combine_on(backend)
        return backend

    def _check_combine(self, x: Any, handle: Any, topk_weights: Any, bias: Any,
                       previous_event: Any, async_: bool, allocate_on_comm_stream: bool,
                       defer_epilogue: bool) -> tuple[torch.Tensor, ...]:
        self.check_alive()
        self._check_stream_keywords(previous_event, async_, allocate_on_comm_stream,
                                    defer_epilogue)
        self._check_handle(handle)
        handle.check_topk_idx()
        x = _tensor(x, "x", 2)
        if x.dtype != torch.bfloat16:
            raise InvalidArgumentError("x", str(x.dtype),
                                       "must be torch.bfloat16 (DeepEP's V2 combine)")
        hidden = handle.dispatch_route.hidden
        rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        allowed = {rows} if handle.do_expand else {rows, handle.dispatch_route.rec.num_rows}
        if x.shape[0] not in allowed or x.shape[1] != hidden:
            raise InvalidArgumentError(
                "x", tuple(x.shape), f"must be [{rows}, {hidden}] like the dispatch's recv_x")
        if topk_weights is not None:
            w = _tensor(topk_weights, "topk_weights", 1 if handle.do_expand else 2)
            want = (x.shape[0],) if handle.do_expand else (x.shape[0], handle.topk_idx.shape[1])
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
        num_tokens = int(handle.topk_idx.shape[0])
        for b in biases:
            b = _tensor(b, "bias", 2)
            if b.dtype != x.dtype or tuple(b.shape) != (num_tokens, hidden):
                raise InvalidArgumentError("bias", f"{tuple(b.shape)} {b.dtype}",
                                           f"must be [{num_tokens}, {hidden}] {x.dtype}")
        return tuple(biases)

    def _fill(self, out: np.ndarray, call: int, x: torch.Tensor, rows: torch.Tensor | None,
              route: _Route, plan: _BackPlan) -> None:
        """Write combine call ``call``'s rows into ``out`` (``[received rows, width]`` BF16 bits,
        row ``i`` answering the engine's row ``i``; zeros outside the blocks): ``rows`` (one per
        (token, rank), the receive order) or, per slot, ``x``'s expanded rows. Filled in the
        receive order, where each source rank's rows are one slice (copies of slices, no
        scatter), then put in the engine's order where that differs; in numpy, over the bits
        (a decode step's few slices cost less there than as tensors)."""
        rec, H, G = route.rec, route.hidden, plan.per_call
        me, R, first = self.rank_idx, self.num_ranks, route.first
        dst = out if route.in_order else np.empty_like(out)
        dst[:, G * H:] = 0  # an FP8 row's scale bytes: no block
        own = None if rows is None else to_numpy(rows)
        expanded = to_numpy(x) if plan.per_slot else None
        for g in range(G):
            b, block = call * G + g, dst[:, g * H: (g + 1) * H]
            if b >= plan.num_blocks:  # the last call's spare blocks
                block[...] = 0
            elif plan.per_slot:  # slot b's expanded row of every received row that has one
                block[...] = 0
                row = np.nonzero(rec.slots[:, b] >= 0)[0]
                block[row] = cast(np.ndarray, expanded)[rec.slots[row, b]]
            elif plan.sum_block and b == 0:  # every row: the core sums them
                block[...] = own
            else:  # the rows of one source rank s (never this rank: its own rows stay here)
                s = (me - 1 - (b - int(plan.sum_block))) % R
                lo, hi = first[s], first[s + 1]
                block[:lo] = 0
                block[lo:hi] = cast(np.ndarray, own)[lo:hi]
                block[hi:] = 0
        if dst is not out:
            out[rec.order] = dst

    @staticmethod
    def _stage(backend: Any, route: _Route) -> np.ndarray:
        """Where a combine call's rows are written: the ubep Buffer's own combine buffer
        (``Buffer.get_combine_buffer``: no copy into its segment; it waits until no peer still
        reads the combine that used it last), or an array of the same shape."""
        get = getattr(getattr(backend, "buffer", None), "get_combine_buffer", None)
        if get is not None:
            return cast(np.ndarray, get(route.back.inner))
        return np.empty((route.rec.num_rows, route.back.width), dtype=np.uint16)  # BF16 bits

    def _combined_x(self, ys: list[Any], route: _Route, plan: _BackPlan,
                    own: torch.Tensor | None, biases: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The combined tokens from the combine calls' results ``ys`` (``combine``)."""
        src, H, G = route.src, route.hidden, plan.per_call
        T, K = src.owner.shape
        if plan.sum_block and not biases:  # the core's sum, in DeepEP's order (combine)
            summed = np.asarray(ys[0]).reshape(T, route.back.width)[:, :H]
            return from_numpy(np.ascontiguousarray(summed), torch.bfloat16)
        blocks = []  # [T, hidden] each, block b of call b // G; one cat below, block-major
        for c, y in enumerate(ys):
            got = from_numpy(np.asarray(y), torch.bfloat16).reshape(T, route.back.width)
            blocks += [got[:, g * H: (g + 1) * H] for g in range(G)
                       if c * G + g < plan.num_blocks]
        if plan.per_slot:
            use = src.owner >= 0
            block = np.broadcast_to(np.arange(K), (T, K))
        else:  # this rank's own term of its tokens, one block more
            rec, me = route.rec, self.rank_idx
            mine = np.nonzero(rec.src_rank == me)[0]
            local = torch.zeros((T, H), dtype=torch.bfloat16)
            local.index_copy_(0, torch.from_numpy(rec.src_token[mine]),
                              cast(torch.Tensor, own).index_select(0, torch.from_numpy(mine)))
            blocks.append(local)
            use = src.last
            far = int(plan.sum_block) + (src.owner - me - 1) % self.num_ranks
            block = np.where(src.owner == me, plan.num_blocks, far)
        row_of = block * T + np.arange(T, dtype=np.int64)[:, None]
        native = native_or_none()
        if native is None or biases:
            return reduce_at_source(torch.cat(blocks), row_of, use, biases, torch.bfloat16)
        # From +0.0, the used terms in slot order, in FP32, rounded once: the core's reduction
        # of rows by index (one native pass, no gather per slot); without a bias no sum can
        # be -0.0, so the +0.0 of an unused slot changes nothing (reduce_at_source)
        out = torch.empty((T, H), dtype=torch.bfloat16)
        native.reduce_at(to_numpy(torch.cat(blocks)), np.where(use, row_of, np.int64(-1)),
                         np.zeros(use.shape, np.float32), to_numpy(out), K, DTYPES["bf16"], False)
        return out

    def _combined_weights(self, handle: EPHandle, route: _Route,
                          topk_weights: torch.Tensor) -> torch.Tensor:
        """``combined_topk_weights``: each slot's weight from the rank that owns it, summed at
        the sources as the V1 facade's combine sums them (``Backends.weights_back``): a rank
        sends, per received row, its own slots' weights and zeros, so each slot's sum is its
        one weight."""
        rec, src = route.rec, route.src
        n = rec.num_rows
        if handle.do_expand:  # allow_multiple_reduction: a row's slots from the expanded rows
            at = torch.from_numpy(np.maximum(rec.slots, 0))
            values = torch.where(torch.from_numpy(rec.slots >= 0), topk_weights[at], 0.0)
        else:
            values = torch.where(torch.from_numpy(rec.local_idx >= 0), topk_weights[:n], 0.0)
        R = self.num_ranks
        in_rank = np.stack([(src.owner == r).any(axis=1) for r in range(R)], axis=1)
        return cast(torch.Tensor, self.core.backends.weights_back(
            route.back.backend, values, rec.rows_per_rank, in_rank,
            int(route.back.sent.sum(axis=0).max(initial=0)), R * handle.num_max_tokens_per_rank))

    # ------------------------------------------------------------------ shared
    def _check_handle(self, handle: Any) -> None:
        if not isinstance(handle, EPHandle):
            raise InvalidArgumentError("handle", type(handle).__name__,
                                       "must be the EPHandle a dispatch of this buffer returned")
        if handle.dispatch_route.owner is not self._owner:
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

    def flush(self) -> None:
        """Finish deferred epilogues before the next call (their wait() still returns them)."""
        pending, self._pending[:] = list(self._pending), []
        for deferred in pending:
            deferred()
