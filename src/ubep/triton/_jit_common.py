# mypy: allow-untyped-defs, allow-incomplete-defs
# (Triton reads a kernel's annotations itself: its parameters stay unannotated but constexprs)
"""Device helpers every kernel of the engine shares (``@triton.jit`` functions).

Pointers into any rank's region are ``table[rank] + byte offset`` converted to a typed pointer:
the table holds one address per rank (``ubep.triton.memory``). Flags are 8-byte words read with
acquire and written with release atomics at system scope; ``tl.debug_barrier()`` (a CTA
barrier on a GPU, nothing in the interpreter) precedes each release, so the stores of every
thread of the program are ordered before it, and follows each successful acquire.

Every launch is gated (``opened``): on the status words of an earlier waiting launch of the
call, or on the call's own input check, run on the device; a closed gate makes it a no-op.

Status of a waiting program (``status[pid] = [code, peer]``): 0 its spins ran out (the host
launches it again until its deadline), 1 done, 3 corrupt (a count disagrees with the routing
record it came with), 4 rank ``peer`` published a failure notice for this call, 5 source
``peer``'s call signature differs from this rank's (``signature_kernel``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import sync as _sync

# globals a kernel reads must be constexprs (the engine's host side uses the same numbers)
PENDING: tl.constexpr = tl.constexpr(0)
DONE: tl.constexpr = tl.constexpr(1)
CORRUPT: tl.constexpr = tl.constexpr(3)
REMOTE: tl.constexpr = tl.constexpr(4)
DIFFERS: tl.constexpr = tl.constexpr(5)

# the sync table's row and batch kinds (ubep.triton.sync), as the kernels compare them
ROW_WORDS: tl.constexpr = tl.constexpr(_sync.ROW_WORDS)
ROW_SENTINEL: tl.constexpr = tl.constexpr(_sync.ROW_SENTINEL)
ROW_CHECKSUM: tl.constexpr = tl.constexpr(_sync.ROW_CHECKSUM)
BATCH_FLAG: tl.constexpr = tl.constexpr(_sync.BATCH_FLAG)
BATCH_CHECKSUM: tl.constexpr = tl.constexpr(_sync.BATCH_CHECKSUM)


@triton.jit
def region(table, rank, offset, ty: tl.constexpr):
    """A ``ty`` pointer to byte ``offset`` of rank ``rank``'s region."""
    return (tl.load(table + rank) + offset).to(tl.pointer_type(ty))


@triton.jit
def acquire(ptrs, mask):
    """Acquire loads of the words at ``ptrs`` (masked lanes read 0)."""
    return tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")


@triton.jit
def release(ptrs, value, mask):
    """Release stores of ``value`` to the words at ``ptrs``, after every store of the program."""
    tl.debug_barrier()
    tl.atomic_xchg(ptrs, value, mask=mask, sem="release", scope="sys")


@triton.jit
def failed_rank(table, R, OFF_NOTICE, epoch, RP: tl.constexpr):
    """The lowest rank that published a failure notice for call ``epoch``, else ``R``."""
    r = tl.arange(0, RP)
    m = r < R
    ptrs = (tl.load(table + r, mask=m, other=0) + OFF_NOTICE).to(tl.pointer_type(tl.int64))
    seen = acquire(ptrs, m)
    return tl.min(tl.where(m & (seen == epoch), r, R), axis=0)


@triton.jit
def word_sums(ptr, nwords, first, BW: tl.constexpr):
    """DC's two sums over ``nwords`` little-endian words at ``ptr`` (int64 pointer), the first
    word having index ``first`` in its batch: ``(sum w, sum (index + 1) * w)`` mod 2^64."""
    s1 = tl.zeros((), dtype=tl.uint64)
    s2 = tl.zeros((), dtype=tl.uint64)
    for w0 in range(0, nwords, BW):
        i = w0 + tl.arange(0, BW)
        m = i < nwords
        w = tl.load(ptr + i, mask=m, other=0, volatile=True).to(tl.uint64, bitcast=True)
        pos = (first + i + 1).to(tl.uint64)
        s1 += tl.sum(w, axis=0)
        s2 += tl.sum(w * pos, axis=0)
    return s1, s2


@triton.jit
def dc_checksum(s1, s2, epoch_mix):
    """docs/FORMATS.md's DC checksum from the two sums (``epoch_mix`` = epoch * golden as the
    int64 of the same bits); never 0, as an int64."""
    v = s1 ^ ((s2 << 29) | (s2 >> 35)) ^ epoch_mix.to(tl.uint64, bitcast=True)
    v = tl.where(v == 0, 1, v)
    return v.to(tl.int64, bitcast=True)


@triton.jit
def has_sentinel(ptr, n, sentinel, BH: tl.constexpr):
    """Whether any of the ``n`` elements at ``ptr`` still holds the sentinel bit pattern."""
    hit = tl.zeros((), dtype=tl.int32)
    for h0 in range(0, n, BH):
        h = h0 + tl.arange(0, BH)
        v = tl.load(ptr + h, mask=h < n, other=0, volatile=True)
        hit += tl.sum(((v == sentinel) & (h < n)).to(tl.int32), axis=0)
    return hit > 0


@triton.jit
def opened(gate, n, NP: tl.constexpr):
    """1 when each of the ``n`` programs whose status words ``gate`` holds is done: a launch
    gated on a waiting launch of this rank does nothing until that one completed (the host
    then runs both again), so the host reads no status between the launches of a call."""
    i = tl.arange(0, NP)
    st = tl.load(gate + i * 2, mask=i < n, other=DONE)
    return tl.min((st == DONE).to(tl.int32), axis=0)


@triton.jit
def set_status(status, pid, code, peer):
    tl.store(status + pid * 2, code)
    tl.store(status + pid * 2 + 1, peer)
