"""Elastic expert parallelism: a Buffer that masks a lost peer and keeps serving.

``Buffer(group, BufferConfig(..., on_peer_loss="mask"))`` builds a :class:`MaskingBuffer`. It
serves calls through an ordinary Buffer over the current *members* (at first every rank). When
a call fails because a peer died or stopped answering within the deadline, every survivor:

1. agrees with the others on who goes on (:func:`ubep.runtime.membership.agree`: one decision,
   first published wins, so no two survivors ever serve with different masks);
2. builds a fresh Buffer over the members (new segments, whose names a masked rank never
   learns: nothing it writes after waking reaches a survivor);
3. finishes the call that saw the loss over the members, replaying from what it kept the one
   call some survivors had finished and others had not (module notes below).

What callers see, as DeepEP's shrink mode defines it: ranks keep their original numbers;
received rows and counts exclude the masked ranks' tokens (``recv_src_rank`` in original
ranks); a top-k slot whose expert lives on a masked rank is dropped before dispatch, so it
contributes nothing to combine (``y`` is the weighted sum over the remaining slots);
:meth:`MaskingBuffer.mask_status` is the same vector on every survivor. A masked rank's calls
raise :class:`ubep.RankMaskedError`.

The call that saw the loss. Calls are collective and in order, so at a loss every survivor is
in call ``e`` or ``e + 1`` (a rank may finish call ``e`` while a slower one fails in it). The
decision carries each survivor's failed call; all of them run the earliest one, ``e0``, again
over the members: a survivor that had finished ``e0`` takes part with the inputs it kept (the
last dispatch's ``x``/``topk_idx``/``topk_weights`` and the last combine's ``expert_out``,
referenced, not copied: they must not change until the next call on the Buffer returns) and
keeps the result it already returned. A combine first needs its dispatch over the members: that
dispatch is replayed from the kept inputs, and the expert outputs are re-ordered from the old
receive order to the new by each row's origin.

Limits today: a one-host :class:`~ubep.runtime.group.Group` (``ubep.launch``, an environment
launch); blocking calls only (``return_recv_hook`` is refused); a handle from a dispatch older
than the call that saw the loss cannot be combined afterwards (dispatch again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import dtypes as _dt
from ..config import BufferConfig
from ..errors import (
    InvalidArgumentError,
    OutOfStepError,
    PeerLostError,
    RankMaskedError,
    RemoteError,
    TimeoutError,
    UbepError,
)
from ..handle import DispatchHandle, DispatchResult
from ..routing import experts_per_rank
from ..runtime.group import Group
from ..runtime.membership import (
    MemberGroup,
    Roster,
    admit,
    agree,
    request_join,
    roster_of_record,
)
from ..torch_bridge import as_process_group
from .buffer import Buffer
from .checks import check_dispatch_args

__all__ = ["MaskingBuffer"]

# what a call raises when the group under it broke (a clean reject is bad input, not a loss)
_LOSS = (PeerLostError, TimeoutError, OutOfStepError)


@dataclasses.dataclass(frozen=True, eq=False)
class _Kept:
    """A finished call's inputs, kept for a replay after a loss (references)."""

    call: int
    op: str
    result: DispatchResult[Any] | None = None  # a dispatch's, in original ranks
    x: Any = None
    topk_idx: Any = None
    topk_weights: Any = None
    expert_out: Any = None
    handle: Any = None  # the dispatch handle (combine: the one it used)


