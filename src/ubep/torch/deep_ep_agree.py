"""How the DeepEP facades' calls agree: a bad argument fails the call on every rank.

A dispatch learns what DeepEP's API needs of the other ranks from the engine's own count round
(``DispatchResult.num_sent_rows_per_rank``), so normal-mode and V2 calls with ``topk_idx`` make
no exchange of their own. A rank whose arguments fail its local checks still has to fail the
call on its peers, which are waiting in the engine for its rows: :func:`reject_call` makes the
rejected call take its place in the Buffer's sequence and announces it through the Buffer's
failure notice (``StepKeeping.failed``, as a ``ubep.Buffer`` announces its own bad input), so
the peers' same call raises ``RemoteError`` (clean) and every rank stays in step.

What still needs a value of every rank (the per-expert counts of a dispatch without
``topk_idx``, the internode path's destinations, V2's load-balance plans and barriers) goes
through :class:`Board`, one exchange per call. Over a torch group the group's all-gather is a
gloo collective (about half a millisecond on two ranks of a loaded host, more than the rows'
dispatch); the ranks of a one-host group share memory, so here each rank posts its JSON into its
own segment and reads its peers'.

A rank's segment, after the header (``HEADER_BYTES``), holds two slots; exchange ``n`` uses slot
``n % 2``::

    0   round  u64   n, stored last
    8   size   u64   bytes of the JSON (more than the slot holds: the post did not fit)
    16  JSON   BODY_BYTES

After the two slots, one more u64: the rank's **word** about its last combine's weights
(:meth:`Board.post_word`, :func:`combine_weights_word`), posted before the combine enters the
engine and read by the peers after theirs returned (a returned combine read every peer's
combine record, which each peer published after posting its word: no wait in a step that runs
in lockstep).

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
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ..errors import InvalidArgumentError, PeerLostError, TimeoutError, UbepError
from ..plane.records import HEADER_BYTES
from ..runtime.abi import native_or_none
from ..runtime.poll import Backoff, wait_until

__all__ = [
    "BODY_BYTES",
    "WEIGHTS_NONE",
    "WEIGHTS_OTHER",
    "WEIGHTS_RECEIVED",
    "Board",
    "RowCarrier",
    "check_combine_rows",
    "checked",
    "combine_weights_plan",
    "combine_weights_word",
    "exchanged_counts",
    "only_backend",
    "open_board",
    "own_weights_sum",
    "post_weights_word",
    "reject_call",
    "reject_named",
    "send_backend",
    "sum_at_sources",
]

T = TypeVar("T")

BODY_BYTES = 64 * 1024 - 16
_SLOT_BYTES = 16 + BODY_BYTES
# a peer usually posts within microseconds to a millisecond: spin, then yield, then sleep
_BACKOFF = Backoff(spin_polls=200, yield_s=2e-3, sleep_slope=0.05)
_KIND = "deepep.agree"
_TAG_MASK = (1 << 62) - 1


def reject_call(backend: Any, exc: InvalidArgumentError) -> None:
    """Fail this rank's next call through ``backend`` (the one the peers' same call goes
    through) with ``exc`` on every rank: on a ``ubep.Buffer`` the call takes its place in the
    sequence and its failure notice goes out (the peers raise ``RemoteError``, clean; every rank
    stays in step); on the in-process world (:class:`ubep.torch.LocalBackend`) the failure
    takes the place of this rank's inputs in the call's exchange. Nothing is raised here: the
    caller raises ``exc``. A Buffer that refuses calls (out of step, closed) announces
    nothing: its peers' calls fail by themselves."""
    buffer = getattr(backend, "buffer", None)
    if buffer is None:
        post = getattr(backend, "reject", None)
        if post is not None:
            post(f"rank {backend.rank}: {exc}")
        return
    reject = getattr(buffer, "reject", None)
    if reject is not None:  # a ubep.Buffer; anything else: its peers' calls time out
        reject(exc)


def checked(check: Callable[[], T], backend: Callable[[], Any]) -> T:
    """``check()``'s value; when it raises ``InvalidArgumentError``, the call is first
    rejected on the peers too, through the backend ``backend()`` names (:func:`reject_named`)."""
    try:
        return check()
    except InvalidArgumentError as exc:
        reject_named(exc, backend)
        raise


