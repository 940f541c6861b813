"""Typed stub of ``ubep.runtime._native``, the C11 data plane (src/ubep/runtime/native/).

Arrays cross as C-contiguous buffers (numpy arrays); sizes are checked against the engine's
parameters. Collective methods return their result or an ``ubep.plane.records.ErrorRecord``
(built from the type :func:`set_error_type` hands over). ``dispatch`` / ``combine`` are the
door of ``ubep.plane.Engine`` (blocking calls of exact arrays run and their results built here;
calls with options go to the general path :meth:`Engine.set_fast` names); ``run_dispatch`` /
``run_combine`` take one call record (``ubep.plane.DispatchCall``, ``CombineCall``), read by
field name, and fill its arrays.
"""

from typing import Any

import numpy as np

from ubep.plane.protocol import CallOptions, CombineCall, DispatchCall
from ubep.plane.records import ErrorRecord
from ubep.sched import CoreSplit

ABI: int
KERNELS: str
ERRORS: dict[str, int]
DTYPES: dict[str, int]
SYNCS: dict[str, int]
ENGINES: dict[str, int]
LAYOUTS: dict[str, int]
POLICIES: dict[str, int]
QUANTS: dict[str, int]
OFFSETS: dict[str, int]
TRACE: dict[str, int]
PARAMS: tuple[str, ...]
FIELDS: tuple[str, ...]

class Engine:
    """The native engine of one Buffer (the kernel of ``ubep.plane.host.HostEngine``)."""

    def __init__(
        self,
        params: dict[str, int],
        addresses: list[int],
        pids: list[int],
        start_times: list[int],
    ) -> None: ...
    def run_dispatch(self, call: DispatchCall, /) -> int | ErrorRecord | None: ...
    def run_combine(self, call: CombineCall, /) -> int | ErrorRecord | None: ...
    def complete(self, epoch: int, /) -> int | ErrorRecord: ...
    def abandon(self, epoch: int, message: str, /) -> None: ...
    def fail(
        self, epoch: int, code: int, message: str, finished: int, timeout_s: float, /
    ) -> int | ErrorRecord: ...
    def resync(self, base_epoch: int, /) -> None: ...
    def wait_done(self, epoch: int, timeout_s: float, /) -> int | ErrorRecord: ...
    def reset_all(self) -> None: ...
    def comb_last_epoch(self, region: int, /) -> int: ...
    def close(self) -> None: ...
    def set_fast(
        self,
        result_type: type,
        handle_type: type,
        handle_const: dict[str, Any],
        recv_views: list[np.ndarray],
        scale_views: list[np.ndarray] | None,
        x_dtype: Any,
        combine_dtype: Any,
        general_dispatch: Any,
        general_combine: Any,
        plain: CallOptions,
        /,
    ) -> None: ...
    def dispatch(
        self,
        x: object,
        topk_idx: object,
        topk_weights: object,
        epoch: int,
        index: int,
        generation: int,
        plan: CoreSplit | None,
        opts: CallOptions | None = None,
        /,
    ) -> Any: ...
    def combine(
        self, expert_out: object, handle: object, epoch: int, generation: int,
        num_dispatches: int, opts: CallOptions | None = None, /,
    ) -> Any: ...
    def trace(self) -> tuple[int, ...]: ...
    def poke(self, kind: int, phase: int, rank: int, offset: int, data: bytes, /) -> None: ...
    def core_log(self) -> tuple[list[list[int]], list[list[int]]]: ...

def set_error_type(error_type: type[ErrorRecord], /) -> None:
    """The type failed calls return (``ubep.runtime.abi.load_native`` hands it over)."""

def copy(dst: Any, src: Any, element_safe: int = 0, /) -> None:
    """The data plane's copy (``element_safe``: SP's untorn-element copy)."""

def dc_checksum(rows: Any, row_bytes: int, epoch: int, /) -> int:
    """DC checksum of a batch of rows (``ubep.flags.DcCodec``'s, computed natively)."""

def convert(acc_f32: Any, out: Any, dtype_code: int, /) -> None:
    """Round float32 values to ``dtype_code`` with combine's rounding routine."""

