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
from ..sched.plan import Plan, count_expert_ptr
from . import _tensors as tt
from ._require import kernels
from .config import TritonConfig
from .layout import NOTICE_MESSAGE_BYTES, layout_of
from .memory import Arena, open_arena
from .sync import BATCH_NONE, sync_row
from .units import DeviceUnits, device_units

__all__ = ["TritonEngine"]

_DONE, _CORRUPT, _REMOTE, _DIFFERS = 1, 3, 4, 5
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
        self._orders: dict[int, Any] = {}  # grid -> the identity order on the device
        self._count_ptrs: dict[tuple[int, ...], Any] = {}  # count programs' buckets
        self._open = torch.tensor([_DONE, 0], dtype=torch.int32, device=self.device)
        self.launch_log: list[tuple[str, list[str], dict[str, Any]]] | None = None
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
        if self.program_order is None:  # grid order: uploaded once per grid size
            got = self._orders.get(grid)
            if got is None:
                got = self._orders[grid] = self._torch.arange(
                    grid, dtype=self._torch.int32, device=self.device)
            return got
        perm = self.program_order(name, grid)
        if sorted(perm) != list(range(grid)):
            raise InvalidArgumentError("program_order", perm, f"must permute range({grid})")
        return self._torch.tensor(perm, dtype=self._torch.int32, device=self.device)

    def _launch(self, module: Any, name: str, grid: int, *args: Any,
                gate: tuple[Any, int] | None = None, **consts: Any) -> None:
        """Launch ``name``, gated (``_jit_common.opened``) on ``gate``: the status words of an
        earlier launch and its number of programs (``None``: always open)."""
        kernel = getattr(module, name)
        gate_t, gate_n = gate if gate is not None else (self._open, 1)
        full = (self.table, self._order(name, grid), gate_t, gate_n, *args)
        if self.launch_log is not None:
            self.launch_log.append((name, [_arg_type(a) for a in full],
                                    {**consts, "GP": _pow2(gate_n)}))
        extra = {"enable_fp_fusion": False} if self.device.type == "cuda" else {}
        kernel[(grid,)](*full, **consts, GP=_pow2(gate_n), **extra)

    def _status(self, grid: int) -> Any:
        """Fresh status words of a waiting launch (``[grid, 2]`` int32, flattened)."""
        return self._torch.zeros(grid * 2, dtype=self._torch.int32, device=self.device)

    def _wait(self, module: Any, name: str, grid: int, epoch: int, what: str, status: Any,
              *args: Any, gate: tuple[Any, int] | None = None, **consts: Any) -> None:
        """Launch a waiting kernel again until every program is done, a peer failed or died,
        or ``timeout_s`` passed (each launch's waits are bounded by ``spins`` polls; programs
        ``status`` says are done skip): the path of a call whose first pass did not finish."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            self._launch(module, name, grid, status, *args, gate=gate, **consts)
            if self._settled(tt.to_host(status).reshape(grid, 2), epoch, what, deadline):
                return
            if self.device.type == "cpu":
                time.sleep(0.0005)  # leave the CPU to the peers being waited for

    def _settled(self, st: np.ndarray, epoch: int, what: str, deadline: float) -> bool:
        """Whether every program of a waiting launch is done (``st``: its ``[grid, 2]`` status
        words read back); raises what a failed wait means (a peer's notice, corrupt counts, a
        dead peer, the deadline passed)."""
        if (st[:, 0] == _DONE).all():
            return True
        remote = np.flatnonzero(st[:, 0] == _REMOTE)
        if len(remote):
            raise self._remote_error(int(st[remote[0], 1]), epoch)
        corrupt = np.flatnonzero(st[:, 0] == _CORRUPT)
        if len(corrupt):
            raise self._lose_step(epoch, UbepError(
                f"rank {self.rank}: call {epoch}: the counts of rank {int(corrupt[0])} "
                "disagree with its routing record (corrupt control data)"))
        dead = [r for r in range(self.num_ranks) if r != self.rank and not self.arena.alive(r)]
        if dead:
            raise self._lose_step(epoch, PeerLostError(
                f"rank {self.rank}: call {epoch} ({what}): peer rank(s) {dead} died"))
        if time.monotonic() > deadline:
            pending = [int(i) for i in np.flatnonzero(st[:, 0] != _DONE)]
            raise self._lose_step(epoch, TimeoutError(
                f"rank {self.rank}: call {epoch} ({what}): programs {pending} still "
                f"waiting after {self.config.timeout_s} s"))
        return False

    def _checked(self, bad: Any) -> tuple[Any, int]:
        """The gate of a call's first launches: open when the device check of its input found
        nothing (``bad``: int32 ``[1]``, 0 or the reason; ``None``: checked on the host)."""
        if bad is None:
            return self._open, 1
        torch = self._torch
        return torch.cat([torch.where(bad == 0, _DONE, 0).to(torch.int32), bad]), 1

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

    def _begin(self, epoch: int | None, generation: int | None) -> int:
        """The call's epoch: the next one, or the one a caller that numbers its calls itself
        (a Buffer) names, with its resync ``generation``."""
        if self._lost_step is not None:
            raise OutOfStepError(f"rank {self.rank}: the Triton engine lost step "
                                 f"({self._lost_step}); call resync() on every rank")
        self.epoch = self.epoch + 1 if epoch is None else int(epoch)
        if generation is not None:
            self.generation = int(generation)
        return self.epoch

    def publish_failure(self, epoch: int, code: int, message: str) -> None:
        """Tell every peer "call ``epoch`` failed here, for reason ``code``" (1: rejected
        before anything reached a peer; 6: out of step), as a peer's waits read it."""
        self._notice(epoch, code, message)

    def lose_step(self, epoch: int, err: BaseException) -> BaseException:
        """Call ``epoch`` failed mid-call here (``err``): the peers are told and this engine
        refuses calls until :meth:`resync` / :meth:`restart`; returns ``err``."""
        return self._lose_step(epoch, err)

    def arm(self) -> None:
        """SP: every receive row and combine slot holds the sentinel again (no call inside)."""
        self._arm_all()

    def set_signature(self, word: int) -> None:
        """What this rank's next dispatches are (``ubep.buffer.signature``, ``Buffer.sign``)."""
        self.signature = int(word) & _MASK64


    def _refuse(self, epoch: int, err: InvalidArgumentError) -> InvalidArgumentError:
        self._notice(epoch, _CLEAN, f"rank {self.rank}: {err}")
        return err

    def _epoch_args(self, epoch: int) -> tuple[int, int]:
        return epoch & 0x7FFFFFFF, _signed64(epoch * _GOLDEN)

    # --- dispatch ---------------------------------------------------------------------------

    def dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, *, epoch: int | None = None,
                 index: int | None = None, generation: int | None = None,
                 plan: Any = None) -> DispatchResult[Any]:
        """Dispatch this rank's tokens (collective): a ``DispatchResult`` of torch tensors
        on the engine's device. Its handle keeps its arrays on the device when ``x`` is a
        tensor (a combine uploads nothing), numpy arrays when the call came with numpy.

        A caller that numbers its calls itself (a Buffer, ``ubep.triton.plane``) names the
        call: its ``epoch``, the dispatch ``index`` (the routing record's parity) and its
        resync ``generation`` (stamped into the handle), and its cores' split ``plan``
        (``ubep.sched``'s ``CoreSplit``, ``ScheduleSpec`` or ``Plan``: the send and count
        programs; ``None``: the config's); else the engine counts."""
        epoch = self._begin(epoch, generation)
        # every rank counts every dispatch, refused ones too: the index picks the routing
        # record's parity, which must be the same on every rank
        if index is None:
            index = self.num_dispatches
        self.num_dispatches = index + 1
        try:
            xb, idx, w, bad, host = self._check_dispatch(x, topk_idx, topk_weights)
            self._check_plan(plan, int(xb.shape[0]))
        except InvalidArgumentError as err:
            raise self._refuse(epoch, err) from None
        return self._dispatch(epoch, index, xb, idx, w, bad, plan, host)

    def _check_dispatch(self, x: Any, topk_idx: Any, topk_weights: Any
                        ) -> tuple[Any, Any, Any, Any, tuple[np.ndarray, np.ndarray] | None]:
        """``x``'s bits, ``topk_idx`` (int64) and ``topk_weights`` (float32) on the device,
        checked from their metadata; values of host arrays checked on the host (``host``:
        them), of tensors on the device (``bad``: int32 ``[1]``, 1 routing, 2 sentinel)."""
        torch, cfg = self._torch, self.config
        xb = tt.to_bits(x, cfg.dtype, "x", self.device)
        T = int(xb.shape[0])
        if xb.shape[1] != cfg.hidden or cfg.max_tokens_per_rank < T:
            raise InvalidArgumentError("x", tuple(xb.shape),
                                       f"must be [<= {cfg.max_tokens_per_rank}, {cfg.hidden}]")
        shape = (T, cfg.num_topk)
        if not isinstance(topk_idx, torch.Tensor):
            idx_np = validate_topk_idx(topk_idx, cfg.num_experts, argument="topk_idx",
                                       num_tokens=T)
            if idx_np.shape[1] != cfg.num_topk:
                raise InvalidArgumentError("topk_idx", idx_np.shape,
                                           f"must have {cfg.num_topk} columns")
            w_np = np.asarray(topk_weights)
            if w_np.dtype != np.float32 or w_np.shape != shape:
                raise InvalidArgumentError("topk_weights", (w_np.dtype, w_np.shape),
                                           f"must be float32 {shape}")
            bad = None
            if self.sync.armed and isinstance(x, torch.Tensor):
                bad = torch.where((xb == _bits_of(self.dt.sentinel, xb)).any(), 2, 0).to(
                    torch.int32).reshape(1)
            elif self.sync.armed and self.dt.contains_sentinel(np.asarray(x)):
                raise InvalidArgumentError("x", "sentinel", f"holds SP's sentinel "
                                           f"{self.dt.sentinel:#x}: use sync tff or dc")
            w_np = np.array(w_np, order="C")  # owned: the handle keeps it
            return (xb, torch.from_numpy(idx_np).to(self.device),
                    torch.from_numpy(w_np).to(self.device), bad, (idx_np, w_np))
        if tuple(topk_idx.shape) != shape or topk_idx.dtype.is_floating_point \
                or topk_idx.dtype == torch.bool or topk_idx.is_complex():
            raise InvalidArgumentError("topk_idx", (topk_idx.dtype, tuple(topk_idx.shape)),
                                       f"must be an integer tensor {shape}")
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 \
                or tuple(topk_weights.shape) != shape:
            raise InvalidArgumentError("topk_weights", (getattr(topk_weights, "dtype", None),
                                                        tuple(np.shape(topk_weights))),
                                       f"must be a float32 tensor {shape}")
        # owned copies on the device (the handle keeps them; the caller may reuse its own)
        idx = topk_idx.detach().to(device=self.device, dtype=torch.int64, copy=True)
        w = topk_weights.detach().to(device=self.device, copy=True).contiguous()
        return xb, idx, w, self._bad_input(xb, idx), None

    def _bad_input(self, xb: Any, idx: Any) -> Any:
        """What the device finds wrong with a call's tensors, as int32 ``[1]`` (no read): 1
        an expert id outside ``[-1, num_experts)`` or twice in a row, 2 SP's sentinel in
        ``x``, else 0."""
        torch = self._torch
        bad = ((idx < -1) | (idx >= self.config.num_experts)).any()
        if idx.shape[1] > 1:
            srt = idx.sort(dim=1).values
            bad = bad | ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()
        code = torch.where(bad, 1, 0).to(torch.int32)
        if self.sync.armed:
            hit = (xb == _bits_of(self.dt.sentinel, xb)).any()
            code = torch.where(hit & ~bad, 2, code).to(torch.int32)
        return code.reshape(1)

    def _refused(self, code: int, idx: Any) -> InvalidArgumentError:
        """The error naming the argument the device check refused (``code``: its reason),
        read back in full only on this failure path."""
        if code == 1:
            try:
                validate_topk_idx(tt.to_host(idx), self.config.num_experts, argument="topk_idx")
            except InvalidArgumentError as err:
                return err
        return InvalidArgumentError("x", "sentinel", f"holds SP's sentinel "
                                    f"{self.dt.sentinel:#x}: use sync tff or dc")

    def _cores(self, plan: Any) -> tuple[int, Any]:
        """The send programs of the Buffer's core split ``plan`` and the count programs'
        buckets (a device table, uploaded once per split)."""
        cfg = self.config
        if plan is None:
            n_send, n_count = cfg.num_send_programs, cfg.num_count_programs
        else:
            n_send, n_count = int(plan.num_send_cores), int(plan.num_count_cores)
        buckets = self.num_ranks if self.rank_layout else cfg.num_experts
        ptr = count_expert_ptr(n_count, buckets)
        key = tuple(int(v) for v in ptr)
        got = self._count_ptrs.get(key)
        if got is None:
            got = self._count_ptrs[key] = _i64(ptr, self.device)
        return n_send, got

    def _check_plan(self, plan: Any, num_tokens: int) -> None:
        """A whole Plan must be this rank's, of this layout and batch (its units are sent as
        they are: the caller built them from the same routing)."""
        if isinstance(plan, Plan) and (
                plan.rank != self.rank or plan.layout != self.config.layout
                or plan.num_ranks != self.num_ranks
                or (plan.num_units and int(plan.send_token.max()) >= num_tokens)):
            raise InvalidArgumentError("plan", (plan.rank, plan.layout, plan.num_ranks),
                                       f"must be a Plan of rank {self.rank}, layout "
                                       f"{self.config.layout!r}, {self.num_ranks} ranks, "
                                       f"{num_tokens} tokens")

    def _sends(self, plan: Any, units: DeviceUnits) -> tuple[Any, ...]:
        """The send programs' units (token, destination, bucket, slot, program bounds): a
        whole ``ubep.sched`` Plan of the caller's in its own issue order (its tables uploaded:
        the scheduler's policy on the device), else the device's canonical shares."""
        if not isinstance(plan, Plan):
            return units.token, units.dst, units.bucket, units.slot, units.core_ptr
        bucket = np.zeros_like(plan.send_dst_rank) if self.rank_layout \
            else plan.send_expert - plan.send_dst_rank * self.local_experts
        return tuple(_i64(a, self.device) for a in (plan.send_token, plan.send_dst_rank, bucket,
                                                    plan.send_slot, plan.core_ptr))

    def _dispatch(self, epoch: int, index: int, xb: Any, idx: Any, w: Any, bad: Any,
                  plan: Any, host: tuple[np.ndarray, np.ndarray] | None) -> DispatchResult[Any]:
        """The launches of a dispatch. The first pass launches every kernel once, each gated
        on the one before it waits for, and reads back one vector: the check, the waits'
        status and the rows received. Only a wait that did not finish runs again (with a read
        per launch)."""
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
            idx.reshape(-1).to(torch.int32))
        tt.view(self.arena.local, route + lay.route_w, T * K, torch.float32).copy_(
            w.reshape(-1))
        if self.sync.armed:
            self._recv_rows(self._dirty_rows).fill_(self.dt.sentinel)
        n_send, bptr = self._cores(plan)
        units = device_units(idx, R, L, self.rank_layout, n_send)
        sends = self._sends(plan, units)
        checked = self._checked(bad)
        KP, BT = _pow2(K), 16
        # the counts block of this dispatch's parity (layout: a peer may still read the other)
        parity = index % 2
        off_counts = lay.counts + parity * R * NB * 8
        v_counts = self.v_counts[parity * R * NB:(parity + 1) * R * NB]
        # the call's signature, in this rank's arena before its counts: a peer that has its
        # counts reads it (signature_kernel)
        tt.view(self.arena.local, lay.sig + parity * 16, 2, torch.int64).copy_(
            torch.tensor([epoch, _signed64(self.signature)]))
        # this rank's rows to every rank (its units per destination), before its counts
        rows_to = units.dest_ptr[1:] - units.dest_ptr[:-1]
        self._launch(kd, "ranks_kernel", R, rows_to, me, e32, R, lay.ranks + parity * R * R * 8,
                     gate=checked, RP=_pow2(R))
        self._launch(kd, "count_kernel", int(bptr.shape[0]) - 1, idx, T, K, L, bptr, me, e32,
                     NB, off_counts, gate=checked, RANK_LAYOUT=self.rank_layout, BT=BT, KP=KP)
        offs = torch.zeros(R * NB, dtype=torch.int64, device=dev)
        RP, NBP = _pow2(R), _pow2(NB)
        st_prefix = self._status(R)
        prefix = (kd, "prefix_kernel", R, epoch, "counts", st_prefix, offs, me, epoch, e32, R,
                  NB, off_counts, lay.notice, cfg.poll_spins)
        prefix_consts: dict[str, Any] = {"RP": RP, "NBP": NBP}
        self._launch(*prefix[:3], *prefix[5:], gate=checked, **prefix_consts)
        # every source's signature against this rank's once its counts are in: the sends' gate
        st_sig = self._status(1)
        theirs = torch.zeros(1, dtype=torch.int64, device=dev)

        def sign() -> None:
            self._launch(kd, "signature_kernel", 1, st_sig, theirs, _signed64(self.signature),
                         epoch, R, lay.sig + parity * 16, gate=(st_prefix, R), RP=RP)

        sign()
        counted = (st_sig, 1)
        BH = min(_pow2(cfg.hidden), 1024)
        W = lay.row_bytes // 8

        def send() -> None:
            self._launch(kd, "send_kernel", n_send, xb, *sends, offs, cfg.hidden, NB, lay.recv,
                         lay.row_stride, lay.words, lay.nblk, epoch, gate=counted,
                         ROW=self.sync.dispatch_row, BH=BH, NBLKP=_pow2(lay.nblk))
            if self.sync.dispatch_batch != BATCH_NONE:
                # the batch in receive order: bucket, then slot (the canonical unit order)
                x64 = xb.reshape(-1).view(torch.int64) if self.sync.needs_words else offs
                self._launch(kd, "publish_kernel", R, x64, units.token, units.dest_ptr, W, me,
                             epoch, mix, lay.dflag, gate=counted,
                             BATCH=self.sync.dispatch_batch, BW=min(_pow2(max(W, 1)), 512))

        send()
        cap = lay.cap_rows
        meta = [torch.full((cap,), -1, dtype=torch.int64, device=dev) for _ in range(3)]
        m_idx = torch.full((cap, K) if self.rank_layout else (cap,), -1, dtype=torch.int64,
                           device=dev)
        m_w = torch.zeros((cap, K) if self.rank_layout else (cap,), dtype=torch.float32,
                          device=dev)
        st_recv = self._status(R)
        recv = (kd, "recv_kernel", R, epoch, "rows", st_recv, v_counts, self.v_recv,
                self.v_words, self.v_dflag, *meta, m_idx, m_w, me, epoch, mix, R, NB, L, K,
                route, lay.route_idx, lay.route_w, lay.notice, cfg.hidden,
                lay.row_stride // self.dt.itemsize, lay.nblk, W, self.dt.sentinel or 0,
                cfg.poll_spins)
        recv_consts: dict[str, Any] = {
                       "RANK_LAYOUT": self.rank_layout, "ROW": self.sync.dispatch_row,
                       "BATCH": self.sync.dispatch_batch, "RP": RP, "NBP": NBP, "KP": KP,
                       "BT": BT, "BH": BH, "BW": min(_pow2(max(W, 1)), 512),
                       "NBLKP": _pow2(lay.nblk)}
        self._launch(*recv[:3], *recv[5:], gate=counted, **recv_consts)
        # what the host needs once the counts are in (released after each source's signature
        # and rows per rank), in the call's one read: taken anew after a wait that ran again
        ranks = self.v_ranks[parity * R * R:(parity + 1) * R * R]

        def control() -> Any:
            return torch.cat([st_sig.to(torch.int64), theirs,
                              (v_counts & 0xFFFFFFFF).reshape(R, NB).sum(dim=1), ranks])

        snap = tt.to_host(torch.cat([checked[0].to(torch.int64), st_prefix.to(torch.int64),
                                     st_recv.to(torch.int64), control()]))
        if snap[0] != _DONE:
            raise self._refuse(epoch, self._refused(int(snap[1]), idx))
        deadline = time.monotonic() + cfg.timeout_s
        if not self._settled(snap[2:2 + 2 * R].reshape(R, 2), epoch, "counts", deadline):
            self._wait(*prefix, gate=checked, **prefix_consts)
            sign()
            got = tt.to_host(control())
            self._signed(epoch, got)
            send()
            self._wait(*recv, gate=counted, **recv_consts)
        else:
            got = snap[2 + 4 * R:]
            self._signed(epoch, got)
            if not self._settled(snap[2 + 2 * R:2 + 4 * R].reshape(R, 2), epoch, "rows",
                                 deadline):
                self._wait(*recv, gate=counted, **recv_consts)
        rows = self._sent_rows(epoch, got[3:3 + R], got[3 + R:].reshape(R, R))
        sent = (ranks & 0xFFFFFFFF).reshape(R, R).clone()
        return self._result(index, T, idx, w, host, units, offs, v_counts, meta, m_idx, m_w,
                            rows, sent)

    def _signed(self, epoch: int, control: np.ndarray) -> None:
        """The clean reject, as the native engine's, of a call a source signed otherwise than
        this rank (``control``: ``signature_kernel``'s status words, then the word it read)."""
        if control[0] == _DIFFERS:
            mine, theirs = self.signature & _MASK64, int(control[2]) & _MASK64
            peer = int(control[1])
            raise self._refuse(epoch, InvalidArgumentError(
                "signature", f"{mine:x}:{theirs:x}:{peer}",
                f"rank {peer}'s call {epoch} differs from rank {self.rank}'s"))

    def _sent_rows(self, epoch: int, from_source: np.ndarray, words: np.ndarray) -> int:
        """The rows this rank receives: each source's rows here by its counts, once its row of
        the ranks block (``words``) is this call's and says as much (else corrupt data)."""
        e32 = self._epoch_args(epoch)[0]
        bad = np.flatnonzero(((words >> 32) != e32).any(axis=1)
                             | ((words[:, self.rank] & 0xFFFFFFFF) != from_source))
        if len(bad):
            raise self._lose_step(epoch, UbepError(
                f"rank {self.rank}: call {epoch}: the rows per rank of rank {int(bad[0])} "
                "disagree with its counts (corrupt control data)"))
        return int(from_source.sum())

    def _result(self, index: int, T: int, idx: Any, w: Any,
                host: tuple[np.ndarray, np.ndarray] | None, units: DeviceUnits, offs: Any,
                v_counts: Any, meta: list[Any], m_idx: Any, m_w: Any,
                rows: int, sent: Any) -> DispatchResult[Any]:
        """The result, built on the device from what the launches wrote (``rows``: the rows
        received, the one number the host needs; ``sent``: ``num_sent_rows_per_rank``)."""
        torch, cfg, R, L = self._torch, self.config, self.num_ranks, self.local_experts
        counts = (v_counts & 0xFFFFFFFF).reshape(R, self.lay.num_buckets)
        self._dirty_rows = rows
        recv_x = self._recv_rows(rows).clone().view(tt.torch_dtype(cfg.dtype))
        src, tok, k = (m[:rows].clone() for m in meta)
        r_idx, r_w = m_idx[:rows].clone(), m_w[:rows].clone()
        if self.rank_layout:  # a scatter, not a mask: a masked select would read its size back
            per_expert = torch.zeros(L, dtype=torch.int64, device=self.device).scatter_add_(
                0, r_idx.clamp(min=0).reshape(-1), (r_idx >= 0).reshape(-1).to(torch.int64))
        else:
            per_expert = counts.sum(dim=0)
        arrays: dict[str, Any] = {
            "topk_idx": idx, "topk_weights": w, "recv_src_rank": src, "recv_src_token": tok,
            "recv_src_k": k, "num_recv_rows_per_rank": counts.sum(dim=1),
            "send_dst_row": units.send_dst_row(offs, self.lay.num_buckets)}
        if host is not None:  # a call of host arrays: a handle of host arrays, as it came
            arrays = {n: np.array(tt.to_host(a)) for n, a in arrays.items()}
            arrays["topk_idx"], arrays["topk_weights"] = host
        handle = RuntimeHandle(
            layout=cfg.layout, rank=self.rank, num_ranks=R, num_experts=cfg.num_experts,
            num_tokens=T, hidden=cfg.hidden, x_dtype=cfg.dtype, dispatch_index=index,
            buffer_uid=self.uid, generation=self.generation, **arrays)
        return DispatchResult(recv_x=recv_x, recv_topk_idx=r_idx, recv_topk_weights=r_w,
                              num_recv_tokens_per_expert=per_expert, recv_src_rank=src,
                              recv_src_token=tok, recv_src_k=k, handle=handle,
                              num_sent_rows_per_rank=sent)

    # --- combine ----------------------------------------------------------------------------

    def combine(self, expert_out: Any, handle: Any, *, epoch: int | None = None,
                generation: int | None = None) -> Any:
        """Send ``expert_out`` (one row per received row of ``handle``'s dispatch) back and
        reduce per source token (collective): ``y`` ``[num_tokens, hidden]`` torch tensor.
        ``epoch``, ``generation``: as :meth:`dispatch`."""
        epoch = self._begin(epoch, generation)
        try:
            eo, bad = self._check_combine(expert_out, handle)
        except InvalidArgumentError as err:
            raise self._refuse(epoch, err) from None
        return self._combine(epoch, eo, bad, handle)

    def _check_combine(self, expert_out: Any, handle: Any) -> tuple[Any, Any]:
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
        if not self.sync.armed:
            return eo, None
        if not isinstance(expert_out, self._torch.Tensor):
            if self.out_dt.contains_sentinel(np.asarray(expert_out)):
                raise InvalidArgumentError("expert_out", "sentinel", "holds SP's sentinel "
                                           f"{self.out_dt.sentinel:#x}: use sync tff or dc")
            return eo, None
        hit = (eo == _bits_of(self.out_dt.sentinel, eo)).any()
        return eo, self._torch.where(hit, 2, 0).to(self._torch.int32).reshape(1)

    def _on_device(self, a: Any, dtype: Any) -> Any:
        """A handle's array on the device: itself when the dispatch kept it there."""
        if isinstance(a, self._torch.Tensor):
            return a.to(device=self.device, dtype=dtype)
        return self._torch.as_tensor(np.ascontiguousarray(a), dtype=dtype).to(self.device)

    def _combine(self, epoch: int, eo: Any, bad: Any, h: RuntimeHandle) -> Any:
        """The launches of a combine, one read back as a dispatch's (:meth:`_dispatch`)."""
        torch, cfg, lay, kc, dev = self._torch, self.config, self.lay, self._kc, self.device
        R, K, L, J, me = self.num_ranks, cfg.num_topk, self.local_experts, lay.comb_slots, \
            self.rank
        T, rows = h.num_tokens, h.num_recv_rows
        _, mix = self._epoch_args(epoch)
        i64 = torch.int64
        idx = self._on_device(h.topk_idx, i64)
        if self.sync.armed:  # the slots this rank expects, armed before it says ready
            slots = self.v_comb.view(lay.cap_tokens, J, -1)[:T, :, :cfg.hidden]
            want = _expected(idx, L, J, self.rank_layout)[:, :, None]
            slots.copy_(torch.where(want, _bits_of(self.out_dt.sentinel, slots), slots))
        checked = self._checked(bad)
        self._launch(kc, "ready_kernel", R, me, epoch, lay.ready, gate=checked)
        RP = _pow2(R)
        st_ready = self._status(R)
        ready = (kc, "wait_ready_kernel", R, epoch, "ready", st_ready, self.v_ready, epoch, R,
                 lay.notice, cfg.poll_spins)
        ready_consts: dict[str, Any] = {"RP": RP}
        self._launch(*ready[:3], *ready[5:], gate=checked, **ready_consts)
        readied = (st_ready, R)
        P = cfg.num_send_programs
        j = torch.full((rows,), me, dtype=i64, device=dev) if self.rank_layout \
            else self._on_device(h.recv_src_k, i64)
        W = lay.comb_row_bytes // 8
        BH, BW = min(_pow2(cfg.hidden), 1024), min(_pow2(max(W, 1)), 512)
        eo64 = eo.reshape(-1).view(i64) if self.sync.needs_words else self.v_ready
        src, tok = self._on_device(h.recv_src_rank, i64), self._on_device(h.recv_src_token, i64)

        def push() -> None:
            self._launch(kc, "push_kernel", P, eo, eo64, src, tok, j, rows,
                         -(-rows // P) or 1, cfg.hidden, J, lay.comb, lay.comb_stride,
                         lay.cwords, lay.cnblk, lay.cdc, W, epoch, mix, gate=readied,
                         ROW=self.sync.combine_row, BH=BH, BW=BW, CNBLKP=_pow2(lay.cnblk))
            if self.sync.combine_batch != BATCH_NONE:
                self._launch(kc, "comb_publish_kernel", R, me, epoch, lay.cflag, gate=readied)

        push()
        y = torch.empty((T, cfg.hidden), dtype=tt.bits_dtype(cfg.out_dtype), device=dev)
        out_kind = {"fp32": 0, "bf16": 1, "fp16": 2}[cfg.out_dtype]
        st_reduce = self._status(P)
        reduce = (kc, "reduce_kernel", P, epoch, "combine rows", st_reduce, y, self.v_comb,
                  self.v_cwords, self.v_cdc, self.v_cflag, idx,
                  self._on_device(h.topk_weights, torch.float32), T, K, L, J, R,
                  -(-T // P) or 1, cfg.hidden, lay.comb_stride // self.out_dt.itemsize,
                  lay.cnblk, W, epoch, mix, self.out_dt.sentinel or 0, lay.notice,
                  cfg.poll_spins)
        reduce_consts: dict[str, Any] = {
                         "RANK_LAYOUT": self.rank_layout, "ROW": self.sync.combine_row,
                         "BATCH": self.sync.combine_batch, "OUT": out_kind, "RP": RP,
                         "KP": _pow2(K), "BH": BH, "BW": BW, "CNBLKP": _pow2(lay.cnblk)}
        self._launch(*reduce[:3], *reduce[5:], gate=readied, **reduce_consts)
        snap = tt.to_host(torch.cat([checked[0], st_ready, st_reduce]))
        if snap[0] != _DONE:
            raise self._refuse(epoch, self._refused(int(snap[1]), idx))
        deadline = time.monotonic() + cfg.timeout_s
        if not self._settled(snap[2:2 + 2 * R].reshape(R, 2), epoch, "ready", deadline):
            self._wait(*ready, gate=checked, **ready_consts)
            push()
            self._wait(*reduce, gate=readied, **reduce_consts)
        elif not self._settled(snap[2 + 2 * R:].reshape(P, 2), epoch, "combine rows",
                               deadline):
            self._wait(*reduce, gate=readied, **reduce_consts)
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


def _expected(idx: Any, L: int, J: int, rank_layout: bool) -> Any:
    """``[num_tokens, J]`` bool (device): the combine slots a source expects rows in."""
    import torch

    if not rank_layout:
        return idx >= 0
    owner = torch.where(idx >= 0, torch.div(idx, L, rounding_mode="floor"), -1)
    return (owner[:, :, None] == torch.arange(J, device=idx.device)).any(dim=1)


def _bits_of(value: int | None, like: Any) -> Any:
    """The bit pattern ``value`` (a sentinel) as a 0-d tensor of ``like``'s integer type."""
    import torch

    width = like.element_size() * 8
    v = int(value or 0) & ((1 << width) - 1)
    if like.dtype != torch.uint8 and v >= 1 << (width - 1):
        v -= 1 << width  # the signed integer of the same bits
    return torch.tensor(v, dtype=like.dtype, device=like.device)


def _arg_type(a: Any) -> str:
    """A launch argument as an ahead-of-time signature type (``*i64``, ``i64``)."""
    if hasattr(a, "data_ptr"):
        return "*" + {"torch.int64": "i64", "torch.int32": "i32", "torch.int16": "i16",
                      "torch.int8": "i8", "torch.uint8": "u8",
                      "torch.float32": "fp32"}[str(a.dtype)]
    return "i64" if isinstance(a, (int, np.integer)) else type(a).__name__
