"""Tests of the reference oracle (ubep.reference) and its handle.

The oracle here is a second, deliberately naive implementation written from the specification
(Python loops over ranks, experts, tokens and slots; float32 scalar arithmetic; an exact-fraction
BF16 rounding), plus hand-computed tiny cases and closed-form row counts.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._dtype_oracle import bits, from_f32_oracle, to_f32_oracle
from ubep import dtypes, reference
from ubep.errors import InvalidArgumentError
from ubep.handle import DispatchHandle
from ubep.modes import LAYOUTS
from ubep.routing import get_dispatch_layout, uniform_topk

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL_DTYPES = [dtypes.BF16, dtypes.FP16, dtypes.FP32, dtypes.INT8, dtypes.UINT8]
FLOAT_DTYPES = [dtypes.BF16, dtypes.FP16, dtypes.FP32]


def brute_dispatch(xs, idxs, ws, num_experts, layout):
    """Per rank: list of (src_rank, token, k) per row, in the specified order."""
    R = len(xs)
    L = num_experts // R
    K = idxs[0].shape[1]
    rows_per_rank = []
    for r in range(R):
        rows = []
        if layout == "expert":
            for e in range(r * L, (r + 1) * L):
                for s in range(R):
                    for t in range(len(xs[s])):
                        for k in range(K):
                            if idxs[s][t][k] == e:
                                rows.append((s, t, k))
        else:
            for s in range(R):
                for t in range(len(xs[s])):
                    ks = [k for k in range(K) if idxs[s][t][k] >= 0 and idxs[s][t][k] // L == r]
                    if ks:
                        rows.append((s, t, ks[0]))
        rows_per_rank.append(rows)
    return rows_per_rank


def brute_combine(outs_f32, rows_per_rank, idxs, ws, num_experts, num_tokens, hidden, layout):
    """float32 accumulators, terms added one at a time in the specified order."""
    R = len(rows_per_rank)
    L = num_experts // R
    where = {}
    for r, rows in enumerate(rows_per_rank):
        for i, (s, t, k) in enumerate(rows):
            where[(r, s, t, k if layout == "expert" else None)] = i
    ys = []
    for s in range(R):
        y = np.zeros((num_tokens[s], hidden), dtype=np.float32)
        for t in range(num_tokens[s]):
            for h in range(hidden):
                acc = np.float32(0.0)
                if layout == "expert":
                    for k in range(idxs[s].shape[1]):
                        e = idxs[s][t][k]
                        if e < 0:
                            continue
                        row = where[(e // L, s, t, k)]
                        acc = np.float32(acc + np.float32(ws[s][t][k] * outs_f32[e // L][row, h]))
                else:
                    for d in range(R):
                        if (d, s, t, None) in where:
                            acc = np.float32(acc + outs_f32[d][where[(d, s, t, None)], h])
                y[t, h] = acc
        ys.append(y)
    return ys


# --- data --------------------------------------------------------------------------------------


def random_payload(dt: dtypes.DType, shape: tuple[int, ...], rng: np.random.Generator):
    """Finite values for float types (NaN payload propagation is not part of the contract);
    raw bytes for 1-byte types."""
    if dt.is_float:
        vals = (rng.standard_normal(shape) * 4).astype(np.float32)
        return dt.from_float32(vals)
    return rng.integers(0, 256, size=shape, dtype=np.uint8).view(dt.storage)


@st.composite
def cases(draw, dts=ALL_DTYPES):
    num_ranks = draw(st.integers(1, 3))
    local = draw(st.integers(1, 3))
    num_experts = num_ranks * local
    num_topk = draw(st.integers(1, min(num_experts, 3)))
    hidden = draw(st.integers(1, 3))
    num_tokens = [draw(st.integers(0, 5)) for _ in range(num_ranks)]
    mask_prob = draw(st.sampled_from([0.0, 0.3]))
    seed = draw(st.integers(0, 2**16))
    dt = draw(st.sampled_from(dts))
    rng = np.random.default_rng(seed)
    xs = [random_payload(dt, (n, hidden), rng) for n in num_tokens]
    idxs = [
        uniform_topk(n, num_experts, num_topk, seed=seed + r, mask_prob=mask_prob)
        for r, n in enumerate(num_tokens)
    ]
    ws = [rng.standard_normal((n, num_topk)).astype(np.float32) for n in num_tokens]
    return xs, idxs, ws, num_experts, dt


def check_dispatch_against_brute(xs, idxs, ws, num_experts, layout):
    R = len(xs)
    L = num_experts // R
    res = reference.dispatch(xs, idxs, ws, num_experts, layout=layout)
    rows_per_rank = brute_dispatch(xs, idxs, ws, num_experts, layout)
    assert len(res) == R
    for r, (got, rows) in enumerate(zip(res, rows_per_rank, strict=True)):
        src = np.array([s for s, _, _ in rows], dtype=np.int64)
        tok = np.array([t for _, t, _ in rows], dtype=np.int64)
        kk = np.array([k for _, _, k in rows], dtype=np.int64)
        np.testing.assert_array_equal(got.recv_src_rank, src)
        np.testing.assert_array_equal(got.recv_src_token, tok)
        np.testing.assert_array_equal(got.recv_src_k, kk)
        assert got.recv_x.dtype == np.asarray(xs[0]).dtype
        assert got.recv_x.shape == (len(rows), xs[0].shape[1])
        for i, (s, t, k) in enumerate(rows):
            np.testing.assert_array_equal(bits(got.recv_x[i]), bits(xs[s][t]))
            if layout == "expert":
                assert got.recv_topk_idx[i] == idxs[s][t][k]
                assert bits(got.recv_topk_weights[i : i + 1]) == bits(ws[s][t : t + 1, k])
            else:
                for j in range(idxs[s].shape[1]):
                    e = idxs[s][t][j]
                    here = e >= 0 and e // L == r
                    assert got.recv_topk_idx[i, j] == (e - r * L if here else -1)
                    assert got.recv_topk_weights[i, j] == (ws[s][t][j] if here else 0.0)
        if layout == "expert":
            assert got.recv_topk_idx.dtype == np.int64 and got.recv_topk_idx.ndim == 1
            want = [sum(1 for s, t, k in rows if idxs[s][t][k] == r * L + e) for e in range(L)]
        else:
            assert got.recv_topk_idx.shape == (len(rows), idxs[0].shape[1])
            want = [sum(1 for s, t, _ in rows if r * L + e in list(idxs[s][t])) for e in range(L)]
        np.testing.assert_array_equal(got.num_recv_tokens_per_expert, want)
        assert got.recv_topk_weights.dtype == np.float32
        assert got.handle.rank == r and got.handle.layout == layout
    return res, rows_per_rank


# --- dispatch ----------------------------------------------------------------------------------


def tiny_case():
    # 2 ranks, 4 experts (rank 0: 0,1; rank 1: 2,3), top-2, hidden 1.
    xs = [np.array([[10.0], [11.0], [12.0]], np.float32), np.array([[20.0], [21.0]], np.float32)]
    idxs = [np.array([[1, 2], [0, 1], [-1, 3]]), np.array([[3, 0], [1, -1]])]
    ws = [
        np.array([[0.5, 0.25], [1, 2], [9, 4]], np.float32),
        np.array([[3, 5], [7, 0]], np.float32),
    ]
    return xs, idxs, ws


def test_hand_built_expert_layout():
    xs, idxs, ws = tiny_case()
    res = reference.dispatch(xs, idxs, ws, 4)
    # Rank 0 rows: expert 0: (r0,t1,k0), (r1,t0,k1); expert 1: (r0,t0,k0), (r0,t1,k1), (r1,t1,k0).
    assert res[0].recv_x[:, 0].tolist() == [11, 20, 10, 11, 21]
    assert res[0].recv_src_rank.tolist() == [0, 1, 0, 0, 1]
    assert res[0].recv_src_token.tolist() == [1, 0, 0, 1, 1]
    assert res[0].recv_src_k.tolist() == [0, 1, 0, 1, 0]
    assert res[0].recv_topk_idx.tolist() == [0, 0, 1, 1, 1]
    assert res[0].recv_topk_weights.tolist() == [1, 5, 0.5, 2, 7]
    assert res[0].num_recv_tokens_per_expert.tolist() == [2, 3]
    # Rank 1 rows: expert 2: (r0,t0,k1); expert 3: (r0,t2,k1), (r1,t0,k0).
    assert res[1].recv_x[:, 0].tolist() == [10, 12, 20]
    assert res[1].recv_topk_idx.tolist() == [2, 3, 3]
    assert res[1].num_recv_tokens_per_expert.tolist() == [1, 2]
    # Identity experts: y[t] = sum_k w * x[t], exact for these values.
    y = reference.combine([r.recv_x for r in res], res)
    assert y[0][:, 0].tolist() == [0.75 * 10, 3 * 11, 4 * 12]
    assert y[1][:, 0].tolist() == [8 * 20, 7 * 21]


def test_hand_built_rank_layout():
    xs, idxs, ws = tiny_case()
    res = reference.dispatch(xs, idxs, ws, 4, layout="rank")
    # Rank 0 gets (r0,t0), (r0,t1), (r1,t0), (r1,t1); token (r0,t1) crosses once for 2 experts.
    assert res[0].recv_x[:, 0].tolist() == [10, 11, 20, 21]
    assert res[0].recv_topk_idx.tolist() == [[1, -1], [0, 1], [-1, 0], [1, -1]]
    assert res[0].recv_topk_weights.tolist() == [[0.5, 0], [1, 2], [0, 5], [7, 0]]
    assert res[0].recv_src_k.tolist() == [0, 0, 1, 0]
    assert res[0].num_recv_tokens_per_expert.tolist() == [2, 3]
    assert res[1].recv_x[:, 0].tolist() == [10, 12, 20]
    assert res[1].recv_topk_idx.tolist() == [[-1, 0], [-1, 1], [1, -1]]
    assert res[1].num_recv_tokens_per_expert.tolist() == [1, 2]
    # Send back 1, 2, 3, ... per row: y[t] = sum over ranks of what each sent back.
    outs = [np.array([[1.0], [2], [3], [4]], np.float32), np.array([[5.0], [6], [7]], np.float32)]
    y = reference.combine(outs, res)
    assert y[0][:, 0].tolist() == [1 + 5, 2, 6]
    assert y[1][:, 0].tolist() == [3 + 7, 4]


@SETTINGS
@given(cases(), st.sampled_from(LAYOUTS))
def test_dispatch_matches_brute_force(case, layout):
    xs, idxs, ws, num_experts, _ = case
    check_dispatch_against_brute(xs, idxs, ws, num_experts, layout)


@SETTINGS
@given(cases(), st.sampled_from(LAYOUTS))
def test_combine_matches_brute_force(case, layout):
    xs, idxs, ws, num_experts, dt = case
    res, rows_per_rank = check_dispatch_against_brute(xs, idxs, ws, num_experts, layout)
    rng = np.random.default_rng(len(rows_per_rank))
    out_dt = dt if dt.is_float else dtypes.BF16  # 1-byte dispatch, BF16 combine (W8A8)
    outs = [random_payload(out_dt, (len(rows), xs[0].shape[1]), rng) for rows in rows_per_rank]
    got = reference.combine(outs, res)
    outs_f32 = [to_f32_oracle(out_dt, o) for o in outs]
    want = brute_combine(outs_f32, rows_per_rank, idxs, ws, num_experts,
                         [len(x) for x in xs], xs[0].shape[1], layout)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == out_dt.storage
        np.testing.assert_array_equal(bits(g), bits(from_f32_oracle(out_dt, w)))


@SETTINGS
@given(cases(dts=[dtypes.FP32]))
def test_row_counts_equal_dispatch_layout(case):
    xs, idxs, ws, num_experts, _ = case
    R = len(xs)
    L = num_experts // R
    layouts = [get_dispatch_layout(i, num_experts, R) for i in idxs]
    per_expert = sum(lay.num_tokens_per_expert for lay in layouts)
    per_rank = sum(lay.num_tokens_per_rank for lay in layouts)
    expert_res = reference.dispatch(xs, idxs, ws, num_experts, layout="expert")
    rank_res = reference.dispatch(xs, idxs, ws, num_experts, layout="rank")
    for r in range(R):
        mine = per_expert[r * L : (r + 1) * L]
        np.testing.assert_array_equal(expert_res[r].num_recv_tokens_per_expert, mine)
        assert len(expert_res[r].recv_x) == mine.sum()
        assert len(rank_res[r].recv_x) == per_rank[r]
        np.testing.assert_array_equal(
            rank_res[r].handle.num_recv_rows_per_rank,
            [lay.num_tokens_per_rank[r] for lay in layouts],
        )


@SETTINGS
@given(cases(dts=[dtypes.FP32]))
def test_identity_experts_give_weighted_sum_and_layouts_agree(case):
    xs, idxs, ws, num_experts, _ = case
    R = len(xs)
    L = num_experts // R
    rng = np.random.default_rng(7)
    # Small integers and weights in quarters keep every product and sum exact in float32, so
    # the expected value holds bit for bit whatever the order.
    xs = [rng.integers(-8, 9, size=x.shape).astype(np.float32) for x in xs]
    ws = [(rng.integers(-8, 9, size=w.shape) / 4).astype(np.float32) for w in ws]
    expert_res = reference.dispatch(xs, idxs, ws, num_experts, layout="expert")
    # Expert e scales its input by (e + 1).
    outs = [r.recv_x * (r.recv_topk_idx[:, None] + 1).astype(np.float32) for r in expert_res]
    y_expert = reference.combine(outs, expert_res)
    rank_res = reference.dispatch(xs, idxs, ws, num_experts, layout="rank")
    rank_outs = []
    for r, res in enumerate(rank_res):
        scale = np.where(res.recv_topk_idx >= 0, res.recv_topk_idx + r * L + 1, 0)
        factor = (res.recv_topk_weights * scale).sum(axis=1, keepdims=True).astype(np.float32)
        rank_outs.append(res.recv_x * factor)
    y_rank = reference.combine(rank_outs, rank_res)
    for s in range(R):
        valid = idxs[s] >= 0
        factor = (np.where(valid, ws[s] * (idxs[s] + 1), 0)).sum(axis=1, keepdims=True)
        want = (xs[s] * factor).astype(np.float32) + np.float32(0)  # +0.0, never -0.0
        np.testing.assert_array_equal(bits(y_expert[s]), bits(want))
        np.testing.assert_array_equal(bits(y_rank[s]), bits(want))


def test_zero_tokens_one_expert_and_single_rank():
    xs = [np.zeros((0, 4), np.uint16), np.ones((3, 4), np.uint16) * 0x3F80]
    idxs = [np.zeros((0, 2), np.int64), np.array([[2, -1], [2, -1], [2, -1]])]
    ws = [np.zeros((0, 2), np.float32), np.ones((3, 2), np.float32)]
    res = reference.dispatch(xs, idxs, ws, 4)
    assert len(res[0].recv_x) == 0 and len(res[1].recv_x) == 3
    assert res[1].num_recv_tokens_per_expert.tolist() == [3, 0]
    y = reference.combine([r.recv_x for r in res], res)
    assert y[0].shape == (0, 4) and y[0].dtype == np.uint16
    assert (y[1] == 0x3F80).all()  # 1.0 in BF16
    single = reference.dispatch([xs[1]], [idxs[1]], [ws[1]], 3, layout="rank")
    assert single[0].recv_src_token.tolist() == [0, 1, 2]


def test_fully_masked_token_combines_to_positive_zero():
    xs = [np.array([[1.0, -2.0], [3.0, 4.0]], np.float32)]
    idxs = [np.array([[-1, -1], [0, -1]])]
    ws = [np.array([[1, 1], [-1, 0]], np.float32)]
    for layout in LAYOUTS:
        res = reference.dispatch(xs, idxs, ws, 2, layout=layout)
        y = reference.combine([np.array([[0.0, -0.0]], np.float32)], res)
        # Token 0 has no slot; token 1 sums +0.0 + (-1 * 0.0) / + (-0.0): always +0.0.
        assert bits(y[0]).tolist() == [[0, 0], [0, 0]]


def test_one_byte_dispatch_and_float_combine():
    rng = np.random.default_rng(3)
    for dt in (dtypes.INT8, dtypes.UINT8):
        xs = [random_payload(dt, (4, 5), rng) for _ in range(2)]
        idxs = [uniform_topk(4, 4, 2, seed=r) for r in range(2)]
        ws = [np.full((4, 2), 0.5, np.float32) for _ in range(2)]
        res = reference.dispatch(xs, idxs, ws, 4)
        assert all(r.recv_x.dtype == dt.storage for r in res)
        outs = [np.ones((len(r.recv_x), 5), np.float16) for r in res]
        y = reference.combine(outs, res)
        assert all(a.dtype == np.float16 and (a == 1).all() for a in y)
        with pytest.raises(InvalidArgumentError) as err:
            reference.combine([r.recv_x for r in res], res)
        assert err.value.argument == "expert_outs[0]"


def test_handles_pickle_and_combine_accepts_handles():
    xs = [np.arange(6, dtype=np.float32).reshape(3, 2)] * 2
    idxs = [uniform_topk(3, 4, 2, seed=r) for r in range(2)]
    ws = [np.ones((3, 2), np.float32)] * 2
    for layout in LAYOUTS:
        res = reference.dispatch(xs, idxs, ws, 4, layout=layout)
        handles = [pickle.loads(pickle.dumps(r.handle)) for r in res]
        assert all(isinstance(h, DispatchHandle) for h in handles)
        outs = [r.recv_x for r in res]
        y_handles, y_results = reference.combine(outs, handles), reference.combine(outs, res)
        for a, b in zip(y_handles, y_results, strict=True):
            np.testing.assert_array_equal(a, b)


def test_combine_needs_only_the_receivers_view():
    # A backend may leave send_dst_row unset; combine is defined by the receivers' recv_src_*.
    xs = [np.arange(12, dtype=np.float32).reshape(6, 2) + 100 * r for r in range(3)]
    idxs = [uniform_topk(6, 6, 3, seed=r, mask_prob=0.2) for r in range(3)]
    ws = [np.full((6, 3), 0.5, np.float32)] * 3
    for layout in LAYOUTS:
        res = reference.dispatch(xs, idxs, ws, 6, layout=layout)
        outs = [r.recv_x for r in res]
        bare = [dataclasses.replace(r.handle, send_dst_row=None) for r in res]
        for a, b in zip(reference.combine(outs, bare), reference.combine(outs, res), strict=True):
            np.testing.assert_array_equal(a, b)
        # A receiver claiming a row twice (and so dropping another) is caught, not summed.
        h = res[1].handle
        src_token = h.recv_src_token.copy()
        src_token[1] = src_token[0]
        src_k = h.recv_src_k.copy()
        src_k[1] = src_k[0]
        src_rank = h.recv_src_rank.copy()
        src_rank[1] = src_rank[0]
        forged = dataclasses.replace(
            h, recv_src_token=src_token, recv_src_k=src_k, recv_src_rank=src_rank
        )
        with pytest.raises(InvalidArgumentError) as err:
            reference.combine(outs, [bare[0], forged, bare[2]])
        assert err.value.argument == "results"


def test_send_dst_row_points_at_the_row():
    xs = [np.arange(12, dtype=np.float32).reshape(6, 2) + 100 * r for r in range(3)]
    idxs = [uniform_topk(6, 6, 3, seed=r, mask_prob=0.2) for r in range(3)]
    ws = [np.ones((6, 3), np.float32)] * 3
    for layout in LAYOUTS:
        res = reference.dispatch(xs, idxs, ws, 6, layout=layout)
        for s, r in enumerate(res):
            h = r.handle
            for t in range(6):
                for j in range(h.send_dst_row.shape[1]):
                    row = h.send_dst_row[t, j]
                    if layout == "expert":
                        sent, dst = idxs[s][t, j] >= 0, idxs[s][t, j] // 2
                    else:
                        sent, dst = bool(((idxs[s][t] >= 0) & (idxs[s][t] // 2 == j)).any()), j
                    assert (row >= 0) == sent
                    if sent:
                        assert res[dst].recv_src_rank[row] == s
                        assert res[dst].recv_src_token[row] == t


# --- validation --------------------------------------------------------------------------------


def _good():
    xs = [np.zeros((2, 3), np.float32), np.zeros((1, 3), np.float32)]
    idxs = [np.array([[0, 1], [2, -1]]), np.array([[3, 2]])]
    ws = [np.ones((2, 2), np.float32), np.ones((1, 2), np.float32)]
    return xs, idxs, ws


def _bad(field, index, value):
    xs, idxs, ws = _good()
    args = {"xs": xs, "topk_idxs": idxs, "topk_weights": ws, "num_experts": 4, "layout": "expert"}
    if index is None:
        args[field] = value
    else:
        args[field][index] = value
    return args


@pytest.mark.parametrize(
    ("args", "argument"),
    [
        (_bad("xs", None, np.zeros((2, 2, 3), np.float32)), "xs"),
        (_bad("xs", None, []), "xs"),
        (_bad("xs", 1, np.zeros(3, np.float32)), "xs[1]"),
        (_bad("xs", 0, np.zeros((2, 3), np.float64)), "xs[0]"),
        (_bad("xs", 1, np.zeros((1, 3), np.float16)), "xs[1]"),
        (_bad("xs", 1, np.zeros((1, 4), np.float32)), "xs[1]"),
        (_bad("xs", 0, np.zeros((2, 0), np.float32)), "xs[0]"),
        (_bad("topk_idxs", None, [np.array([[0, 1], [2, -1]])]), "topk_idxs"),
        (_bad("topk_idxs", 0, np.array([[0.0, 1.0], [2.0, -1.0]])), "topk_idxs[0]"),
        (_bad("topk_idxs", 0, np.array([[0, 4], [2, -1]])), "topk_idxs[0]"),
        (_bad("topk_idxs", 0, np.array([[0, -2], [2, -1]])), "topk_idxs[0]"),
        (_bad("topk_idxs", 0, np.array([[1, 1], [2, -1]])), "topk_idxs[0]"),
        (_bad("topk_idxs", 0, np.array([[0, 1]])), "topk_idxs[0]"),
        (_bad("topk_idxs", 1, np.array([[3]])), "topk_idxs[1]"),
        (_bad("topk_weights", 0, np.ones((2, 2), np.float64)), "topk_weights[0]"),
        (_bad("topk_weights", 0, np.ones((2, 3), np.float32)), "topk_weights[0]"),
        (_bad("topk_weights", None, [np.ones((2, 2), np.float32)]), "topk_weights"),
        (_bad("num_experts", None, 5), "num_experts"),
        (_bad("num_experts", None, 0), "num_experts"),
        (_bad("layout", None, "token"), "layout"),
    ],
)
def test_dispatch_rejects_bad_input(args, argument):
    with pytest.raises(InvalidArgumentError) as err:
        reference.dispatch(
            args["xs"], args["topk_idxs"], args["topk_weights"], args["num_experts"],
            layout=args["layout"],
        )
    assert isinstance(err.value, ValueError)
    assert err.value.argument == argument


def test_combine_rejects_bad_input():
    xs, idxs, ws = _good()
    res = reference.dispatch(xs, idxs, ws, 4)
    rank_res = reference.dispatch(xs, idxs, ws, 4, layout="rank")
    outs = [r.recv_x for r in res]
    bad = [
        (([outs[0]], res), "expert_outs"),
        (([outs[0][:-1], outs[1]], res), "expert_outs[0]"),
        (([outs[0].astype(np.float16), outs[1]], res), "expert_outs[0]"),
        (([outs[0][:, :2], outs[1]], res), "expert_outs[0]"),
        ((outs, [res[1], res[0]]), "results[0]"),
        ((outs, [res[0], rank_res[1]]), "results[1]"),
        ((outs, [res[0], "handle"]), "results[1]"),
        ((outs, []), "results"),
    ]
    for (o, r), argument in bad:
        with pytest.raises(InvalidArgumentError) as err:
            reference.combine(o, r)
        assert err.value.argument == argument, (argument, err.value)



@pytest.mark.parametrize("layout", LAYOUTS)
def test_float64_option_accumulates_in_float64_in_the_reference_order(layout):
    """float64=True (the torch test world's gradient checks): float64 payloads and weights move
    unchanged and combine sums in float64, term by term in the documented order (a Python-float
    oracle per token); without the option float64 is refused."""
    rng = np.random.default_rng(5)
    E, K, H = 4, 3, 5  # 2 ranks
    xs = [rng.standard_normal((n, H)) for n in (4, 3)]
    idxs = [uniform_topk(len(x), E, K, seed=r, mask_prob=0.2) for r, x in enumerate(xs)]
    ws = [rng.standard_normal(i.shape) for i in idxs]
    with pytest.raises(InvalidArgumentError):
        reference.dispatch(xs, idxs, ws, E, layout=layout)
    refs = reference.dispatch(xs, idxs, ws, E, layout=layout, float64=True)
    for res in refs:
        assert res.recv_x.dtype == np.float64 and res.recv_topk_weights.dtype == np.float64
        for row in range(len(res.recv_src_rank)):
            s, t = res.recv_src_rank[row], res.recv_src_token[row]
            assert np.array_equal(res.recv_x[row], xs[s][t])
    outs = [rng.standard_normal(res.recv_x.shape) for res in refs]
    new_w = [rng.standard_normal(i.shape) for i in idxs] if layout == "expert" else None
    ys = reference.combine(outs, refs, float64=True, topk_weights=new_w)
    for s, y in enumerate(ys):
        assert y.dtype == np.float64
        for t in range(len(xs[s])):
            acc = 0.0
            terms = []  # (k or destination rank, value): the order of the sum
            for r, res in enumerate(refs):
                rows = np.nonzero((res.recv_src_rank == s) & (res.recv_src_token == t))[0]
                for row in rows:
                    k = int(res.recv_src_k[row])
                    w = float(new_w[s][t, k]) if new_w is not None else 1.0
                    terms.append((k if layout == "expert" else r, w * outs[r][row]))
            for _, v in sorted(terms, key=lambda kv: kv[0]):
                acc = acc + v
            assert np.array_equal(y[t], np.zeros(H) + acc)


@SETTINGS
@given(cases(), st.integers(0, 2))
def test_padded_layout_places_the_brute_force_rows_in_expert_blocks(case, spare):
    """``expert_padded``: the brute-force expert rows of local expert ``e``, in order, at
    ``e * slots + j`` (``slots = max_tokens * num_ranks``); -1 / weight 0 everywhere else;
    each source's ``send_dst_row`` names the row holding its pick; combine from outputs in
    the same places (garbage in the empty slots) equals the brute-force sums."""
    xs, idxs, ws, num_experts, dt = case
    R, L = len(xs), num_experts // len(xs)
    max_tokens = max(len(x) for x in xs) + spare
    if max_tokens == 0:
        return
    slots = max_tokens * R
    res = reference.dispatch(xs, idxs, ws, num_experts, layout="expert_padded",
                             max_tokens=max_tokens)
    rows_per_rank = brute_dispatch(xs, idxs, ws, num_experts, "expert")
    out_dt = dt if dt.is_float else dtypes.BF16
    rng = np.random.default_rng(7)
    packed_outs, padded_outs = [], []
    for r, (got, rows) in enumerate(zip(res, rows_per_rank, strict=True)):
        place = {}
        for s, t, k in rows:  # the j-th row of its local expert
            e = int(idxs[s][t][k]) - r * L
            place[(s, t, k)] = e * slots + sum(1 for v in place.values() if v // slots == e)
        assert got.recv_x.shape == (L * slots, xs[0].shape[1])
        want_src = np.full(L * slots, -1)
        for (s, t, k), p in place.items():
            want_src[p] = s
            assert got.recv_src_token[p] == t and got.recv_src_k[p] == k
            assert got.recv_topk_idx[p] == idxs[s][t][k] and got.recv_topk_weights[p] == ws[s][t][k]
            np.testing.assert_array_equal(bits(got.recv_x[p]), bits(xs[s][t]))
            assert res[s].handle.send_dst_row[t, k] == p
        np.testing.assert_array_equal(got.recv_src_rank, want_src)
        empty = want_src < 0
        assert (got.recv_topk_idx[empty] == -1).all() and (got.recv_topk_weights[empty] == 0).all()
        packed = random_payload(out_dt, (len(rows), xs[0].shape[1]), rng)
        padded = random_payload(out_dt, (L * slots, xs[0].shape[1]), rng)  # garbage around
        for i, key in enumerate(rows):
            padded[place[key]] = packed[i]
        packed_outs.append(packed)
        padded_outs.append(padded)
    want = brute_combine([to_f32_oracle(out_dt, o) for o in packed_outs], rows_per_rank, idxs,
                         ws, num_experts, [len(x) for x in xs], xs[0].shape[1], "expert")
    for g, w in zip(reference.combine(padded_outs, res), want, strict=True):
        np.testing.assert_array_equal(bits(g), bits(from_f32_oracle(out_dt, w)))