def reduce_rows(
    rows: Any, nt: int, weights: Any, out: Any, dtype_code: int, weighted: bool, /
) -> None:
    """Combine's reduction (``REDUCE[dtype_code]``) of the ``nt`` rows of ``rows`` into
    ``out`` (each row as long as ``out``), weighted by ``weights`` (float32) or not."""

def reduce_at(
    rows: Any, at: Any, weights: Any, out: Any, k: int, dtype_code: int, weighted: bool, /
) -> None:
    """Combine's reduction of rows by index: per token ``t``, ``REDUCE[dtype_code]`` of the
    rows ``rows[at[t, j]]`` with ``at[t, j] >= 0`` (int64 ``[ntok, k]``), in ascending ``j``,
    weighted by ``weights[t, j]`` (float32) or not, into ``out[t]``; a token with none gets
    zero bytes. ``ValueError`` if an index is outside ``rows``."""

def storage_views(to_dlpack: Any, /, *tensors: Any) -> tuple[Any, ...]:
    """Each of ``tensors`` that is not a numpy array or None as a numpy view of its memory, by
    its DLPack capsule (``to_dlpack(t)``; BF16 as ``uint16`` bits); one this path does not view
    (another device, a dtype numpy does not store) as it was."""

def tensor_capsule(array: Any, dlpack_code: int, /) -> Any:
    """A DLPack ``"dltensor"`` capsule over ``array``'s memory with the DLPack dtype code
    ``dlpack_code`` (4: bfloat, for ``uint16`` bits), keeping ``array`` alive."""

def use_dlpack(to_dlpack: Any, /) -> None:
    """From now on the engine's door (``Engine.dispatch`` / ``combine``) takes a tensor as the
    numpy view of its DLPack capsule (``to_dlpack(t)``), and declines one it does not view."""

def y_pool_min_bytes(bytes: int = 0, /) -> int:
    """The size from which a one-call combine's output is a view of one of the Buffer's two
    reusable blocks (32 MiB by default); ``bytes > 0`` sets it. Returns the previous value."""

def use_kernels(level: int, /) -> str:
    """Install the best kernel set up to ``level`` (0 generic, 1 AVX2, 2 AVX-512) that this
    CPU has and return its name; 2 is the module's default (tests run every set)."""

def quantize_rows(
    x: Any,
    fmt: str,
    round_scale: bool,
    values_out: Any,
    scales_out: Any,
    generic: bool = False,
    /,
) -> None:
    """``ubep.quant.quantize`` natively (``quant_row_e4m3`` / ``quant_row_int8`` per row):
    ``x [rows, hidden]`` uint16 (BF16 bits), float16 or float32 into ``values_out``
    (``rows * hidden`` bytes) and ``scales_out`` (``rows * hidden // 128`` float32);
    ``generic``: the baseline build of the row loop rather than the selected (AVX2) one."""

def schedule(
    topk_idx_i32: Any,
    spec: tuple[int, int, int, int, int, int, Any, Any, Any],
    out_units: Any,
    out_core_ptr: Any,
    /,
) -> int:
    """The native scheduler alone: ``spec`` is ``(policy_code, expert_layout, num_ranks,
    num_experts, num_topk, num_send_cores, hop_of_rank, hop_issue_rank, remapped_expert)``;
    fills ``out_units`` (int64 ``[6, num_tokens * num_topk]``: token, k, expert, destination,
    hop, slot per unit in issue order) and ``out_core_ptr`` (int64 ``[num_send_cores + 1]``);
    returns the number of units."""

def dispatch_layout(
    idx: Any, num_experts: int, num_ranks: int, per_rank: Any, per_expert: Any, in_rank: Any, /
) -> bool:
    """DeepEP's layout of int64 ``idx [T, K]`` into ``per_rank`` (int32), ``per_expert``
    (int32) and ``in_rank`` (bool ``[T, num_ranks]``); True where an id is out of range or a
    row names an expert twice (the outputs then undefined)."""

def counts_sum(epoch: int, rows: int, counts: Any, /) -> int: ...
def ranks_sum(epoch: int, rows_per_rank: Any, /) -> int: ...
def route_sum(epoch: int, ntok: int, idx: Any, weights: Any, /) -> int: ...
def row_sums(rows: Any, row_bytes: int, /) -> bytes: ...
def comb_info_sum(
    epoch: int, offset: int, rows: int, stride: int, dispatch_index: int, /
) -> int: ...
