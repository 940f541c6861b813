"""DeepEP's shrink mode on ubep: ``Buffer(..., enable_shrink=True)`` and its mask buffer.

DeepEP's low-latency kernels time out on a rank that stopped answering and mark it in a mask
buffer; later calls neither send to nor receive from it. ubep gets the same from its masking
Buffers (``BufferConfig(on_peer_loss="mask")``, :mod:`ubep.buffer.elastic`), whose survivors
agree on one mask. The facade, though, holds several ubep Buffers (one per shape, dtype and
FP8 mode) and builds them on first use, possibly after a loss. :class:`ShrinkGroup` keeps them
on one membership:

* every Buffer is built over the current members (``MaskingBuffer.over_members``); a member
  lost while a Buffer is built is found by the build's deadline, agreed on
  (:func:`ubep.runtime.membership.agree`) and the build runs again over the rest;
* when a Buffer masks a rank in a call, the facade adopts its members and closes the other
  Buffers (they are rebuilt over the members on their next use);
* ``clean_low_latency_buffer`` is a barrier of the members (DeepEP's clean is where its
  kernels meet too), and a rank missing there is agreed on and masked;
* ``low_latency_update_mask_buffer(rank, True)`` is an exchange of the members, each naming
  the ranks it masks; the union is masked on all of them at once (DeepEP's is a local write,
  which would let two ranks serve with different masks);
* each change of members is a *generation*, published once in the rendezvous directory (the
  first writer wins, as with every agreement). Every member checks for the next generation
  before each call, so a rank that was silent while the others moved on reads that it is
  masked instead of serving over stale Buffers.

The mask is the complement of the members: the same vector on every member.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from ..buffer.elastic import MaskingBuffer
from ..config import BufferConfig
from ..env import timeout_s_from_env
from ..errors import (
    InvalidArgumentError,
    OutOfStepError,
    PeerLostError,
    RankMaskedError,
    TimeoutError,
)
from ..runtime.group import Group
from ..runtime.membership import MemberGroup, Roster, agree, publish_once
from ._runtime import RuntimeBackend
from .group import TorchGroup

if TYPE_CHECKING:
    from .deep_ep_core import FacadeCore

__all__ = ["MaskBuffer", "MaskedBackend", "ShrinkGroup", "open_shrink_group"]

# what a collective of the members raises when one of them is lost
_LOSS = (PeerLostError, TimeoutError, OutOfStepError)
T = TypeVar("T")


class MaskedBackend(RuntimeBackend):
    """A :class:`MaskingBuffer` through the facade's backend protocol, in original rank numbers.

    Masking Buffers run blocking calls (a receive hook is run at once), and after a loss a
    handle's rows are re-ordered inside the Buffer, so the facade does not pack combine inputs
    into its combine buffer (``zero_copy``)."""

    can_split = False
    zero_copy = False

    def __init__(self, buffer: MaskingBuffer) -> None:
        super().__init__(buffer)
        self.rank = int(buffer.rank)
        self.num_ranks = int(buffer.num_ranks)

    def combine(
        self, expert_out: np.ndarray, handle: Any, topk_weights: np.ndarray | None = None
    ) -> np.ndarray:
        # the weights travel beside the handle: after a loss the Buffer finds a combine's rows
        # by the handle dispatch returned
        return np.asarray(self.buffer.combine(expert_out, handle, topk_weights=topk_weights))


class ShrinkGroup:
    """The members a shrink-mode facade serves over (module docstring).

    Built collectively by every rank of ``group`` (it agrees on a name there) over ``roster``,
    every rank of it; the roster's ``default_timeout_s`` is the deadline that finds a silent
    member."""

    def __init__(self, group: Any, roster: Roster) -> None:
        self.rank = int(roster.rank)
        self.num_ranks = len(roster.members)
        self.timeout_s = float(roster.default_timeout_s)
        self.roster = roster
        self._uid = int(group.allgather(secrets.randbits(48))[0])
        self._gen = 0  # changes of members so far
        self._ops = 0  # collectives of the members in this generation (their names)
        self._masked: str | None = None
        self._buffers: list[MaskingBuffer] = []

    # --- state ---------------------------------------------------------------------------

    @property
    def members(self) -> tuple[int, ...]:
        return self.roster.members

    def mask_status(self) -> np.ndarray:
        """``[num_ranks]`` int32, 1 for a masked rank."""
        status = np.ones(self.num_ranks, dtype=np.int32)
        status[list(self.members)] = 0
        return status

    def current(self, buffer: Any) -> bool:
        """Whether ``buffer`` still serves the members (else it was closed: build another)."""
        return any(b is buffer for b in self._buffers)

    # --- collectives of the members ------------------------------------------------------

    def call(self, run: Callable[[], T]) -> T:
        """Run one facade call (it may build Buffers); then adopt a mask a Buffer agreed on."""
        self._catch_up()
        try:
            out = run()
        except RankMaskedError as exc:
            self._out(str(exc))
            raise
        common = set(self.members)
        for b in self._buffers:
            common &= set(b.members)
        if common != set(self.members):
            self._publish(common)
        return out

    def build(self, config: BufferConfig) -> MaskingBuffer:
        """A masking Buffer over the members (collective over them). A member lost during
        the build is agreed on and masked, and the build runs again over the others."""
        for _ in range(self.num_ranks):
            self._catch_up()
            try:
                buffer = MaskingBuffer.over_members(self.roster, self.num_ranks, config,
                                                    self._name("b"))
            except RankMaskedError:
                raise
            except _LOSS as exc:
                self._agree(exc)
                continue
            self._buffers.append(buffer)
            return buffer
        raise PeerLostError(f"rank {self.rank}: a member was lost in every build")

    def barrier(self) -> None:
        """Meet every member (DeepEP's clean); a member that does not come is masked."""
        self.exchange(None)

    def exchange(self, value: Any) -> list[Any]:
        """Every member's ``value`` (an allgather of the members). A member lost in it is
        agreed on and masked; the values are then those of the members that are left."""
        self._catch_up()
        try:
            return MemberGroup(self.roster, self._name("x")).allgather(value, self.timeout_s)
        except RankMaskedError:
            raise
        except _LOSS as exc:
            return self._agree(exc, value)

    def mask(self, ranks: Iterable[int]) -> None:
        """Mask ``ranks`` on every member (collective: each member names the ranks it masks;
        the union goes). A named rank that takes part learns it is masked."""
        union = {int(r) for named in self.exchange(sorted({int(r) for r in ranks}))
                 for r in named}
        if union & set(self.members):
            self._publish(set(self.members) - union)

    def close(self) -> None:
        for b in self._buffers:
            b.close()
        self._buffers = []

    # --- generations ---------------------------------------------------------------------

    def _name(self, what: str) -> str:
        self._ops += 1
        return f"deepep.{self._uid:x}.g{self._gen}.{what}{self._ops}"

    def _gen_path(self, gen: int) -> str:
        return os.path.join(self.roster.rendezvous, f"deepep.{self._uid:x}.g{gen}.json")

    def _agree(self, cause: BaseException, state: Any = None) -> list[Any]:
        """Agree with the members still running on who goes on; adopt it. Returns the
        survivors' ``state`` values."""
        key = f"deepep.{self._uid:x}.a{self._gen + 1}"
        decision = agree(self.roster, key, state, self.timeout_s)
        self._publish(set(decision.members), cause)
        return list(decision.states)

    def _publish(self, members: set[int], cause: BaseException | None = None) -> None:
        """Publish the next generation's members (the first published wins) and adopt it."""
        publish_once(self._gen_path(self._gen + 1), {"members": sorted(members)})
        self._catch_up(cause)

    def _catch_up(self, cause: BaseException | None = None) -> None:
        """Adopt every generation published since this rank's (raise if it masks this rank)."""
        if self._masked is not None:
            raise RankMaskedError(self._masked)
        while True:
            try:
                with open(self._gen_path(self._gen + 1)) as f:
                    members = tuple(int(r) for r in json.load(f)["members"])
            except FileNotFoundError:
                return
            self._gen, self._ops = self._gen + 1, 0
            if self.rank not in members:
                self._out(f"rank {self.rank} was masked by the members {list(members)}")
                raise RankMaskedError(self._masked or "") from cause
            self.roster = self.roster.with_members(
                [r for r in members if r in self.roster.members])
            for b in [b for b in self._buffers if b.members != self.members]:
                with contextlib.suppress(Exception):  # its segments go either way
                    b.close()
                self._buffers.remove(b)

    def _out(self, why: str) -> None:
        self._masked = why
        self.close()


class MaskBuffer:
    """DeepEP's mask-buffer calls and ``clean_low_latency_buffer``, held by a
    :class:`ubep.torch.deep_ep.Buffer` (its methods of those names call this one's) over the
    facade's core (:class:`.deep_ep_core.FacadeCore`; its ``shrink`` is None without
    ``enable_shrink``)."""

    def __init__(self, core: FacadeCore) -> None:
        self.group_size = core.group_size
        self.shrink = core.shrink
        self._check_alive = core.check_alive

    def clean(self) -> None:
        """``clean_low_latency_buffer``: nothing to clean; in shrink mode a barrier of the
        members (the facade's docstring)."""
        self._check_alive()
        if self.shrink is not None:
            self.shrink.call(self.shrink.barrier)

    def update(self, rank_to_mask: int, mask: bool) -> None:
        """``low_latency_update_mask_buffer`` (the facade's docstring)."""
        shrink = self._mask_buffer()
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) or not (
            0 <= rank_to_mask < self.group_size
        ):
            raise InvalidArgumentError("rank_to_mask", rank_to_mask,
                                       f"must be a rank in [0, {self.group_size})")
        masked = bool(shrink.mask_status()[rank_to_mask])
        if mask and not masked:
            with contextlib.suppress(RankMaskedError):  # this rank masked itself with the others
                shrink.call(lambda: shrink.mask([rank_to_mask]))
        elif not mask and masked:
            raise InvalidArgumentError(
                "rank_to_mask", rank_to_mask, "is masked: a masked rank comes back only as a new "
                "process (ubep.Buffer.rejoin and admit, docs/ELASTIC.md), not by unmasking")

    def query(self, mask_status: torch.Tensor) -> None:
        """``low_latency_query_mask_buffer`` (the facade's docstring)."""
        shrink = self._mask_buffer()
        if not isinstance(mask_status, torch.Tensor) or mask_status.numel() != self.group_size or (
            mask_status.dtype != torch.int32
        ):
            raise InvalidArgumentError(
                "mask_status", getattr(mask_status, "shape", mask_status),
                f"must be an int32 tensor of {self.group_size} (num_ranks) elements")
        mask_status.view(-1).copy_(torch.from_numpy(shrink.mask_status()))

    def clean_mask(self) -> None:
        """``low_latency_clean_mask_buffer``: does nothing but check (the facade's
        docstring)."""
        self._mask_buffer()

    def _mask_buffer(self) -> ShrinkGroup:
        self._check_alive()
        if self.shrink is None:
            raise InvalidArgumentError(
                "enable_shrink", False,
                "the mask buffer needs Buffer(..., enable_shrink=True) (as DeepEP)")
        return self.shrink


