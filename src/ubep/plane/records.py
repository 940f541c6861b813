"""What every engine shares: the error codes and the typed error record an engine returns
instead of a result, and the control records' fixed offsets (docs/FORMATS.md "Control
records"; ``runtime/native/abi.h`` is the C side, checked against these at load).

Where each record sits in an engine's memory is :mod:`ubep.plane.layout`'s business; what lies at
which byte of a record is fixed here.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable
from dataclasses import dataclass

from .. import errors  # qualified: ubep's TimeoutError is not the builtin

__all__ = [
    "ERRORS",
    "EXCEPTIONS",
    "E_BAD_INPUT",
    "E_INTERNAL",
    "E_LOST",
    "E_OK",
    "E_PEER_LOST",
    "E_REMOTE",
    "E_TIMEOUT",
    "HEADER",
    "HEADER_BYTES",
    "OFFSETS",
    "ErrorRecord",
]

# --- error codes -------------------------------------------------------------------------------

E_OK, E_BAD_INPUT, E_TIMEOUT, E_PEER_LOST, E_REMOTE, E_INTERNAL, E_LOST = range(7)
ERRORS = {"ok": E_OK, "bad_input": E_BAD_INPUT, "timeout": E_TIMEOUT, "peer_lost": E_PEER_LOST,
          "remote": E_REMOTE, "internal": E_INTERNAL, "lost": E_LOST}
# --- the segment header (written and checked by the memory's owner; no engine reads it) ---

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
IN_SIGNATURE = 56  # the source's call signature (ubep.buffer.signature), outside the checksum
IN_SW_COUNT, IN_SW_EPOCH = 64, 72
IN_DC_COUNT, IN_DC_SUM, IN_DC_EPOCH = 128, 136, 144
IN_COUNTS = 192  # u32 counts per local expert, then u32 rows the source sends each rank
IN_RANKS_SUM = 152  # the checksum of those rows per rank (bound to the call's epoch)
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
    "IN_DC_SUM", "IN_DC_EPOCH", "IN_COUNTS", "IN_RANKS_SUM",
    "IN_SIGNATURE",
    "CI_OFF", "CI_ROWS", "CI_STRIDE", "CI_EPOCH", "CI_INDEX", "CI_SUM", "CI_BYTES",
    "FAIL_EPOCH", "FAIL_LEN", "FAIL_MSG", "FAIL_MSG_MAX", "FAIL_SUM", "FAIL_BYTES",
    "ROUTE_NTOK", "ROUTE_EPOCH", "ROUTE_SUM", "ROUTE_IDX",
)
OFFSETS: dict[str, int] = {name: globals()[name] for name in _OFFSET_NAMES}

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

    def to_exception(self, rank: int) -> errors.UbepError:
        """The exception this record stands for (:data:`EXCEPTIONS`)."""
        return EXCEPTIONS.get(self.code, _internal)(self, rank)

    @classmethod
    def of(cls, exc: BaseException) -> ErrorRecord:
        """The record an engine that raises (rather than returns records) hands back for
        ``exc``: :meth:`to_exception`'s inverse for ubep's exceptions; anything else leaves the
        ranks out of step (``E_LOST``)."""
        if isinstance(exc, errors.InvalidArgumentError):
            return cls(E_BAD_INPUT, -1, 0, exc.argument, exc.problem, str(exc.value))
        if isinstance(exc, errors.TimeoutError):
            return cls(E_TIMEOUT, -1, 0, "", str(exc), "")
        if isinstance(exc, errors.PeerLostError):
            return cls(E_PEER_LOST, -1, 0, "", str(exc), "")
        if isinstance(exc, errors.RemoteError):
            return cls(E_REMOTE, exc.rank, E_BAD_INPUT if exc.clean else E_LOST, "", str(exc),
                       exc.message)
        return cls(E_LOST, -1, 0, "", str(exc), "")


def _bad_input(rec: ErrorRecord, rank: int) -> errors.UbepError:
    value: object = rec.message
    with contextlib.suppress(ValueError):
        value = int(rec.message)
    return errors.InvalidArgumentError(rec.argument, value, rec.what)


def _internal(rec: ErrorRecord, rank: int) -> errors.UbepError:
    return errors.UbepError(f"rank {rank}: internal error: {rec.what}")


# code -> the exception class it becomes (each built from the record's fields)
EXCEPTIONS: dict[int, Callable[[ErrorRecord, int], errors.UbepError]] = {
    E_BAD_INPUT: _bad_input,
    E_TIMEOUT: lambda rec, rank: errors.TimeoutError(rec.what),
    E_PEER_LOST: lambda rec, rank: errors.PeerLostError(rec.what),
    E_REMOTE: lambda rec, rank: errors.RemoteError(rec.peer, rec.message, rec.clean),
    E_INTERNAL: _internal,
    E_LOST: lambda rec, rank: errors.OutOfStepError(f"{rec.what}; call resync() on every rank"),
}
