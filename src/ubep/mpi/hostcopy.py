"""Dispatch's rows cross to another host once per (token, host), not once per pick or per
rank there (:class:`ubep.mpi.engine.RmaEngine`, ASP, sync ``dc`` or ``sw``).

In the expert layout a token has one row per pick at the experts' ranks, in the rank layout
one per rank its picks land on; when several of them are on one other host, sending each over
the network moves the same bytes several times (top-8 of 64 experts on 2 hosts x 2 ranks:
about 4 copies of each token to the other host in the expert layout, up to 2 in the rank
layout). DeepEP's internode normal mode sends a token once to a node and forwards it there over
NVLink; this does the same with the memory ubep already shares inside a host:

* the source packs its tokens with a pick on host ``h`` (ascending token order, each once) and
  puts them with one ``MPI_Rput`` into a landing slot of one rank of ``h``, its *gateway*
  (``h``'s rank ``source % ranks_per_host``: the sources of a host spread over the gateways),
  then puts a record ``[rows][checksum][token bitmask]`` (the DC checksum of the packed rows)
  to every rank of ``h``;
* each rank of ``h`` that has rows of that source waits for the record, checks the landed rows
  against it where they lie (in the gateway's memory, a load through the host's shared window)
  and copies its own picks' rows from there to their places in ``recv_x``: a token's landed row
  is its rank among the bitmask's set bits; the metadata (token, pick, expert, weight) still
  comes from the source's per-rank count records, so every result is what it was;
* the gateway waits for every landing it holds, whether or not it has rows of that source
  itself: over TCP (``osc/rdma``) a put lands only while its target runs MPI's progress, so
  the gateway stays in the call until its host's rows are in.

Wire bytes of a dispatch per rank: ``sum over other hosts h of |tokens with a pick on h| x
row_bytes`` instead of ``picks (or token-rank pairs) on other hosts x row_bytes``. Combine is
unchanged: the reference adds a token's picks in ascending ``k`` in float32, so a host's
partial sum is bit-exact only for a prefix of that order; every row goes back as it is.

A landing slot (per epoch parity and source host) is rewritten two calls later, after every
rank finished the call before the last (dispatch waits for that before it sends), hence after
every rank of the host copied out of it. SW flushes the rows before the record (the record
then matches at once); TFF and BSP keep sending each pick's row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..plane.layout import align_up
from ..plane.records import E_INTERNAL
from .protocol import _Op, _OpError
from .rows import rows_of, runs_of, take_runs
from .syncs import rows_checksum

__all__ = ["HOST_SYNCS", "HostCopy"]

# the sync modes whose arrival test is a record (DC: with the checksum, SW: after a flush)
HOST_SYNCS = ("dc", "sw")
_PAGE = 4096


class HostCopy:
    """The once-per-host dispatch path of the RMA engine ``e`` (held as ``e.hosts``): its
    landing window (``[parity][source host][max_tokens_per_rank rows]`` on every rank) and the
    sender's and receiver's sides."""

    def __init__(self, e: Any) -> None:
        self.e = e
        g = e.group
        self.P = int(getattr(g, "ranks_per_host", 1))
        self.host_of = [int(h) for h in getattr(g, "host_of", range(e.R))]
        self.H = e.R // self.P
        self.me = self.host_of[e.rank]
        self.T, self.rb = e.T, e.row_bytes
        self.mask_bytes = align_up((self.T + 7) // 8, 8)
        self.payload_bytes = 16 + self.mask_bytes  # [rows][checksum][bitmask]
        self.win = g.map_global(align_up(max(2 * self.H * self.T * self.rb, 1), _PAGE),
                                "rma-host-land")

    def ranks_of(self, h: int) -> range:
        return range(h * self.P, (h + 1) * self.P)

    def gateway(self, h: int, src: int) -> int:
        """The rank of host ``h`` whose landing slot takes ``src``'s rows."""
        return h * self.P + src % self.P

    def remote(self, q: int) -> bool:
        return self.host_of[q] != self.me

    def _slot(self, par: int, src_host: int) -> int:
        return (par * self.H + src_host) * self.T * self.rb

    # --- sending ------------------------------------------------------------------------

    def send(self, op: _Op, x: np.ndarray, tokens_to: list[np.ndarray]) -> None:
        """Each other host's tokens (``tokens_to[d]``: the tokens of this rank's rows to rank
        ``d``), once each, into its gateway's landing slot; the record to every rank there."""
        e = self.e
        at = self._slot(op.par, self.me)
        for i in range(1, self.H):
            h = (self.me + i) % self.H
            mask = np.zeros(self.T, bool)
            for d in self.ranks_of(h):
                mask[tokens_to[d]] = True
            tokens = np.flatnonzero(mask)
            if not len(tokens):
                continue  # its ranks know from the counts that nothing comes
            t0 = e.spans.t0()
            rows = rows_of(x, tokens, self.rb)
            gw = self.gateway(h, e.rank)
            self.win.put(gw, at, rows)
            if not e.sync_no_flush:
                e.proto.complete(op, self.win, gw, f"the rows to host {h} to complete")
            payload = np.zeros(self.payload_bytes, np.uint8)
            payload[:16] = np.array([len(tokens), rows_checksum(rows, self.rb, op.epoch)],
                                    "<u8").view(np.uint8)
            bits = np.packbits(mask, bitorder="little")
            payload[16: 16 + len(bits)] = bits
            for d in self.ranks_of(h):
                e.proto.put_record(e.ctrl, d, e.cl.slot(e.cl.host, op.par, e.rank,
                                                        e.cl.host_rec), payload, op.epoch)
            e.spans.rec(0, "send", t0, peer=gw, rows=len(tokens), size_bytes=rows.nbytes,
                        epoch=op.epoch)

    # --- receiving ----------------------------------------------------------------------

    def waits_for(self, s: int, rows: np.ndarray) -> bool:
        """Whether this rank waits for remote source ``s``'s landing: it has rows of ``s``, or
        it is the gateway of ``s``'s rows to this host and the host has some."""
        e = self.e
        if rows[s, e.rank] > 0:
            return True
        host_rows = int(rows[s, self.ranks_of(self.me).start: self.ranks_of(self.me).stop].sum())
        return self.gateway(self.me, s) == e.rank and host_rows > 0

    def source_complete(self, op: _Op, s: int, meta: np.ndarray, pos: np.ndarray,
                        out_rows: np.ndarray) -> bool:
        """Whether remote source ``s``'s landing for this host is whole; once it is, this
        rank's rows of ``s`` (``meta`` in batch order, at ``pos``) copied into ``out_rows``."""
        e = self.e
        got = e.proto.read_record(e.cl.slot(e.cl.host, op.par, s, e.cl.host_rec),
                                  self.payload_bytes, op.epoch)
        if got is None:
            return False
        n, check = (int(v) for v in got[1][:16].view("<u8"))
        bits = np.unpackbits(got[1][16:], bitorder="little")
        mask = bits[:self.T].astype(bool)
        if n != int(mask.sum()) or bits[self.T:].any():
            raise _OpError(E_INTERNAL, s, f"rank {s}'s host record counts {n} rows, its bitmask "
                                          f"{int(mask.sum())} (of {self.T} tokens)")
        gw = self.gateway(self.me, s)
        mem = self.win.local_array if gw == e.rank else self.win.peer_arrays[gw]
        if mem is None:
            raise _OpError(E_INTERNAL, gw, f"gateway rank {gw} is not on this rank's host")
        land = np.ndarray((n, self.rb), np.uint8, mem, self._slot(op.par, self.host_of[s]))
        if rows_checksum(land, self.rb, op.epoch) != check:
            return False  # DC: not all landed yet
        if len(meta):
            t = meta["t"].astype(np.int64)  # in [0, T): checked with the metadata
            if not mask[t].all():
                raise _OpError(E_INTERNAL, s, f"rank {s} sent rows of tokens its host record "
                                              "leaves out")
            at = np.cumsum(mask) - 1  # a token's landed row: its rank among the set bits
            take_runs(land, at[t], runs_of(pos), out_rows)
        return True