def open_shrink_group(ep: Any, options: dict[str, Any]) -> ShrinkGroup:
    """The members of a shrink-mode facade on ``ep`` (its ubep group: one of ``ubep.launch``,
    an environment launch, or a ``torch.distributed`` group's, whose private directory and
    process table are all masking needs: the agreements go through files there, never through
    the torch backend, which a lost process breaks). ``options``: the facade's ``BufferConfig``
    options; their ``timeout_s`` (default ``UBEP_TIMEOUT_S``, else ``BufferConfig``'s) is set
    there, so calls and agreements share one deadline."""
    if "timeout_s" not in options:
        options["timeout_s"] = (timeout_s_from_env() if "UBEP_TIMEOUT_S" in os.environ
                                else BufferConfig.timeout_s)
    timeout_s = float(options["timeout_s"])
    if isinstance(ep, Group):
        roster = Roster.of(ep)
    elif isinstance(ep, TorchGroup):
        roster = Roster(ep.rank, tuple(range(ep.num_ranks)), {p.rank: p for p in ep.peers},
                        ep.rendezvous, ep.group_id, ep.topology.cores_per_rank, timeout_s)
    else:
        raise InvalidArgumentError(
            "enable_shrink", True,
            f"masking a lost rank needs a one-host group whose control plane outlives a "
            f"process: a torch.distributed group or one of ubep.launch or an environment "
            f"launch, not {type(ep).__name__} (docs/ELASTIC.md)")
    return ShrinkGroup(ep, replace(roster, default_timeout_s=timeout_s))
