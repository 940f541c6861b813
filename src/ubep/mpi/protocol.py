"""The call protocol of the RMA engine (:mod:`ubep.mpi.engine`, "Call protocol"): its control
window's layout, the self-checking records peers write there (``[payload][check][epoch]``),
done records and failure notices, and the bounded waits that check deadline, failure notices,
peer progress and liveness while they poll. :class:`RmaProtocol` is the engine's base class:
the engine moves rows, this part decides when a call may go on and how it ends.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..flags.dc import words_checksum
from ..plane.layout import align_up
from ..plane.records import E_BAD_INPUT, E_LOST, E_PEER_LOST, E_REMOTE, E_TIMEOUT, ErrorRecord
from ..runtime.abi import native_or_none
from .memory import MpiGlobalMemory

__all__ = ["RmaProtocol", "record_check"]

_LINE = 64
_FAIL_BYTES = 512
_FAIL_MSG_MAX = 472  # the notice payload: [length u64][code u64][UTF-8 text]
_LIVENESS_PERIOD_NS = 10_000_000
_CHECK_PERIOD_NS = 1_000_000
_YIELD_SPINS = 200


def record_check(payload: np.ndarray, epoch: int) -> int:
    """Check word of a control record: the DC formula of docs/FORMATS.md over the payload's
    little-endian u64 words (zero padded), never 0 (:func:`ubep.flags.dc.words_checksum`)."""
    raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    pad = (-raw.size) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, np.uint8)])
    native = native_or_none()
    if native is not None and raw.size:  # the same formula in one C pass (read every poll)
        return int(native.dc_checksum(raw.reshape(1, -1), raw.size, epoch))
    return words_checksum(raw.view("<u8"), epoch)


class _OpError(Exception):
    """Ends an operation; becomes the native engine's error tuple."""

    def __init__(self, code: int, peer: int, what: str, arg: str = "", msg: str = "",
                 core: int = 0) -> None:
        super().__init__(what)
        self.code, self.peer, self.what, self.arg, self.msg = code, peer, what, arg, msg
        self.core = core  # the error tuple's core slot: for E_REMOTE, the remote's code


class _Op:
    def __init__(self, kind: int, epoch: int, timeout_ns: int) -> None:
        self.kind = kind  # 0 dispatch, 1 combine, 2 wait_done
        self.epoch = epoch
        self.par = epoch & 1
        self.deadline = time.monotonic_ns() + timeout_ns


