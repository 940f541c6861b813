"""A pure-numpy engine, in one process: ranks are threads, their memory a dict.

Written for the conformance suite, as the proof that a transport plugs into ``ubep.plane`` with
one registry row (:func:`register`) and no edit under ``src/ubep/buffer``: it keeps the
:class:`ubep.plane.Engine` protocol with none of the host-memory helpers (no segment, no row
kernel, no view of its memory: every result is a fresh array), computing each rank's rows from
every rank's posted inputs. Its waits have the config's deadline and check the peers' liveness
(``NumpyWorld.dead``) and failure notices, as every engine's must.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ubep import dtypes as _dt
from ubep import quant as _quant
from ubep import topology as topo
from ubep.errors import PeerLostError, TimeoutError
from ubep.plane import (
    PLAIN,
    CallOptions,
    DispatchResult,
    EngineSpec,
    ErrorRecord,
    RuntimeHandle,
    register_engine,
)
from ubep.plane.records import E_BAD_INPUT, E_LOST, E_PEER_LOST, E_REMOTE, E_TIMEOUT

__all__ = ["NumpyGroup", "NumpyWorld", "register"]

NAME = "numpy"


@dataclass
class NumpyWorld:
    """What the ranks share: posted call inputs by epoch, failure notices, the dead."""

    num_ranks: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    posts: dict[tuple[int, int], dict[int, tuple[str, Any]]] = field(default_factory=dict)
    notices: dict[tuple[int, int], tuple[int, int, str]] = field(default_factory=dict)
    gathers: dict[tuple[int, int], dict[int, Any]] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.groups = [NumpyGroup(self, r) for r in range(self.num_ranks)]

    def die(self, rank: int) -> None:
        """``rank`` is gone (its peers' waits find it)."""
        with self.cond:
            self.dead.add(rank)
            self.cond.notify_all()

    def gather(self, n: int, rank: int, value: Any, timeout_s: float) -> list[Any]:
        """The ``n``-th control-plane exchange of every rank."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            got = self.gathers.setdefault((0, n), {})
            got[rank] = value
            self.cond.notify_all()
            while len(got) < self.num_ranks:
                gone = self.dead - got.keys()
                if gone:
                    raise PeerLostError(f"rank {rank}: rank {min(gone)} died")
                if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"rank {rank}: exchange {n} timed out")
            return [got[q] for q in range(self.num_ranks)]


class NumpyMemory:
    """The memory protocol with nothing a Buffer may read: the engine keeps its own."""

    transport = NAME
    addresses = None

    def __init__(self, group: NumpyGroup) -> None:
        self.group = group
        self.local_array = np.zeros(0, np.uint8)
        self.pids = [os.getpid()] * group.num_ranks
        self.start_times = [0] * group.num_ranks

    def unlink(self) -> None:
        pass

    def close(self) -> None:
        pass


class NumpyGroup:
    """One rank of a :class:`NumpyWorld` (the ``ProcessGroup`` protocol)."""

    def __init__(self, world: NumpyWorld, rank: int) -> None:
        self.world, self.rank, self.num_ranks = world, rank, world.num_ranks
        self.topology = topo.host(world.num_ranks, 1)
        self._n = 0

    def allgather(self, value: Any, timeout_s: float | None = None) -> list[Any]:
        self._n += 1
        return self.world.gather(self._n, self.rank, value, timeout_s or 30.0)

    def barrier(self, timeout_s: float | None = None) -> None:
        self.allgather(None, timeout_s)

    def map_global(self, size_bytes: int, kind: str,
                   timeout_s: float | None = None) -> NumpyMemory:
        return NumpyMemory(self)


def _record(code: int, what: str, peer: int = -1, core: int = 0, argument: str = "",
            message: str = "") -> ErrorRecord:
    return ErrorRecord(code, peer, core, argument, what, message)


class NumpyEngine:
    """The engine of one rank (module docstring)."""

    takes_unchecked = False
    takes_tensors = False

    def __init__(self, world: NumpyWorld, spec: EngineSpec) -> None:
        cfg = spec.config
        self.world, self.spec, self.cfg = world, spec, cfg
        self.rank, self.R = spec.rank, spec.num_ranks
        self.L = cfg.num_experts // self.R
        self.dtype, self.cdtype = _dt.dtype_of(cfg.dtype), _dt.dtype_of(cfg.combine_dtype)
        self._pending: dict[int, Any] = {}
        self._base = 0
        self.signature = 0  # set_signature: what this rank's calls are

    # --- the protocol -----------------------------------------------------------------------

    def dispatch(self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray,
                 epoch: int, index: int, generation: int, plan: Any,
                 opts: CallOptions | None = None) -> Any:
        opts = opts or PLAIN
        bad = self._bad_routing(topk_idx)
        if bad is not None:  # before anything is posted: a clean reject, every peer told
            self._notice(epoch, E_BAD_INPUT, f"rank {self.rank}: topk_idx: {bad[1]}")
            return _record(E_BAD_INPUT, bad[1], argument="topk_idx", message=str(bad[0]))
        rows, scales = self._rows(x, opts.prequant)
        self._post(epoch, "dispatch", (rows, scales, topk_idx, topk_weights, self.signature))
        finish = (self._finish_dispatch, epoch, index, generation, topk_idx, topk_weights,
                  opts.copy)
        if opts.split:
            self._pending[epoch] = finish
            return None
        return finish[0](*finish[1:])

    def combine(self, expert_out: np.ndarray, handle: Any, epoch: int, generation: int,
                num_dispatches: int, opts: CallOptions | None = None) -> Any:
        opts = opts or PLAIN
        self._post(epoch, "combine", (int(handle.dispatch_index), expert_out))
        finish = (self._finish_combine, epoch, handle)
        if opts.split:
            self._pending[epoch] = finish
            return None
        return finish[0](*finish[1:])

    def set_signature(self, word: int) -> None:
        self.signature = int(word)

    def complete(self, epoch: int) -> Any:
        fn, *args = self._pending.pop(epoch)
        return fn(*args)

    def combine_buffer(self, index: int, rows: int) -> np.ndarray:
        return np.empty((rows, self.cfg.hidden), self.cdtype.storage)

    def stale_view(self, array: Any, dispatch_index: int, num_dispatches: int) -> None:
        return None  # every result is a fresh array: no view of this engine's memory

    def recv_valid(self, dispatch_index: int, num_dispatches: int) -> bool:
        return True  # the rows are a fresh array the engine never writes again

    def abandon(self, epoch: int, message: str) -> None:
        self._pending.pop(epoch, None)
        self._notice(epoch, E_LOST, message)

    def fail(self, epoch: int, code: int, message: str, finished: int,
             timeout_s: float) -> int:
        self._notice(epoch, code, message)
        return 0

    def resync(self, base_epoch: int) -> None:
        self._pending.clear()
        self._base = base_epoch

    def reset_all(self) -> None:
        pass

    def close(self) -> None:
        self._pending.clear()

    def trace_enable(self, capacity: int) -> bool:
        return False  # records no spans

    def trace_spans(self) -> tuple[bytes, tuple[int, ...], int]:
        return b"", (), 0

    # --- posting and waiting ----------------------------------------------------------------

    def _post(self, epoch: int, kind: str, value: Any) -> None:
        with self.world.cond:
            self.world.posts.setdefault((self.spec.uid, epoch), {})[self.rank] = (kind, value)
            self.world.cond.notify_all()

    def _notice(self, epoch: int, code: int, message: str) -> None:
        with self.world.cond:
            self.world.notices[(self.spec.uid, epoch)] = (self.rank, code, message)
            self.world.cond.notify_all()

    def _wait_all(self, epoch: int, kind: str) -> list[Any] | ErrorRecord:
        """Every rank's post of call ``epoch``, or why not (a notice, a death, the deadline)."""
        key = (self.spec.uid, epoch)
        deadline = time.monotonic() + float(self.cfg.timeout_s)
        w = self.world
        with w.cond:
            while True:
                got = w.posts.get(key, {})
                notice = w.notices.get(key)
                if notice is not None and notice[0] != self.rank:
                    peer, code, message = notice
                    return _record(E_REMOTE, f"rank {peer} failed call {epoch}", peer, code,
                                   message=message)
                gone = sorted(w.dead - got.keys())
                if gone:
                    return _record(E_PEER_LOST, f"rank {self.rank}: rank {gone[0]} died in "
                                   f"call {epoch}", gone[0])
                if len(got) == self.R:
                    break
                if not w.cond.wait(max(0.0, deadline - time.monotonic())):
                    return _record(E_TIMEOUT, f"rank {self.rank}: call {epoch} timed out "
                                   "waiting for its peers")
        if any(k != kind for k, _ in got.values()):
            return _record(E_LOST, f"rank {self.rank}: call {epoch} is not a {kind} on every "
                           "rank")
        return [got[q][1] for q in range(self.R)]

    # --- dispatch ---------------------------------------------------------------------------

    def _bad_routing(self, idx: np.ndarray) -> tuple[int, str] | None:
        E = self.cfg.num_experts
        out = (idx < -1) | (idx >= E)
        if out.any():
            return int(idx[out][0]), f"expert id out of range [-1, {E})"
        s = np.sort(idx, axis=1)
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        if dup.any():
            return int(s[:, 1:][dup][0]), "an expert twice in one token's row"
        return None

    def _rows(self, x: np.ndarray, prequant: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows as they travel: the payload, or quantised values and their scales."""
        cfg, H = self.cfg, self.cfg.hidden
        if cfg.quant is None:
            return x.copy(), None
        if prequant:  # the caller's values and scales, packed (ubep.buffer's checks)
            raw = np.ascontiguousarray(x).view(np.uint8)
            fmt = _quant.FORMATS[cfg.quant].storage
            return raw[:, :H].view(fmt).copy(), raw[:, H:].copy().view(np.float32)
        values, scales = _quant.quantize(self.dtype.to_float32(x), cfg.quant,
                                         round_scale=cfg.quant_round_scale)
        return values, scales

    def _order(self, posts: list[Any], dst: int) -> tuple[np.ndarray, ...]:
        """Rows rank ``dst`` receives, in receive order: (source, token, k or -1, expert)."""
        src, tok, kk, exp = [], [], [], []
        for s, (_, _, idx, *_) in enumerate(posts):
            if self.cfg.layout != "rank":
                t, k = np.nonzero((idx >= 0) & (idx // self.L == dst))
                src.append(np.full(len(t), s))
                tok.append(t)
                kk.append(k)
                exp.append(idx[t, k])
            else:
                t = np.nonzero(((idx >= 0) & (idx // self.L == dst)).any(axis=1))[0]
                src.append(np.full(len(t), s))
                tok.append(t)
                kk.append(np.full(len(t), -1))
                exp.append(np.zeros(len(t), np.int64))
        a = [np.concatenate(v).astype(np.int64) for v in (src, tok, kk, exp)]
        order = np.lexsort((a[1], a[0], a[3]))  # by expert, source, token (rank: source, token)
        return tuple(v[order] for v in a)

    def _finish_dispatch(self, epoch: int, index: int, generation: int, idx: np.ndarray,
                         w: np.ndarray, copy: bool) -> Any:
        posts = self._wait_all(epoch, "dispatch")
        if isinstance(posts, ErrorRecord):
            return posts
        for s, post in enumerate(posts):  # every source's call must be this rank's
            if post[4] != self.signature:
                return _record(E_BAD_INPUT, f"rank {s}'s call {epoch} differs", self.rank,
                               argument="signature",
                               message=f"{self.signature:x}:{post[4]:x}:{s}")
        r, L, K = self.rank, self.L, self.cfg.num_topk
        expert = self.cfg.layout != "rank"
        orders = [self._order(posts, d) for d in range(self.R)]
        # where each of this rank's rows landed
        send_dst_row = np.full((idx.shape[0], K if expert else self.R), -1, np.int64)
        for d, (src, tok, kk, exp) in enumerate(orders):
            mine = np.nonzero(src == r)[0]
            send_dst_row[tok[mine], kk[mine] if expert else d] = self._places(d, exp)[mine]
        src, tok, kk, exp = orders[r]
        recv_x = np.empty((len(src), self.cfg.hidden), posts[0][0].dtype)
        scales = None if posts[0][1] is None else np.empty((len(src), posts[0][1].shape[1]),
                                                           np.float32)
        if expert:
            r_idx, r_w = exp, np.empty(len(src), np.float32)
        else:
            r_idx, r_w = np.full((len(src), K), -1, np.int64), np.zeros((len(src), K), np.float32)
        for s, (rows, sc, s_idx, s_w, _) in enumerate(posts):
            at = np.nonzero(src == s)[0]
            recv_x[at] = rows[tok[at]]
            if scales is not None:
                scales[at] = sc[tok[at]]
            if expert:
                r_w[at] = s_w[tok[at], kk[at]]
            else:
                here = (s_idx[tok[at]] >= 0) & (s_idx[tok[at]] // L == r)
                r_idx[at] = np.where(here, s_idx[tok[at]] - r * L, -1)
                r_w[at] = np.where(here, s_w[tok[at]], np.float32(0))
        if not expert:
            kk = np.argmax(r_idx >= 0, axis=1).astype(np.int64) if len(src) else kk
        local = r_idx - r * L if expert else r_idx[r_idx >= 0]
        if self.cfg.layout == "expert_padded":
            recv_x, scales, r_idx, r_w, src, tok, kk = self._spread(
                self._places(r, exp), recv_x, scales, r_idx, r_w, src, tok, kk)
        handle = RuntimeHandle(
            layout=self.cfg.layout, rank=r, num_ranks=self.R, num_experts=self.cfg.num_experts,
            num_tokens=idx.shape[0], hidden=self.cfg.hidden, x_dtype=self.spec.dtype_name,
            topk_idx=idx, topk_weights=w, recv_src_rank=src, recv_src_token=tok,
            recv_src_k=kk, num_recv_rows_per_rank=np.bincount(src[src >= 0], minlength=self.R),
            send_dst_row=send_dst_row, dispatch_index=index, buffer_uid=self.spec.uid,
            generation=generation)
        del copy  # every result here is a fresh array already
        # every source's rows to every rank: each rank computes them from the posted routings
        sent = np.stack([np.bincount(o[0], minlength=self.R) for o in orders], axis=1)
        return DispatchResult(recv_x, r_idx, r_w, np.bincount(local, minlength=L), src, tok, kk,
                              handle, scales, sent.astype(np.int64))

    def _places(self, d: int, exp: np.ndarray) -> np.ndarray:
        """Row ``i`` of rank ``d``'s receive order -> its row in ``d``'s ``recv_x``: itself,
        or with ``expert_padded`` its expert's block of slots, that expert's ``j``-th row at
        ``j``."""
        if self.cfg.layout != "expert_padded":
            return np.arange(len(exp), dtype=np.int64)
        el = exp - d * self.L
        first = np.searchsorted(el, el)  # the receive order is by expert
        return el * self.cfg.max_tokens_per_rank * self.R + np.arange(len(el)) - first

    def _spread(self, places: np.ndarray, *arrays: np.ndarray | None) -> list[Any]:
        """The received arrays at their padded places; the empty slots' payload garbage
        (0x5A bytes: nothing may read it), their metadata -1 and weight 0."""
        cap = self.L * self.cfg.max_tokens_per_rank * self.R
        out: list[Any] = []
        for i, a in enumerate(arrays):
            if a is None:
                out.append(None)
                continue
            full = np.empty((cap, *a.shape[1:]), a.dtype)
            if i < 2:
                full.view(np.uint8)[...] = 0x5A
            else:
                full[...] = 0 if a.dtype == np.float32 else -1
            full[places] = a
            out.append(full)
        return out

    # --- combine ----------------------------------------------------------------------------

    def _finish_combine(self, epoch: int, h: Any) -> Any:
        posts = self._wait_all(epoch, "combine")
        if isinstance(posts, ErrorRecord):
            return posts
        if len({i for i, _ in posts}) != 1:
            return _record(E_LOST, f"rank {self.rank}: call {epoch} combines different "
                           "dispatches on different ranks")
        cd = self.cdtype
        acc_t = np.float64 if cd.storage == np.float64 else np.float32
        outs = [eo.astype(acc_t) if acc_t is np.float64 else cd.to_float32(eo)
                for _, eo in posts]
        acc = np.zeros((h.num_tokens, self.cfg.hidden), acc_t)
        if self.cfg.layout != "rank":
            for k in range(h.topk_idx.shape[1]):
                tok = np.nonzero(h.topk_idx[:, k] >= 0)[0]
                dst = h.topk_idx[tok, k] // self.L
                term = np.empty((len(tok), self.cfg.hidden), acc_t)
                for d in np.unique(dst):
                    at = dst == d
                    term[at] = outs[d][h.send_dst_row[tok[at], k]]
                acc[tok] = acc[tok] + h.topk_weights[tok, k].astype(acc_t)[:, None] * term
        else:
            for d in range(self.R):
                tok = np.nonzero(h.send_dst_row[:, d] >= 0)[0]
                acc[tok] = acc[tok] + outs[d][h.send_dst_row[tok, d]]
        return cd.from_float32(acc) if acc_t is np.float32 else acc


def open_numpy(memory: NumpyMemory, spec: EngineSpec) -> NumpyEngine:
    """The registry row's opener."""
    return NumpyEngine(memory.group.world, spec)


def register() -> None:
    """The one registry row."""
    register_engine(NAME, open_numpy)  # type: ignore[arg-type]
