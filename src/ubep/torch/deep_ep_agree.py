"""The DeepEP facades' per-call exchange through shared memory, on one host.

Every normal-mode and V2 call of :mod:`ubep.torch.deep_ep` first exchanges each rank's verdict on
its own arguments (an error, or a few counts) so that a bad argument fails the call on every
rank. Over a torch group the group's all-gather is a gloo collective (about half a millisecond
on two ranks of a loaded host, more than the rows' dispatch); the ranks of a one-host group share
memory, so here each rank posts its JSON into its own segment and reads its peers'.

A rank's segment, after the header (``HEADER_BYTES``), holds two slots; exchange ``n`` uses slot
``n % 2``::

    0   round  u64   n, stored last
    8   size   u64   bytes of the JSON (more than the slot holds: the post did not fit)
    16  JSON   BODY_BYTES

A rank reuses slot ``n % 2`` at exchange ``n + 2`` only after every peer posted exchange ``n + 1``,
that is after every peer finished reading exchange ``n``: two slots are enough. The round word is
stored after the body and read before it; on x86-64 stores become visible in program order and
loads are not reordered with loads, so a reader that sees round ``n`` sees its body. Other
machines keep the group's all-gather (:func:`open_board` returns None). A post too large for its
slot is seen as such by every rank, and then every rank takes the group's all-gather for that
exchange.

A rank that does not post raises ``ubep.TimeoutError`` on the others at the group's deadline, a
dead one ``ubep.PeerLostError`` (liveness checked every 20 ms), as the group's all-gather does.
The names are unlinked once every peer mapped them; :meth:`Board.close` unmaps.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import PeerLostError, TimeoutError
from ..plane.records import HEADER_BYTES
from ..runtime.poll import Backoff, wait_until

__all__ = ["BODY_BYTES", "Board", "open_board"]

BODY_BYTES = 64 * 1024 - 16
_SLOT_BYTES = 16 + BODY_BYTES
# a peer usually posts within microseconds to a millisecond: spin, then yield, then sleep
_BACKOFF = Backoff(spin_polls=200, yield_s=2e-3, sleep_slope=0.05)
_KIND = "deepep.agree"


def open_board(group: Any) -> Board | None:
    """A :class:`Board` over ``group`` where its ranks share memory (collective: every rank of
    ``group`` calls it), else None: the caller keeps ``group.allgather``."""
    from ..runtime.group import Group
    from .group import TorchGroup

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # the protocol leans on x86-64's store and load order
    if not isinstance(group, (Group, TorchGroup)):  # one-host groups: POSIX shared memory
        return None
    memory = group.map_global(HEADER_BYTES + 2 * _SLOT_BYTES, _KIND)
    group.barrier()  # every peer mapped every segment: the names can go
    memory.unlink()
    return Board(group, memory)


class Board:
    """Exchanges of small JSON values among a one-host group's ranks (module docstring)."""

    def __init__(self, group: Any, memory: Any) -> None:
        self._group = group
        self._memory = memory
        self.rank = int(group.rank)
        self._round = 0
        # per rank: the round words and size words of both slots (u64), and the slots' bytes
        self._words: list[np.ndarray] = []
        self._bytes: list[np.ndarray] = []
        for seg in memory.segments:
            raw = seg.array[HEADER_BYTES: HEADER_BYTES + 2 * _SLOT_BYTES]
            self._bytes.append(raw)
            self._words.append(raw.view(np.uint64).reshape(2, _SLOT_BYTES // 8)[:, :2])

    def allgather(self, value: Any, fallback: Callable[[Any], list[Any]]) -> list[Any]:
        """Every rank's JSON-serialisable ``value``, in rank order (collective); ``fallback``
        (the group's all-gather) carries an exchange in which some rank's JSON does not fit."""
        body = json.dumps(value).encode()  # first: a value JSON refuses leaves no round used
        self._round += 1
        n, slot = self._round, self._round % 2
        mine_words, mine = self._words[self.rank], self._bytes[self.rank]
        base = slot * _SLOT_BYTES + 16
        if len(body) <= BODY_BYTES:
            mine[base: base + len(body)] = np.frombuffer(body, dtype=np.uint8)
        mine_words[slot, 1] = len(body)
        mine_words[slot, 0] = n  # last: a peer that sees n sees the body
        self._wait(n, slot)
        sizes = [int(w[slot, 1]) for w in self._words]
        if max(sizes) > BODY_BYTES:  # every rank sees the same sizes: all take the fallback
            return list(fallback(value))
        # this rank's own value read back too: every entry is what JSON makes of it, as over
        # the group's all-gather
        return [json.loads(bytes(raw[base: base + size]))
                for raw, size in zip(self._bytes, sizes, strict=True)]

    def close(self) -> None:
        self._words, self._bytes = [], []
        self._memory.close()

    def _wait(self, n: int, slot: int) -> None:
        words = self._words
        timeout_s = float(self._group.default_timeout_s)
        deadline = time.monotonic() + timeout_s

        def missing() -> list[int]:
            return [r for r, w in enumerate(words) if int(w[slot, 0]) != n]

        def check_peers() -> None:
            try:
                self._group.check_peers()
            except PeerLostError as exc:
                raise PeerLostError(f"{exc} (this rank waited for a DeepEP call's exchange "
                                    f"{n}; ranks {missing()} had not posted)") from None

        def timed_out(waited_s: float) -> BaseException:
            return TimeoutError(
                f"rank {self.rank}: a DeepEP call's exchange {n} timed out after {waited_s:.1f}s: "
                f"rank(s) {missing()} did not post (a rank is missing or at another call)")

        def ready() -> bool:
            return all(int(w[slot, 0]) == n for w in words)

        wait_until(ready, deadline, check_peers=check_peers, timed_out=timed_out,
                   backoff=_BACKOFF)
