"""The Python side of the native core's ABI (``src/ubep/runtime/native/abi.h`` is the C side).

One home for what Python and C must agree on:

* the codes: errors, payload types, sync modes, engines, layouts, trace slots;
* the engine's parameters, built from a :class:`~ubep.buffer.BufferConfig` and a
  :class:`~ubep.plane.layout.SegmentLayout` (:func:`engine_params`).

The error codes, the error record and the control records' offsets every engine shares are
:mod:`ubep.plane.records`; this module checks the native build against them too.

:func:`load_native` imports ``ubep.runtime._native`` and compares what it exports (codes, record
offsets, parameter keys, ABI version) with this module: a build older or newer than the Python
code fails there, with a message that says to rebuild, instead of misreading records later.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

from .. import dtypes as _dt
from .. import modes
from ..env import wait_yield_us_from_env
from ..plane.records import ERRORS, HEADER_BYTES, OFFSETS, ErrorRecord
from ..plane.results import DispatchResult, RuntimeHandle
from .host_topology import last_level_cache_bytes

if TYPE_CHECKING:
    from ..config import BufferConfig
    from ..plane.layout import SegmentLayout

# the shared codes and records are ubep.plane.records' (HEADER_BYTES re-exported for the
# torch layer's raw buffers)
__all__ = [
    "ABI_VERSION",
    "DTYPES",
    "ENGINES",
    "HEADER_BYTES",
    "LAYOUTS",
    "OFFSETS",
    "PARAMS",
    "POLICIES",
    "SYNCS",
    "TRACE",
    "ErrorRecord",
    "check_native",
    "engine_params",
    "llc_bytes",
    "load_native",
]

ABI_VERSION = 4  # abi.h UBEP_ABI_VERSION

# --- codes -------------------------------------------------------------------------------------

# name -> native code: a name's position in ubep.modes' tuple (abi.h's enums, same order)
DTYPES: dict[str, int] = {name: code for code, name in enumerate(modes.DTYPE_NAMES)}
SYNCS: dict[str, int] = {name: code for code, name in enumerate(modes.SYNCS)}
ENGINES: dict[str, int] = {name: code for code, name in enumerate(modes.ENGINES)}
LAYOUTS: dict[str, int] = {name: code for code, name in enumerate(modes.BUFFER_LAYOUTS)}
# the native scheduler's policies (schedule.h SCHED_*; ubep.sched.ScheduleSpec.policy_code)
POLICIES: dict[str, int] = {name: code for code, name in enumerate(modes.POLICIES)}
# BufferConfig.quant ("none" for None) -> the engine's code (abi.h QUANT_*)
QUANTS: dict[str, int] = {"none": 0, "e4m3": 1, "int8": 2}

# the engine's trace slots (abi.h TRACE_*): core 0's stamp as each phase of the last call ends
TRACE: dict[str, int] = {
    "d_enter": 0, "d_prev_done": 1, "d_validated": 2, "d_published": 3, "d_sent": 4,
    "d_counts_in": 5, "d_metadata": 6, "d_data_in": 7,
    "c_enter": 8, "c_prev_done": 9, "c_copied": 10, "c_published": 11, "c_peers": 12,
    "c_reduced": 13, "d_native": 14, "c_native": 15, "slots": 16,
}

# --- engine parameters -----------------------------------------------------------------------

# Keys the native engine reads (module.c's PARAMS table, same order); SegmentLayout gives the
# sizes and offsets (its size_bytes as seg_size), the config and the group the rest.
PARAMS = (
    "rank", "num_ranks", "num_cores", "num_experts", "num_local_experts", "num_topk",
    "max_tokens", "hidden", "itemsize", "dtype", "combine_dtype", "combine_itemsize", "sync",
    "engine", "layout", "num_regions", "num_land_regions", "threaded", "cap_rows",
    "cap_src_rows", "row_bytes", "slot_bytes", "out_stride", "combine_row_bytes",
    "tff_block_bytes", "tff_flag_bytes", "sentinel", "off_fail", "off_entered", "off_done",
    "off_recv_ready", "off_doorbell", "off_comb_info", "off_barrier", "off_inbox",
    "inbox_bytes", "off_route", "route_stride", "route_w_off", "off_land", "land_bytes",
    "off_out", "out_bytes", "off_comb", "comb_bytes", "seg_size", "timeout_ns", "yield_ns",
    "sp_check_bytes", "quant", "quant_round_scale", "background", "llc_bytes", "off_rsum",
    "rsum_bytes", "integrity",
)


@functools.cache
def llc_bytes() -> int:
    """The last-level cache combine.c sizes its prefetching by; 32 MiB where /sys is mute."""
    return last_level_cache_bytes() or 32 << 20


def engine_params(
    config: BufferConfig,
    layout: SegmentLayout,
    *,
    rank: int,
    num_ranks: int,
    num_cores: int,
    threaded: bool,
    background: bool = False,
) -> dict[str, int]:
    """The parameters an engine is built with (``Engine(params, addresses, pids, starts)``):
    exactly the keys of :data:`PARAMS`."""
    dtype = _dt.dtype_of(config.dtype)
    cdtype = _dt.dtype_of(config.combine_dtype)
    params = layout.as_params()
    params["seg_size"] = params.pop("size_bytes")
    params.update(
        rank=rank,
        num_ranks=num_ranks,
        num_cores=num_cores,
        num_experts=config.num_experts,
        num_local_experts=config.num_experts // num_ranks,
        num_topk=config.num_topk,
        max_tokens=config.max_tokens_per_rank,
        hidden=config.hidden,
        itemsize=dtype.itemsize,
        dtype=DTYPES[dtype.name],
        combine_dtype=DTYPES[cdtype.name],
        combine_itemsize=cdtype.itemsize,
        sync=SYNCS[config.sync],
        engine=ENGINES[config.engine],
        layout=LAYOUTS[config.layout],
        threaded=int(threaded),
        tff_block_bytes=config.tff_block_bytes,
        tff_flag_bytes=config.tff_flag_bytes,
        sentinel=dtype.sentinel or 0,
        timeout_ns=int(config.timeout_s * 1e9),
        yield_ns=int(wait_yield_us_from_env() * 1e3),
        sp_check_bytes=config.sp_check_bytes,
        quant=QUANTS[config.quant or "none"],
        quant_round_scale=int(config.quant_round_scale),
        background=int(background),
        llc_bytes=llc_bytes(),
        integrity=int(config.integrity == "checksum"),
    )
    return params


# --- loading the native module ---------------------------------------------------------------


def check_native(native: Any) -> None:
    """Raise ``ImportError`` unless ``native`` exports exactly this module's ABI."""
    ours: dict[str, object] = {
        "ABI": ABI_VERSION, "ERRORS": ERRORS, "DTYPES": DTYPES, "SYNCS": SYNCS,
        "ENGINES": ENGINES, "LAYOUTS": LAYOUTS, "QUANTS": QUANTS, "OFFSETS": OFFSETS,
        "PARAMS": PARAMS, "TRACE": TRACE, "POLICIES": POLICIES,
    }
    # the result's field names have one source, ubep.plane.results' dataclasses: the one-call
    # path builds exactly these
    ours["FIELDS"] = frozenset(DispatchResult.__dataclass_fields__) | frozenset(
        RuntimeHandle.__dataclass_fields__)
    for name, want in ours.items():
        got = getattr(native, name, None)
        if name == "FIELDS" and got is not None:
            got = frozenset(got)
        if got != want:
            raise ImportError(
                f"ubep's native data plane ({getattr(native, '__file__', native)}) is a stale "
                f"build: it exports {name}={got!r}, ubep.runtime.abi expects {want!r}. Rebuild "
                "it: `pip install -e . --no-deps --no-build-isolation` (or `make venv`)."
            )


@functools.cache
def load_native() -> Any:
    """``ubep.runtime._native``, checked against this module (:func:`check_native`)."""
    try:
        # by its full name: an import through this package's __init__ would tie the two
        _native = importlib.import_module(f"{__package__}._native")
    except ImportError as exc:
        raise ImportError(
            "ubep's native data plane (ubep.runtime._native) is not built. Install ubep with "
            "its build step (`pip install -e .` or `make venv` in the source tree; needs gcc and "
            f"the Python headers). Original error: {exc}"
        ) from exc
    check_native(_native)
    _native.set_error_type(ErrorRecord)
    return _native


@functools.cache
def native_or_none() -> Any:
    """:func:`load_native`'s module, or None without a native build: for the helpers that have
    a numpy way too (the DeepEP facades' layout and weights passes)."""
    try:
        return load_native()
    except ImportError:
        return None