def send_backend(backends: Any, layout: str, hidden: int, num_topk: int, num_experts: int,
                 dtype: Any, max_tokens: int, fp8_pair: bool, round_scale: bool | None) -> Any:
    """The backend a V1 facade's (first) dispatch of these shapes goes through (``backends``:
    its ``deep_ep_core.Backends``); with a ``dtype`` the facade refuses (the reject path), the
    one that exists for the rest (:func:`only_backend`)."""
    import torch

    from .backend import LocalBackend
    from .deep_ep_checks import DISPATCH_DTYPES

    shape = (layout, hidden, num_topk, num_experts)
    fp8 = round_scale is not None or fp8_pair
    local = isinstance(backends.ep, LocalBackend)
    if not fp8 and dtype not in DISPATCH_DTYPES and not local:
        return only_backend(backends.table, (*shape, max_tokens))
    if fp8 and not local:
        return backends.get(*shape, torch.bfloat16 if fp8_pair else dtype, max_tokens,
                            combine_dtype=torch.bfloat16, quant="e4m3",
                            round_scale=bool(round_scale))
    return backends.get(*shape, torch.uint8 if fp8 else dtype, max_tokens)


def only_backend(backends: dict[tuple[Any, ...], Any], shape: tuple[Any, ...]) -> Any:
    """The one backend of ``backends`` (a facade's, keyed ``(layout, hidden, num_topk,
    num_experts, dtype, max_tokens, combine_dtype, quant, ...)``) of ``shape`` = ``(layout,
    hidden, num_topk, num_experts, max_tokens)`` and no quantisation, whatever its dtype: where
    a rank's own dtype is refused, the peers' call of the same shapes goes through it. Raises
    ``ValueError`` unless there is exactly one (nothing is built on a guess)."""
    found = [b for k, b in backends.items()
             if (*k[:4], k[5]) == shape and k[6] is None and k[7] is None]
    if len(found) != 1:
        raise ValueError(f"{len(found)} backends of these shapes")
    return found[0]


def reject_named(exc: InvalidArgumentError, backend: Callable[[], Any]) -> None:
    """:func:`reject_call` through the backend ``backend()`` names (the one the peers' same
    call goes through, from this rank's argument shapes); when the arguments are too broken to
    name it, nothing is announced and the peers' call fails at its deadline instead."""
    try:
        target = backend()
    except (InvalidArgumentError, AttributeError, IndexError, TypeError, ValueError):
        return
    reject_call(target, exc)


def check_combine_rows(x: Any, topk_weights: Any, rows: tuple[int, int]) -> None:
    """A normal-mode combine's ``x`` (``[rows, hidden]``, ``rows`` the received rows or the
    ``num_worst_tokens`` padded ones) and ``topk_weights`` (``[len(x), num_topk]``)."""
    import torch

    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] not in rows:
        raise InvalidArgumentError("x", tuple(getattr(x, "shape", ())),
                                   f"needs [{rows[0]}, hidden] (the dispatch's recv_x)")
    if topk_weights is not None and (not isinstance(topk_weights, torch.Tensor)
                                     or topk_weights.dim() != 2
                                     or topk_weights.shape[0] != x.shape[0]):
        raise InvalidArgumentError("topk_weights", tuple(getattr(topk_weights, "shape", ())),
                                   f"needs [{x.shape[0]}, num_topk] like x")


