"""The engine's sync table: each Data-as-Flag mode of docs/FORMATS.md as one row of constants.

The kernels branch on a row's constants (``tl.constexpr``), never on a mode's name, and the host
code reads the row too: adding a mode is adding a row. What each constant means:

* ``dispatch_row`` / ``combine_row``: how a receiver learns that one row arrived.
  ``ROW_NONE``: it does not (a batch flag covers the row); ``ROW_WORDS``: TFF in place, one
  epoch word per 480-byte block of the row, each released after the row's payload;
  ``ROW_SENTINEL``: SP, every element of the row is its own flag (the receiver pre-fills the
  row with the type's signalling-NaN sentinel, a row is in when no element is the sentinel);
  ``ROW_CHECKSUM``: DC with one row per batch, ``[checksum][epoch]`` released after the row.
* ``dispatch_batch`` / ``combine_batch``: what a sender publishes once all its rows to one
  destination are written. ``BATCH_NONE``; ``BATCH_FLAG``: SW, one epoch word;
  ``BATCH_CHECKSUM``: DC, ``[count][checksum][epoch]`` over the batch's rows in receive order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..modes import SYNCS

__all__ = [
    "BATCH_CHECKSUM",
    "BATCH_FLAG",
    "BATCH_NONE",
    "DEFAULT_SYNC",
    "ROW_CHECKSUM",
    "ROW_NONE",
    "ROW_SENTINEL",
    "ROW_WORDS",
    "SYNC_TABLE",
    "SyncRow",
    "sync_row",
]

ROW_NONE, ROW_WORDS, ROW_SENTINEL, ROW_CHECKSUM = 0, 1, 2, 3
BATCH_NONE, BATCH_FLAG, BATCH_CHECKSUM = 0, 1, 2


@dataclass(frozen=True)
class SyncRow:
    """One sync mode as the kernels see it (module docstring)."""

    name: str
    dispatch_row: int
    dispatch_batch: int
    combine_row: int
    combine_batch: int

    @property
    def armed(self) -> bool:
        """The receiver pre-fills rows with the sentinel before peers may write them."""
        return ROW_SENTINEL in (self.dispatch_row, self.combine_row)

    @property
    def needs_words(self) -> bool:
        """Rows are cut into 8-byte words by a checksum (payload rows a multiple of 8 bytes)."""
        return self.dispatch_batch == BATCH_CHECKSUM or self.combine_row == ROW_CHECKSUM


# Combine under DC checks each row on its own (a batch of one row): the source reduces a token
# as soon as its rows are in, and the rows of one pusher reach it in an order the source would
# have to re-derive (the pusher's receive order), which a per-row record avoids.
SYNC_TABLE: dict[str, SyncRow] = {
    "sw": SyncRow("sw", ROW_NONE, BATCH_FLAG, ROW_NONE, BATCH_FLAG),
    "tff": SyncRow("tff", ROW_WORDS, BATCH_NONE, ROW_WORDS, BATCH_NONE),
    "dc": SyncRow("dc", ROW_NONE, BATCH_CHECKSUM, ROW_CHECKSUM, BATCH_NONE),
    "sp": SyncRow("sp", ROW_SENTINEL, BATCH_NONE, ROW_SENTINEL, BATCH_NONE),
}
assert tuple(SYNC_TABLE) == SYNCS  # every mode ubep names has its row

#: The engine's default: data-as-flag per block, no pass over the data to check it.
DEFAULT_SYNC = "tff"


def sync_row(sync: str) -> SyncRow:
    """The table's row of ``sync``; an ``InvalidArgumentError`` naming ``sync`` otherwise."""
    row = SYNC_TABLE.get(sync)
    if row is None:
        raise InvalidArgumentError("sync", sync, f"must be one of {tuple(SYNC_TABLE)}")
    return row
