"""What engines on host memory share: a row kernel (it fills a call's arrays) made an
:class:`~ubep.plane.protocol.Engine` that builds its own results.

The native engine on one host and the MPI RMA engine both keep their receive regions in memory
this process addresses and fill the arrays of a :class:`~ubep.plane.protocol.DispatchCall` /
:class:`~ubep.plane.protocol.CombineCall` (their *kernel*: ``run_dispatch``, ``run_combine``,
``complete`` returning a row count). :class:`HostEngine` turns one into the contract's engine:
it allocates the outputs, builds the ``DispatchResult`` (``recv_x`` a read-only view of the
receive region) or ``y``, and keeps a split-phase call's outputs until ``complete``. An engine
whose memory the host cannot address (an accelerator's) implements the protocol itself and
returns tensors of its device; nothing in the contract needs this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .layout import HostRegions
from .protocol import PLAIN, CallOptions, CombineCall, DispatchCall, EngineSpec
from .records import ErrorRecord
from .results import DispatchHandle, DispatchResult, RuntimeHandle

__all__ = ["HostEngine", "int64_outputs", "new_frozen"]

_T = TypeVar("_T")


def new_frozen(cls: type[_T], **fields: Any) -> _T:
    """Build a frozen dataclass instance without ``__init__``/``__post_init__``.

    Only for results this module assembles itself, whose consistency holds by construction:
    the generated frozen ``__init__`` plus the handle's checks cost ~12 us per dispatch, more
    than the rest of the Python side together. Every field must be given.
    """
    obj = object.__new__(cls)
    assert fields.keys() == _field_names(cls)  # type: ignore[arg-type]
    object.__setattr__(obj, "__dict__", fields)  # the call's own fresh dict: no copy
    return obj


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(cls.__dataclass_fields__)  # type: ignore[attr-defined]


def int64_outputs(cap: int, K: int, L: int, R: int, ntok: int,
                  expert: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A dispatch's int64 outputs as views of one allocation (one malloc, not four):
    ``recv_topk_idx``, ``meta`` (recv_src_rank, recv_src_token, recv_src_k), ``counts`` (per
    local expert, then rows per source rank, then the rows each source sent each rank, ``R x
    R``) and ``send_dst_row``."""
    w_idx, w_dst = (1, K) if expert else (K, R)
    a = cap * w_idx
    b = a + 3 * cap
    c = b + L + R + R * R
    block = np.empty(c + ntok * w_dst, np.int64)
    o_idx = block[:a]
    return (o_idx if expert else o_idx.reshape(cap, K), block[a:b].reshape(3, cap), block[b:c],
            block[c:].reshape(ntok, w_dst))


@dataclass(frozen=True, slots=True)
class _Outputs:
    """A dispatch's output arrays, filled by the kernel, and what its result is built from."""

    index: int
    ntok: int
    copy: bool
    o_idx: np.ndarray
    o_w: np.ndarray
    meta: np.ndarray
    counts: np.ndarray
    o_dst: np.ndarray
    idx: np.ndarray
    w: np.ndarray
    generation: int


