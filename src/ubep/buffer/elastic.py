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
contributes nothing to combine (``y`` is the weighted sum over the remaining slots), unless
``config.expert_map`` gives it a live replica (``ubep.expert_map``: the members' Buffer routes
logical ids itself, ``ubep.buffer.replicas``); :meth:`MaskingBuffer.mask_status` is the same
vector on every survivor. A masked rank's calls raise :class:`ubep.RankMaskedError`.
:meth:`MaskingBuffer.mask_ranks` masks ranks on request through the same agreement.

The call that saw the loss. Calls are collective and in order, so at a loss every survivor is
in call ``e`` or ``e + 1`` (a rank may finish call ``e`` while a slower one fails in it). The
decision carries each survivor's failed call; all of them run the earliest one, ``e0``, again
over the members: a survivor that had finished ``e0`` takes part with the inputs it kept (the
last dispatch's ``x``/``topk_idx``/``topk_weights`` and the last combine's ``expert_out``,
referenced, not copied: they must not change until the next call on the Buffer returns) and
keeps the result it already returned. A combine first needs its dispatch over the members: that
dispatch is replayed from the kept inputs, and the expert outputs are re-ordered from the old
receive order to the new by each row's origin. With an expert map, a replayed dispatch keeps
the routing it was issued with (picks on the lost rank dropped): a survivor may hold its rows.

Split-phase calls (``return_recv_hook=True``) are not replayed: a loss while any is open makes
every survivor agree, rebuild and raise :class:`ubep.CallLostError` (in the call the loss
struck, or in its next one on a survivor that had finished it); the next call is served.

