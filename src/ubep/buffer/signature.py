"""A call's signature: what a call is (its kind, dtype, shape, expert count, capacity and
flags), packed into one 64-bit word that rides in the count records of the engine's own count
round, so that ranks making different calls fail together without a round of their own.

A Buffer's engine publishes the word it was given (:meth:`ubep.Buffer.sign`) in every count
record of a dispatch and compares it with every source's record before any row of the call
reaches a peer: a difference is a clean reject on every rank, the call rejected as bad input
(``InvalidArgumentError``) that names what differs with both ranks' values, decoded here.

The word has fixed bit fields (:data:`FIELDS`), so both values can be named; a value wider
than its field is compared modulo its width (a shape past 65535, say, is told apart only by
its low bits). Word 0 is "not signed" (a plain ``ubep.Buffer``: its config, checked equal at
construction, says everything its calls are).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = ["CALLS", "DTYPES", "FIELDS", "FLAGS", "Signature", "mismatch_error"]

#: the fields of the word, low bits first: (name, bits)
FIELDS: tuple[tuple[str, int], ...] = (
    ("call", 4), ("dtype", 4), ("hidden", 16), ("num_experts", 12), ("capacity", 16),
    ("num_topk", 6), ("flags", 6),
)
#: the call kinds (field ``call``); 0 is "not signed"
CALLS = ("unsigned", "dispatch", "cached_dispatch", "low_latency_dispatch", "v2_dispatch",
         "internode_dispatch", "combine", "low_latency_combine", "combine_weights")
#: the dtypes of the rows (field ``dtype``), by their torch names
DTYPES = ("none", "bfloat16", "float16", "float32", "int8", "uint8", "float8_e4m3fn",
          "float8_e5m2", "float64")
#: the flag bits (field ``flags``): ``switch`` marks the call a rank makes on the Buffer of its
#: previous call to move to another Buffer of a facade (its other fields: the next call's)
FLAGS = ("switch", "use_fp8", "round_scale", "use_ue8m0", "with_topk", "expert_layout")

_SPAN = {name: bits for name, bits in FIELDS}
_SHIFT: dict[str, int] = {}
_at = 0
for _name, _bits in FIELDS:
    _SHIFT[_name] = _at
    _at += _bits
assert _at == 64, "the fields fill one word"


@dataclass(frozen=True)
class Signature:
    """The fields of one call (names of :data:`CALLS` and :data:`DTYPES`, numbers, flags)."""

    call: str
    dtype: str = "none"
    hidden: int = 0
    num_experts: int = 0
    capacity: int = 0
    num_topk: int = 0
    flags: frozenset[str] = frozenset()

    @functools.cached_property
    def word(self) -> int:
        """The 64-bit word (never 0: ``call`` is a signed kind)."""
        values = {
            "call": CALLS.index(self.call),
            "dtype": DTYPES.index(self.dtype) if self.dtype in DTYPES else 15,  # 15: another
            "hidden": self.hidden, "num_experts": self.num_experts, "capacity": self.capacity,
            "num_topk": self.num_topk,
            "flags": sum(1 << FLAGS.index(f) for f in self.flags),
        }
        word = 0
        for name, value in values.items():
            word |= (int(value) & ((1 << _SPAN[name]) - 1)) << _SHIFT[name]
        return word

    @staticmethod
    def decode(word: int) -> dict[str, object]:
        """The fields of ``word``, by name (kinds and dtypes by name, flags as a set)."""
        raw = {name: (word >> _SHIFT[name]) & ((1 << bits) - 1) for name, bits in FIELDS}
        out: dict[str, object] = dict(raw)
        out["call"] = CALLS[raw["call"]] if raw["call"] < len(CALLS) else raw["call"]
        out["dtype"] = DTYPES[raw["dtype"]] if raw["dtype"] < len(DTYPES) else raw["dtype"]
        out["flags"] = frozenset(f for i, f in enumerate(FLAGS) if raw["flags"] >> i & 1)
        return out


# what each field is called in a message: the argument a caller changes
_ARGUMENTS: Mapping[str, str] = {
    "dtype": "x", "hidden": "x", "num_experts": "num_experts",
    "capacity": "num_max_dispatch_tokens_per_rank", "num_topk": "topk_idx",
}


def mismatch_error(mine: int, theirs: int, peer: int, rank: int) -> InvalidArgumentError:
    """The error of a call whose signature ``mine`` differs from rank ``peer``'s ``theirs``:
    the first differing field names the argument, every differing field is listed with both
    values."""
    a, b = Signature.decode(mine), Signature.decode(theirs)
    diffs = [name for name, _ in FIELDS if a[name] != b[name]]
    fa, fb = frozenset(a["flags"]), frozenset(b["flags"])  # type: ignore[call-overload]
    parts = []
    for name in diffs:
        if name != "flags":
            parts.append(f"{name} {a[name]} on rank {rank}, {b[name]} on rank {peer}")
    for flag in sorted(fa ^ fb):
        if flag == "switch":  # one rank moved to another Buffer of a facade, one did not
            mover, stayer = (rank, peer) if flag in fa else (peer, rank)
            parts.append(f"rank {mover} moved to another Buffer of the facade, rank {stayer} "
                         "called the one of the previous call")
        else:
            parts.append(f"{flag} {flag in fa} on rank {rank}, {flag in fb} on rank {peer}")
    argument = next((_ARGUMENTS[n] for n in diffs if n in _ARGUMENTS), "call")
    if "dtype" in diffs:
        value: object = a["dtype"]
    elif diffs and diffs[0] in _ARGUMENTS:
        value = a[diffs[0]]
    else:
        value = a["call"]
    return InvalidArgumentError(
        argument, value,
        f"differs between ranks ({'; '.join(parts) or 'another call'}): every rank must make "
        "the same call")