def exchanged_counts(agree: Callable[..., tuple[Any, list[Any]]], check: Callable[[], Any],
                     rank: int, num_ranks: int) -> tuple[Any, np.ndarray]:
    """A dispatch without ``topk_idx``'s route (``check()``) and this rank's received tokens
    per local expert, from every rank's ``num_tokens_per_expert`` through one exchange
    (``agree``: the facade's, which also fails a bad argument on every rank)."""
    route, summaries = agree(check, lambda r: [int(v) for v in r.num_tokens_per_expert])
    E = route.num_experts
    if any(len(s) != E for s in summaries):
        raise InvalidArgumentError("num_tokens_per_expert", E,
                                   "differs between ranks (same num_experts)")
    local = slice(rank * E // num_ranks, (rank + 1) * E // num_ranks)
    return route, np.array(summaries, dtype=np.int64)[:, local].sum(axis=0)


#: the most bytes of rows a rank sends back carrying a combine's weights; past it a float32
#: Buffer of their width costs less (two rounds of small rows against copying whole rows:
#: 2 ranks here, 16 x 2048 BF16 rows carried 234 us a combine against 267 through the float32
#: Buffer with a switch each way, 128 x 2048 640 against 435)
CARRIED_BYTES = 256 * 1024
#: a carrier's high byte of a 16-bit element (values in [0.5, 1) and [1, 2)); None: byte rows
_CARRIER_HIGH: dict[str, int | None] = {"bf16": 0x3F, "fp16": 0x3C, "uint8": None}


class RowCarrier:
    """Float32 values ``[rows, width]`` as the rows of a Buffer of 16-bit or byte rows
    (``hidden`` elements a row, ``num_topk`` slots), so that they travel through the dispatch's
    own Buffer rather than a float32 one of their own (whose every use meant a switch of
    Buffers, a round each way). Byte rows carry the bytes as they are (their sync is never SP:
    a byte has no free pattern). In a BF16 or FP16 row each byte rides in the low byte of one
    element whose high byte is ``high``: a finite normal number, which no sync mode rewrites
    (none is a NaN, an infinity or a sentinel), so the bytes arrive as they left."""

    def __init__(self, hidden: int, num_topk: int, high: int | None) -> None:
        self.hidden, self.num_topk, self.high = hidden, num_topk, high
        self.row_bytes = hidden * (1 if high is None else 2)  # a row's bytes
        self._rows: np.ndarray | None = None  # encode's, grown to the most rows carried

    @staticmethod
    def of(config: Any, width: int, most_rows: int) -> RowCarrier | None:
        """The carrier of a Buffer ``config`` for ``width`` float32 values a row, a rank
        sending at most ``most_rows`` rows (the same on every rank), or None where it cannot
        carry them (another row dtype, a quantising Buffer, rows too narrow, more rows than a
        rank may dispatch) or should not (more than :data:`CARRIED_BYTES` of rows)."""
        name = str(config.dtype)
        if name not in _CARRIER_HIGH or config.quant is not None or (
                4 * width > int(config.hidden)):
            return None
        key = (int(config.hidden), int(config.num_topk), _CARRIER_HIGH[name])
        mine = _CARRIERS.__dict__.setdefault("by_shape", {})
        carrier = mine.get(key)
        if carrier is None:
            carrier = mine[key] = RowCarrier(*key)
        if most_rows > min(int(config.max_tokens_per_rank), CARRIED_BYTES // carrier.row_bytes):
            return None
        return carrier

    def encode(self, values: np.ndarray) -> np.ndarray:
        """The rows carrying ``values``: a view of this carrier's own rows (their tails are
        zeros, written once; a blocking dispatch has copied them out when it returns)."""
        n = values.shape[0]
        raw = np.ascontiguousarray(values, dtype=np.float32).view(np.uint8).reshape(n, -1)
        rows = self._rows
        if rows is None or rows.shape[0] < n:
            rows = self._rows = np.zeros((max(n, 16), self.hidden),
                                         dtype=np.uint8 if self.high is None else np.uint16)
        if self.high is None:
            rows[:n, : raw.shape[1]] = raw
        else:
            np.bitwise_or(raw, np.uint16(self.high << 8), out=rows[:n, : raw.shape[1]],
                          casting="unsafe")
        return rows[:n]

    def decode(self, rows: np.ndarray, width: int) -> np.ndarray:
        raw = np.ascontiguousarray(np.asarray(rows)[:, : 4 * width])
        if self.high is not None:
            raw = (raw & 0xFF).astype(np.uint8)
        return raw.view(np.float32).reshape(-1, width)


#: a thread's carriers, one per row shape (their rows are reused from call to call: threads
#: calling at once have their own)
_CARRIERS = threading.local()


def sum_at_sources(back: Any, values: Any, recv_counts: np.ndarray,
                   is_token_in_rank: np.ndarray, carrier: RowCarrier | None = None) -> Any:
    """Per-received-row float32 values ``[rows, width]`` (a normal-mode combine's
    ``topk_weights``) summed at each row's source token, destination ranks ascending, in
    float32 (as DeepEP sums them): a ``[num_tokens, width]`` tensor. The rows go back by one
    rank-layout dispatch through ``back`` whose "expert" is each row's source rank (rows move
    through the engine, nothing is exchanged); a source gets, from each rank in ascending order,
    the rows of its tokens that went there, tokens ascending. ``recv_counts``: the rows
    this rank received from each rank (its column of the sent matrix);
    ``is_token_in_rank``: ``[num_tokens, num_ranks]``, where this rank's tokens went.
    ``carrier``: ``back`` is a 16-bit Buffer whose rows carry the values (:class:`RowCarrier`);
    else ``back`` is a float32 Buffer of their width and one slot."""
    import torch

    R, width = is_token_in_rank.shape[1], int(values.shape[1])
    per_source = np.asarray(recv_counts, dtype=np.int64)
    first = back.num_experts // R  # each rank's first expert (1 a rank, but in-process)
    floats = values.detach()
    floats = np.ascontiguousarray(
        (floats if floats.dtype == torch.float32 else floats.float()).numpy())
    slots = 1 if carrier is None else carrier.num_topk
    idx = np.full((int(per_source.sum()), slots), -1, dtype=np.int64)
    idx[:, 0] = np.repeat(np.arange(0, R * first, first, dtype=np.int64), per_source)
    res = back.dispatch(floats if carrier is None else carrier.encode(floats), idx,
                        np.zeros(idx.shape, np.float32))
    rows = (np.asarray(res.recv_x, dtype=np.float32).reshape(-1, width) if carrier is None
            else carrier.decode(res.recv_x, width))
    acc = np.zeros((is_token_in_rank.shape[0], width), dtype=np.float32)
    at = 0
    for r in range(R):
        tokens = np.flatnonzero(is_token_in_rank[:, r])
        acc[tokens] += rows[at: at + tokens.size]
        at += tokens.size
    if at != rows.shape[0]:
        raise UbepError(f"{rows.shape[0]} rows came back for the {at} sent")
    return torch.from_numpy(acc)


#: a rank's word about its combine's ``topk_weights`` (:meth:`Board.post_word`); 0 is a word
#: never posted
WEIGHTS_NONE, WEIGHTS_RECEIVED, WEIGHTS_OTHER = 1, 2, 3


def combine_weights_word(values: Any, received: np.ndarray | None) -> int:
    """This rank's word about a normal-mode combine's ``values`` (its ``topk_weights``, before
    any check, or their host view): none given; a CPU float32 tensor (or float32 array)
    holding, bit for bit, ``received`` (the weights its dispatch received); or anything
    else."""
    if values is None:
        return WEIGHTS_NONE
    if received is None:
        return WEIGHTS_OTHER
    if type(values) is np.ndarray:  # a decode step's view of the tensor
        bits = values
    elif _is_float32_cpu_tensor(values):
        bits = values.detach().numpy()
    else:
        return WEIGHTS_OTHER
    if bits.dtype != np.float32 or bits.shape != received.shape:
        return WEIGHTS_OTHER
    # bit for bit (a NaN, -0.0 too), a few hundred bytes: one compare of their bytes
    return WEIGHTS_RECEIVED if bits.tobytes() == received.tobytes() else WEIGHTS_OTHER


def _is_float32_cpu_tensor(values: Any) -> bool:
    import torch

    return isinstance(values, torch.Tensor) and values.dtype is torch.float32 and values.is_cpu


def combine_weights_plan(codes: list[int]) -> str:
    """What every rank does with a combine's weights, from every rank's word: ``"none"``
    (none given), ``"local"`` (every rank passed the weights its dispatch received: a source
    sums its own, as they left it) or ``"carried"`` (they travel); weights given on some
    ranks only fail the call on every rank, naming them."""
    given = [r for r, c in enumerate(codes) if c != WEIGHTS_NONE]
    if not given:
        return "none"
    if len(given) < len(codes):
        absent = [r for r in range(len(codes)) if r not in given]
        raise InvalidArgumentError(
            "topk_weights", f"given on rank(s) {given}",
            f"not on rank(s) {absent}: every rank passes them to combine, or none does")
    return "local" if all(c == WEIGHTS_RECEIVED for c in codes) else "carried"


def post_weights_word(board: Board, handle: Any, topk_weights: Any) -> int:
    """Post this rank's word about a normal-mode combine of ``handle`` given ``topk_weights``
    (:func:`combine_weights_word`) on ``board``, before the combine can raise; its tag: every
    rank's same for the same combine of the same dispatch of the same Buffer (the handle counts
    the combines begun on it)."""
    combines = handle.combines
    combines[0] += 1
    tag = (handle.backend.buffer.uid * 1_000_003 + handle.inner.dispatch_index * 4099
           + combines[0]) | (1 << 61)
    values = topk_weights
    if values is not None:
        rows = handle.num_recv_rows
        shape = getattr(values, "shape", None)
        if shape is not None and shape[0] != rows:
            values = values[:rows]
    board.post_word(tag, combine_weights_word(values, handle.recv_weights))
    return tag


def own_weights_sum(topk_idx: np.ndarray, topk_weights: np.ndarray) -> np.ndarray:
    """What a source's combine sums of its tokens' weights when every rank passes back the
    weights its dispatch received: a received row holds the weights of its rank's slots and
    0.0 in the others, each slot's owner is one of the ranks the token went to, so a valid
    slot's float32 sum is ``0.0 + ... + w + ... + 0.0`` = ``w + 0.0`` (-0.0 becomes 0.0) and
    a masked slot (-1) sums zeros. A new array; one native pass where the build has it (the
    handle's own int64 and float32 copies), numpy's otherwise."""
    native = native_or_none()
    if (native is not None and topk_idx.dtype == np.int64 and topk_weights.dtype == np.float32
            and topk_idx.shape == topk_weights.shape and topk_idx.flags.c_contiguous
            and topk_weights.flags.c_contiguous):
        out = np.empty(topk_weights.shape, dtype=np.float32)
        native.masked_weights(topk_idx, topk_weights, _NO_BOUND, out, True)  # ids: the handle's
        return out
    return own_weights_sum_numpy(topk_idx, topk_weights)


_NO_BOUND = 1 << 62  # own_weights_sum's ids were checked by their dispatch


def own_weights_sum_numpy(topk_idx: np.ndarray, topk_weights: np.ndarray) -> np.ndarray:
    """:func:`own_weights_sum` in numpy (any layout; the native pass's fallback)."""
    return np.where(topk_idx >= 0, topk_weights + np.float32(0), np.float32(0)).astype(
        np.float32, copy=False)


def open_board(group: Any) -> Board | None:
    """A :class:`Board` over ``group`` where its ranks share memory (collective: every rank of
    ``group`` calls it), else None: the caller keeps ``group.allgather``."""
    from ..runtime.group import Group
    from .group import TorchGroup

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # the protocol leans on x86-64's store and load order
    if not isinstance(group, (Group, TorchGroup)):  # one-host groups: POSIX shared memory
        return None
    memory = group.map_global(HEADER_BYTES + 2 * _SLOT_BYTES + 8, _KIND)
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
        self._posts: list[np.ndarray] = []  # per rank: its word (one u64)
        for seg in memory.segments:
            raw = seg.array[HEADER_BYTES: HEADER_BYTES + 2 * _SLOT_BYTES]
            self._bytes.append(raw)
            self._words.append(raw.view(np.uint64).reshape(2, _SLOT_BYTES // 8)[:, :2])
            end = HEADER_BYTES + 2 * _SLOT_BYTES
            self._posts.append(seg.array[end: end + 8].view(np.uint64))

    def post_word(self, tag: int, code: int) -> None:
        """This rank's word: ``code`` (0-3) of the call ``tag`` (every rank's same), one store."""
        self._posts[self.rank][0] = ((tag & _TAG_MASK) << 2) | code

    def words(self, tag: int) -> list[int]:
        """Every rank's code of the call ``tag``, in rank order, once every rank posted it
        (bounded: the group's deadline, liveness checked, as :meth:`allgather`)."""
        want = tag & _TAG_MASK
        posts = self._posts
        got = [int(w[0]) for w in posts]
        if all(word >> 2 == want for word in got):  # a lockstep step's case: already posted
            return [word & 3 for word in got]

        def missing() -> list[int]:
            return [r for r, w in enumerate(posts) if int(w[0]) >> 2 != want]

        self._wait_for(missing, f"a DeepEP combine's word {want}")
        return [int(w[0]) & 3 for w in posts]

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

        def missing() -> list[int]:
            return [r for r, w in enumerate(words) if int(w[slot, 0]) != n]

        self._wait_for(missing, f"a DeepEP call's exchange {n}")

    def _wait_for(self, missing: Callable[[], list[int]], what: str) -> None:
        """Until ``missing()`` names no rank: ``what`` in the errors."""
        deadline = time.monotonic() + float(self._group.default_timeout_s)

        def check_peers() -> None:
            try:
                self._group.check_peers()
            except PeerLostError as exc:
                raise PeerLostError(f"{exc} (this rank waited for {what}; ranks {missing()} "
                                    "had not posted)") from None

        def timed_out(waited_s: float) -> BaseException:
            return TimeoutError(
                f"rank {self.rank}: {what} timed out after {waited_s:.1f}s: rank(s) "
                f"{missing()} did not post (a rank is missing or at another call)")

        wait_until(lambda: not missing(), deadline, check_peers=check_peers,
                   timed_out=timed_out, backoff=_BACKOFF)