class MaskingBuffer:
    """A Buffer with ``on_peer_loss="mask"`` (module docstring). Built by ``Buffer(group,
    config)``; the same calls, plus :meth:`mask_status`."""

    def __init__(self, group: Any, config: BufferConfig) -> None:
        group = as_process_group(group)
        if not isinstance(group, Group):
            raise InvalidArgumentError(
                "on_peer_loss", "mask", "needs a one-host ubep Group (ubep.launch or an "
                f"environment launch), not {type(group).__name__}: its control plane must "
                "outlive a process")
        self._start(config, Roster.of(group), group.num_ranks)
        self._inner = Buffer(group, self._inner_config())
        self._uid = self._inner._uid  # agreed by every rank at construction

    def _start(self, config: BufferConfig, roster: Roster, num_ranks: int) -> None:
        self.config = config
        self.rank = roster.rank
        self.num_ranks = num_ranks
        self.num_experts = config.num_experts
        self.num_local_experts = experts_per_rank(config.num_experts, num_ranks)
        self._roster = roster
        self._losses = 0  # losses and admissions so far: their agreements' names
        self._admits = 0
        self._calls = 0
        self._masked: str | None = None
        self._last_dispatch: _Kept | None = None
        self._last_combine: _Kept | None = None
        # id(handle of before the loss) -> (that handle, the result of its dispatch then, the
        # result of its replay over the members): what combine re-orders rows by
        self._moved: dict[int, tuple[Any, DispatchResult[Any], DispatchResult[Any]]] = {}
        self._to_inner: np.ndarray | None = None  # None while every rank is a member

    # --- calls ---------------------------------------------------------------------------

    def dispatch(self, x: object, topk_idx: object, topk_weights: object, *,
                 copy: bool = False, return_recv_hook: bool = False,
                 x_scales: object = None) -> DispatchResult[Any]:
        """:meth:`ubep.Buffer.dispatch` over the members (module docstring)."""
        self._check_call(return_recv_hook)
        kept = _Kept(self._calls + 1, "dispatch", x=x, topk_idx=topk_idx,
                     topk_weights=topk_weights)
        res: DispatchResult[Any] = self._serve(kept, lambda: self._dispatch(
            x, topk_idx, topk_weights, copy, x_scales))
        self._last_dispatch = dataclasses.replace(kept, handle=res.handle, result=res)
        return res

    def combine(self, expert_out: object, handle: DispatchHandle, *,
                return_recv_hook: bool = False, topk_weights: object = None) -> np.ndarray:
        """:meth:`ubep.Buffer.combine` over the members (module docstring). ``topk_weights``
        (``[num_tokens, num_topk]``, this rank's): weights in place of the dispatched ones (the
        DeepEP facade's low-latency combine takes them here; the handle must stay the one
        dispatch returned, which is how a combine after a loss finds its rows)."""
        self._check_call(return_recv_hook)
        kept = _Kept(self._calls + 1, "combine", expert_out=expert_out, handle=handle,
                     topk_weights=topk_weights)
        y: np.ndarray = self._serve(kept, lambda: self._combine(expert_out, handle,
                                                                topk_weights))
        self._last_combine = kept
        return y

    def _serve(self, kept: _Kept, run: Callable[[], Any]) -> Any:
        """Run one call; after a loss, agree, rebuild and run it again (a loss during the
        recovery is one more loss: at most one round per member)."""
        self._calls = kept.call
        cause: BaseException | None = None
        for _ in range(self.num_ranks):
            try:
                if cause is None:
                    return run()
                return self._recover(kept, cause, run)
            except RankMaskedError:
                raise  # the survivors went on without this rank
            except RemoteError as exc:
                if exc.clean:  # a peer rejected its input on every rank: not a loss
                    self._calls -= 1
                    raise
                cause = exc
            except _LOSS as exc:
                cause = exc
            except InvalidArgumentError:
                self._calls -= 1  # refused before anything was sent: the call never happened
                raise
        raise PeerLostError(f"rank {self.rank}: call {kept.call} lost a member in every "
                            f"recovery round") from cause

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks serving, ascending (original numbers)."""
        return self._roster.members

    def admit(self, ranks: Sequence[int] = (), timeout_s: float | None = None
              ) -> tuple[int, ...]:
        """Let in every process waiting in :meth:`rejoin` as a masked rank (collective over the
        members, between calls: no handle of before survives it), first waiting up to
        ``timeout_s`` (default ``config.timeout_s``) for those of ``ranks`` (the replacements
        an orchestrator started). After it the newcomers are members again and calls run over
        them too, bit-exact. Returns the ranks admitted (none: nothing changes)."""
        self._check_call(False)
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.num_ranks)
               or r in self.members]
        if bad:
            raise InvalidArgumentError("ranks", list(ranks),
                                       f"must be masked ranks (members: {list(self.members)})")
        wait = float(self.config.timeout_s if timeout_s is None else timeout_s)
        self._admits += 1
        key = f"{self._uid:x}.a{self._admits}"
        roster, record = admit(self._roster, key, self.num_ranks, {
            "uid": self._uid, "num_ranks": self.num_ranks, "calls": self._calls,
            "losses": self._losses, "admits": self._admits,
        }, expect=tuple(ranks), timeout_s=wait)
        joined = tuple(sorted(int(r) for r in record["joiners"]))
        if joined:
            self._rebuild(roster, key)
        return joined

    @classmethod
    def rejoin(cls, rendezvous: str, rank: int, config: BufferConfig, *,
               timeout_s: float | None = None) -> MaskingBuffer:
        """Join the masking Buffer whose group meets in ``rendezvous`` as ``rank`` (a masked
        one: the number of a lost rank), from a new process: waits (at most ``timeout_s``,
        default ``config.timeout_s``) until the members call :meth:`admit`, then builds the
        Buffer with them. ``config`` must be the members' config."""
        wait = float(config.timeout_s if timeout_s is None else timeout_s)
        record = request_join(rendezvous, rank, wait)
        self = object.__new__(cls)
        self._start(config, roster_of_record(rank, record, rendezvous),
                    int(record["num_ranks"]))
        self._uid = int(record["uid"])
        self._calls = int(record["calls"])
        self._losses = int(record["losses"])
        self._admits = int(record["admits"])
        self._open(self._roster, f"{self._uid:x}.a{self._admits}")
        return self

    @classmethod
    def over_members(cls, roster: Roster, num_ranks: int, config: BufferConfig,
                     key: str) -> MaskingBuffer:
        """A masking Buffer over the members of ``roster`` only (collective over them, under
        ``key``, unique per build): for a caller that keeps its own mask of a group of
        ``num_ranks`` (the DeepEP facade's shrink mode) and builds Buffers after a loss."""
        self = object.__new__(cls)
        self._start(config, roster, num_ranks)
        self._open(roster, key)
        self._uid = self._inner._uid
        return self

    def mask_status(self) -> np.ndarray:
        """``[num_ranks]`` int32, 1 for a masked rank: the same on every survivor."""
        status = np.ones(self.num_ranks, dtype=np.int32)
        status[list(self.members)] = 0
        return status

    def get_combine_buffer(self, handle: DispatchHandle) -> np.ndarray:
        self._check_call(False)
        return self._inner.get_combine_buffer(handle)

    def resync(self, timeout_s: float | None = None) -> None:
        self._check_call(False)
        self._inner.resync(timeout_s)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> MaskingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:  # layout, num_cores, ...: the current Buffer's
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    # --- one call over the members -------------------------------------------------------

    def _dispatch(self, x: object, topk_idx: object, topk_weights: object, copy: bool,
                  x_scales: object) -> DispatchResult[Any]:
        table = self._to_inner
        if table is None:
            return self._inner.dispatch(x, topk_idx, topk_weights, copy=copy, x_scales=x_scales)
        # the Buffer's own checks, against the original expert count; the ids' range is the
        # native engine's check, needed here before they index the table
        _, idx, w = check_dispatch_args(self.config, _dt.dtype_of(self.config.dtype), x,
                                        topk_idx, topk_weights, x_scales)
        bad = idx[(idx < -1) | (idx >= self.num_experts)]
        if bad.size:
            raise InvalidArgumentError("topk_idx", int(bad[0]), "expert id out of range "
                                       f"[-1, {self.num_experts}) (num_experts)")
        res = self._inner.dispatch(x, table[idx + 1], w, copy=copy, x_scales=x_scales)
        return self._outer_result(res)

    def _outer_result(self, res: DispatchResult[Any]) -> DispatchResult[Any]:
        """The inner Buffer's result in original rank numbers and expert ids."""
        members = np.asarray(self.members, dtype=np.int64)
        idx = res.recv_topk_idx
        if self.config.layout == "expert":  # global ids; the rank layout's are local
            L = self.num_local_experts
            idx = np.where(idx < 0, idx, members[np.maximum(idx, 0) // L] * L + idx % L)
        return dataclasses.replace(res, recv_src_rank=members[res.recv_src_rank],
                                   recv_topk_idx=idx)

    def _combine(self, expert_out: object, handle: DispatchHandle,
                 topk_weights: object = None) -> np.ndarray:
        moved = self._moved.get(id(handle))
        if moved is None or moved[0] is not handle:
            return self._inner.combine(expert_out, _weighted(handle, topk_weights))
        _, before, replay = moved
        rows = _rows_in_new_order(before, replay, self.config.layout)
        return self._inner.combine(np.asarray(expert_out)[rows],
                                   _weighted(replay.handle, topk_weights))

    # --- the loss ------------------------------------------------------------------------

    def _recover(self, kept: _Kept, cause: BaseException, again: Any) -> Any:
        """Agree on the members, rebuild over them, replay what the survivors need of call
        ``kept.call - 1``, then run this call again (``again``)."""
        self._losses += 1
        key = f"{self._uid:x}.{self._losses}"
        decision = agree(self._roster, key, {"call": kept.call, "op": kept.op},
                         float(self.config.timeout_s))
        if self.rank not in decision.members:
            # mask_status() shows what the survivors decided
            self._roster = dataclasses.replace(self._roster, members=decision.members)
            self._masked = (f"rank {self.rank} was masked by the survivors "
                            f"{list(decision.members)} after: {cause}")
            self._inner.close()
            raise RankMaskedError(self._masked) from cause
        self._rebuild(self._roster.with_members(decision.members), key)
        first = min(int(s["call"]) for s in decision.states)
        first_op = next(s["op"] for s in decision.states if int(s["call"]) == first)
        if kept.call not in (first, first + 1):
            raise OutOfStepError(f"rank {self.rank}: call {kept.call} cannot resume at call "
                                 f"{first} of the survivors")
        if first_op == "combine":
            self._replay_dispatch_of_combine(kept if kept.call == first else self._last_combine)
        if kept.call == first + 1:
            self._replay_finished(first_op, first)
        return again()

    def _replay_dispatch_of_combine(self, combine: _Kept | None) -> None:
        """Dispatch again, over the members, the last dispatch: the one whose handle the
        combine being resumed uses."""
        d = self._last_dispatch
        if combine is None or d is None or combine.handle is not d.handle:
            raise OutOfStepError(f"rank {self.rank}: the combine to resume is not of the last "
                                 "dispatch; it cannot be resumed over the members")
        self._replay(d)

    def _replay_finished(self, op: str, first: int) -> None:
        """Take part in call ``first``, which this rank had finished (and returned)."""
        if op == "dispatch":
            d = self._last_dispatch
            if d is None or d.call != first:
                raise OutOfStepError(f"rank {self.rank}: call {first} was not kept")
            self._replay(d)
        else:
            c = self._last_combine
            if c is None or c.call != first:
                raise OutOfStepError(f"rank {self.rank}: call {first} was not kept")
            self._combine(c.expert_out, c.handle, c.topk_weights)

    def _replay(self, d: _Kept) -> None:
        assert d.result is not None
        again = self._dispatch(d.x, d.topk_idx, d.topk_weights, False, None)
        self._moved[id(d.handle)] = (d.handle, d.result, again)

    def _rebuild(self, roster: Roster, key: str) -> None:
        """A fresh Buffer over the members of ``roster`` in place of the current one."""
        old = self._inner
        self._open(roster, key)
        old.close()

    def _open(self, roster: Roster, key: str) -> None:
        """Serve over the members of ``roster``: build their Buffer (collective over them,
        under ``key``) and the expert-id table to it."""
        self._roster = roster
        self._moved.clear()
        self._inner = Buffer(MemberGroup(roster, key), self._inner_config())
        everyone = len(roster.members) == self.num_ranks
        self._to_inner = None if everyone else self._expert_table()

    def _expert_table(self) -> np.ndarray:
        """Original expert id + 1 -> expert id of the members' Buffer, -1 for a masked rank's."""
        L = self.num_local_experts
        table = np.full(self.num_experts + 1, -1, dtype=np.int64)
        for i, r in enumerate(self.members):
            table[1 + r * L: 1 + (r + 1) * L] = np.arange(i * L, (i + 1) * L)
        return table

    def _inner_config(self) -> BufferConfig:
        return dataclasses.replace(self.config, on_peer_loss="raise",
                                   num_experts=self.num_local_experts * len(self.members))

    def _check_call(self, hook: bool) -> None:
        if self._masked is not None:
            raise RankMaskedError(self._masked)
        if hook:
            raise InvalidArgumentError("return_recv_hook", True,
                                       "split-phase calls are not maskable yet "
                                       "(on_peer_loss='mask' runs blocking calls)")


def _weighted(handle: DispatchHandle, topk_weights: object) -> DispatchHandle:
    """``handle`` combining with ``topk_weights`` (None: the dispatched weights)."""
    if topk_weights is None:
        return handle
    return dataclasses.replace(handle, topk_weights=np.ascontiguousarray(topk_weights,
                                                                         dtype=np.float32))


def _rows_in_new_order(old: DispatchResult[Any], new: DispatchResult[Any],
                       layout: str) -> np.ndarray:
    """For each row of the replayed dispatch ``new``, its row in the old handle's receive order
    (rows are named by their origin; the replay's are a subset of the old ones)."""
    def keys(rank: np.ndarray, token: np.ndarray, k: np.ndarray) -> np.ndarray:
        key = rank.astype(np.int64) * (1 << 40) + token.astype(np.int64) * (1 << 8)
        return key + k if layout == "expert" else key

    old_keys = keys(old.recv_src_rank, old.recv_src_token, old.recv_src_k)
    new_keys = keys(new.recv_src_rank, new.recv_src_token, new.recv_src_k)
    order = np.argsort(old_keys, kind="stable")
    at = np.searchsorted(old_keys[order], new_keys)
    if at.size and (at.max() >= len(order) or not np.array_equal(old_keys[order][at], new_keys)):
        raise UbepError("a replayed dispatch received a row the original did not")
    return order[at]


Buffer.masking_class = MaskingBuffer
