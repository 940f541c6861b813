"""The sync modes of the simulator as one table: each mode is a row, chosen once.

Everything the model does differently per sync mode is a field of :class:`SyncMode`: what a
row's wire bytes are, what the sender and the receiver check per atomic block, whether the
receiver may use a row as soon as it lands (the data is the flag) or only after a per-batch
signal (a stop-and-wait flag after a fence, or a checksum message), and which of the host
model's kernels price its writer and reader. Code elsewhere reads a row (:func:`sync_mode`)
and never compares a mode's name; a new mode is one more row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidArgumentError
from ..modes import SYNCS, Sync

__all__ = ["DATA_AS_FLAG", "SP", "SW", "SYNC_MODES", "SyncMode", "sync_mode"]


@dataclass(frozen=True)
class SyncMode:
    """One sync mode's predicates and costs (docs/SIMULATOR.md 1.4).

    Attributes:
        name: the mode's name in :data:`ubep.modes.SYNCS`.
        flag_in_block: a flag rides inside every atomic block (TFF): a row travels as
            ``ceil(row / (block - flag))`` blocks and the receiver checks one flag per block.
        sender_block_steps: the sender runs one vector step per ``check_lanes`` blocks (DC's
            checksum).
        receiver_block_steps: the receiver runs one vector step per ``check_lanes`` blocks
            (the DC checksum, the SP sentinel compare; TFF's flags are counted per TFF block).
        receiver_reset: the receiver rewrites the row to the sentinel after use (SP).
        batch_signal: what ends one core's batch of rows to one destination before the
            receiver may use them (ASP): ``"fence"`` (stop-and-wait: the core waits for its
            last store's acknowledgement, then writes a flag), ``"checksum"`` (a checksum
            message), ``""`` (the data is the flag: usable once landed).
        bsp_after_barrier: the BSP engine may run it (its count and flag words follow the
            barrier, fenced).
        meet: the ASP sender's AIVs meet before each per-destination flag (stop-and-wait's
            cross-AIV synchronisation): every sending AIV of the rank adds to one counter,
            the adds serialise at the counter (``flag_ns`` each), so a flag waits ``P x
            flag_ns`` for ``P`` sending AIVs (docs/SIMULATOR.md 1.4). BSP's SyncAll is its
            meeting instead.
        colour: the mode's colour in the figures.
        host_writer, host_reader: the host model's microbenchmark passes that price a peer
            row's write and read (``{engine: pass}``; ``"-"``: none).
        host_checksum: the host model's pass that prices a per-batch checksum word (DC;
            ``""``: none).
        host_validate: the host model prices the sentinel check of every polled tail (SP).
    """

    name: Sync
    flag_in_block: bool
    sender_block_steps: bool
    receiver_block_steps: bool
    receiver_reset: bool
    batch_signal: Literal["", "fence", "checksum"]
    bsp_after_barrier: bool
    colour: str
    host_writer: tuple[tuple[str, str], ...]
    host_reader: tuple[tuple[str, str], ...]
    host_checksum: str = ""
    host_validate: bool = False
    meet: bool = False

    @property
    def data_as_flag(self) -> bool:
        """The receiver learns that a row is complete from the row itself."""
        return self.batch_signal != "fence"

    def host_pass(self, which: str, engine: str) -> str:
        table = dict(self.host_writer if which == "writer" else self.host_reader)
        return table[engine]


SYNC_MODES: dict[str, SyncMode] = {m.name: m for m in (
    SyncMode("sw", False, False, False, False, "fence", True, "#d62728",
             (("asp", "copy"), ("bsp", "copy")), (("asp", "-"), ("bsp", "out")), meet=True),
    SyncMode("tff", True, False, False, False, "", False, "#1f77b4",
             (("asp", "tffw"), ("bsp", "tff")), (("asp", "tffr"), ("bsp", "untff"))),
    SyncMode("dc", False, True, True, False, "checksum", False, "#ff7f0e",
             (("asp", "copy"), ("bsp", "copy")), (("asp", "dc"), ("bsp", "bsp_dc")),
             host_checksum="dc"),
    SyncMode("sp", False, False, True, True, "", False, "#2ca02c",
             (("asp", "spw"), ("bsp", "spw")), (("asp", "sptail"), ("bsp", "bsp_sp")),
             host_validate=True),
)}
assert tuple(SYNC_MODES) == SYNCS, "one row per ubep.modes.SYNCS entry, in its order"

SW = SYNC_MODES["sw"].name
"""Stop-and-wait: CANN EP's flags (the baseline)."""
SP = SYNC_MODES["sp"].name
"""Sentinel polling: UBEP's default Data-as-Flag mode."""
DATA_AS_FLAG: tuple[str, ...] = tuple(n for n, m in SYNC_MODES.items() if m.data_as_flag)
"""The Data-as-Flag variants of Figure 10, in :data:`SYNCS` order."""


def sync_mode(sync: str) -> SyncMode:
    """The row of ``sync``; a clear error naming the argument for an unknown mode."""
    mode = SYNC_MODES.get(sync) if isinstance(sync, str) else None
    if mode is None:
        raise InvalidArgumentError("sync", sync, f"must be one of {SYNCS}")
    return mode
