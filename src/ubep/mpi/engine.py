"""The RMA engine: dispatch and combine between hosts with MPI one-sided operations.

It has the native engine's interface (``dispatch``, ``combine``, ``fail``, ``wait_done``,
``resync``, ``reset_all``, ``comb_last_epoch``, ``close``; same arguments, same results and error
tuples), so :class:`ubep.Buffer` runs it unchanged, and it writes received rows to the same
places of the Buffer's region (``SegmentLayout``): ``recv_x`` views work as on one host. It is
Python (numpy and mpi4py): one thread per rank; a Plan's core assignment is not used (ASP with
DC or SW: other hosts first, a token once a host, :mod:`ubep.mpi.hostcopy`; then rank by rank).

**What MPI guarantees, and what each sync mode becomes** (MPI-4.1 chapter 12): a put is complete
at its target only after ``MPI_Win_flush``; two puts in flight are not ordered, nor are the
bytes of one put; a load that races with a put may see any mix of old and new bytes (not even
element atomicity: only accumulate operations are atomic per element, and only with respect to
each other). Hence:

* ``sw``: rows, ``flush(dst)``, then the flag record: stop and wait.
* ``tff``: ASP puts the rows straight into ``recv_x`` (as SW does), ``flush(dst)``, then one
  put writes the epoch word of every block into the rows' word slots (ubep.plane.layout);
  BSP stages rows as blocks with their flags zero, flushes, then one strided put writes each
  block's epoch word (a vector datatype). The receiver still learns arrival from the epoch of
  each block (docs/FORMATS.md), but a flush separates payload and flags: over RMA, TFF costs
  what SW costs.
* ``dc``: rows and the ``[count][checksum][epoch]`` record go out together, no flush at all: the
  receiver recomputes the checksum and retries until it matches. DC tolerates any arrival order,
  so it is the one mode that saves the flush round trip over RMA.
* ``sp``: refused across hosts (``InvalidArgumentError`` naming ``sync``): the sentinel test is
  sound only if elements cannot tear, and MPI promises no atomicity for a put against the
  receiver's loads.

Combine pushes back (:mod:`ubep.mpi.combine`): a source's output rows go into its landing
window (a third window), as messages to other hosts (:mod:`ubep.mpi.rows2`); no rank reads a
peer's memory. A call ends once what it sent has left this rank (``MPI_Test``).

Control words (counts, per-row metadata, flags, combine's records, failure notices,
progress) live in a second window. Each is a self-checking record ``[payload][check]
[epoch]`` written with one put and accepted only when ``check`` matches ``payload`` and
``epoch`` (the DC formula): a half-arrived record is never used, and no flush is needed, so no
rank ever blocks inside MPI waiting for a peer that is busy elsewhere. Receivers poll their own
window (``MPI_Win_sync`` + a progress call).

Engines: ``asp`` publishes counts point to point and sends each destination's rows as soon as
the counts of all sources are in, straight to their final positions; receivers take sources in
whatever order they complete. ``bsp`` keeps the baseline's phases: rows to per-source staging,
a global barrier, flags and counts, verification, a second barrier, then reordering.

Bounds: every count, row number and offset read from a peer is checked against the Buffer's
capacity before it is used as a position (``ubep.UbepError`` "internal error" otherwise).

**Never a blocking MPI call inside a call.** Every put and get is request-based; waits poll the
requests (``MPI_Test``) under the call's deadline and flush only once they completed, so a
stopped peer gives ``ubep.TimeoutError`` at ``timeout_s`` (a flush would sit in MPI for as long
as the peer stays stopped over TCP). A call does not wait for its puts to complete at the end:
the transport keeps their buffers until they do, and :meth:`RmaEngine.resync` drains them.

**Call protocol** (the native engine's): a failure notice ``[length][code][text]`` and a done
record ``[code]`` (0 = ok) per call; error tuples ``(code, peer, core, argument, what,
message)`` with codes 1 bad input, 2 timeout, 3 peer lost, 4 remote failure (the remote's code
in ``core``), 5 internal, 6 lost step. A call is refused when a peer it still needs has finished
it with an error (remote) or finished a later call (lost step): a record is taken only when its
epoch equals this call's, never by order. A call that completed still returns a peer's failure
notice for it instead of its result. Waits check the liveness of every peer that has not
finished the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import dtypes as _dt
from ..errors import InvalidArgumentError, PeerLostError, TimeoutError
from ..flags import TffCodec
from ..plane.protocol import CombineCall, DispatchCall
from ..plane.records import E_BAD_INPUT, E_INTERNAL, E_LOST, E_PEER_LOST, ErrorRecord
from ..trace.ring import SpanRing
from .combine import RmaCombine, landing_bytes
from .hostcopy import HOST_SYNCS, HostCopy
from .memory import MpiGlobalMemory
from .protocol import (
    _LINE,
    RmaProtocol,
    _CtrlLayout,
    _Op,
    _OpError,
    record_check,
)
from .rows import RoutingError, Units, empty_slots, route, rows_of, runs_of, take_runs
from .rows2 import TwoSidedRows
from .syncs import SYNC_ROWS, rows_checksum
from .watchdog import WedgedError

if TYPE_CHECKING:
    from ..config import BufferConfig
    from ..plane.layout import SegmentLayout

__all__ = ["RmaEngine", "record_check"]



class RmaEngine:
    """Dispatch/combine of one Buffer whose peers are (partly) on other hosts."""

    def __init__(self, config: BufferConfig, layout: SegmentLayout,
                 data: MpiGlobalMemory) -> None:
        if config.quant is not None:
            raise InvalidArgumentError(
                "quant", config.quant, "quantised dispatch runs on the native engine (one "
                "host); the MPI RMA engine moves rows as they are")
        # the jobs, each an object this engine holds: the call protocol (records, waits, the
        # end of a call) and the combine
        self.proto = RmaProtocol(self)
        self.combiner = RmaCombine(self)
        self.lay = layout
        self.data = data
        self.group = data.group
        self.rank, self.R = data.group.rank, data.group.num_ranks
        self.E, self.K, self.T = config.num_experts, config.num_topk, config.max_tokens_per_rank
        self.L = self.E // self.R
        self.hidden = config.hidden
        self.bsp = config.engine == "bsp"
        self.signature = 0  # set_signature: what this rank's calls are
        self.expert = config.layout != "rank"
        # expert_padded: each local expert's rows start at its block of R * T slots
        self.slots = self.R * self.T if config.layout == "expert_padded" else 0
        self.nreg, self.cap_rows, self.cap_src = (layout.num_regions, layout.cap_rows,
                                                  layout.cap_src_rows)
        self.row_bytes, self.slot_bytes = layout.row_bytes, layout.slot_bytes
        self.out_stride, self.crow_bytes = layout.out_stride, layout.combine_row_bytes
        self.tff = TffCodec(config.tff_block_bytes, config.tff_flag_bytes)
        self.tff_nblocks = self.tff.num_blocks(self.row_bytes)
        self.seg_size, self.timeout_ns = layout.size_bytes, int(config.timeout_s * 1e9)
        self.cdtype = _dt.dtype_of(config.combine_dtype)
        self.land_is_out = layout.off_land == layout.off_out
        if config.sync not in SYNC_ROWS:  # SP (ubep.mpi.syncs)
            raise InvalidArgumentError(
                "sync", config.sync,
                "SP cannot run across hosts: MPI_Put gives no element atomicity against the "
                "receiver's loads, so the sentinel test could accept a torn element; use "
                "sync='dc' (no flush over RMA), 'tff' or 'sw'",
            )
        # the sync mode's row, chosen once: the writer's and reader's side of every call
        self.sync = SYNC_ROWS[config.sync]
        self.tff_in_place = self.sync.in_place and not self.bsp  # rows in out, words in land
        # ASP with a record-based sync: a token crosses to another host once, not once per
        # pick (expert layouts) or per rank (rank layout) there (ubep.mpi.hostcopy)
        once_per_host = not self.bsp and config.sync in HOST_SYNCS
        self.cl = _CtrlLayout(self.R, self.E, self.K, self.cap_src, self.expert,
                              tokens=self.T if once_per_host else 0)
        self.ctrl = self.group.map_global(self.cl.size_bytes, "rma-ctrl")
        # where peers push this rank's combine rows back (ubep.mpi.combine)
        # the most rows one rank sends in a dispatch: one per pick (expert layout), one per
        # token and destination rank (rank layout)
        self.cap_sent = self.T * (self.K if self.expert else self.R)
        self.cland = self.group.map_global(landing_bytes(self.cap_sent, self.crow_bytes),
                                           "rma-comb-land")
        self.two = TwoSidedRows(self, self.group.dup_comm())  # its rows to other hosts
        self.sync_no_flush = config.sync == "dc"  # combine's records: DC needs no flush
        self.hosts = HostCopy(self) if once_per_host else None
        # the last dispatch's positions of each source's rows, and its rows[s, d] table
        self._rx_positions: tuple[list[np.ndarray], np.ndarray] = ([], np.zeros(0))
        # Highest done record seen per peer and its outcome (0 = ok, else the peer's code).
        self._done_seen = [0] * self.R
        self._done_code = [0] * self.R
        self._closed = False
        # task spans (off unless traced): one core, as the native engine's rings read
        self.spans = SpanRing(1)
        self.trace_enable = self.spans.trace_enable
        self.trace_spans = self.spans.trace_spans

    # --- native-engine interface --------------------------------------------------------

    def _reap(self) -> None:
        """Drop the operations of earlier calls that have completed (their buffers with them);
        never waits."""
        for mem in self._windows():
            mem.done()

    def _windows(self) -> tuple[MpiGlobalMemory | TwoSidedRows, ...]:
        """Every window this engine puts into (data first: the rows), and its messages."""
        extra = (self.hosts.win,) if self.hosts is not None else ()
        return (self.data, *extra, self.cland, self.ctrl, self.two)

    def _land_regions(self) -> int:
        return self.nreg if self.land_is_out else 1

    def reset_all(self) -> None:
        """Nothing to reset: SP (the only mode with a pre-filled buffer) is refused."""

    def comb_last_epoch(self, region: int) -> int:
        """0: no peer reads this rank's combine regions (combine pushes, ubep.mpi.combine),
        so the Buffer may refill one at once."""
        del region
        return 0

    def rows_checksum(self, rows: np.ndarray, epoch: int) -> int:
        """DC checksum of contiguous combine rows (ubep.mpi.syncs.rows_checksum)."""
        return rows_checksum(rows, self.crow_bytes, epoch)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for mem in self._windows()[1:]:  # the data window is the Buffer's
                mem.close()

    def fail(
        self, epoch: int, code: int, message: str, finished: int = 1, timeout_s: float = 0.0
    ) -> int:
        """Call ``epoch`` failed on this rank outside the engine: tell every peer; ``finished``:
        also count it done here (0: a notice ahead of time, from a Buffer that lost step).

        ``code``: 1 bad input (a clean reject: nothing of this call reached a peer), 6 lost
        (this rank lost step; peers must resync), else the error code. Nothing waits for the
        notices to arrive (``timeout_s`` is unused): a stopped peer gets them when it runs again.
        """
        del timeout_s

        def notify() -> int:
            self._reap()
            self.proto.publish_failure(epoch, int(code), message)
            if finished:
                self.proto.publish_done(epoch, int(code))
            return 0

        # puts only, nothing waited for: the deadline is the grace alone
        outcome = self._guarded(notify, 0)
        return outcome if isinstance(outcome, int) else 0

    def resync(self, base_epoch: int) -> None:
        """Forget every call before ``base_epoch`` (local; ``Buffer.resync`` runs it between two
        group-wide exchanges, so no rank is inside a call).

        First this rank's own RMA operations must have completed at their targets (a put still
        in flight from an abandoned call could land in a peer's memory during a later call):
        ``ubep.TimeoutError`` if they do not within the call timeout (a peer is still stopped).
        Then this rank's windows are cleared: failure notices, done/ready/barrier records, flags,
        counts, routing metadata, combine descriptors and the land region (TFF flags), and every
        peer counts as having finished call ``base_epoch - 1``. ``base_epoch`` must exceed every
        epoch used before, so that a record of an old call that lands after the clear never
        equals a new call's epoch.
        """
        outcome = self._guarded(functools.partial(self._resync, base_epoch), self.timeout_ns)
        if not isinstance(outcome, int):
            raise PeerLostError(outcome.what)

    def _resync(self, base_epoch: int) -> int:
        op = _Op(2, base_epoch, self.timeout_ns)
        self.two.forget(base_epoch)
        for mem in self._windows():
            try:
                self.proto.wait(op, mem.done, -1, "this rank's RMA operations of earlier calls",
                                failures=False, needs=tuple)
            except _OpError as err:
                raise TimeoutError(f"rank {self.rank}: resync: {err.what}") from None
            mem.flush_all()
        self.ctrl.local_array[:] = 0
        land = self.lay.off_land
        self.data.local_array[land: land + self._land_regions() * self.lay.land_bytes] = 0
        self.data.sync()
        self.ctrl.sync()
        self._done_seen = [base_epoch - 1] * self.R
        self._done_code = [0] * self.R
        return 0

    def wait_done(self, epoch: int, timeout_s: float) -> int | ErrorRecord:
        op = _Op(2, epoch, int(timeout_s * 1e9))

        def wait() -> int | ErrorRecord:
            try:
                self.proto.wait_peers_done(op, epoch)
            except _OpError as err:
                return self.proto.record(err)
            return 0

        return self._guarded(wait, int(timeout_s * 1e9))

    def run_dispatch(self, call: DispatchCall, /) -> int | ErrorRecord:
        return self._guarded(functools.partial(self._dispatch_call, call), self.timeout_ns)

    def run_combine(self, call: CombineCall, /) -> int | ErrorRecord:
        return self._guarded(functools.partial(self._combine_call, call), self.timeout_ns)

    def _guarded(self, fn: Callable[[], int | ErrorRecord], timeout_ns: int) -> int | ErrorRecord:
        """``fn`` on the group's MPI thread under ``timeout_ns`` (ubep.mpi.watchdog): an error
        MPI raises, or a call MPI never returns from, is a lost peer."""
        try:
            return self.group.runner.run(fn, timeout_ns / 1e9)
        except WedgedError as exc:
            return self._mpi_failure(exc)
        except self.data.mpi.Exception as exc:
            return self._mpi_failure(exc)

    def _mpi_failure(self, exc: BaseException) -> ErrorRecord:
        """An error MPI raised inside a call: how MPI reports a failed process when the job
        runs with fault tolerance (``mpiexec --with-ft ulfm``); without it ``mpiexec`` ends the
        job instead. Nothing is announced to the peers (a put to a failed process may never
        complete): each survivor learns it from MPI, within the call's deadline. The Buffer
        raises ``PeerLostError`` and refuses calls; a masking Buffer agrees on the survivors
        (ubep.mpi.membership) and serves on."""
        return ErrorRecord(E_PEER_LOST, -1, 0, "", f"rank {self.rank}: MPI reported a failure "
                           f"({exc}); with on_peer_loss='raise' build a new group of the "
                           "survivors (on_peer_loss='mask' does it by itself)", "")

    def _dispatch_call(self, call: DispatchCall, /) -> int | ErrorRecord:
        # one thread: rows go destination by destination (module docstring); a split-phase
        # call runs whole here (no second half: Buffer settles its hook at once); plan unused,
        # prequant too: quantised Buffers are refused at construction
        x, topk_idx, topk_weights, ntok = call.x, call.topk_idx, call.topk_weights, call.num_tokens
        epoch, index, o_dst = call.epoch, call.index, call.send_dst_row
        o_idx, o_w, o_rank = call.recv_topk_idx, call.recv_topk_weights, call.recv_src_rank
        o_tok, o_k, o_nrecv = call.recv_src_token, call.recv_src_k, call.counts
        op = _Op(0, epoch, self.timeout_ns)
        t_call = self.spans.t0()
        try:
            return self._dispatch_op(op, x, topk_idx, topk_weights, ntok, index, o_dst,
                                     o_idx, o_w, o_rank, o_tok, o_k, o_nrecv)
        finally:
            self.spans.rec(1, "dispatch", t_call, unit=index, epoch=epoch)

    def _dispatch_op(self, op: _Op, x: np.ndarray, topk_idx: np.ndarray,
                     topk_weights: np.ndarray, ntok: int, index: int,
                     o_dst: np.ndarray, *outs: np.ndarray) -> int | ErrorRecord:
        o_idx, o_w, o_rank, o_tok, o_k, o_nrecv = outs
        self._reap()
        try:
            t0 = self.spans.t0()
            units = self._validate(x[:ntok], topk_idx[:ntok], topk_weights[:ntok])
            self.spans.rec(0, "init", t0, epoch=op.epoch)
            self.proto.check_in_step(op)
            o_dst.reshape(-1)[:] = -1
            reg = index % self.nreg
            if self.bsp:
                n = self._dispatch_bsp(op, x, units, reg, o_idx, o_w, o_rank, o_tok, o_k,
                                       o_nrecv, o_dst)
            else:
                n = self._dispatch_asp(op, x, units, reg, o_idx, o_w, o_rank, o_tok, o_k,
                                       o_nrecv, o_dst)
            self.combiner.remember(reg, index, *self._rx_positions)
            self._drain(op)
        except _OpError as err:
            return self.proto.finish_error(op, err)
        self.proto.finish(op)
        try:
            self.proto.check_outcome(op)
        except _OpError as err:
            return self.proto.record(err)
        return n

    def _combine_call(self, call: CombineCall, /) -> int | ErrorRecord:
        # as dispatch: the whole call runs here (split unused)
        eo, rows, h_idx, h_w, h_dst = (call.expert_out, call.num_rows, call.topk_idx,
                                       call.topk_weights, call.send_dst_row)
        ntok, epoch, y = call.num_tokens, call.epoch, call.y
        dispatch_index = call.dispatch_index
        op = _Op(1, epoch, self.timeout_ns)
        t_call = self.spans.t0()
        self._reap()
        try:
            self.proto.check_in_step(op)
            t0 = self.spans.t0()
            zero_copy = self.combiner.combine(op, eo, rows, h_idx, h_w, h_dst, ntok, y,
                                              dispatch_index)
            self._drain(op)
            self.spans.rec(0, "reduce", t0, epoch=epoch, after_last=True)  # BSP: its barrier
        except _OpError as err:
            return self.proto.finish_error(op, err)
        self.proto.finish(op)
        # Peers pushed what this rank needs and read nothing of it, but a rank leaves a combine
        # only with every peer done with it (their done records: no MPI call waits), as before
        # combine pushed: survivors of a loss then meet it in the same call, the one the
        # masking agreement completes (ubep.mpi.membership); a rank one call ahead split a
        # 3-host job's survivors under the soak of tests/mpi/test_multihost_faults.py.
        try:
            self.proto.wait_peers_done(op, epoch, failures=False)
            self.proto.check_outcome(op)
        except _OpError as err:
            return self.proto.record(err)
        finally:
            self.spans.rec(1, "combine", t_call, epoch=epoch)
        return int(zero_copy)

    def _drain(self, op: _Op) -> None:
        """Wait (``MPI_Test``, under the call's deadline) until every row and record this call
        put has left this rank. Over TCP an operation that has not left moves only while its
        origin is inside MPI, and a program may leave MPI for a collective of its own (gloo)
        that waits for the very peers still waiting for those rows; each of them is needed by a
        peer that is still in this call, polling, so none of this waits for a peer to enter
        MPI."""
        mems = self._windows()
        self.proto.wait(op, lambda: all([m.done() for m in mems]), -1,
                        "this rank's rows and records of this call to leave", needs=tuple)

    # --- validation and routing ---------------------------------------------------------

    def _validate(self, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> Units:
        del x  # its rows are read where they are sent
        try:
            return route(idx, w, self.E, self.R, self.expert)
        except RoutingError as err:
            raise _OpError(E_BAD_INPUT, self.rank, err.what, err.arg, err.value) from None

    def _meta(self, units: Units, d: int) -> np.ndarray:
        t, k, e, w = units.to[d]
        meta = np.zeros(len(t), dtype=self.cl.meta_dtype)
        meta["t"], meta["k"], meta["e"], meta["w"] = t, k, e, w
        return meta

    # --- counts -------------------------------------------------------------------------

    def _publish_counts(self, op: _Op, units: Units) -> None:
        cl = self.cl
        payload = np.zeros(cl.counts_payload, np.uint8)
        cnt32 = units.cnt.astype("<u4")
        rows32 = units.rows_to.astype("<u4")
        payload[:4 * self.E] = cnt32.view(np.uint8)
        payload[4 * self.E: 4 * self.E + 4 * self.R] = rows32.view(np.uint8)
        payload[cl.counts_sig: cl.counts_sig + 8] = np.array(
            [self.signature], "<u8").view(np.uint8)
        for i in range(self.R):
            d = (self.rank + 1 + i) % self.R
            meta = self._meta(units, d)
            self.ctrl.put(d, cl.slot(cl.meta, op.par, self.rank, cl.meta_bytes), meta)
            self.proto.put_record(self.ctrl, d,
                                  cl.slot(cl.counts, op.par, self.rank, cl.counts_rec), payload,
                                  op.epoch, extra=meta)

    def _counts_table(self, op: _Op) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """Wait for every source's counts; return ``cnt[s, e]``, ``rows[s, d]`` and each
        source's metadata for this rank, all bounds-checked."""
        cl = self.cl
        cnt = np.zeros((self.R, self.E), np.int64)
        rows = np.zeros((self.R, self.R), np.int64)
        metas: list[np.ndarray] = [np.zeros(0, cl.meta_dtype)] * self.R
        pending = set(range(self.R))

        def poll() -> bool:
            for s in sorted(pending):
                got = self._read_counts(s, op)
                if got is not None:
                    cnt[s], rows[s], metas[s] = got
                    pending.discard(s)
            return not pending

        self.proto.wait(op, poll, -1, "the counts of every rank",
                        needs=functools.partial(sorted, pending))
        return cnt, rows, metas

    def _read_counts(self, s: int, op: _Op) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        cl = self.cl
        off = cl.slot(cl.counts, op.par, s, cl.counts_rec)
        arr = self.ctrl.local_array
        size = cl.counts_payload
        if int(arr[off + size + 8: off + size + 16].view("<u8")[0]) != op.epoch:
            return None
        head = arr[off: off + size].copy()
        c = head[:4 * self.E].view("<u4").astype(np.int64)
        r = head[4 * self.E: 4 * self.E + 4 * self.R].view("<u4").astype(np.int64)
        n = int(r[self.rank])
        if n > self.cap_src:  # bounds first: this number sizes the metadata read below
            n = 0  # the check below fails unless the record is still arriving
        moff = cl.slot(cl.meta, op.par, s, cl.meta_bytes)
        mbytes = arr[moff: moff + n * cl.meta_dtype.itemsize]
        if self.proto.read_record(off, size, op.epoch, extra=mbytes) is None:
            return None
        if (c > self.T).any() or (r > self.cap_src).any():
            raise _OpError(E_INTERNAL, s, f"rank {s} announced counts larger than the Buffer "
                                          f"holds (max_tokens_per_rank {self.T})")
        sig = int(head[cl.counts_sig: cl.counts_sig + 8].view("<u8")[0])
        if sig != self.signature:
            self._signature_mismatch(op, s, sig)
        return c, r, mbytes.copy().view(cl.meta_dtype)

    def _signature_mismatch(self, op: _Op, s: int, theirs: int) -> None:
        """Source ``s``'s call is another call (its signature differs). ASP reads every
        source's counts before its first row goes out: a clean reject on every rank that
        differs (the value ``mine:theirs:rank`` in hex, ubep.buffer.signature decodes it). BSP
        has sent its rows by then: the ranks lose step."""
        value = f"{self.signature:x}:{theirs:x}:{s}"
        if self.bsp:
            raise _OpError(E_LOST, s, f"rank {s}'s call {op.epoch} is another call than rank "
                                      f"{self.rank}'s (signature {value})")
        raise _OpError(E_BAD_INPUT, self.rank, f"rank {s}'s call {op.epoch} differs from rank "
                                               f"{self.rank}'s", "signature", value)

    def set_signature(self, word: int) -> None:
        """What this rank's next calls are (published in its count records, compared with
        every source's); local, between calls."""
        self.signature = int(word) & (2**64 - 1)

    def _bases(self, cnt: np.ndarray, rows: np.ndarray, d: int, src: int) -> np.ndarray:
        """Start of ``src``'s rows at ``d``: per local expert (expert layout) or one number."""
        L = self.L
        if not self.expert:
            total = int(rows[:, d].sum())
            if total > self.cap_rows:
                raise _OpError(E_INTERNAL, d, f"counts for rank {d} add up to {total} rows, "
                                              f"more than the buffer's {self.cap_rows}")
            return np.array([rows[:src, d].sum()], np.int64)
        mine = cnt[:, d * L:(d + 1) * L]  # [sources, local experts]
        per_expert = mine.sum(axis=0)
        if int(per_expert.sum()) > self.cap_rows:
            raise _OpError(E_INTERNAL, d, f"counts for rank {d} add up to "
                                          f"{int(per_expert.sum())} rows, more than the "
                                          f"buffer's {self.cap_rows}")
        expert_start = (np.arange(L) * self.slots if self.slots else
                        np.concatenate([[0], np.cumsum(per_expert)[:-1]]))
        return (expert_start + mine[:src].sum(axis=0)).astype(np.int64)

    def _positions(self, bases: np.ndarray, units: Any, n: int) -> np.ndarray:
        """Final positions at the destination of one source's rows, in batch order."""
        if not self.expert:
            return bases[0] + np.arange(n, dtype=np.int64)
        e = units[2]
        el = (e % self.L).astype(np.int64)
        first = np.searchsorted(el, el, side="left")  # rows are sorted by expert
        return bases[el] + (np.arange(n) - first)

    # --- dispatch: sending --------------------------------------------------------------

    def _land(self, reg: int) -> int:
        """Offset of the land region of dispatch region ``reg``. ASP has one per region (the
        rows in recv_x itself; TFF: the rows' epoch words); BSP stages in one land region for
        every call (ubep.plane.layout): a sender writes it only after this rank published
        that it entered the call (counts / ready record), hence finished reading it for the
        last one."""
        return self.lay.off_land + (reg % self.lay.num_land_regions) * self.lay.land_bytes

    def _out_rows(self, reg: int) -> np.ndarray:
        """This rank's out region as ``[cap_rows, row_bytes]`` (strided by out_stride)."""
        off = self.lay.off_out + reg * self.lay.out_bytes
        return np.ndarray((self.cap_rows, self.row_bytes), np.uint8, self.data.local_array,
                          off, (self.out_stride, 1))

    def _land_slots(self, reg: int) -> np.ndarray:
        return np.ndarray((self.cap_rows, self.slot_bytes), np.uint8, self.data.local_array,
                          self._land(reg), (self.slot_bytes, 1))

    def _send_rows(self, op: _Op, d: int, rows: np.ndarray, pos: np.ndarray, reg: int) -> None:
        """Put ``rows`` (raw, batch order) at slots ``pos`` of ``d``'s land region, then the
        flags of the sync mode."""
        t0 = self.spans.t0()
        slots = self.sync.encode(self, rows, self.tff_in_place)
        flat = slots.reshape(len(rows), -1)
        at = 0
        runs = runs_of(pos)
        base, stride = self._land(reg), self.slot_bytes
        if self.tff_in_place:
            base, stride = self.lay.off_out + reg * self.lay.out_bytes, self.out_stride
        for p0, m in runs:
            self.data.put(d, base + p0 * stride, flat[at: at + m])
            at += m
        if not self.bsp:  # BSP: flags around the barrier
            self.sync.send_flags(self, op, d, rows, runs, reg)
        self.spans.rec(0, "send", t0, peer=d, rows=len(rows), size_bytes=rows.nbytes,
                       epoch=op.epoch)

    # --- dispatch: ASP ------------------------------------------------------------------

    def _dispatch_asp(self, op: _Op, x: np.ndarray, units: Units, reg: int,
                      *outs: np.ndarray) -> int:
        self.proto.wait_peers_done(op, op.epoch - 2)
        self._publish_counts(op, units)
        cnt, rows, metas = self._counts_table(op)
        self._check_consistency(cnt, rows)
        o_dst = outs[-1]
        out_rows = self._out_rows(reg)
        hosts = self.hosts
        if hosts is not None:  # other hosts first: their rows take longest to arrive
            hosts.send(op, x, [u[0] for u in units.to])
        xraw = x.view(np.uint8).reshape(x.shape[0], self.row_bytes)
        for i in range(self.R):
            d = (self.rank + 1 + i) % self.R
            n = int(units.rows_to[d])
            if not n:
                continue
            u = units.to[d]
            pos = self._positions(self._bases(cnt, rows, d, self.rank), u, n)
            self._record_dst(o_dst, u, d, pos)
            if hosts is not None and hosts.remote(d):
                continue  # went with its host's tokens
            if d == self.rank:  # own rows: gathered straight into recv_x
                take_runs(xraw, u[0], runs_of(pos), out_rows)
            elif self._stores_rows(d):
                self._store_rows(op, d, xraw, u[0], pos, reg)
            else:
                self._send_rows(op, d, rows_of(x, u[0], self.row_bytes), pos, reg)
        return self._receive(op, cnt, rows, metas, reg, outs, staged=False)

    def _stores_rows(self, d: int) -> bool:
        """Whether ASP's rows to ``d`` are gathered straight into its memory: a peer on this
        host, rows raw in their slots (DC, SW; TFF lands epoch words beside them)."""
        return self.data.peer_arrays[d] is not None and self.sync.name in ("dc", "sw") \
            and not self.tff_in_place

    def _store_rows(self, op: _Op, d: int, xraw: np.ndarray, tokens: np.ndarray,
                    pos: np.ndarray, reg: int) -> None:
        """Rows ``tokens`` of ``xraw`` gathered straight into same-host ``d``'s slots ``pos``
        (one pass: no packed copy first), then the flags of the sync mode over the runs as
        they lie there."""
        t0 = self.spans.t0()
        peer = self.data.peer_arrays[d]
        land = np.ndarray((self.cap_rows, self.row_bytes), np.uint8, peer, self._land(reg),
                          (self.slot_bytes, 1))
        runs = runs_of(pos)
        take_runs(xraw, tokens, runs, land)
        blocks = [land[p0: p0 + m] for p0, m in runs]
        self.sync.send_flags(self, op, d, land, runs, reg, blocks=blocks)
        self.spans.rec(0, "send", t0, peer=d, rows=len(tokens),
                       size_bytes=len(tokens) * self.row_bytes, epoch=op.epoch)

    def _record_dst(self, o_dst: np.ndarray, u: Any, d: int, pos: np.ndarray) -> None:
        if self.expert:
            o_dst[u[0], u[1]] = pos
        else:
            o_dst[u[0], d] = pos

    def _check_consistency(self, cnt: np.ndarray, rows: np.ndarray) -> None:
        if not self.expert:
            return
        per_dst = cnt.reshape(self.R, self.R, self.L).sum(axis=2)
        bad = np.nonzero((per_dst != rows).any(axis=1))[0]
        if len(bad):
            s = int(bad[0])
            raise _OpError(E_INTERNAL, s, f"rank {s}'s row counts disagree with its per-expert "
                                          "counts")

    # --- dispatch: receiving ------------------------------------------------------------

    def _rx_bases(self, cnt: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``[R, L]`` start of each source's rows (per local expert) in this rank's region."""
        out = np.zeros((self.R, self.L), np.int64)
        for s in range(self.R):
            out[s] = self._bases(cnt, rows, self.rank, s) if self.expert else (
                self._bases(cnt, rows, self.rank, s)[0])
        return out

    def _fill_metadata(self, s: int, meta: np.ndarray, pos: np.ndarray, counts: np.ndarray,
                       outs: tuple[np.ndarray, ...]) -> None:
        o_idx, o_w, o_rank, o_tok, o_k = outs[:5]
        n = len(meta)
        t, k, e = meta["t"].astype(np.int64), meta["k"].astype(np.int64), meta["e"]
        lo = self.rank * self.L
        ok = bool(((t >= 0) & (t < self.T) & (k >= 0) & (k < self.K)).all())
        if self.expert:
            el = e.astype(np.int64) - lo
            ok = ok and bool(((el >= 0) & (el < self.L)).all()) and bool((np.diff(el) >= 0).all())
            ok = ok and bool((np.bincount(el, minlength=self.L)[: self.L] == counts).all())
        else:
            ids = e.astype(np.int64)
            ok = ok and bool(((ids >= -1) & (ids < self.L)).all())
            ok = ok and bool((ids[np.arange(n), k] >= 0).all()) if n else ok
        if not ok or (n and (pos.min() < 0 or pos.max() >= self.cap_rows)):
            raise _OpError(E_INTERNAL, s, f"rank {s}'s routing disagrees with its counts")
        o_rank[pos], o_tok[pos], o_k[pos] = s, t, k
        if self.expert:
            o_idx[pos], o_w[pos] = e, meta["w"]
        else:
            o_idx[pos], o_w[pos] = meta["e"], meta["w"]

    def _receive(self, op: _Op, cnt: np.ndarray, rows: np.ndarray, metas: list[np.ndarray],
                 reg: int, outs: tuple[np.ndarray, ...], staged: bool) -> int:
        L, r = self.L, self.rank
        rx = self._rx_bases(cnt, rows)
        mine = cnt[:, r * L:(r + 1) * L]
        n_total = int(rows[:, r].sum())
        counts_out = outs[5]  # rows per local expert, then rows from each source
        counts_out[:L] = mine.sum(axis=0)
        counts_out[L:L + self.R] = rows[:, r]
        counts_out[L + self.R:] = rows.reshape(-1)  # every source's rows to every rank
        if self.slots:  # padded: recv_x is the whole region, its empty slots no row
            n_total = self.cap_rows
            empty_slots(counts_out[:L], self.slots, outs)
        positions: list[np.ndarray] = []
        for s in range(self.R):
            n = int(rows[s, r])
            if self.expert:
                counts = mine[s]
                pos = np.concatenate([rx[s, el] + np.arange(counts[el]) for el in range(L)]) \
                    if n else np.zeros(0, np.int64)
            else:
                counts = np.zeros(L, np.int64)
                pos = rx[s, 0] + np.arange(n, dtype=np.int64)
            positions.append(pos.astype(np.int64))
            if len(metas[s]) != n:
                raise _OpError(E_INTERNAL, s, f"rank {s}'s metadata has {len(metas[s])} rows, "
                                              f"its counts say {n}")
            self._fill_metadata(s, metas[s], positions[s], counts, outs)
        self._rx_positions = (positions, rows)  # combine sends each source's rows back
        if staged:
            return n_total
        pending = {s for s in range(self.R) if s != r and rows[s, r] > 0}
        hosts = self.hosts
        if hosts is not None:  # a gateway waits for its host's rows, its own or not
            pending |= {s for s in range(self.R) if hosts.remote(s) and hosts.waits_for(s, rows)}
        since = [self.spans.t0()]  # the last completion: each source's wait span starts there
        out_rows = self._out_rows(reg)

        def complete(s: int) -> bool:
            if hosts is not None and hosts.remote(s):
                return hosts.source_complete(op, s, metas[s], positions[s], out_rows)
            return self.sync.source_complete(self, op, s, positions[s], reg)

        def poll() -> bool:
            for s in sorted(pending):
                if complete(s):
                    pending.discard(s)
                    n = int(rows[s, r])  # one span a source, as the native in-place waits
                    since[0] = self.spans.rec(0, "wait", since[0], peer=s, rows=n,
                                              size_bytes=n * self.row_bytes, epoch=op.epoch)
            return not pending

        self.proto.wait(op, poll, -1, "rows of every source",
                        needs=functools.partial(sorted, pending))
        return n_total

    # --- dispatch: BSP ------------------------------------------------------------------

    def _dispatch_bsp(self, op: _Op, x: np.ndarray, units: Units, reg: int,
                      *outs: np.ndarray) -> int:
        cl, r = self.cl, self.rank
        self.proto.wait_peers_done(op, op.epoch - 2)
        empty = np.zeros(0, np.uint8)
        for q in range(self.R):  # Init: my staging area is free for this call
            self.proto.put_record(self.ctrl, q, cl.slot(cl.ready, op.par, r), empty, op.epoch)
        # Token-Sending: each source owns a partition of the staging area, slots by batch rank
        sent: dict[int, tuple[np.ndarray, list[tuple[int, int]]]] = {}
        for i in range(self.R - 1):  # own rows are placed by the reordering below
            d = (r + 1 + i) % self.R
            n = int(units.rows_to[d])
            if not n:
                continue
            ready = functools.partial(self.proto.has_record, cl.slot(cl.ready, op.par, d), 0,
                                      op.epoch)
            self.proto.wait(op, ready, d, f"staging area of rank {d}")
            payload = rows_of(x, units.to[d][0], self.row_bytes)
            pos = r * self.cap_src + np.arange(n, dtype=np.int64)
            self._send_rows(op, d, payload, pos, reg)
            sent[d] = (payload, runs_of(pos))
        # SyncAll: every row (and every TFF flag) complete at its destination first
        self.proto.complete(op, self.data, None, "the rows to every rank to complete")
        self.sync.flags_before_barrier(self, op, sent, reg)
        self._barrier(op, 1)
        # SendFlag & TokenCnt
        self._publish_counts(op, units)
        self.sync.flags_after_barrier(self, op, sent)
        cnt, rows, metas = self._counts_table(op)
        self._check_consistency(cnt, rows)
        # Verification
        stage = self._land_slots(reg)
        for s in range(self.R):
            n = int(rows[s, r])
            if s == r or not n:
                continue
            pos = s * self.cap_src + np.arange(n, dtype=np.int64)
            if not self.sync.staged_verified(self, op, s, stage, pos):
                raise _OpError(E_INTERNAL, s, f"verification of rank {s}'s rows failed after "
                                              "the barrier")
        self._barrier(op, 2)
        # CalCumSum + Token-Reordering
        n_total = self._receive(op, cnt, rows, metas, reg, outs, staged=True)
        rx = self._rx_bases(cnt, rows)
        out_rows = self._out_rows(reg)
        mine = cnt[:, r * self.L:(r + 1) * self.L]
        for s in range(self.R):
            n = int(rows[s, r])
            if not n:
                continue
            if s == r:
                payload = rows_of(x, units.to[r][0], self.row_bytes)
            else:
                part = stage[s * self.cap_src: s * self.cap_src + n]
                payload = self.sync.decode_staged(self, part)
            if self.expert:
                dest = np.concatenate([rx[s, el] + np.arange(mine[s, el]) for el in range(self.L)])
            else:
                dest = rx[s, 0] + np.arange(n)
            out_rows[dest] = payload
        o_dst = outs[-1]
        for d in range(self.R):
            n = int(units.rows_to[d])
            if n:
                u = units.to[d]
                self._record_dst(o_dst, u, d, self._positions(self._bases(cnt, rows, d, r), u, n))
        return n_total

    def _barrier(self, op: _Op, phase: int) -> None:
        """Global barrier of all ranks (BSP SyncAll), one record per (phase, source)."""
        cl = self.cl
        t0 = self.spans.t0()
        empty = np.zeros(0, np.uint8)
        for q in range(self.R):
            at = cl.barrier + ((phase - 1) * self.R + self.rank) * _LINE
            self.proto.put_record(self.ctrl, q, at, empty, op.epoch)
        for q in range(self.R):
            arrived = functools.partial(
                self.proto.has_record, cl.barrier + ((phase - 1) * self.R + q) * _LINE, 0, op.epoch)
            self.proto.wait(op, arrived, q, f"global barrier {phase} (rank {q})")
        self.spans.rec(0, "barrier", t0, epoch=op.epoch)