class _CtrlLayout:
    """Offsets of one rank's control window (records written by peers, indexed by source)."""

    def __init__(self, R: int, E: int, K: int, cap_src_rows: int, expert: bool,
                 tokens: int = 0) -> None:
        self.R = R
        self.meta_dtype = np.dtype(
            [("t", "<i4"), ("k", "<i4"), ("e", "<i4"), ("w", "<f4")] if expert else
            [("t", "<i4"), ("k", "<i4"), ("e", "<i4", (K,)), ("w", "<f4", (K,))]
        )
        # counts per expert, rows per destination, then the call's signature (u64: a rank's
        # call must be every source's, ubep.buffer.signature)
        self.counts_sig = align_up(4 * E + 4 * R, 8)
        self.counts_payload = self.counts_sig + 8
        rec = align_up(self.counts_payload + 16, _LINE)
        off = 0
        self.fail = off
        off += R * 2 * _FAIL_BYTES
        self.done = off  # [parity][src] done records
        off += 2 * R * _LINE
        self.ready = off  # [parity][src] BSP readiness
        off += 2 * R * _LINE
        self.barrier = off  # [phase 1..3][src]
        off += 3 * R * _LINE
        self.flag = off  # [parity][src] SW / DC records
        off += 2 * R * _LINE
        self.comb_info = off  # [parity][src]
        off += 2 * R * _LINE
        self.counts = off  # [parity][src]
        self.counts_rec = rec
        off += 2 * R * rec
        # [parity][src] host records of the once-per-host dispatch (ubep.mpi.hostcopy):
        # [rows][checksum][a bit per token]; none without it (tokens 0)
        self.host = off
        self.host_rec = align_up(16 + align_up((tokens + 7) // 8, 8) + 16, _LINE) if tokens else 0
        off += 2 * R * self.host_rec
        self.meta = align_up(off, _LINE)  # [parity][src] per-row metadata
        self.meta_bytes = align_up(max(cap_src_rows, 1) * self.meta_dtype.itemsize, _LINE)
        off = self.meta + 2 * R * self.meta_bytes
        self.size_bytes = align_up(off, 4096)

    def slot(self, base: int, par: int, src: int, size: int = _LINE) -> int:
        return base + (par * self.R + src) * size


class RmaProtocol:
    """Records, waits and the end of an operation of the RMA engine ``e`` (held as
    ``e.proto``), on the windows and control layout the engine sets up."""

    def __init__(self, e: Any) -> None:
        self.e = e

    # --- records ------------------------------------------------------------------------

    def put_record(self, mem: MpiGlobalMemory, dst: int, off: int, payload: np.ndarray,
                   epoch: int, extra: np.ndarray | None = None) -> None:
        """One put of ``[payload][check][epoch]``; ``extra`` (already put) is covered too."""
        raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        body = raw if extra is None else np.concatenate([raw, _u8(extra)])
        rec = np.zeros(align_up(raw.size, 8) + 16, np.uint8)
        rec[:raw.size] = raw
        rec[-16:] = np.array([record_check(body, epoch), epoch], "<u8").view(np.uint8)
        mem.put(dst, off, rec)

    def read_record(self, off: int, nbytes: int, epoch: int | None,
                    extra: np.ndarray | None = None) -> tuple[int, np.ndarray] | None:
        """``(epoch, payload)`` of a complete record in this rank's control window, else None
        (also when ``epoch`` is given and differs)."""
        arr = self.e.ctrl.local_array
        size = align_up(nbytes, 8)
        got = int(arr[off + size + 8: off + size + 16].view("<u8")[0])
        if got == 0 or (epoch is not None and got != epoch):
            return None
        payload = arr[off: off + nbytes].copy()
        check = int(arr[off + size: off + size + 8].view("<u8")[0])
        body = payload if extra is None else np.concatenate([payload, _u8(extra)])
        if check != record_check(body, got):
            return None
        # The epoch word was read first: if it changed meanwhile the record is being rewritten.
        if int(arr[off + size + 8: off + size + 16].view("<u8")[0]) != got:
            return None
        return got, payload

    def epoch_at(self, off: int, nbytes: int) -> int:
        """The epoch word of the record of ``nbytes`` at ``off`` as it is now (unchecked)."""
        at = off + align_up(nbytes, 8) + 8
        return int(self.e.ctrl.local_array[at: at + 8].view("<u8")[0])

    def has_record(self, off: int, nbytes: int, epoch: int) -> bool:
        return self.read_record(off, nbytes, epoch) is not None

    def done_geq(self, q: int, epoch: int) -> bool:
        return self.done_of(q) >= epoch

    def publish_done(self, epoch: int, code: int) -> None:
        """"Call ``epoch`` is over here, with outcome ``code``" (0 ok) to every rank. One
        record, so a peer that sees this rank done also sees whether it failed (a failure
        notice is a separate put, and two puts in flight are not ordered)."""
        e = self.e
        # One slot per epoch parity: two done records in flight to one peer are not ordered,
        # so the reader takes the larger of both (and remembers it).
        par = epoch & 1
        payload = np.array([code], "<u8")
        for q in range(e.R):
            self.put_record(e.ctrl, q, e.cl.slot(e.cl.done, par, e.rank), payload,
                            epoch)

    def done_of(self, q: int) -> int:
        """The last call rank ``q`` finished (its outcome in ``_done_code[q]``)."""
        e = self.e
        for par in (0, 1):
            off = e.cl.slot(e.cl.done, par, q)
            if self.epoch_at(off, 8) <= e._done_seen[q]:
                continue  # nothing newer there: no record to check
            got = self.read_record(off, 8, None)
            if got is not None and got[0] > e._done_seen[q]:
                # done only grows: a reordered older record is ignored
                e._done_seen[q] = got[0]
                e._done_code[q] = int(got[1].view("<u8")[0])
        return e._done_seen[q]

    def publish_failure(self, epoch: int, code: int, message: str) -> None:
        e = self.e
        text = message.encode("utf-8", "replace")[:_FAIL_MSG_MAX]
        payload = np.zeros(_FAIL_BYTES - 16, np.uint8)
        payload[:16] = np.array([len(text), code], "<u8").view(np.uint8)
        payload[16: 16 + len(text)] = np.frombuffer(text, np.uint8)
        off = e.cl.fail + (e.rank * 2 + (epoch & 1)) * _FAIL_BYTES
        for q in range(e.R):
            if q != e.rank:
                self.put_record(e.ctrl, q, off, payload, epoch)

    # --- waiting ------------------------------------------------------------------------

    def wait(self, op: _Op, ready: Callable[[], bool], peer: int, what: str,
             failures: bool = True, needs: Callable[[], Iterable[int]] | None = None) -> None:
        """Poll ``ready`` (after a memory barrier) until true; deadline, failure notices of
        peers and liveness of every peer still in the call are checked while waiting.

        ``needs``: the peers whose records of this call ``ready`` still waits for (default
        ``peer``, if any); one of them that has finished this call with an error or a later
        call is an error at once (it will send nothing more for this call). Its progress is
        read before ``ready`` is tried: records of this call left that peer before its later
        done record did, and a pair of ranks delivers in order on every transport ubep runs
        on (shared memory: the stores' order; ``osc/rdma`` over TCP: one stream per pair).
        """
        e = self.e
        if needs is None:
            needs = functools.partial(list, [peer] if peer >= 0 else [])
        spins = 0
        next_live = next_check = 0
        while True:
            e.ctrl.sync()
            e.data.sync()
            # peers' notices and progress: a few control records per peer, read at most once
            # a period (polling them every spin took CPU from the ranks that move the rows)
            checked = (failures and op.kind != 2 and spins >= 8
                       and time.monotonic_ns() >= next_check)
            past = self.peer_past(op, needs()) if checked else None
            if ready():
                return
            spins += 1
            e.group.progress()
            if spins < 8:
                continue
            now = time.monotonic_ns()
            if checked:
                next_check = now + _CHECK_PERIOD_NS
                self.check_failures(op)
                if past is not None:
                    raise past
            if now >= op.deadline:
                raise _OpError(
                    E_TIMEOUT, peer,
                    f"rank {e.rank} core 0 timed out after {e.timeout_ns / 1e9:.3g} s "
                    f"waiting for {what} (epoch {op.epoch})",
                )
            if now >= next_live:
                next_live = now + _LIVENESS_PERIOD_NS
                self.check_liveness(op, what)
            if spins < _YIELD_SPINS:
                time.sleep(0)
            else:
                time.sleep(50e-6 if spins < 2000 else 5e-4)

    def complete(self, op: _Op, mem: MpiGlobalMemory, dst: int | None, what: str) -> None:
        """Remote completion of every operation to ``dst`` (``None``: all) within the deadline:
        poll the requests (``MPI_Test``), then flush, which then has nothing left to wait for.
        A flush alone would sit in MPI for as long as a stopped peer stays stopped."""
        self.wait(op, functools.partial(mem.done, dst), -1 if dst is None else dst, what,
                  needs=tuple)
        if dst is None:
            mem.flush_all()
        else:
            mem.flush(dst)

    def check_liveness(self, op: _Op, what: str) -> None:
        """Every peer that has not finished this call must be alive, not only the one waited
        for (a peer that finished it and exited is not lost)."""
        e = self.e
        waiting_on = [q for q in range(e.R) if q != e.rank and self.done_of(q) < op.epoch]
        dead = e.group.dead_peers(waiting_on) if waiting_on else []
        if dead:
            q = dead[0]
            raise _OpError(E_PEER_LOST, q,
                           f"rank {q} (pid {e.group.pids[q]}) died while rank {e.rank} "
                           f"core 0 waited for {what}")

    def notice(self, q: int, epoch: int) -> tuple[int, str] | None:
        """``(code, message)`` of rank ``q``'s failure notice for call ``epoch``, if here."""
        off = self.e.cl.fail + (q * 2 + (epoch & 1)) * _FAIL_BYTES
        got = self.read_record(off, _FAIL_BYTES - 16, epoch)
        if got is None:
            return None
        n, code = (int(v) for v in got[1][:16].view("<u8"))
        msg = got[1][16: 16 + min(n, _FAIL_MSG_MAX)].tobytes().decode("utf-8", "replace")
        return code, msg

    def check_failures(self, op: _Op) -> None:
        e = self.e
        for q in range(e.R):
            if q == e.rank:
                continue
            got = self.notice(q, op.epoch)
            if got is None:
                continue
            self.check_liveness(op, "a peer that failed this call")
            code, msg = got
            raise _OpError(E_REMOTE, q, f"failure notice of rank {q}", msg=msg, core=code)

    def peer_past(self, op: _Op, peers: Iterable[int]) -> _OpError | None:
        """The error of the first of ``peers`` that has finished this call with an error
        (remote failure, its code in ``core``) or finished a later call (this rank lost step:
        that peer sends nothing more for this call), else None."""
        e = self.e
        for q in peers:
            if q == e.rank:
                continue
            done = self.done_of(q)
            if done > op.epoch:
                return _OpError(E_LOST, q, f"rank {q} has finished call {done}, past this "
                                f"rank's call {op.epoch}: this rank lost step")
            if done == op.epoch and e._done_code[q]:
                got = self.notice(q, op.epoch)
                msg = got[1] if got else f"rank {q} failed call {op.epoch}"
                return _OpError(E_REMOTE, q, f"failure of rank {q}", msg=msg,
                                core=e._done_code[q])
        return None

    def check_in_step(self, op: _Op) -> None:
        """At the start of a call: no peer may have finished it or a later one (a peer cannot
        complete a call without this rank's part; a failure of it is a remote error)."""
        e = self.e
        e.ctrl.sync()
        self.check_failures(op)
        err = self.peer_past(op, range(e.R))
        if err is not None:
            raise err

    def check_outcome(self, op: _Op) -> None:
        """After this rank completed the call: a peer that failed it (notice, or a done
        record with an error code) turns the result into that peer's error."""
        e = self.e
        e.ctrl.sync()
        self.check_failures(op)
        for q in range(e.R):
            if q != e.rank and self.done_of(q) == op.epoch and e._done_code[q]:
                err = self.peer_past(op, [q])
                assert err is not None
                raise err

    def wait_peers_done(self, op: _Op, epoch: int, failures: bool = True) -> None:
        e = self.e
        if epoch <= 0:
            return
        for q in range(e.R):
            if q != e.rank:
                self.wait(op, functools.partial(self.done_geq, q, epoch), q,
                          "a peer to finish the call before the last" if op.kind != 2 else
                          f"rank {q} to finish call {epoch}", failures, needs=tuple)

    # --- end of an operation ------------------------------------------------------------

    def finish(self, op: _Op) -> None:
        # No wait for the puts to complete: the transport keeps their buffers until they do.
        self.publish_done(op.epoch, 0)

    def finish_error(self, op: _Op, err: _OpError) -> ErrorRecord:
        rec = self.record(err)
        # a failure caught from a peer's notice passes that notice's code on: a clean reject
        # (bad input somewhere) stays clean for every rank, whoever saw it first
        code = err.core if err.code == E_REMOTE else err.code
        self.publish_failure(op.epoch, code, _format(self.e.rank, err))
        self.publish_done(op.epoch, code)
        return rec

    def record(self, err: _OpError) -> ErrorRecord:
        msg = err.msg if err.code in (E_REMOTE, E_BAD_INPUT) else err.what
        return ErrorRecord(err.code, err.peer, err.core, err.arg, err.what, msg)

def _format(rank: int, err: _OpError) -> str:
    if err.code == E_BAD_INPUT:
        return f"rank {rank}: bad input: {err.arg}={err.msg}: {err.what}"
    if err.code == E_REMOTE:
        return f"rank {rank} saw rank {err.peer} fail: {err.msg}"
    return err.what


def _u8(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
