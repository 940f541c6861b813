"""The Python side of the native core's ABI (``src/ubep/runtime/native/abi.h`` is the C side).

One home for what Python and C must agree on:

* the codes: errors, payload types, sync modes, engines, layouts, trace slots;
* the fixed offsets inside the segment header and inside the control records (where each record
  sits in a segment is :mod:`ubep.runtime.layout`'s business; what lies at which byte of a
  record is fixed here and in ``abi.h``);
* the engine's parameters, built from a :class:`~ubep.buffer.BufferConfig` and a
  :class:`~ubep.runtime.layout.SegmentLayout` (:func:`engine_params`);
* the error record an engine returns (the native engine builds it from the type handed over
  at load) and its conversion to an exception (:class:`ErrorRecord`).

:func:`load_native` imports ``ubep.runtime._native`` and compares what it exports (codes, record
offsets, parameter keys, ABI version) with this module: a build older or newer than the Python
code fails there, with a message that says to rebuild, instead of misreading records later.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import dtypes as _dt
from .. import modes
from ..env import wait_yield_us_from_env
from ..errors import (
    InvalidArgumentError,
    OutOfStepError,
    PeerLostError,
    RemoteError,
    TimeoutError,
    UbepError,
)
from .host_topology import last_level_cache_bytes

if TYPE_CHECKING:
    from ..config import BufferConfig
    from .layout import SegmentLayout

__all__ = [
    "ABI_VERSION",
    "DTYPES",
    "ENGINES",
    "ERRORS",
    "HEADER",
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

ABI_VERSION = 3  # abi.h UBEP_ABI_VERSION

# --- codes -------------------------------------------------------------------------------------

E_OK, E_BAD_INPUT, E_TIMEOUT, E_PEER_LOST, E_REMOTE, E_INTERNAL, E_LOST = range(7)
ERRORS = {"ok": E_OK, "bad_input": E_BAD_INPUT, "timeout": E_TIMEOUT, "peer_lost": E_PEER_LOST,
          "remote": E_REMOTE, "internal": E_INTERNAL, "lost": E_LOST}
# name -> native code: a name's position in ubep.modes' tuple (abi.h's enums, same order)
DTYPES: dict[str, int] = {name: code for code, name in enumerate(modes.DTYPE_NAMES)}
SYNCS: dict[str, int] = {name: code for code, name in enumerate(modes.SYNCS)}
ENGINES: dict[str, int] = {name: code for code, name in enumerate(modes.ENGINES)}
LAYOUTS: dict[str, int] = {name: code for code, name in enumerate(modes.LAYOUTS)}
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

# --- the segment header (written and checked by ubep.runtime.shm; the engine never reads it) ---

HEADER_BYTES = 256
HEADER = struct.Struct("<8sIIQQ16s16s")  # magic, version, owner rank, size, pid, group id, kind
HDR_MAGIC, HDR_VERSION, HDR_OWNER, HDR_SIZE, HDR_PID, HDR_GROUP, HDR_KIND = (
    0, 8, 12, 16, 24, 32, 48)

# --- control records (docs/FORMATS.md "Control records"; abi.h's structs) ---------------------

LINE_BYTES = 64  # every record starts a line of its own
WORD_CHECK = 8  # a progress word [value u64][~value u64]
DOORBELL_SLEEPERS = 32  # the doorbell line: [eventcount u32] ... [sleepers u32]
# an inbox entry (per source and epoch parity)
IN_COUNTS_EPOCH, IN_ROWS, IN_SUM = 0, 8, 16
IN_SW_COUNT, IN_SW_EPOCH = 64, 72
IN_DC_COUNT, IN_DC_SUM, IN_DC_EPOCH = 128, 136, 144
IN_COUNTS = 192  # u32 counts per local expert
# the combine info (per epoch parity)
CI_OFF, CI_ROWS, CI_STRIDE, CI_EPOCH, CI_INDEX, CI_SUM = 0, 8, 16, 24, 32, 40
CI_BYTES = 64
# a failure notice (per epoch parity): [epoch][length | code << 32][message][checksum]
FAIL_EPOCH, FAIL_LEN, FAIL_MSG, FAIL_SUM = 0, 8, 16, 488
FAIL_MSG_MAX = 472
FAIL_BYTES = 512
# the routing of a dispatch: [num_tokens][epoch][checksum], then topk_idx as int32
ROUTE_NTOK, ROUTE_EPOCH, ROUTE_SUM = 0, 8, 16
ROUTE_IDX = 64

_OFFSET_NAMES = (
    "HEADER_BYTES", "LINE_BYTES", "WORD_CHECK", "DOORBELL_SLEEPERS",
    "IN_COUNTS_EPOCH", "IN_ROWS", "IN_SUM", "IN_SW_COUNT", "IN_SW_EPOCH", "IN_DC_COUNT",
    "IN_DC_SUM", "IN_DC_EPOCH", "IN_COUNTS",
    "CI_OFF", "CI_ROWS", "CI_STRIDE", "CI_EPOCH", "CI_INDEX", "CI_SUM", "CI_BYTES",
    "FAIL_EPOCH", "FAIL_LEN", "FAIL_MSG", "FAIL_MSG_MAX", "FAIL_SUM", "FAIL_BYTES",
    "ROUTE_NTOK", "ROUTE_EPOCH", "ROUTE_SUM", "ROUTE_IDX",
)
OFFSETS: dict[str, int] = {name: globals()[name] for name in _OFFSET_NAMES}

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


# --- the error record ------------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorRecord:
    """What an engine returns instead of a result. The native engine builds it from this type
    (:func:`load_native` hands it over once), decoding ``what`` and ``message`` without failing:
    peers write them, any bytes at all.

    Attributes:
        code: ``E_*`` (1 bad input, 2 timeout, 3 peer lost, 4 remote failure, 5 internal,
            6 out of step).
        peer: the rank concerned (``-1``: none).
        core: the core that failed; for ``E_REMOTE`` the code of the peer's notice.
        argument: bad input: the offending argument's name.
        what: the description.
        message: bad input: the offending value; remote: the peer's notice.
    """

    code: int
    peer: int
    core: int
    argument: str
    what: str
    message: str

    @property
    def clean(self) -> bool:
        """Rejected before anything of the call reached a peer (here or on the peer whose
        notice this is): the ranks are still in step."""
        return self.code == E_BAD_INPUT or (self.code == E_REMOTE and self.core == E_BAD_INPUT)

    def to_exception(self, rank: int) -> UbepError:
        """The exception this record stands for (:data:`EXCEPTIONS`)."""
        return EXCEPTIONS.get(self.code, _internal)(self, rank)


def _bad_input(rec: ErrorRecord, rank: int) -> UbepError:
    value: object = rec.message
    with contextlib.suppress(ValueError):
        value = int(rec.message)
    return InvalidArgumentError(rec.argument, value, rec.what)


def _internal(rec: ErrorRecord, rank: int) -> UbepError:
    return UbepError(f"rank {rank}: internal error: {rec.what}")


# code -> the exception class it becomes (each built from the record's fields)
EXCEPTIONS: dict[int, Callable[[ErrorRecord, int], UbepError]] = {
    E_BAD_INPUT: _bad_input,
    E_TIMEOUT: lambda rec, rank: TimeoutError(rec.what),
    E_PEER_LOST: lambda rec, rank: PeerLostError(rec.what),
    E_REMOTE: lambda rec, rank: RemoteError(rec.peer, rec.message, rec.clean),
    E_INTERNAL: _internal,
    E_LOST: lambda rec, rank: OutOfStepError(f"{rec.what}; call resync() on every rank"),
}


# --- loading the native module ---------------------------------------------------------------


def check_native(native: Any) -> None:
    """Raise ``ImportError`` unless ``native`` exports exactly this module's ABI."""
    ours: dict[str, object] = {
        "ABI": ABI_VERSION, "ERRORS": ERRORS, "DTYPES": DTYPES, "SYNCS": SYNCS,
        "ENGINES": ENGINES, "LAYOUTS": LAYOUTS, "QUANTS": QUANTS, "OFFSETS": OFFSETS,
        "PARAMS": PARAMS, "TRACE": TRACE, "POLICIES": POLICIES,
    }
    for name, want in ours.items():
        got = getattr(native, name, None)
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