The agreement and the members' group come from a *plane*: on one host the rendezvous
directory (:class:`~ubep.runtime.group.Group`: ``ubep.launch``, an environment launch); over MPI
ULFM's revoke + shrink (``ubep.mpi.membership``, which masks dead ranks only and lets none back
in). Limit: a handle from a dispatch older than the call that saw the loss cannot be combined
afterwards (dispatch again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import errors  # qualified: ubep's TimeoutError is not the builtin
from .. import topology as topo
from ..config import BufferConfig
from ..expert_map import ExpertMap
from ..plane.control import Decision
from ..plane.registry import control_plane
from ..plane.results import DispatchHandle, DispatchResult, PendingCall
from ..routing import experts_per_rank
from ..torch_bridge import as_process_group, is_torch_tensor, torch_door
from .buffer import Buffer
from .replicas import LogicalRouting

__all__ = ["MaskingBuffer"]


# what a call raises when the group under it broke (a clean reject is bad input, not a loss)
_LOSS = (errors.PeerLostError, errors.TimeoutError, errors.OutOfStepError)


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
    physical: np.ndarray | None = None  # a dispatch's routing in original slots (None: topk_idx)


@dataclasses.dataclass(eq=False)
class _Open:
    """A split-phase call awaiting its hook: the caller's pending call and the members'."""

    call: int
    op: str
    outer: PendingCall[Any]
    inner: PendingCall[Any]
    kept: _Kept | None  # a dispatch's inputs (kept as the last dispatch once it completes)
    physical: np.ndarray | None
    to_inner: np.ndarray | None  # the members' numbering it was issued under


class MaskingBuffer:
    """A Buffer with ``on_peer_loss="mask"`` (module docstring). Built by ``Buffer(group,
    config)``; the same calls, plus :meth:`mask_status`."""

    # original expert id + 1 -> the members' Buffer's (None while every rank is a member)
    _to_inner: np.ndarray | None
    # what the members' Buffer routes topk_idx by (None: ids as they are), handed to it at its
    # construction; this Buffer keeps it to pin a replay and read a call's slots
    _route: LogicalRouting | None

    def __init__(self, group: Any, config: BufferConfig) -> None:
        group = as_process_group(group)
        # the group names its control plane: ubep.runtime's Group the rendezvous directory's
        # ("shm"), ubep.mpi's group ULFM's agreement
        name = getattr(group, "control_plane", None)
        if name is not None:
            plane: Any = control_plane(name).of(group)
            roster: Any = plane.roster
        elif hasattr(group, "membership_plane"):  # ubep.mpi: ULFM's agreement
            plane = group.membership_plane(config)  # the quorum: ubep.mpi.quorum
            roster = plane.roster
        else:
            raise errors.InvalidArgumentError(
                "on_peer_loss", "mask", "needs a ubep Group (ubep.launch, an environment "
                f"launch) or an MPI group (ubep.mpi.init), not {type(group).__name__}: its "
                "control plane must outlive a process")
        self._start(config, roster, group.num_ranks, group.topology.hop_matrix(), plane)
        to_inner, route = self._routing()
        self._inner = Buffer(group, self._inner_config(), routing=route)
        self._to_inner, self._route = to_inner, route
        self._uid = self._inner.uid  # agreed by every rank at construction

    def _start(self, config: BufferConfig, roster: Any, num_ranks: int,
               hops: np.ndarray, plane: Any = None) -> None:
        self.config = config
        # agreement + member groups (a roster of its own: the rendezvous directory's)
        self._plane = control_plane("shm")(roster) if plane is None else plane
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
        self._to_inner = None
        self._route = None
        self._open: list[_Open] = []  # split-phase calls awaiting their hook, in issue order
        self._requests = 0  # mask_ranks() calls so far: their agreements' names
        self._hops = np.asarray(hops)  # the group's hop classes: the replica rule reads them
        # logical experts -> physical slots (without a map: expert e on slot e)
        self._map = config.expert_map or ExpertMap.identity(config.num_experts)

    # --- calls ---------------------------------------------------------------------------

    def dispatch(self, x: object, topk_idx: object, topk_weights: object, *,
                 copy: bool = False, return_recv_hook: bool = False,
                 x_scales: object = None) -> Any:
        """:meth:`ubep.Buffer.dispatch` over the members (module docstring)."""
        if is_torch_tensor(x):  # torch in, torch out: the members' Buffer sees numpy views
            return self._torch_door().dispatch(x, topk_idx, topk_weights, copy,
                                               return_recv_hook, x_scales)
        self._check_call()
        if return_recv_hook:
            return self._split_call("dispatch", lambda: self._inner.dispatch(
                x, topk_idx, topk_weights, copy=copy, return_recv_hook=True,
                x_scales=x_scales), _Kept(0, "dispatch", x=x, topk_idx=topk_idx,
                                          topk_weights=topk_weights))
        kept = _Kept(self._calls + 1, "dispatch", x=x, topk_idx=topk_idx,
                     topk_weights=topk_weights)
        res: DispatchResult[Any] = self._serve(kept, lambda: self._dispatch(
            x, topk_idx, topk_weights, copy, x_scales))
        self._last_dispatch = dataclasses.replace(kept, handle=res.handle, result=res,
                                                  physical=self._physical())
        return res

    def combine(self, expert_out: object, handle: DispatchHandle, *,
                return_recv_hook: bool = False, topk_weights: object = None) -> Any:
        """:meth:`ubep.Buffer.combine` over the members (module docstring). ``topk_weights``
        (``[num_tokens, num_topk]``, this rank's): weights in place of the dispatched ones (the
        DeepEP facade's low-latency combine takes them here; the handle must stay the one
        dispatch returned, which is how a combine after a loss finds its rows)."""
        if is_torch_tensor(expert_out):  # torch in, torch out (as dispatch)
            return self._torch_door().combine(expert_out, handle, return_recv_hook,
                                              topk_weights=topk_weights)
        self._check_call()
        if return_recv_hook:
            return self._split_call("combine", lambda: self._combine(
                expert_out, handle, topk_weights, True), None)
        kept = _Kept(self._calls + 1, "combine", expert_out=expert_out, handle=handle,
                     topk_weights=topk_weights)
        y: np.ndarray = self._serve(kept, lambda: self._combine(expert_out, handle,
                                                                topk_weights))
        self._last_combine = kept
        return y

    def _torch_door(self) -> Any:
        """The torch door (``ubep.torch._convert.TorchDoor``), made once: the dtype plans; no
        region views (a replayed result is not a view of one region)."""
        door = self.__dict__.get("_door")
        if door is None:
            cfg = self.config
            door = self._door = torch_door(
                x_dtype=cfg.dtype, combine_dtype=cfg.combine_dtype, quant=cfg.quant,
                call_dispatch=self.dispatch, call_combine=self.combine)
        return door

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
            except (errors.RankMaskedError, errors.CallLostError):
                raise  # the survivors went on without this rank / without this call
            except errors.RemoteError as exc:
                if exc.clean:  # a peer rejected its input on every rank: not a loss
                    self._calls -= 1
                    raise
                cause = exc
            except _LOSS as exc:
                cause = exc
            except errors.InvalidArgumentError:
                self._calls -= 1  # refused before anything was sent: the call never happened
                raise
        raise errors.PeerLostError(f"rank {self.rank}: call {kept.call} lost a member in every "
                                   f"recovery round") from cause

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks serving, ascending (original numbers)."""
        return self._roster.members

    @property
    def rendezvous(self) -> str:
        """The directory the group meets in: what :meth:`rejoin` needs to come back (a rank
        masked on request rejoins from the same process, once the members :meth:`admit` it)."""
        return self._roster.rendezvous

    def admit(self, ranks: Sequence[int] = (), timeout_s: float | None = None
              ) -> tuple[int, ...]:
        """Let in every process waiting in :meth:`rejoin` as a masked rank (collective over the
        members, between calls: no handle of before survives it), first waiting up to
        ``timeout_s`` (default ``config.timeout_s``) for those of ``ranks`` (the replacements
        an orchestrator started). After it the newcomers are members again and calls run over
        them too, bit-exact. Returns the ranks admitted (none: nothing changes)."""
        self._check_call()
        self._one_host("admit")
        if self._open:
            raise errors.InvalidArgumentError("ranks", list(ranks), "admit runs between calls: "
                                              "split-phase calls are still waiting for their hooks")
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.num_ranks)
               or r in self.members]
        if bad:
            raise errors.InvalidArgumentError(
                "ranks", list(ranks), f"must be masked ranks (members: {list(self.members)})")
        wait = float(self.config.timeout_s if timeout_s is None else timeout_s)
        self._admits += 1
        key = f"{self._uid:x}.a{self._admits}"
        roster, record = self._plane.admit(self._roster, key, self.num_ranks, {
            "uid": self._uid, "num_ranks": self.num_ranks, "calls": self._calls,
            "losses": self._losses, "admits": self._admits, "requests": self._requests,
            "hops": self._hops.tolist(),
        }, expect=tuple(ranks), timeout_s=wait)
        joined = tuple(sorted(int(r) for r in record["joiners"]))
        if joined:
            self._rebuild(roster, key)
        return joined

    def mask_ranks(self, ranks: Sequence[int], timeout_s: float | None = None) -> np.ndarray:
        """Mask ``ranks`` on request (an application that knows a rank is bad: DeepEP's
        ``low_latency_update_mask_buffer(rank, True)``). Collective over the members, between
        calls, each passing the ranks it wants masked (they may differ: their union is masked).
        It runs through the loss agreement (one decision, first published wins), so every
        survivor ends with the same mask; a member that does not take part within
        ``timeout_s`` (default ``config.timeout_s``) is masked too. The survivors rebuild over
        the rest; a rank masked here gets the mask back, and its next call raises
        ``RankMaskedError``. Returns :meth:`mask_status`."""
        self._check_call()
        self._one_host("mask_ranks")
        if self._open:
            raise errors.InvalidArgumentError(
                "ranks", list(ranks), "mask_ranks runs between calls: "
                "split-phase calls are still waiting for their hooks")
        ok = isinstance(ranks, Sequence) and not isinstance(ranks, str) and all(
            isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in ranks)
        want = sorted({int(r) for r in ranks}) if ok else []
        if not ok or any(not 0 <= r < self.num_ranks for r in want):
            raise errors.InvalidArgumentError("ranks", ranks, f"must be rank numbers in [0, "
                                              f"{self.num_ranks})")
        self._requests += 1
        key = f"{self._uid:x}.m{self._requests}"
        wait = float(self.config.timeout_s if timeout_s is None else timeout_s)
        decision = self._plane.agree(self._roster, key, {"call": self._calls, "mask": want}, wait)
        masked = {r for s in decision.states for r in s["mask"]}
        members = tuple(r for r in decision.members if r not in masked)
        if self.rank not in members:
            self._leave(members, "on request")
        elif members != self.members:
            self._rebuild(self._roster.with_members(members), key)
        return self.mask_status()

    @classmethod
    def rejoin(cls, rendezvous: str, rank: int, config: BufferConfig, *,
               timeout_s: float | None = None) -> MaskingBuffer:
        """Join the masking Buffer whose group meets in ``rendezvous`` as ``rank`` (a masked
        one: the number of a lost rank), from a new process: waits (at most ``timeout_s``,
        default ``config.timeout_s``) until the members call :meth:`admit`, then builds the
        Buffer with them. ``config`` must be the members' config."""
        wait = float(config.timeout_s if timeout_s is None else timeout_s)
        roster, record = control_plane("shm").rejoin(rendezvous, rank, wait)
        self = object.__new__(cls)
        self._start(config, roster, int(record["num_ranks"]),
                    np.asarray(record["hops"], dtype=np.int8))
        self._uid = int(record["uid"])
        self._calls = int(record["calls"])
        self._losses = int(record["losses"])
        self._admits = int(record["admits"])
        self._requests = int(record["requests"])
        self._build(self._roster, f"{self._uid:x}.a{self._admits}")
        return self

    @classmethod
    def over_members(cls, roster: Any, num_ranks: int, config: BufferConfig,
                     key: str) -> MaskingBuffer:
        """A masking Buffer over the members of ``roster`` only (collective over them, under
        ``key``, unique per build): for a caller that keeps its own mask of a group of
        ``num_ranks`` (the DeepEP facade's shrink mode) and builds Buffers after a loss. An
        expert map routes by this host's hop classes (``ubep.topology.host``)."""
        self = object.__new__(cls)
        self._start(config, roster, num_ranks,
                    topo.host(num_ranks, roster.cores_per_rank).hop_matrix())
        self._build(roster, key)
        self._uid = self._inner.uid
        return self

    def mask_status(self) -> np.ndarray:
        """``[num_ranks]`` int32, 1 for a masked rank: the same on every survivor."""
        status = np.ones(self.num_ranks, dtype=np.int32)
        status[list(self.members)] = 0
        return status

    def get_combine_buffer(self, handle: DispatchHandle) -> np.ndarray:
        self._check_call()
        return self._inner.get_combine_buffer(handle)

    def resync(self, timeout_s: float | None = None) -> None:
        self._check_call()
        self._inner.resync(timeout_s)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> MaskingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:  # layout, num_cores, ...: the current Buffer's
        if name.startswith("_"):  # its private state stays its own
            raise AttributeError(name)
        return getattr(self._inner, name)

    # --- split-phase calls ----------------------------------------------------------------

    def _split_call(self, op: str, issue: Callable[[], Any], kept: _Kept | None) -> Any:
        """Issue a split-phase call over the members; its hook completes it. A loss while any
        is open is not replayed: every survivor agrees, rebuilds and raises ``CallLostError``
        (``_lost_open_calls``), and serves the next call over the members."""
        self._calls += 1
        call = self._calls
        if self._route is not None:
            self._route.last_physical = None
        try:
            inner = issue()
        except errors.RankMaskedError:
            raise
        except (errors.RemoteError, errors.InvalidArgumentError) as exc:
            if isinstance(exc, errors.InvalidArgumentError) or exc.clean:
                self._calls -= 1  # rejected on every rank: the call never happened
                raise
            raise self._split_loss(call, op, exc) from exc
        except _LOSS as exc:
            raise self._split_loss(call, op, exc) from exc
        holder: list[_Open] = []
        outer: PendingCall[Any] = PendingCall(op, self.rank, call,
                                              lambda: self._complete_split(holder[0]))
        holder.append(_Open(call, op, outer, inner, kept, self._physical(), self._to_inner))
        self._open.append(holder[0])
        return outer

    def _complete_split(self, o: _Open) -> None:
        """``PendingCall.hook`` of a split-phase call on this Buffer."""
        if self._masked is not None:
            o.outer._settle(False, errors.RankMaskedError(self._masked))
            return
        try:
            value = o.inner.hook()
        except errors.RemoteError as exc:
            if not exc.clean:
                self._split_loss(o.call, o.op, exc)  # settles o
                return
            o.outer._settle(False, exc)
        except _LOSS as exc:
            self._split_loss(o.call, o.op, exc)
            return
        except BaseException as exc:  # not a loss (an interrupt, a bug): the call fails as such
            o.outer._settle(False, exc)
            if o in self._open:
                self._open.remove(o)
            raise
        else:
            if o.to_inner is not None and o.op == "dispatch":
                value = self._outer_result(value)
            if o.kept is not None:
                self._last_dispatch = dataclasses.replace(
                    o.kept, call=o.call, handle=value.handle, result=value, physical=o.physical)
            o.outer._settle(True, value)
        if o in self._open:
            self._open.remove(o)

    def _split_loss(self, call: int, op: str, cause: BaseException) -> BaseException:
        """A loss while split-phase calls are open: agree and rebuild like a blocking call's
        loss, then fail every open call (returns the error; ``RankMaskedError`` when this rank
        is the one masked)."""
        self._losses += 1
        key = f"{self._uid:x}.{self._losses}"
        try:
            decision = self._agree_on_loss(key, call, op, cause, split=True)
        except errors.RankMaskedError as exc:
            return exc
        return self._lost_open_calls(call, op, decision)

    def _lost_open_calls(self, call: int, op: str, decision: Decision) -> errors.CallLostError:
        """Every survivor raises this for a loss with split-phase calls open (nothing is
        replayed: a hook's inputs are the caller's until it runs); the open calls fail with it."""
        err = errors.CallLostError(
            f"rank {self.rank}: call {call} ({op}) did not complete: rank(s) "
            f"{list(decision.masked)} were lost while split-phase calls were open; the "
            f"survivors {list(decision.members)} masked them and serve the next call")
        for o in self._open:
            o.outer._settle(False, err)
        self._open.clear()
        return err

    # --- one call over the members -------------------------------------------------------

    def _dispatch(self, x: object, topk_idx: object, topk_weights: object, copy: bool,
                  x_scales: object) -> DispatchResult[Any]:
        # the members' Buffer routes topk_idx itself (_routing), inside its call: bad ids are a
        # clean reject on every rank
        if self._route is not None:
            self._route.last_physical = None  # what _recover finds: this call's routing
        res = self._inner.dispatch(x, topk_idx, topk_weights, copy=copy, x_scales=x_scales)
        return res if self._to_inner is None else self._outer_result(res)

    def _routing(self) -> tuple[np.ndarray | None, LogicalRouting | None]:
        """The expert-id table to the members' Buffer (None while every rank is a member) and
        the routing of logical ids to its slots that Buffer is built with: the map's rule with
        the masked ranks out, then the members' renumbering (none is needed while every rank
        is a member and there is no map)."""
        everyone = len(self.members) == self.num_ranks
        to_inner = None if everyone else self._expert_table()
        if everyone and self.config.expert_map is None:
            return to_inner, None
        masked = [r for r in range(self.num_ranks) if r not in self.members]
        return to_inner, LogicalRouting(
            self._map, self.num_experts, self.num_ranks, self._hops[self.rank],
            self.config.num_topk, masked, to_inner)

    def _physical(self) -> np.ndarray | None:
        """The routing of the last dispatch in original slots (None: it was topk_idx)."""
        route = self._route
        return None if route is None else route.last_physical

    def _outer_result(self, res: DispatchResult[Any]) -> DispatchResult[Any]:
        """The inner Buffer's result in original rank numbers and expert ids."""
        members = np.asarray(self.members, dtype=np.int64)
        idx = res.recv_topk_idx
        if self.config.layout != "rank":  # global ids; the rank layout's are local
            L = self.num_local_experts
            idx = np.where(idx < 0, idx, members[np.maximum(idx, 0) // L] * L + idx % L)
        sent = res.num_sent_rows_per_rank
        if sent is not None:  # the members' rows, in original rank numbers
            outer = np.zeros((self.num_ranks, self.num_ranks), np.int64)
            outer[np.ix_(members, members)] = sent
            sent = outer
        return dataclasses.replace(res, recv_src_rank=members[res.recv_src_rank],
                                   recv_topk_idx=idx, num_sent_rows_per_rank=sent)

    def _combine(self, expert_out: object, handle: DispatchHandle,
                 topk_weights: object = None, hook: bool = False) -> Any:
        inner: Any = self._inner  # the hook flag picks the overload
        moved = self._moved.get(id(handle))
        if moved is None or moved[0] is not handle:
            return inner.combine(expert_out, _weighted(handle, topk_weights),
                                 return_recv_hook=hook)
        _, before, replay = moved
        rows = _rows_in_new_order(before, replay, self.config.layout)
        return inner.combine(np.asarray(expert_out)[rows], _weighted(replay.handle, topk_weights),
                             return_recv_hook=hook)

    # --- the loss ------------------------------------------------------------------------

    def _recover(self, kept: _Kept, cause: BaseException, again: Any) -> Any:
        """Agree on the members, rebuild over them, replay what the survivors need of call
        ``kept.call - 1``, then run this call again (``again``)."""
        self._losses += 1
        key = f"{self._uid:x}.{self._losses}"
        issued = self._physical()  # this call's routing, if it is a dispatch that got that far
        decision = self._agree_on_loss(key, kept.call, kept.op, cause)
        if any(s.get("split") for s in decision.states):
            raise self._lost_open_calls(kept.call, kept.op, decision) from cause
        first = min(int(s["call"]) for s in decision.states)
        first_op = next(s["op"] for s in decision.states if int(s["call"]) == first)
        if kept.call not in (first, first + 1):
            raise errors.OutOfStepError(f"rank {self.rank}: call {kept.call} cannot resume at call "
                                        f"{first} of the survivors")
        if first_op == "combine":
            self._replay_dispatch_of_combine(kept if kept.call == first else self._last_combine)
        if kept.call == first + 1:
            self._replay_finished(first_op, first)
        elif kept.op == "dispatch" and issued is not None:
            self._pin(issued)  # the call that saw the loss keeps the routing it was issued with
        return again()

    def _agree_on_loss(self, key: str, call: int, op: str, cause: BaseException,
                       split: bool = False) -> Decision:
        """The survivors' decision on a loss; this rank masked: raise ``RankMaskedError``, else
        rebuild over the members. ``split``: the loss struck with split-phase calls open (then
        no survivor replays: every one raises)."""
        state = {"call": call, "op": op, "split": split or bool(self._open)}
        decision = self._plane.agree(self._roster, key, state, float(self.config.timeout_s))
        if self.rank not in decision.members:
            self._leave(decision.members, f"after: {cause}")
            raise errors.RankMaskedError(self._masked) from cause
        self._rebuild(self._roster.with_members(decision.members), key)
        return decision

    def _leave(self, members: tuple[int, ...], why: str) -> None:
        """This rank is masked: mask_status() shows what the survivors decided, every call in
        flight and after raises ``RankMaskedError``."""
        self._roster = dataclasses.replace(self._roster, members=members)
        self._masked = f"rank {self.rank} was masked by the survivors {list(members)} {why}"
        for o in self._open:
            o.outer._settle(False, errors.RankMaskedError(self._masked))
        self._open.clear()
        self._inner.close()

    def _pin(self, physical: np.ndarray | None) -> None:
        route = self._route
        if physical is not None and route is not None:
            route.pin(physical)

    def _replay_dispatch_of_combine(self, combine: _Kept | None) -> None:
        """Dispatch again, over the members, the last dispatch: the one whose handle the
        combine being resumed uses."""
        d = self._last_dispatch
        if combine is None or d is None or combine.handle is not d.handle:
            raise errors.OutOfStepError(
                f"rank {self.rank}: the combine to resume is not of the last dispatch; it cannot "
                "be resumed over the members")
        self._replay(d)

    def _replay_finished(self, op: str, first: int) -> None:
        """Take part in call ``first``, which this rank had finished (and returned)."""
        if op == "dispatch":
            d = self._last_dispatch
            if d is None or d.call != first:
                raise errors.OutOfStepError(f"rank {self.rank}: call {first} was not kept")
            self._replay(d)
        else:
            c = self._last_combine
            if c is None or c.call != first:
                raise errors.OutOfStepError(f"rank {self.rank}: call {first} was not kept")
            self._combine(c.expert_out, c.handle, c.topk_weights)

    def _replay(self, d: _Kept) -> None:
        assert d.result is not None
        self._pin(d.physical)
        again = self._dispatch(d.x, d.topk_idx, d.topk_weights, False, None)
        self._moved[id(d.handle)] = (d.handle, d.result, again)

    def _rebuild(self, roster: Any, key: str) -> None:
        """A fresh Buffer over the members of ``roster`` in place of the current one."""
        old = self._inner
        self._build(roster, key)
        old.close()

    def _build(self, roster: Any, key: str) -> None:
        """Serve over the members of ``roster``: build their Buffer (collective over them,
        under ``key``) with its routing, and the expert-id table to it."""
        self._roster = roster
        self._moved.clear()
        to_inner, route = self._routing()
        self._inner = Buffer(self._plane.member_group(roster, key), self._inner_config(),
                             routing=route)
        self._to_inner, self._route = to_inner, route

    def _expert_table(self) -> np.ndarray:
        """Original expert id + 1 -> expert id of the members' Buffer, -1 for a masked rank's."""
        L = self.num_local_experts
        table = np.full(self.num_experts + 1, -1, dtype=np.int64)
        for i, r in enumerate(self.members):
            table[1 + r * L: 1 + (r + 1) * L] = np.arange(i * L, (i + 1) * L)
        return table

    def _inner_config(self) -> BufferConfig:
        return dataclasses.replace(self.config, on_peer_loss="raise", expert_map=None,
                                   num_experts=self.num_local_experts * len(self.members))

    def _one_host(self, what: str) -> None:
        if not self._plane.one_host:
            raise errors.UbepError(
                f"rank {self.rank}: {what} needs a one-host group: over MPI a lost rank is "
                "masked (ULFM's shrink), but ranks are not masked on request nor let back in "
                "(docs/ELASTIC.md)")

    def _check_call(self) -> None:
        if self._masked is not None:
            raise errors.RankMaskedError(self._masked)


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
        return key if layout == "rank" else key + k

    old_keys = keys(old.recv_src_rank, old.recv_src_token, old.recv_src_k)
    new_keys = keys(new.recv_src_rank, new.recv_src_token, new.recv_src_k)
    order = np.argsort(old_keys, kind="stable")
    at = np.searchsorted(old_keys[order], new_keys)
    if at.size and (at.max() >= len(order) or not np.array_equal(old_keys[order][at], new_keys)):
        raise errors.UbepError("a replayed dispatch received a row the original did not")
    return order[at]


Buffer.masking_class = MaskingBuffer
Buffer.register(MaskingBuffer)  # a Buffer (it holds one over the members), by registration

