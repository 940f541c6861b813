"""``TritonEngine``: UBEP's ASP dispatch and combine as Triton kernels over a pointer table.

The engine owns its memory (``ubep.triton.memory``: one region per rank, laid out by
``ubep.triton.layout``), runs the launches of ``kernels_dispatch`` and ``kernels_combine`` in
order, and returns results as torch tensors on its device. Every call carries an epoch (the
same on every rank: one per call), and every record a peer reads is accepted only for exactly
that epoch.

Failures: bad input is refused on the rank that sees it before anything reaches a peer; that
rank publishes a notice (code 1) that every peer's waits read, so the call fails everywhere
(:class:`~ubep.errors.RemoteError` with ``clean=True``) and the next call works. A wait that
passes ``timeout_s`` (:class:`~ubep.errors.TimeoutError`), a dead peer
(:class:`~ubep.errors.PeerLostError`) or corrupt counts publish a notice (code 6) and leave
the engine refusing calls with :class:`~ubep.errors.OutOfStepError` until :meth:`resync` has
run on every rank.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ..closing import Closing
from ..dtypes import dtype_of
from ..errors import (
    InvalidArgumentError,
    OutOfStepError,
    PeerLostError,
    RemoteError,
    TimeoutError,
    UbepError,
)
from ..handle import DispatchResult, RuntimeHandle
from ..routing import validate_topk_idx
from ..sched import schedule
from ..sched.plan import count_expert_ptr
from . import _tensors as tt
from ._require import kernels
from .config import TritonConfig
from .layout import NOTICE_MESSAGE_BYTES, layout_of
from .memory import Arena, open_arena
from .sync import BATCH_NONE, sync_row

__all__ = ["TritonEngine"]

_DONE, _CORRUPT, _REMOTE = 1, 3, 4
_CLEAN, _OUT_OF_STEP = 1, 6
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _signed64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class TritonEngine(Closing):
    """One rank's Triton engine (collective construction: every rank of ``group``).

    Args:
        group: a ``ubep.runtime.Group`` (``ubep.launch`` hands one to each rank).
        config: :class:`~ubep.triton.config.TritonConfig`, the same on every rank.

    Attributes:
        program_order: ``None`` (programs in grid order) or a function ``(kernel name, grid)
            -> permutation``: program ``i`` of a launch runs as program ``perm[i]``. Tests use
            it to show that a launch's programs make progress in any order.
        launch_log: ``None``, or a list that receives ``(kernel name, argument types,
            constexprs)`` of every launch (what the ahead-of-time compile check compiles).
    """

    def __init__(self, group: Any, config: TritonConfig, *, arena: Arena | None = None,
                 uid: int | None = None) -> None:
        if not isinstance(config, TritonConfig):
            raise InvalidArgumentError("config", type(config).__name__, "must be a TritonConfig")
        self._kd, self._kc = kernels(config.device)  # refuses first when Triton is missing
        import torch

        self._torch = torch
        self.config = config
        self.group = group
        self.rank, self.num_ranks = int(group.rank), int(group.num_ranks)
        self.sync = sync_row(config.sync)
        R, E = self.num_ranks, config.num_experts
        if E % R:
            raise InvalidArgumentError("num_experts", E, f"must be a multiple of {R} ranks")
        self.local_experts = E // R
        self.rank_layout = config.layout == "rank"
        self.dt, self.out_dt = dtype_of(config.dtype), dtype_of(config.out_dtype)
        self.lay = layout_of(config, R)
        self.device = torch.device(config.device)
        self.program_order: Callable[[str, int], list[int]] | None = None
        self.launch_log: list[tuple[str, list[str], dict[str, Any]]] | None = None
        # the Plan's cores are this engine's programs, whatever the host's core count
        self.topology = replace(group.topology, cores_per_rank=max(
            group.topology.cores_per_rank, config.num_send_programs + config.num_count_programs))
        # An arena given (and a uid): a caller that owns the memory and the set-up's
        # agreement (a Buffer) made them; else the engine makes both, collectively.
        self.arena: Arena = arena if arena is not None else open_arena(
            group, self.lay.size_bytes, self.device, config.timeout_s)
        try:
            if self.arena.local.numel() < self.lay.size_bytes:
                raise InvalidArgumentError("arena", self.arena.local.numel(),
                                           f"must be >= {self.lay.size_bytes} bytes per rank")
            self._bind()
            self._arm_all()
            if uid is None:
                uid = int(group.allgather(secrets.randbits(62), config.timeout_s)[0])
                group.barrier(config.timeout_s)  # every region armed before any rank writes
            self.uid = uid
        except BaseException:
            self.arena.close()
            raise
        self.epoch = 0
        self.generation = 0
        self.num_dispatches = 0
        self.signature = 0  # what this rank's dispatches are (ubep.buffer.signature)
        self._resyncs = 0
        self._lost_step: str | None = None
        self._dirty_rows = 0

    # --- set-up ---------------------------------------------------------------------------

    def _bind(self) -> None:
        torch, lay, loc = self._torch, self.lay, self.arena.local
        i64 = torch.int64
        self.table = torch.tensor(self.arena.addresses, dtype=i64, device=self.device)
        self.v_counts = tt.view(loc, lay.counts, 2 * lay.num_ranks * lay.num_buckets, i64)
        self.v_ranks = tt.view(loc, lay.ranks, 2 * lay.num_ranks * lay.num_ranks, i64)
        self.v_dflag = tt.view(loc, lay.dflag, lay.num_ranks * 4, i64)
        self.v_cflag = tt.view(loc, lay.cflag, lay.num_ranks, i64)
        self.v_ready = tt.view(loc, lay.ready, lay.num_ranks, i64)
        self.v_notice = tt.view(loc, lay.notice, 3, i64)
        isz, osz = self.dt.itemsize, self.out_dt.itemsize
        self.v_recv = tt.view(loc, lay.recv, lay.cap_rows * lay.row_stride // isz,
                              tt.bits_dtype(self.config.dtype))
        self.v_words = tt.view(loc, lay.words, max(1, lay.cap_rows * lay.nblk), i64)
        slots = lay.cap_tokens * lay.comb_slots
        self.v_comb = tt.view(loc, lay.comb, slots * lay.comb_stride // osz,
                              tt.bits_dtype(self.config.out_dtype))
        self.v_cwords = tt.view(loc, lay.cwords, max(1, slots * lay.cnblk), i64)
        self.v_cdc = tt.view(loc, lay.cdc, slots * 2, i64)

    def _recv_rows(self, n: int) -> Any:
        return self.v_recv.view(self.lay.cap_rows, -1)[:n, :self.config.hidden]

    def _arm_all(self) -> None:
        """SP: every receive row and combine slot holds the sentinel (set-up and resync)."""
        if self.sync.armed:
            self._recv_rows(self.lay.cap_rows).fill_(self.dt.sentinel)
            slots = self.lay.cap_tokens * self.lay.comb_slots
            self.v_comb.view(slots, -1)[:, :self.config.hidden].fill_(self.out_dt.sentinel)

    # --- launching --------------------------------------------------------------------------

    def _order(self, name: str, grid: int) -> Any:
        perm = list(range(grid)) if self.program_order is None else self.program_order(name, grid)
        if sorted(perm) != list(range(grid)):
            raise InvalidArgumentError("program_order", perm, f"must permute range({grid})")
        return self._torch.tensor(perm, dtype=self._torch.int32, device=self.device)

    def _launch(self, module: Any, name: str, grid: int, *args: Any, **consts: Any) -> None:
        kernel = getattr(module, name)
        full = (self.table, self._order(name, grid), *args)
        if self.launch_log is not None:
            self.launch_log.append((name, [_arg_type(a) for a in full], dict(consts)))
        extra = {"enable_fp_fusion": False} if self.device.type == "cuda" else {}
        kernel[(grid,)](*full, **consts, **extra)

    def _wait(self, module: Any, name: str, grid: int, epoch: int, what: str, *args: Any,
              **consts: Any) -> None:
        """Launch a waiting kernel until every program is done, a peer failed or died, or
        ``timeout_s`` passed (each launch's waits are bounded by ``spins`` polls)."""
        status = self._torch.zeros(grid * 2, dtype=self._torch.int32, device=self.device)
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            self._launch(module, name, grid, status, *args, **consts)
            st = status.view(grid, 2).cpu().numpy()
            if (st[:, 0] == _DONE).all():
                return
            remote = np.flatnonzero(st[:, 0] == _REMOTE)
            if len(remote):
                raise self._remote_error(int(st[remote[0], 1]), epoch)
            corrupt = np.flatnonzero(st[:, 0] == _CORRUPT)
            if len(corrupt):
                raise self._lose_step(epoch, UbepError(
                    f"rank {self.rank}: call {epoch}: the counts of rank {int(corrupt[0])} "
                    "disagree with its routing record (corrupt control data)"))
            dead = [r for r in range(self.num_ranks) if r != self.rank
                    and not self.arena.alive(r)]
            if dead:
                raise self._lose_step(epoch, PeerLostError(
                    f"rank {self.rank}: call {epoch} ({what}): peer rank(s) {dead} died"))
            if time.monotonic() > deadline:
                pending = [int(i) for i in np.flatnonzero(st[:, 0] != _DONE)]
                raise self._lose_step(epoch, TimeoutError(
                    f"rank {self.rank}: call {epoch} ({what}): programs {pending} still "
                    f"waiting after {self.config.timeout_s} s"))
            if self.device.type == "cpu":
                time.sleep(0.0005)  # leave the CPU to the peers being waited for

    # --- failures ---------------------------------------------------------------------------

    def _notice(self, epoch: int, code: int, message: str) -> None:
        """Publish "call ``epoch`` failed here" (message first, epoch word last)."""
        raw = message.encode("utf-8", "replace")[:NOTICE_MESSAGE_BYTES]
        msg = tt.view(self.arena.local, self.lay.notice + 24, NOTICE_MESSAGE_BYTES,
                      self._torch.uint8)
        msg.zero_()
        if raw:
            msg[:len(raw)] = self._torch.frombuffer(bytearray(raw), dtype=self._torch.uint8)
        self.v_notice[1] = code
        self.v_notice[2] = len(raw)
        if self.device.type == "cuda":
            self._torch.cuda.synchronize(self.device)
        self.v_notice[0] = epoch

    def _remote_error(self, peer: int, epoch: int) -> BaseException:
        raw = self.arena.peer_bytes(peer, self.lay.notice, 24 + NOTICE_MESSAGE_BYTES)
        words = np.frombuffer(raw[:24], dtype=np.int64)
        code, length = int(words[1]), int(words[2])
        message = raw[24:24 + max(0, min(length, NOTICE_MESSAGE_BYTES))].decode("utf-8",
                                                                              "replace")
        clean = code == _CLEAN
        err = RemoteError(peer, message, clean=clean)
        if not clean:
            self._lost_step = f"rank {peer} failed call {epoch} mid-call"
        return err

    def _lose_step(self, epoch: int, err: BaseException) -> BaseException:
        self._lost_step = str(err)
        self._notice(epoch, _OUT_OF_STEP, str(err))
        return err

    def _begin(self) -> int:
        if self._lost_step is not None:
            raise OutOfStepError(f"rank {self.rank}: the Triton engine lost step "
                                 f"({self._lost_step}); call resync() on every rank")
        self.epoch += 1
        return self.epoch

    def _check_signatures(self, epoch: int, parity: int) -> None:
        """Every source's call is this rank's (its signature, stored before its counts, which
        are in): else a clean reject before any row moves, as the native engine's."""
        mine = self.signature & _MASK64
        for s in range(self.num_ranks):
            raw = self.arena.peer_bytes(s, self.lay.sig + parity * 16, 16)
            got_epoch, theirs = (int(v) & _MASK64 for v in np.frombuffer(raw, "<i8"))
            if got_epoch == epoch and theirs != mine:
                raise self._refuse(epoch, InvalidArgumentError(
                    "signature", f"{mine:x}:{theirs:x}:{s}",
                    f"rank {s}'s call {epoch} differs from rank {self.rank}'s"))

    def _refuse(self, epoch: int, err: InvalidArgumentError) -> InvalidArgumentError:
        self._notice(epoch, _CLEAN, f"rank {self.rank}: {err}")
        return err

    def _epoch_args(self, epoch: int) -> tuple[int, int]:
        return epoch & 0x7FFFFFFF, _signed64(epoch * _GOLDEN)

    # --- dispatch ---------------------------------------------------------------------------

    def dispatch(self, x: Any, topk_idx: Any, topk_weights: Any) -> DispatchResult[Any]:
        """Dispatch this rank's tokens (collective): a ``DispatchResult`` of torch tensors
        on the engine's device (``handle``: a ``RuntimeHandle`` of numpy arrays)."""
        epoch = self._begin()
        # every rank counts every dispatch, refused ones too: the index picks the routing
        # record's parity, which must be the same on every rank
        index = self.num_dispatches
        self.num_dispatches += 1
        try:
            xb, idx, w = self._check_dispatch(x, topk_idx, topk_weights)
        except InvalidArgumentError as err:
            raise self._refuse(epoch, err) from None
        return self._dispatch(epoch, index, xb, idx, w)

    def _check_dispatch(self, x: Any, topk_idx: Any, topk_weights: Any) -> tuple[Any, Any, Any]:
        cfg = self.config
        xb = tt.to_bits(x, cfg.dtype, "x", self.device)
        T = int(xb.shape[0])
        if xb.shape[1] != cfg.hidden or cfg.max_tokens_per_rank < T:
            raise InvalidArgumentError("x", tuple(xb.shape),
                                       f"must be [<= {cfg.max_tokens_per_rank}, {cfg.hidden}]")
        idx_np = topk_idx.cpu().numpy() if hasattr(topk_idx, "cpu") else topk_idx
        idx = validate_topk_idx(idx_np, cfg.num_experts, argument="topk_idx", num_tokens=T)
        if idx.shape[1] != cfg.num_topk:
            raise InvalidArgumentError("topk_idx", idx.shape, f"must have {cfg.num_topk} columns")
        w = np.asarray(topk_weights.cpu().numpy() if hasattr(topk_weights, "cpu")
                       else topk_weights)
        if w.dtype != np.float32 or w.shape != idx.shape:
            raise InvalidArgumentError("topk_weights", (w.dtype, w.shape),
                                       f"must be float32 {idx.shape}")
        if self.sync.armed and self.dt.contains_sentinel(xb.cpu().numpy()):
            raise InvalidArgumentError("x", "sentinel", f"holds SP's sentinel "
                                       f"{self.dt.sentinel:#x}: use sync tff or dc")
        return xb, idx, np.ascontiguousarray(w)

    def _dispatch(self, epoch: int, index: int, xb: Any, idx: np.ndarray,
                  w: np.ndarray) -> DispatchResult[Any]:
        torch, cfg, lay, kd = self._torch, self.config, self.lay, self._kd
        R, NB, K, L, me = self.num_ranks, lay.num_buckets, cfg.num_topk, self.local_experts, \
            self.rank
        T = int(xb.shape[0])
        e32, mix = self._epoch_args(epoch)
        dev = self.device
        # The routing record peers read (own region, parity of the dispatch), and SP's re-arm
        # of the rows the last call filled: both before this rank's counts are released.
        route = lay.route[index % 2]
        tt.view(self.arena.local, route, 2, torch.int64).copy_(torch.tensor([T, epoch]))
        tt.view(self.arena.local, route + lay.route_idx, T * K, torch.int32).copy_(
            torch.from_numpy(idx.astype(np.int32).reshape(-1)))
        tt.view(self.arena.local, route + lay.route_w, T * K, torch.float32).copy_(
            torch.from_numpy(w.reshape(-1)))
        if self.sync.armed:
            self._recv_rows(self._dirty_rows).fill_(self.dt.sentinel)
        plan = schedule(idx, self.topology, rank=me, num_experts=cfg.num_experts,
                        policy=cfg.policy, num_send_cores=cfg.num_send_programs,
                        num_count_cores=cfg.num_count_programs, layout=cfg.layout)
        idx_t = torch.from_numpy(idx).to(dev)
        bptr = count_expert_ptr(plan.num_count_cores, R) if self.rank_layout \
            else plan.count_expert_ptr
        KP, BT = _pow2(K), 16
        # the counts block of this dispatch's parity (layout: a peer may still read the other)
        parity = index % 2
        off_counts = lay.counts + parity * R * NB * 8
        v_counts = self.v_counts[parity * R * NB:(parity + 1) * R * NB]
        # the call's signature, in this rank's arena before its counts: a peer that has its
        # counts reads it (_check_signatures)
        tt.view(self.arena.local, lay.sig + parity * 16, 2, torch.int64).copy_(
            torch.tensor([epoch, _signed64(self.signature)]))
        # this rank's rows to every rank (one unit of the Plan per row), before its counts
        rows_to = np.bincount(plan.send_dst_rank, minlength=R).astype(np.int64)
        self._launch(kd, "ranks_kernel", R, _i64(rows_to, dev), me, e32, R,
                     lay.ranks + parity * R * R * 8, RP=_pow2(R))
        self._launch(kd, "count_kernel", plan.num_count_cores, idx_t, T, K, L,
                     _i64(bptr, dev), me, e32, NB, off_counts, RANK_LAYOUT=self.rank_layout,
                     BT=BT, KP=KP)
        offs = torch.zeros(R * NB, dtype=torch.int64, device=dev)
        RP, NBP = _pow2(R), _pow2(NB)
        self._wait(kd, "prefix_kernel", R, epoch, "counts", offs, me, epoch, e32, R, NB,
                   off_counts, lay.notice, cfg.poll_spins, RP=RP, NBP=NBP)
        self._check_signatures(epoch, parity)
        bucket = np.zeros_like(plan.send_dst_rank) if self.rank_layout \
            else plan.send_expert - plan.send_dst_rank * L
        # where each unit's row lands (send_kernel's row), the handle's send_dst_row
        dst_row = offs.cpu().numpy()[plan.send_dst_rank * NB + bucket] + plan.send_slot
        send_dst_row = np.full((T, R if self.rank_layout else K), -1, dtype=np.int64)
        send_dst_row[plan.send_token, plan.send_dst_rank if self.rank_layout
                     else plan.send_k] = dst_row
        BH = min(_pow2(cfg.hidden), 1024)
        self._launch(kd, "send_kernel", plan.num_send_cores, xb, _i64(plan.send_token, dev),
                     _i64(plan.send_dst_rank, dev), _i64(bucket, dev),
                     _i64(plan.send_slot, dev), _i64(plan.core_ptr, dev), offs, cfg.hidden, NB,
                     lay.recv, lay.row_stride, lay.words, lay.nblk, epoch,
                     ROW=self.sync.dispatch_row, BH=BH, NBLKP=_pow2(lay.nblk))
        W = lay.row_bytes // 8
        if self.sync.dispatch_batch != BATCH_NONE:
            # the batch in receive order: bucket, then slot (the canonical unit order)
            canon = np.lexsort((plan.send_slot, bucket, plan.send_dst_rank))
            c_ptr = np.zeros(R + 1, dtype=np.int64)
            np.cumsum(np.bincount(plan.send_dst_rank, minlength=R), out=c_ptr[1:])
            x64 = xb.reshape(-1).view(torch.int64) if self.sync.needs_words else offs
            self._launch(kd, "publish_kernel", R, x64, _i64(plan.send_token[canon], dev),
                         _i64(c_ptr, dev), W, me, epoch, mix, lay.dflag,
                         BATCH=self.sync.dispatch_batch, BW=min(_pow2(max(W, 1)), 512))
        cap = lay.cap_rows
        meta = [torch.full((cap,), -1, dtype=torch.int64, device=dev) for _ in range(3)]
        m_idx = torch.full((cap, K) if self.rank_layout else (cap,), -1, dtype=torch.int64,
                           device=dev)
        m_w = torch.zeros((cap, K) if self.rank_layout else (cap,), dtype=torch.float32,
                          device=dev)
        self._wait(kd, "recv_kernel", R, epoch, "rows", v_counts, self.v_recv,
                   self.v_words, self.v_dflag, *meta, m_idx, m_w, me, epoch, mix, R, NB, L, K,
                   route, lay.route_idx, lay.route_w, lay.notice, cfg.hidden,
                   lay.row_stride // self.dt.itemsize, lay.nblk, W, self.dt.sentinel or 0,
                   cfg.poll_spins, RANK_LAYOUT=self.rank_layout, ROW=self.sync.dispatch_row,
                   BATCH=self.sync.dispatch_batch, RP=RP, NBP=NBP, KP=KP, BT=BT, BH=BH,
                   BW=min(_pow2(max(W, 1)), 512), NBLKP=_pow2(lay.nblk))
        sent = self._sent_rows(epoch, parity, v_counts)
        return self._result(index, T, idx, w, send_dst_row, v_counts, meta, m_idx, m_w, sent)

    def _sent_rows(self, epoch: int, parity: int, v_counts: Any) -> np.ndarray:
        """``[source, destination]`` rows of this dispatch, from the ranks block (every source
        released its row before its counts, which this rank has all acquired); a row that is
        not this call's, or whose entry for this rank is not the rows its counts announced, is
        corrupt control data."""
        R, e32 = self.num_ranks, self._epoch_args(epoch)[0]
        words = self.v_ranks[parity * R * R:(parity + 1) * R * R].cpu().numpy().reshape(R, R)
        sent = (words & 0xFFFFFFFF).astype(np.int64)
        counts = (v_counts.cpu().numpy() & 0xFFFFFFFF).reshape(R, self.lay.num_buckets)
        bad = np.flatnonzero(((words >> 32) != e32).any(axis=1)
                             | (sent[:, self.rank] != counts.sum(axis=1)))
        if len(bad):
            raise self._lose_step(epoch, UbepError(
                f"rank {self.rank}: call {epoch}: the rows per rank of rank {int(bad[0])} "
                "disagree with its counts (corrupt control data)"))
        return sent

    def _result(self, index: int, T: int, idx: np.ndarray, w: np.ndarray,
                send_dst_row: np.ndarray, v_counts: Any, meta: list[Any], m_idx: Any,
                m_w: Any, sent: np.ndarray) -> DispatchResult[Any]:
        torch, cfg, R, L = self._torch, self.config, self.num_ranks, self.local_experts
        counts = (v_counts.cpu().numpy() & 0xFFFFFFFF).reshape(R, self.lay.num_buckets)
        rows = int(counts.sum())
        self._dirty_rows = rows
        recv_x = self._recv_rows(rows).clone().view(tt.torch_dtype(cfg.dtype))
        src, tok, k = (m[:rows].clone() for m in meta)
        r_idx, r_w = m_idx[:rows].clone(), m_w[:rows].clone()
        if self.rank_layout:
            flat = r_idx[r_idx >= 0]
            per_expert = torch.bincount(flat, minlength=L).to(torch.int64)
        else:
            per_expert = torch.from_numpy(counts.sum(axis=0).astype(np.int64)).to(self.device)
        src_np = src.cpu().numpy()
        handle = RuntimeHandle(
            layout=cfg.layout, rank=self.rank, num_ranks=R, num_experts=cfg.num_experts,
            num_tokens=T, hidden=cfg.hidden, x_dtype=cfg.dtype, topk_idx=idx, topk_weights=w,
            recv_src_rank=src_np, recv_src_token=tok.cpu().numpy(), recv_src_k=k.cpu().numpy(),
            num_recv_rows_per_rank=np.bincount(src_np, minlength=R).astype(np.int64),
            send_dst_row=send_dst_row, dispatch_index=index, buffer_uid=self.uid,
            generation=self.generation)
        return DispatchResult(recv_x=recv_x, recv_topk_idx=r_idx, recv_topk_weights=r_w,
                              num_recv_tokens_per_expert=per_expert, recv_src_rank=src,
                              recv_src_token=tok, recv_src_k=k, handle=handle,
                              num_sent_rows_per_rank=torch.from_numpy(sent).to(self.device))

    # --- combine ----------------------------------------------------------------------------

    def combine(self, expert_out: Any, handle: Any) -> Any:
        """Send ``expert_out`` (one row per received row of ``handle``'s dispatch) back and
        reduce per source token (collective): ``y`` ``[num_tokens, hidden]`` torch tensor."""
        epoch = self._begin()
        try:
            eo = self._check_combine(expert_out, handle)
        except InvalidArgumentError as err:
            raise self._refuse(epoch, err) from None
        return self._combine(epoch, eo, handle)

    def _check_combine(self, expert_out: Any, handle: Any) -> Any:
        cfg = self.config
        if not isinstance(handle, RuntimeHandle) or handle.buffer_uid != self.uid \
                or handle.generation != self.generation:
            raise InvalidArgumentError("handle", type(handle).__name__,
                                       "must come from this engine's dispatch since its "
                                       "last resync")
        eo = tt.to_bits(expert_out, cfg.out_dtype, "expert_out", self.device)
        if tuple(eo.shape) != (handle.num_recv_rows, cfg.hidden):
            raise InvalidArgumentError("expert_out", tuple(eo.shape),
                                       f"must be ({handle.num_recv_rows}, {cfg.hidden})")
        if self.sync.armed and self.out_dt.contains_sentinel(eo.cpu().numpy()):
            raise InvalidArgumentError("expert_out", "sentinel", "holds SP's sentinel "
                                       f"{self.out_dt.sentinel:#x}: use sync tff or dc")
        return eo

    def _combine(self, epoch: int, eo: Any, h: RuntimeHandle) -> Any:
        torch, cfg, lay, kc, dev = self._torch, self.config, self.lay, self._kc, self.device
        R, K, L, J, me = self.num_ranks, cfg.num_topk, self.local_experts, lay.comb_slots, \
            self.rank
        T, rows = h.num_tokens, h.num_recv_rows
        _, mix = self._epoch_args(epoch)
        if self.sync.armed:  # the slots this rank expects, armed before it says ready
            slots = self.v_comb.view(lay.cap_tokens, J, -1)[:T, :, :cfg.hidden]
            slots[torch.from_numpy(_expected(h, L, J, self.rank_layout))] = \
                self.out_dt.sentinel
        self._launch(kc, "ready_kernel", R, me, epoch, lay.ready)
        RP = _pow2(R)
        self._wait(kc, "wait_ready_kernel", R, epoch, "ready", self.v_ready, epoch, R,
                   lay.notice, cfg.poll_spins, RP=RP)
        P = cfg.num_send_programs
        j = np.full(rows, me, dtype=np.int64) if self.rank_layout else h.recv_src_k
        W = lay.comb_row_bytes // 8
        BH, BW = min(_pow2(cfg.hidden), 1024), min(_pow2(max(W, 1)), 512)
        eo64 = eo.reshape(-1).view(torch.int64) if self.sync.needs_words else self.v_ready
        self._launch(kc, "push_kernel", P, eo, eo64, _i64(h.recv_src_rank, dev),
                     _i64(h.recv_src_token, dev), _i64(j, dev), rows, -(-rows // P) or 1,
                     cfg.hidden, J, lay.comb, lay.comb_stride, lay.cwords, lay.cnblk, lay.cdc,
                     W, epoch, mix, ROW=self.sync.combine_row, BH=BH, BW=BW,
                     CNBLKP=_pow2(lay.cnblk))
        if self.sync.combine_batch != BATCH_NONE:
            self._launch(kc, "comb_publish_kernel", R, me, epoch, lay.cflag)
        y = torch.empty((T, cfg.hidden), dtype=tt.bits_dtype(cfg.out_dtype), device=dev)
        out_kind = {"fp32": 0, "bf16": 1, "fp16": 2}[cfg.out_dtype]
        self._wait(kc, "reduce_kernel", P, epoch, "combine rows", y, self.v_comb,
                   self.v_cwords, self.v_cdc, self.v_cflag, _i64(h.topk_idx, dev),
                   torch.from_numpy(np.ascontiguousarray(h.topk_weights)).to(dev), T, K, L, J,
                   R, -(-T // P) or 1, cfg.hidden, lay.comb_stride // self.out_dt.itemsize,
                   lay.cnblk, W, epoch, mix, self.out_dt.sentinel or 0, lay.notice,
                   cfg.poll_spins, RANK_LAYOUT=self.rank_layout, ROW=self.sync.combine_row,
                   BATCH=self.sync.combine_batch, OUT=out_kind, RP=RP, KP=_pow2(K), BH=BH,
                   BW=BW, CNBLKP=_pow2(lay.cnblk))
        return y.view(tt.torch_dtype(cfg.out_dtype))

    # --- resync and close -------------------------------------------------------------------

    def resync(self, timeout_s: float | None = None) -> None:
        """Bring every rank back in step after a failure (collective; every rank calls it,
        none inside a call): calls resume at an epoch past any rank's, control words are
        cleared and SP's rows re-armed, handles of earlier dispatches are refused.
        ``timeout_s``: how long to wait for the peers (default: the group's; a peer may
        still be waiting out a call's deadline when this rank arrives)."""
        self._resyncs += 1
        key = f"triton.resync.{self.uid}.{self._resyncs}"
        timeout = timeout_s
        epochs = self.group.exchange(key + ".a", self.epoch, timeout)
        base = max(int(e) for e in epochs) + 2
        # Nobody is inside a call: clear what peers wrote here, then meet again before any
        # peer may write for the new epochs.
        self.restart(base)
        self.group.exchange(key + ".b", base, timeout)

    def restart(self, base_epoch: int) -> None:
        """The local half of :meth:`resync` (what a caller that agrees on ``base_epoch`` itself
        runs on every rank, no peer inside a call, before any rank's next call): control words
        cleared, SP's rows re-armed, calls resume at ``base_epoch``, earlier handles refused."""
        for v in (self.v_counts, self.v_dflag, self.v_cflag, self.v_ready, self.v_notice,
                  self.v_words, self.v_cwords, self.v_cdc):
            v.zero_()
        self._arm_all()
        self.epoch = base_epoch - 1
        self.num_dispatches = 0  # the routing records' parity, the same on every rank again
        self.generation += 1
        self._lost_step = None

    def close(self) -> None:
        """Release this rank's mappings (local)."""
        self.arena.close()


def _i64(a: np.ndarray, device: Any) -> Any:
    import torch

    return torch.from_numpy(np.array(a, dtype=np.int64)).to(device)


def _expected(h: RuntimeHandle, L: int, J: int, rank_layout: bool) -> np.ndarray:
    """``[num_tokens, J]`` bool: the combine slots a source expects rows in."""
    idx = h.topk_idx
    if not rank_layout:
        return idx >= 0
    owner = np.where(idx >= 0, idx // L, -1)
    return (owner[:, :, None] == np.arange(J)).any(axis=1)


def _arg_type(a: Any) -> str:
    """A launch argument as an ahead-of-time signature type (``*i64``, ``i64``)."""
    if hasattr(a, "data_ptr"):
        return "*" + {"torch.int64": "i64", "torch.int32": "i32", "torch.int16": "i16",
                      "torch.int8": "i8", "torch.uint8": "u8",
                      "torch.float32": "fp32"}[str(a.dtype)]
    return "i64" if isinstance(a, (int, np.integer)) else type(a).__name__
