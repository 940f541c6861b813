"""Single-process reference dispatch/combine: the definition of correct for every backend.

All ranks live in one process as per-rank lists (``xs[r]`` is rank ``r``'s input). Plain numpy,
deterministic, and specified down to the bit so a backend can be compared with ``==``.

Experts are placed contiguously: rank ``r`` owns global experts ``[r*L, (r+1)*L)`` with
``L = num_experts // num_ranks`` (local expert ``e - r*L``).

**layout="expert"** (DeepEP low-latency layout; one row per valid ``(token, k)`` pair):
rank ``r``'s rows are ordered by local expert, then source rank ascending, then source token
ascending. Per row: ``recv_topk_idx`` = the row's *global* expert id, ``recv_topk_weights`` =
its weight ``w[t, k]``, ``recv_src_rank``/``recv_src_token``/``recv_src_k``.
``num_recv_tokens_per_expert[e]`` = rows of local expert ``e``. Combine takes ``expert_outs[r]``
``[rows_r, hidden]`` in the same row order and returns, per source token,
``y[t] = sum over valid k ascending of w[t, k] * out(t, k)``.

**layout="expert_padded"** (DeepEP's low-latency places; ``max_tokens`` given): the rows of
``"expert"``, each local expert's at the start of its own block of ``slots = max_tokens *
num_ranks`` rows, so rank ``r``'s ``recv_x`` is ``[num_local * slots, hidden]`` (DeepEP's
``[num_local_experts, slots, hidden]``) and the row of local expert ``e`` that ``"expert"`` puts
``j``-th among that expert's rows lies at ``e * slots + j``. The slots past
``num_recv_tokens_per_expert[e]`` hold no row: an engine leaves their payload as it was (here
zeros) and their metadata reads ``recv_src_rank = recv_src_token = recv_src_k = recv_topk_idx
= -1``, weight 0 (:func:`defined_rows`). Combine takes ``expert_outs[r]`` in the same places
(what the empty slots hold is never read).

**layout="rank"** (DeepEP normal mode; one row per (token, destination rank) pair): a token
crosses to a rank once however many of its experts live there. Rank ``r``'s rows are ordered by
source rank, then source token. ``recv_topk_idx`` ``[rows, num_topk]`` = the *local* expert id
where the slot's expert lives on ``r``, else -1; ``recv_topk_weights`` = the weight there, else
0; ``recv_src_k`` = the lowest such slot; ``num_recv_tokens_per_expert[e]`` = rows naming local
expert ``e``. Combine takes one row per received row (the caller applied its local experts and
weights) and returns ``y[t] = sum over destination ranks ascending of the row sent back``.

**Redundant experts and masked ranks** (``expert_map``, ``mask``): ``topk_idxs`` then name
logical experts and each rank's picks are first routed to physical slots by
``ubep.expert_map``'s rule (the code a Buffer runs), with the masked ranks' replicas out; a
masked rank sends nothing (its inputs count as empty). ``num_experts`` counts physical slots
and everything above applies to the physical routing. A ``mask`` without a map drops every pick
of an expert on a masked rank (DeepEP's shrink mode). ``expert_ranks`` (M2N, ``ubep.m2n``) is
such a map: ``num_experts`` then counts the logical experts, the expert layout's
``recv_topk_idx`` names them too (expert ``e`` is local expert ``e % S`` of ``expert_ranks[e //
S]``, ``S = num_experts // len(expert_ranks)``), and a rank not in ``expert_ranks`` gets a
``num_recv_tokens_per_expert`` of length 0.

**Combine arithmetic, bit-exact**: per element, ``acc = +0.0f``; for each term in the order above
``acc = fl32(acc + fl32(w * out))`` (expert layout; the product is rounded to float32 *before*
the add: no fused multiply-add, so native code needs ``-ffp-contract=off``) or
``acc = fl32(acc + out)`` (rank layout); masked slots are skipped (never multiplied by 0, which
would turn an ``inf`` output into NaN); a token with no term gives ``+0.0``. Inputs convert to
float32 exactly (``ubep.dtypes``) and the result rounds to the output type to nearest-even; a
NaN result is the type's canonical quiet NaN (``ubep.dtypes.CANONICAL_NAN``), since IEEE 754
leaves the payload of ``NaN + NaN`` to the implementation.

**Types**: dispatch moves any ``ubep.dtypes`` type bit for bit (BF16 as uint16, FP16, FP32,
INT8, UINT8/FP8). Combine needs float data: ``expert_outs`` must have ``x``'s dtype when ``x`` is
a float type; when ``x`` was a 1-byte type (W8A8 dispatch), ``expert_outs`` may be any float type
(the same on every rank) and the output has that type, as in DeepEP's FP8 dispatch / BF16 combine.

**float64** (``float64=True``; only for in-process worlds such as ``ubep.torch.LocalWorld``,
whose float64 gradient checks need it, never a runtime): payloads and weights may also be
float64; float64 expert outputs accumulate in float64, in the same order and with the same
rounding points (every other type still accumulates in float32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .dtypes import DType, as_storage, dtype_of
from .errors import InvalidArgumentError
from .expert_map import ExpertMap, replica_table, route_topk
from .handle import DispatchHandle, DispatchResult
from .m2n import m2n_expert_map
from .modes import BUFFER_LAYOUTS
from .routing import experts_per_rank, validate_topk_idx
from .topology import Topology, host

__all__ = ["FP64", "RefDispatchResult", "combine", "defined_rows", "dispatch"]

#: The float64 payload type ``float64=True`` admits (module docstring); no runtime moves it.
FP64 = DType("fp64", np.dtype(np.float64), True, None)


# The reference's results are the shared result type, typed with the plain handle.
RefDispatchResult = DispatchResult[DispatchHandle]


@dataclass(frozen=True)
class _Inputs:
    xs: list[np.ndarray]
    dtype: DType
    topk_idxs: list[np.ndarray]
    topk_weights: list[np.ndarray]
    num_ranks: int
    local: int  # experts per rank
    num_topk: int
    hidden: int
    weight_dtype: np.dtype  # float32 (float64 only with float64=True)


def dispatch(
    xs: Sequence[object],
    topk_idxs: Sequence[object],
    topk_weights: Sequence[object],
    num_experts: int,
    *,
    layout: str = "expert",
    float64: bool = False,
    expert_map: ExpertMap | None = None,
    mask: Sequence[int] | np.ndarray | None = None,
    topology: Topology | None = None,
    expert_ranks: Sequence[int] | None = None,
    max_tokens: int | None = None,
) -> list[RefDispatchResult]:
    """Dispatch every rank's tokens to the ranks owning their experts.

    Args:
        xs: per rank ``[num_tokens_r, hidden]`` payload (any ``ubep.dtypes`` type; the same type
            and hidden on every rank; ``num_tokens_r`` may be 0).
        topk_idxs: per rank ``[num_tokens_r, num_topk]`` integer, -1 = masked slot.
        topk_weights: per rank ``[num_tokens_r, num_topk]`` float32.
        num_experts: global expert count, a multiple of ``len(xs)``.
        layout: ``"expert"`` or ``"rank"`` (module docstring).
        float64: also accept float64 payloads and weights (module docstring, "float64").
        expert_map: logical experts -> physical slots (module docstring, "Redundant experts").
        mask: ``[num_ranks]``, nonzero for a masked rank (a Buffer's ``mask_status()``).
        topology: the hop classes the routing rule reads (default ``ubep.topology.host``).
        expert_ranks: M2N (``ubep.m2n``): the ranks holding the ``num_experts`` logical
            experts; the call then runs the placement's expert map over ``num_experts //
            len(expert_ranks)`` slots per rank, as a Buffer with the same ``expert_ranks``.
        max_tokens: ``layout="expert_padded"`` only (and needed there): a Buffer's
            ``max_tokens_per_rank``, at least every rank's token count.

    Returns:
        One :class:`RefDispatchResult` per rank, in rank order.
    """
    if expert_ranks is not None:
        if expert_map is not None:
            raise InvalidArgumentError("expert_ranks", expert_ranks,
                                       "cannot be combined with expert_map")
        num_ranks = len(_as_list(xs, "xs", None))
        expert_map = m2n_expert_map(num_experts, expert_ranks, num_ranks)
        num_experts = num_experts // len(expert_ranks) * num_ranks
    if expert_map is not None or mask is not None:
        xs, topk_idxs, topk_weights = _physical(xs, topk_idxs, topk_weights, num_experts,
                                                expert_map, mask, topology)
    inp = _validate_dispatch(xs, topk_idxs, topk_weights, num_experts, layout, float64)
    if layout == "expert":
        out = _dispatch_expert(inp, num_experts)
    elif layout == "expert_padded":
        out = _dispatch_padded(inp, num_experts, _slots(max_tokens, inp))
    else:
        if max_tokens is not None:
            raise InvalidArgumentError("max_tokens", max_tokens,
                                       "is for layout='expert_padded' only")
        out = _dispatch_rank(inp, num_experts)
    if expert_ranks is not None:  # M2N: a sender holds no expert; ids are logical
        for r, res in enumerate(out):
            if r not in expert_ranks:
                out[r] = dataclasses.replace(
                    res, num_recv_tokens_per_expert=res.num_recv_tokens_per_expert[:0])
            elif layout != "rank":  # slot r * S + j is logical expert p * S + j
                S = num_experts // num_ranks
                shift = (list(expert_ranks).index(r) - r) * S
                ids = res.recv_topk_idx
                out[r] = dataclasses.replace(res, recv_topk_idx=np.where(ids >= 0, ids + shift,
                                                                         ids))
    return out


def combine(
    expert_outs: Sequence[object],
    results: Sequence[RefDispatchResult | DispatchHandle],
    *,
    float64: bool = False,
    topk_weights: Sequence[object | None] | None = None,
) -> list[np.ndarray]:
    """Send expert outputs back and reduce them per source token (module docstring).

    Args:
        expert_outs: per rank ``[rows_r, hidden]``, row ``i`` answering row ``i`` of that rank's
            ``recv_x``; a float type (module docstring, "Types").
        results: the per-rank dispatch results (or their handles) of the matching dispatch.
        float64: also accept float64 expert outputs and weights, accumulated in float64
            (module docstring, "float64").
        topk_weights: ``layout="expert"`` only: per rank, the weights to combine with instead
            of the dispatched ones (``[num_tokens_r, num_topk]``; ``None`` entries keep them).

    Returns:
        Per rank ``[num_tokens_r, hidden]`` combined output.
    """
    handles = _validate_handles(results)
    if topk_weights is not None:
        handles = _reweighted(handles, topk_weights, float64)
    outs, out_dtype = _validate_expert_outs(expert_outs, handles, float64)
    outs_acc = [_to_acc(out_dtype, o) for o in outs]
    # Where each source row's answer lies is defined by the receivers' recv_src_* (what a
    # backend's receiver knows), not by the optional send_dst_row.
    dst_rows = _dst_rows_from_receivers(handles)
    reduce = _combine_rank if handles[0].layout == "rank" else _combine_expert
    return [
        _from_acc(out_dtype, reduce(h, rows, outs_acc))
        for h, rows in zip(handles, dst_rows, strict=True)
    ]


def _physical(
    xs: Sequence[object], topk_idxs: Sequence[object], topk_weights: Sequence[object],
    num_experts: int, expert_map: ExpertMap | None, mask: object, topology: Topology | None,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Every rank's inputs routed to physical slots, the masked ranks' emptied."""
    x_list = _as_list(xs, "xs", None)
    R = len(x_list)
    idx_list = _as_list(topk_idxs, "topk_idxs", R)
    w_list = _as_list(topk_weights, "topk_weights", R)
    slots_per_rank = experts_per_rank(num_experts, R)
    emap = ExpertMap.identity(num_experts) if expert_map is None else expert_map
    if not isinstance(emap, ExpertMap):
        raise InvalidArgumentError("expert_map", type(emap).__name__, "must be an ExpertMap")
    m = np.zeros(R, dtype=bool) if mask is None else np.asarray(mask) != 0
    if m.shape != (R,):
        raise InvalidArgumentError("mask", m.shape, f"must be [num_ranks={R}]")
    masked = [int(r) for r in np.flatnonzero(m)]
    hops = (host(R) if topology is None else topology).hop_matrix()
    if hops.shape != (R, R):
        raise InvalidArgumentError("topology", hops.shape, f"must have {R} ranks")
    out_x, out_idx, out_w = [], [], []
    for r in range(R):
        x, w = np.asarray(x_list[r]), np.asarray(w_list[r])
        idx = validate_topk_idx(idx_list[r], emap.num_logical, argument=f"topk_idxs[{r}]",
                                num_tokens=x.shape[0] if x.ndim else None)
        phys = route_topk(idx, replica_table(emap, hops[r], masked, slots_per_rank))
        keep = slice(0, 0) if m[r] else slice(None)
        out_x.append(x[keep])
        out_idx.append(phys[keep])
        out_w.append(w[keep])
    return out_x, out_idx, out_w


def _to_acc(dtype: DType, a: np.ndarray) -> np.ndarray:
    """Exact values in the accumulation type: float64 for FP64, float32 for the rest."""
    return a if dtype is FP64 else dtype.to_float32(a)


def _from_acc(dtype: DType, acc: np.ndarray) -> np.ndarray:
    return acc if dtype is FP64 else dtype.from_float32(acc)


# --- dispatch -------------------------------------------------------------------------------


def _dispatch_expert(inp: _Inputs, num_experts: int) -> list[RefDispatchResult]:
    # Every valid (source rank, token, k) pair once, then ordered by (expert, rank, token): that
    # is the receive order on every rank at once, since experts are contiguous per rank.
    src, tok, kk = _valid_pairs(inp)
    expert = np.concatenate([idx[t, k] for idx, t, k in zip(inp.topk_idxs, tok, kk, strict=True)])
    src_all, tok_all, k_all = np.concatenate(src), np.concatenate(tok), np.concatenate(kk)
    order = np.lexsort((tok_all, src_all, expert))
    expert, src_all, tok_all, k_all = expert[order], src_all[order], tok_all[order], k_all[order]
    dst_all = expert // inp.local
    rank_start = np.searchsorted(dst_all, np.arange(inp.num_ranks + 1))
    row_all = np.arange(len(expert), dtype=np.int64) - rank_start[dst_all]

    send_dst_row = [np.full(i.shape, -1, dtype=np.int64) for i in inp.topk_idxs]
    for s in range(inp.num_ranks):
        mine = src_all == s
        send_dst_row[s][tok_all[mine], k_all[mine]] = row_all[mine]

    sent = np.zeros((inp.num_ranks, inp.num_ranks), np.int64)  # [source, destination] rows
    np.add.at(sent, (src_all, dst_all), 1)
    results = []
    for r in range(inp.num_ranks):
        sl = slice(rank_start[r], rank_start[r + 1])
        r_src, r_tok, r_k = src_all[sl], tok_all[sl], k_all[sl]
        recv_x = _gather_rows(inp.xs, r_src, r_tok, inp)
        weights = _gather_weights(inp.topk_weights, r_src, r_tok, r_k, inp.weight_dtype)
        per_expert = np.bincount(expert[sl] - r * inp.local, minlength=inp.local)
        handle = _make_handle(inp, num_experts, "expert", r, send_dst_row[r], r_src, r_tok, r_k)
        results.append(
            RefDispatchResult(
                recv_x=recv_x,
                num_sent_rows_per_rank=sent.copy(),
                recv_topk_idx=expert[sl].copy(),
                recv_topk_weights=weights,
                num_recv_tokens_per_expert=per_expert.astype(np.int64),
                recv_src_rank=r_src,
                recv_src_token=r_tok,
                recv_src_k=r_k,
                handle=handle,
            )
        )
    return results


def _dispatch_rank(inp: _Inputs, num_experts: int) -> list[RefDispatchResult]:
    owner = [np.where(i >= 0, i // inp.local, -1) for i in inp.topk_idxs]
    # send_dst_row[s][t, r]: running count of rank r's rows, in (source rank, token) order.
    send_dst_row = []
    next_row = np.zeros(inp.num_ranks, dtype=np.int64)
    sent_rows = np.zeros((inp.num_ranks, inp.num_ranks), np.int64)  # [source, destination]
    for s in range(inp.num_ranks):
        sent = _token_in_rank(owner[s], inp.num_ranks)
        rows = np.cumsum(sent, axis=0, dtype=np.int64) - 1 + next_row[None, :]
        send_dst_row.append(np.where(sent, rows, -1))
        sent_rows[s] = sent.sum(axis=0)
        next_row += sent_rows[s]

    results = []
    for r in range(inp.num_ranks):
        srcs, toks = [], []
        for s in range(inp.num_ranks):
            t = np.nonzero(send_dst_row[s][:, r] >= 0)[0]
            srcs.append(np.full(len(t), s, dtype=np.int64))
            toks.append(t.astype(np.int64))
        r_src, r_tok = np.concatenate(srcs), np.concatenate(toks)
        r_idx = np.empty((len(r_src), inp.num_topk), dtype=np.int64)
        r_w = np.empty((len(r_src), inp.num_topk), dtype=inp.weight_dtype)
        for s in range(inp.num_ranks):
            mine = r_src == s
            here = owner[s][r_tok[mine]] == r
            r_idx[mine] = np.where(here, inp.topk_idxs[s][r_tok[mine]] - r * inp.local, -1)
            r_w[mine] = np.where(here, inp.topk_weights[s][r_tok[mine]], inp.weight_dtype.type(0))
        r_k = np.argmax(r_idx >= 0, axis=1).astype(np.int64)
        per_expert = np.bincount(r_idx[r_idx >= 0], minlength=inp.local).astype(np.int64)
        handle = _make_handle(inp, num_experts, "rank", r, send_dst_row[r], r_src, r_tok, r_k)
        results.append(
            RefDispatchResult(
                recv_x=_gather_rows(inp.xs, r_src, r_tok, inp),
                recv_topk_idx=r_idx,
                recv_topk_weights=r_w,
                num_recv_tokens_per_expert=per_expert,
                recv_src_rank=r_src,
                recv_src_token=r_tok,
                recv_src_k=r_k,
                handle=handle,
                num_sent_rows_per_rank=sent_rows.copy(),
            )
        )
    return results


def _valid_pairs(inp: _Inputs) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    src, tok, kk = [], [], []
    for s, idx in enumerate(inp.topk_idxs):
        t, k = np.nonzero(idx >= 0)  # row-major: ascending token, then k
        src.append(np.full(len(t), s, dtype=np.int64))
        tok.append(t.astype(np.int64))
        kk.append(k.astype(np.int64))
    return src, tok, kk


def _token_in_rank(owner: np.ndarray, num_ranks: int) -> np.ndarray:
    sent = np.zeros((owner.shape[0], num_ranks), dtype=bool)
    t, k = np.nonzero(owner >= 0)
    sent[t, owner[t, k]] = True
    return sent


def _gather_rows(
    xs: list[np.ndarray], src: np.ndarray, tok: np.ndarray, inp: _Inputs
) -> np.ndarray:
    out = np.empty((len(src), inp.hidden), dtype=inp.dtype.storage)
    for s, x in enumerate(xs):
        mine = src == s
        out[mine] = x[tok[mine]]
    return out


def _gather_weights(
    ws: list[np.ndarray], src: np.ndarray, tok: np.ndarray, k: np.ndarray, dtype: np.dtype
) -> np.ndarray:
    out = np.empty(len(src), dtype=dtype)
    for s, w in enumerate(ws):
        mine = src == s
        out[mine] = w[tok[mine], k[mine]]
    return out


def _make_handle(
    inp: _Inputs,
    num_experts: int,
    layout: str,
    rank: int,
    send_dst_row: np.ndarray,
    r_src: np.ndarray,
    r_tok: np.ndarray,
    r_k: np.ndarray,
) -> DispatchHandle:
    return DispatchHandle(
        layout=layout,
        rank=rank,
        num_ranks=inp.num_ranks,
        num_experts=num_experts,
        num_tokens=int(inp.xs[rank].shape[0]),
        hidden=inp.hidden,
        x_dtype=inp.dtype.name,
        topk_idx=inp.topk_idxs[rank].copy(),
        topk_weights=inp.topk_weights[rank].copy(),
        send_dst_row=send_dst_row,
        recv_src_rank=r_src.copy(),
        recv_src_token=r_tok.copy(),
        recv_src_k=r_k.copy(),
        num_recv_rows_per_rank=np.bincount(r_src, minlength=inp.num_ranks).astype(np.int64),
    )


def _slots(max_tokens: int | None, inp: _Inputs) -> int:
    """The padded layout's slots per local expert, ``max_tokens * num_ranks``."""
    most = max(x.shape[0] for x in inp.xs)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or (
            max_tokens < max(most, 1)):
        raise InvalidArgumentError(
            "max_tokens", max_tokens, f"layout='expert_padded' needs an integer >= every "
            f"rank's token count ({most})")
    return int(max_tokens) * inp.num_ranks


def defined_rows(num_recv_tokens_per_expert: np.ndarray, slots: int) -> np.ndarray:
    """The rows of a padded ``recv_x`` that hold a row: the first ``num_recv_tokens_per_expert[e]``
    of each expert's block of ``slots``, ascending."""
    counts = np.asarray(num_recv_tokens_per_expert, dtype=np.int64)
    starts = np.repeat(np.arange(len(counts), dtype=np.int64) * slots, counts)
    return starts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _dispatch_padded(inp: _Inputs, num_experts: int, slots: int) -> list[RefDispatchResult]:
    """The ``"expert"`` results at the padded places (empty slots: zeros, -1 and weight 0)."""
    packed = _dispatch_expert(inp, num_experts)
    places = [defined_rows(res.num_recv_tokens_per_expert, slots) for res in packed]
    cap = inp.local * slots
    out = []
    for res, rows in zip(packed, places, strict=True):

        def spread(a: np.ndarray, empty: object, rows: np.ndarray = rows) -> np.ndarray:
            full = np.full((cap, *a.shape[1:]), empty, dtype=a.dtype)
            full[rows] = a
            return full

        h = res.handle
        assert h.send_dst_row is not None
        owner = np.where(h.topk_idx >= 0, h.topk_idx // inp.local, -1)
        send_dst_row = h.send_dst_row.copy()
        for d in range(inp.num_ranks):  # a packed row index at d -> its padded place
            mine = owner == d
            send_dst_row[mine] = places[d][h.send_dst_row[mine]]
        handle = dataclasses.replace(
            h, layout="expert_padded", recv_src_rank=spread(h.recv_src_rank, -1),
            recv_src_token=spread(h.recv_src_token, -1), recv_src_k=spread(h.recv_src_k, -1),
            send_dst_row=send_dst_row)
        out.append(RefDispatchResult(
            recv_x=spread(res.recv_x, 0), recv_topk_idx=spread(res.recv_topk_idx, -1),
            recv_topk_weights=spread(res.recv_topk_weights, 0),
            num_recv_tokens_per_expert=res.num_recv_tokens_per_expert,
            recv_src_rank=handle.recv_src_rank, recv_src_token=handle.recv_src_token,
            recv_src_k=handle.recv_src_k, handle=handle,
            num_sent_rows_per_rank=res.num_sent_rows_per_rank))  # rows, not slots
    return out


# --- combine --------------------------------------------------------------------------------


def _dst_rows_from_receivers(handles: list[DispatchHandle]) -> list[np.ndarray]:
    """Per source rank, the row of each sent (token, k) / (token, rank) at its destination."""
    expert = handles[0].layout != "rank"
    num_ranks = len(handles)
    rows = [
        np.full((h.num_tokens, h.num_topk if expert else num_ranks), -1, dtype=np.int64)
        for h in handles
    ]
    claims = np.zeros(num_ranks, dtype=np.int64)
    for r, h in enumerate(handles):
        src = h.recv_src_rank
        if h.layout == "expert_padded":  # the empty slots (-1) hold no row
            src = np.where(src < 0, num_ranks, src)
        if len(src) and (src.min() < 0 or src.max() >= num_ranks + (h.layout == "expert_padded")):
            raise InvalidArgumentError(f"results[{r}]", "recv_src_rank", "out of range")
        claims += np.bincount(src, minlength=num_ranks + 1)[:num_ranks]
        for s in range(num_ranks):
            mine = np.nonzero(src == s)[0]
            tok = h.recv_src_token[mine]
            if len(tok) and (tok.min() < 0 or tok.max() >= handles[s].num_tokens):
                raise InvalidArgumentError(
                    f"results[{r}]", "recv_src_token", f"names tokens rank {s} does not have"
                )
            col = h.recv_src_k[mine] if expert else np.full(len(mine), r)
            if len(col) and (col.min() < 0 or col.max() >= rows[s].shape[1]):
                raise InvalidArgumentError(f"results[{r}]", "recv_src_k", "out of range")
            rows[s][tok, col] = mine
    for s, h in enumerate(handles):
        if expert:
            sent = h.topk_idx >= 0
        else:
            owner = np.where(h.topk_idx >= 0, h.topk_idx // h.num_local_experts, -1)
            sent = (owner[:, :, None] == np.arange(num_ranks)).any(axis=1)
        # Every sent row answered exactly once (a duplicate claim would hide a missing one).
        if ((rows[s] >= 0) != sent).any() or claims[s] != sent.sum():
            raise InvalidArgumentError(
                "results", f"rank {s}", "receivers' rows do not match the source's routing"
            )
    return rows


def _combine_expert(
    h: DispatchHandle, dst_row: np.ndarray, outs_acc: list[np.ndarray]
) -> np.ndarray:
    acc_dtype = outs_acc[0].dtype  # float32 (float64: module docstring)
    acc = np.zeros((h.num_tokens, h.hidden), dtype=acc_dtype)
    local = h.num_local_experts
    for k in range(h.num_topk):
        tok = np.nonzero(h.topk_idx[:, k] >= 0)[0]
        if not len(tok):
            continue
        dst = h.topk_idx[tok, k] // local
        term = np.empty((len(tok), h.hidden), dtype=acc_dtype)
        for d in np.unique(dst):
            mine = dst == d
            term[mine] = outs_acc[d][dst_row[tok[mine], k]]
        # Two float32 ufuncs: the product is rounded before the add (no FMA), as specified.
        term = h.topk_weights[tok, k].astype(acc_dtype, copy=False)[:, None] * term
        acc[tok] = acc[tok] + term
    return acc


def _combine_rank(h: DispatchHandle, dst_row: np.ndarray, outs_acc: list[np.ndarray]) -> np.ndarray:
    acc = np.zeros((h.num_tokens, h.hidden), dtype=outs_acc[0].dtype)
    for d in range(h.num_ranks):
        tok = np.nonzero(dst_row[:, d] >= 0)[0]
        if len(tok):
            acc[tok] = acc[tok] + outs_acc[d][dst_row[tok, d]]
    return acc


# --- validation -----------------------------------------------------------------------------


def _as_list(value: object, argument: str, length: int | None) -> list[object]:
    if isinstance(value, np.ndarray) or not isinstance(value, Sequence) or isinstance(value, str):
        raise InvalidArgumentError(argument, type(value).__name__, "must be a list, one per rank")
    items = list(value)
    if length is None and not items:
        raise InvalidArgumentError(argument, items, "needs at least one rank")
    if length is not None and len(items) != length:
        raise InvalidArgumentError(argument, len(items), f"must have one entry per rank ({length})")
    return items


def _payload(arr: object, argument: str, float64: bool) -> tuple[np.ndarray, DType]:
    a = np.asarray(arr)
    if float64 and a.dtype == np.float64:
        return a, FP64
    return as_storage(a, argument=argument)


def _weights(arr: object, argument: str, float64: bool) -> np.ndarray:
    w = np.asarray(arr)
    if w.dtype != np.float32 and not (float64 and w.dtype == np.float64):
        raise InvalidArgumentError(argument, w.dtype,
                                   "must be float32 (or float64)" if float64 else "must be float32")
    return w


def _validate_dispatch(
    xs: object, topk_idxs: object, topk_weights: object, num_experts: int, layout: str,
    float64: bool,
) -> _Inputs:
    if layout not in BUFFER_LAYOUTS:
        raise InvalidArgumentError("layout", layout, f"must be one of {BUFFER_LAYOUTS}")
    x_list = _as_list(xs, "xs", None)
    num_ranks = len(x_list)
    local = experts_per_rank(num_experts, num_ranks)
    idx_list = _as_list(topk_idxs, "topk_idxs", num_ranks)
    w_list = _as_list(topk_weights, "topk_weights", num_ranks)

    arrays: list[np.ndarray] = []
    dtype: DType | None = None
    for r, x in enumerate(x_list):
        a, dt = _payload(x, f"xs[{r}]", float64)
        if a.ndim != 2 or a.shape[1] < 1:
            raise InvalidArgumentError(f"xs[{r}]", a.shape, "must be [num_tokens, hidden>=1]")
        if dtype is not None and (dt != dtype or a.shape[1] != arrays[0].shape[1]):
            raise InvalidArgumentError(
                f"xs[{r}]", (a.dtype, a.shape),
                f"dtype and hidden must match xs[0] ({arrays[0].dtype}, {arrays[0].shape[1]})",
            )
        dtype = dt
        arrays.append(a)
    assert dtype is not None

    idxs: list[np.ndarray] = []
    ws: list[np.ndarray] = []
    for r in range(num_ranks):
        idx = validate_topk_idx(
            idx_list[r], num_experts, argument=f"topk_idxs[{r}]", num_tokens=arrays[r].shape[0]
        )
        if idx.shape[1] < 1 or (idxs and idx.shape[1] != idxs[0].shape[1]):
            raise InvalidArgumentError(
                f"topk_idxs[{r}]", idx.shape, "num_topk must be >= 1 and equal on every rank"
            )
        w = _weights(w_list[r], f"topk_weights[{r}]", float64)
        if w.shape != idx.shape:
            raise InvalidArgumentError(
                f"topk_weights[{r}]", w.shape, f"must match topk_idxs[{r}] {idx.shape}"
            )
        idxs.append(idx)
        ws.append(np.ascontiguousarray(w))
    return _Inputs(arrays, dtype, idxs, ws, num_ranks, local, idxs[0].shape[1],
                   int(arrays[0].shape[1]), np.result_type(*ws))


def _validate_handles(results: object) -> list[DispatchHandle]:
    items = _as_list(results, "results", None)
    handles: list[DispatchHandle] = []
    for r, item in enumerate(items):
        h = getattr(item, "handle", item)
        if not isinstance(h, DispatchHandle):
            raise InvalidArgumentError(
                f"results[{r}]", type(item).__name__, "must be a dispatch result or its handle"
            )
        if h.rank != r or h.num_ranks != len(items):
            raise InvalidArgumentError(
                f"results[{r}]", (h.rank, h.num_ranks),
                f"must be rank {r}'s handle of one {len(items)}-rank dispatch, in rank order",
            )
        if handles and (h.layout, h.hidden, h.x_dtype) != (
            handles[0].layout, handles[0].hidden, handles[0].x_dtype
        ):
            raise InvalidArgumentError(
                f"results[{r}]", h.layout, "handles come from different dispatch calls"
            )
        handles.append(h)
    return handles


def _reweighted(handles: list[DispatchHandle], topk_weights: object,
                float64: bool) -> list[DispatchHandle]:
    """The handles with the weights of ``topk_weights`` (``None`` entries: unchanged)."""
    items = _as_list(topk_weights, "topk_weights", len(handles))
    if handles[0].layout == "rank":
        raise InvalidArgumentError("topk_weights", "given", "the rank layout combines without "
                                   "weights")
    out = []
    for r, (h, w) in enumerate(zip(handles, items, strict=True)):
        if w is not None:
            w = _weights(w, f"topk_weights[{r}]", float64)
            if w.shape != h.topk_idx.shape:
                raise InvalidArgumentError(f"topk_weights[{r}]", w.shape,
                                           f"must match rank {r}'s topk_idx {h.topk_idx.shape}")
            h = dataclasses.replace(h, topk_weights=w)
        out.append(h)
    return out


def _validate_expert_outs(
    expert_outs: object, handles: list[DispatchHandle], float64: bool
) -> tuple[list[np.ndarray], DType]:
    items = _as_list(expert_outs, "expert_outs", len(handles))
    x_dtype = FP64 if handles[0].x_dtype == FP64.name else dtype_of(handles[0].x_dtype)
    outs: list[np.ndarray] = []
    out_dtype: DType | None = None
    for r, (item, h) in enumerate(zip(items, handles, strict=True)):
        a, dt = _payload(item, f"expert_outs[{r}]", float64)
        if a.shape != (h.num_recv_rows, h.hidden):
            raise InvalidArgumentError(
                f"expert_outs[{r}]", a.shape,
                f"must be ({h.num_recv_rows}, {h.hidden}): one row per received row",
            )
        if not dt.is_float:
            raise InvalidArgumentError(
                f"expert_outs[{r}]", dt.name, "combine needs a float type (bf16, fp16, fp32)"
            )
        if x_dtype.is_float and dt != x_dtype:
            raise InvalidArgumentError(
                f"expert_outs[{r}]", dt.name, f"must have x's dtype ({x_dtype.name})"
            )
        if out_dtype is not None and dt != out_dtype:
            raise InvalidArgumentError(
                f"expert_outs[{r}]", dt.name, f"must match expert_outs[0] ({out_dtype.name})"
            )
        out_dtype = dt
        outs.append(a)
    assert out_dtype is not None
    return outs, out_dtype