class HostEngine:
    """The :class:`~ubep.plane.protocol.Engine` of a row kernel on host memory.

    Args:
        kernel: fills calls' arrays (``run_dispatch(DispatchCall)``,
            ``run_combine(CombineCall)``, ``complete``, ``abandon``, ``fail``, ``resync``,
            ``wait_done``, ``comb_last_epoch``, ``reset_all``, ``close``).
        spec: what the engine was opened with.
        regions: the receive regions' views and the combine staging regions.
        fast: the kernel's one-call path takes blocking calls itself (the native engine:
            ``kernel.dispatch`` / ``kernel.combine`` run them and build their results in C,
            handing every other call to this object's general path).
    """

    def __init__(self, kernel: Any, spec: EngineSpec, regions: HostRegions, *,
                 fast: bool = False) -> None:
        cfg = spec.config
        self.kernel = kernel
        self.spec = spec
        self.regions = regions
        self._pending: dict[int, Callable[[int], Any]] = {}  # split calls' result builders
        self._expert = cfg.layout != "rank"
        self._L = cfg.num_experts // spec.num_ranks
        self._handle_const = {
            "layout": cfg.layout, "rank": spec.rank, "num_ranks": spec.num_ranks,
            "num_experts": cfg.num_experts, "hidden": cfg.hidden, "buffer_uid": spec.uid,
        }
        # the door: the kernel's own one-call entries when it has them (no Python frame on a
        # blocking call), else this object's general path
        self.takes_unchecked = fast
        self.takes_tensors = False  # host memory: every input a checked numpy array
        self.dispatch: Callable[..., Any] = kernel.dispatch if fast else self.general_dispatch
        self.combine: Callable[..., Any] = kernel.combine if fast else self.general_combine
        self.fail = kernel.fail
        self.reset_all = kernel.reset_all

    def set_signature(self, word: int) -> None:
        """What this rank's next dispatches are (``Buffer.sign``): the kernel's count records
        carry the word."""
        self.kernel.set_signature(word)

    # --- tracing (the kernel's rings, where it keeps any) ------------------------------------

    def trace_enable(self, capacity: int) -> bool:
        enable = getattr(self.kernel, "trace_enable", None)
        if enable is None:
            return False
        enable(capacity)
        return True

    def trace_spans(self) -> tuple[bytes, tuple[int, ...], int]:
        spans = getattr(self.kernel, "trace_spans", None)
        if spans is None:
            return b"", (), 0
        got: tuple[bytes, tuple[int, ...], int] = spans()
        return got

    # --- dispatch ---------------------------------------------------------------------------

    def general_dispatch(
        self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray, epoch: int,
        index: int, generation: int, plan: Any, opts: CallOptions | None = None,
    ) -> DispatchResult[RuntimeHandle] | ErrorRecord | None:
        """A dispatch of checked arrays (the Buffer's checks: ``x`` in storage dtype,
        ``topk_idx`` / ``topk_weights`` owned C-contiguous copies)."""
        opts = opts or PLAIN
        lay = self.spec.layout
        ntok = x.shape[0]
        cap, K, R = lay.cap_rows, self.spec.config.num_topk, self.spec.num_ranks
        o_idx, meta, counts, o_dst = int64_outputs(cap, K, self._L, R, ntok, self._expert)
        o_w = np.empty(cap if self._expert else (cap, K), np.float32)
        got = self.kernel.run_dispatch(DispatchCall(
            x=x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens=ntok, epoch=epoch,
            index=index, recv_topk_idx=o_idx, recv_topk_weights=o_w, recv_src_rank=meta[0],
            recv_src_token=meta[1], recv_src_k=meta[2], counts=counts, send_dst_row=o_dst,
            plan=plan, split=opts.split, prequant=opts.prequant,
        ))
        if type(got) is ErrorRecord:
            return got
        out = _Outputs(index, ntok, opts.copy, o_idx, o_w, meta, counts, o_dst, topk_idx,
                       topk_weights, generation)
        return self._settled(epoch, got, functools.partial(self._dispatch_result, out))

    def _dispatch_result(self, o: _Outputs, n: int) -> DispatchResult[RuntimeHandle]:
        reg = o.index % self.spec.layout.num_regions
        recv_x = self.regions.recv_views[reg][:n]
        scales = self.regions.scale_views[reg][:n] if self.regions.scale_views else None
        if o.copy:
            recv_x = recv_x.copy()
            scales = None if scales is None else scales.copy()
        # shared by the result and the handle, and what combine trusts: not writable
        for owned in (o.meta, o.o_dst, o.idx, o.w):
            owned.flags.writeable = False
        src_rank, src_token, src_k = o.meta[0, :n], o.meta[1, :n], o.meta[2, :n]
        L, R = self._L, self.spec.num_ranks
        handle = new_frozen(
            RuntimeHandle, **self._handle_const, num_tokens=o.ntok, x_dtype=self.spec.dtype_name,
            topk_idx=o.idx, topk_weights=o.w, recv_src_rank=src_rank, recv_src_token=src_token,
            recv_src_k=src_k, num_recv_rows_per_rank=o.counts[L:L + R], send_dst_row=o.o_dst,
            dispatch_index=o.index, generation=o.generation,
        )
        return new_frozen(
            DispatchResult, recv_x=recv_x, recv_topk_idx=o.o_idx[:n],
            recv_topk_weights=o.o_w[:n], num_recv_tokens_per_expert=o.counts[:self._L],
            recv_src_rank=src_rank, recv_src_token=src_token, recv_src_k=src_k, handle=handle,
            recv_x_scales=scales, num_sent_rows_per_rank=o.counts[L + R:].reshape(R, R),
        )

    # --- combine ----------------------------------------------------------------------------

    def general_combine(
        self, expert_out: np.ndarray, handle: DispatchHandle, epoch: int, generation: int,
        num_dispatches: int, opts: CallOptions | None = None,
    ) -> np.ndarray | ErrorRecord | None:
        """A combine of checked arguments (``expert_out`` in combine storage dtype, the
        handle's arrays C-contiguous)."""
        del generation, num_dispatches  # the Buffer checked the handle against them
        opts = opts or PLAIN
        index = int(getattr(handle, "dispatch_index", -1))
        assert handle.send_dst_row is not None  # the Buffer's checks
        y = np.empty((handle.num_tokens, self.spec.config.hidden),
                     dtype=self.spec.combine_storage)
        got = self.kernel.run_combine(CombineCall(
            expert_out=expert_out, num_rows=handle.num_recv_rows, topk_idx=handle.topk_idx,
            topk_weights=handle.topk_weights, send_dst_row=handle.send_dst_row,
            num_tokens=handle.num_tokens, epoch=epoch, region=combine_region(index), y=y,
            dispatch_index=index, split=opts.split,
        ))
        if type(got) is ErrorRecord:
            return got
        return self._settled(epoch, got, lambda n: y)

    def combine_buffer(self, index: int, rows: int) -> np.ndarray | ErrorRecord:
        """A writable ``[rows, hidden]`` array in this rank's combine staging region of dispatch
        ``index``, once no peer still reads the combine that used it last."""
        reg = combine_region(index)
        last = int(self.kernel.comb_last_epoch(reg))
        got = self.kernel.wait_done(last, float(self.spec.config.timeout_s))
        if type(got) is ErrorRecord:
            return got
        return np.ndarray((rows, self.spec.config.hidden), dtype=self.spec.combine_storage,
                          buffer=self.regions.comb_regions[reg])

    def stale_view(self, array: Any, dispatch_index: int,
                   num_dispatches: int) -> tuple[str, str] | None:
        """A view of a receive region a dispatch after ``dispatch_index`` filled again."""
        if not isinstance(array, np.ndarray) or array.size == 0:
            return None
        lay, n = self.spec.layout, num_dispatches
        lo, hi = _byte_span(array)
        for r, view in enumerate(self.regions.recv_views):
            base = int(view.__array_interface__["data"][0])
            if hi <= base or lo >= base + lay.out_bytes or n <= r:
                continue
            last = n - 1 - (n - 1 - r) % lay.num_regions  # the latest dispatch into region r
            index = dispatch_index if dispatch_index >= 0 else last
            if last > index:
                return (f"a view of receive region {r}",
                        f"was overwritten by dispatch {last} after the handle's dispatch {index} "
                        "(a recv_x view stays valid until the second dispatch after it): "
                        "combine before that, or dispatch with copy=True")
        return None

    def recv_valid(self, dispatch_index: int, num_dispatches: int) -> bool:
        """A receive region is filled again by the ``num_regions``-th dispatch after the one
        that filled it (``dispatch(copy=True)`` rows are the caller's and stay)."""
        refilled_at = dispatch_index + self.spec.layout.num_regions
        return dispatch_index >= 0 and num_dispatches <= refilled_at

    # --- split-phase calls ------------------------------------------------------------------

    def _settled(self, epoch: int, got: Any, finish: Callable[[int], Any]) -> Any:
        if got is None:  # the first half ran: complete() builds the result
            self._pending[epoch] = finish
            return None
        return finish(int(got))

    def complete(self, epoch: int) -> Any:
        """The second half of split call ``epoch``: its result or an ``ErrorRecord``."""
        finish = self._pending.pop(epoch)
        got = self.kernel.complete(epoch)
        return got if type(got) is ErrorRecord else finish(int(got))

    def abandon(self, epoch: int, message: str) -> None:
        self._pending.pop(epoch, None)
        self.kernel.abandon(epoch, message)

    def resync(self, base_epoch: int) -> None:
        self._pending.clear()
        self.kernel.resync(base_epoch)

    def close(self) -> None:
        """Stop the kernel and drop every view of its memory (the mapping goes with the last
        view: the caller's own results keep theirs)."""
        self._pending.clear()
        self.regions = HostRegions([], [], [])
        self.kernel.close()


def _byte_span(a: np.ndarray) -> tuple[int, int]:
    """The first and one-past-last byte address ``a`` can reach (numpy's ``byte_bounds``,
    which moved between numpy 1 and 2)."""
    lo = hi = int(a.__array_interface__["data"][0])
    for n, stride in zip(a.shape, a.strides, strict=True):
        if stride < 0:
            lo += (n - 1) * stride
        else:
            hi += (n - 1) * stride
    return lo, hi + a.itemsize


def combine_region(dispatch_index: int) -> int:
    """The combine staging region (0 or 1) of the outputs of dispatch ``dispatch_index``."""
    return dispatch_index % 2 if dispatch_index >= 0 else 0
