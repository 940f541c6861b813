"""ubep.deep_ep's V2 buffers (``ElasticBuffer``, ``EPBuffer``) on real processes (``ubep.launch``),
bit for bit against a single-process reference of DeepEP's semantics (_deepep_v2_oracle.py):
both layouts, expert alignment, FP8, biases, cached and deferred calls, the deterministic
order, no-CPU-sync outputs, uneven token counts, masked slots and a skewed routing. The full
product of the switches runs under the ``matrix`` marker."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from tests._shm import leaked_since, ubep_segments  # noqa: E402
from tests.torch import _deepep_v2_oracle as oracle  # noqa: E402
from tests.torch._deepep_v2_oracle import Case, Shape  # noqa: E402
from ubep.runtime import launch  # noqa: E402


def _call(fn: Any, deferred: bool, v25: bool, *args: Any, **kwargs: Any) -> Any:
    """A dispatch/combine, deferred the way each API defers (2.5: the event's wait returns the
    results; 2.1: async_with_compute_stream, results now, the event waited on)."""
    if not deferred:
        return fn(*args, **kwargs)[:-1]
    if v25:
        event = fn(*args, async_with_compute_stream=True, defer_epilogue=True, **kwargs)
        return event.wait()
    *out, event = fn(*args, async_with_compute_stream=True, **kwargs)
    assert event.current_stream_wait() is None
    return tuple(out)


def _np(t: Any) -> Any:
    return None if t is None else t.detach().clone().numpy()


def _case(buf: Any, shape: Shape, case: Case, v25: bool, rank: int) -> dict[str, Any]:
    everyone = [oracle.inputs(shape, case, r) for r in range(shape.num_ranks)]
    inp = everyone[rank]
    x = inp["x_fp8"] if case.fp8 else inp["x"]
    idx, w = inp["topk_idx"], inp["topk_weights"]
    common = dict(num_experts=shape.num_experts, expert_alignment=case.expert_alignment,
                  do_cpu_sync=case.do_cpu_sync)
    stats = torch.zeros(shape.local, dtype=torch.int32)
    recv_x, recv_idx, recv_w, handle = _call(buf.dispatch, case.deferred, v25, x, idx, w,
                                             cumulative_local_expert_recv_stats=stats, **common)
    ex, e_idx, ew, eh = _call(buf.dispatch, case.deferred, v25, x, idx, w, do_expand=True,
                              cumulative_local_expert_recv_stats=stats, **common)
    cached = _call(buf.dispatch, case.deferred, v25, x, handle=handle)
    cached_e = _call(buf.dispatch, case.deferred, v25, x, topk_weights=w, handle=eh,
                     do_expand=True, do_zero_padding=True)
    valid = handle.num_valid_recv_tokens
    g = torch.Generator().manual_seed(7 + rank)
    # the expert side: reduced rows per received row, garbage past the valid prefix
    src = handle.recv_src_metadata[:valid, 0].long()
    y = torch.randn(recv_idx.shape[0], shape.hidden, generator=g).to(torch.bfloat16)
    y[:valid] = oracle.local_partial(src, recv_idx[:valid], shape.hidden)
    bias = inp["bias"] if len(inp["bias"]) != 1 else inp["bias"][0]
    combined, combined_w = _call(buf.combine, case.deferred, v25, y, handle, topk_weights=recv_w,
                                 bias=bias if inp["bias"] else None)
    # expanded: one row per (received row, local slot); padding rows are garbage
    ye = torch.randn(ex[0].shape[0] if case.fp8 else ex.shape[0], shape.hidden,
                     generator=g).to(torch.bfloat16)
    slots = eh.recv_src_metadata[:valid, 2:]
    src_e = eh.recv_src_metadata[:valid, 0].long()
    for k in range(shape.num_topk):
        ok = slots[:, k] >= 0
        ye[slots[ok, k].long()] = oracle.expert_rows(src_e[ok], k, shape.hidden)
    ewk = {"topk_weights": ew} if buf.allow_multiple_reduction else {}
    e_combined, e_combined_w = _call(buf.combine, case.deferred, v25, ye, eh,
                                     bias=bias if inp["bias"] else None, **ewk)
    again = buf.dispatch(x, idx, w, **common)  # the order does not depend on timing
    ones, _, _ = buf.combine(torch.ones_like(y), handle)

    def rows(t: Any) -> Any:
        return (oracle.bits(t[0]), _np(t[1])) if case.fp8 else (oracle.bits(t), None)

    return {
        "recv_x": rows(recv_x), "recv_topk_idx": _np(recv_idx), "recv_topk_weights": _np(recv_w),
        "valid": valid, "num_recv_tokens": handle.num_recv_tokens,
        "meta": _np(handle.recv_src_metadata), "psum_rank": _np(
            handle.psum_num_recv_tokens_per_scaleup_rank),
        "psum_expert": _np(handle.psum_num_recv_tokens_per_expert),
        "per_expert_list": handle.num_recv_tokens_per_expert_list,
        "dst_slot": _np(handle.dst_buffer_slot_idx), "stats": _np(stats),
        "ex": rows(ex), "e_idx": e_idx, "ew": _np(ew), "e_psum": _np(
            eh.psum_num_recv_tokens_per_expert), "e_meta": _np(eh.recv_src_metadata),
        "num_expanded": eh.num_expanded_tokens,
        "cached": (rows(cached[0]), _np(cached[1]), cached[3] is handle),
        "cached_e": (rows(cached_e[0]), _np(cached_e[2])),
        "combined": oracle.bits(combined), "combined_w": _np(combined_w),
        "e_combined": oracle.bits(e_combined), "e_combined_w": _np(e_combined_w),
        "again": (rows(again[0]), _np(again[1]), _np(again[3].recv_src_metadata)),
        "ones": _np(ones.float()),
    }


def _flow(group: Any, shape: Shape, cases: list[Case], api: str, amr: bool) -> list[Any]:
    from ubep.deep_ep import ElasticBuffer, EPBuffer

    cls = EPBuffer if api == "EPBuffer" else ElasticBuffer
    buf = cls(group, num_max_tokens_per_rank=shape.num_max_tokens_per_rank, hidden=shape.hidden,
              num_topk=shape.num_topk, deterministic=True, allow_multiple_reduction=amr,
              explicitly_destroy=True, timeout_s=60.0)
    out = [_case(buf, shape, case, api == "EPBuffer", group.rank) for case in cases]
    buf.destroy()
    return out


def _check_rows(got: tuple[Any, Any], ref_x: Any, ref_sf: Any, rows: Any) -> None:
    data, sf = got
    np.testing.assert_array_equal(data[rows], oracle.bits(ref_x))
    if ref_sf is not None:
        np.testing.assert_array_equal(sf[rows], ref_sf.numpy())


def _verify(shape: Shape, case: Case, rank: int, got: dict[str, Any], amr: bool) -> None:
    R, T, L, K, A = (shape.num_ranks, shape.num_max_tokens_per_rank, shape.local,
                     shape.num_topk, case.expert_alignment)
    everyone = [oracle.inputs(shape, case, r) for r in range(R)]
    ref = oracle.dispatch(shape, everyone, rank, case.fp8)
    exp = oracle.expanded(ref, shape, A)
    valid = sum(ref["per_rank"])
    assert got["valid"] == valid
    assert got["num_recv_tokens"] == (valid if case.do_cpu_sync else R * T)
    np.testing.assert_array_equal(got["psum_rank"], np.cumsum(ref["per_rank"]))
    head = slice(0, valid)
    _check_rows(got["recv_x"], ref["recv_x"], ref["recv_sf"], head)
    np.testing.assert_array_equal(got["recv_topk_idx"][head], ref["recv_topk_idx"].numpy())
    assert (got["recv_topk_idx"][valid:] == -1).all()
    mine = ref["recv_topk_idx"].numpy() >= 0
    np.testing.assert_array_equal(got["recv_topk_weights"][head][mine],
                                  ref["recv_topk_weights"].numpy()[mine])
    np.testing.assert_array_equal(got["meta"][head, 0], ref["src_global"].numpy())
    aligned = [math_align(c, A) for c in exp["counts"]]
    np.testing.assert_array_equal(got["psum_expert"], np.cumsum(aligned))
    assert got["per_expert_list"] == (aligned if case.do_cpu_sync else [])
    np.testing.assert_array_equal(got["stats"], 2 * np.array(exp["counts"]))
    # expanded: block placement, zero padding, the slot pointers, prefix sums
    worst = math_align(R * T * min(K, L) + (A - 1) * L, A)
    assert got["num_expanded"] == (exp["num_rows"] if case.do_cpu_sync else worst)
    assert got["e_idx"] is None
    data, sf = got["ex"]
    cdata, csf = got["cached_e"][0]
    ref_rows = oracle.bits(ref["recv_x"])
    for row in range(got["num_expanded"]):
        pair = exp["slot_of"].get(row)
        want = ref_rows[pair[0]] if pair else np.zeros_like(data[row])
        np.testing.assert_array_equal(data[row], want)
        np.testing.assert_array_equal(cdata[row], want)
        w_want = float(ref["recv_topk_weights"][pair]) if pair else 0.0
        assert got["ew"][row] == w_want and got["cached_e"][1][row] == w_want
        if sf is not None and pair:
            np.testing.assert_array_equal(sf[row], ref["recv_sf"][pair[0]].numpy())
            np.testing.assert_array_equal(csf[row], ref["recv_sf"][pair[0]].numpy())
    for row, (r, k) in exp["slot_of"].items():
        assert got["e_meta"][r, 2 + k] == row
    np.testing.assert_array_equal(got["e_psum"], np.add(exp["starts"], exp["counts"]))
    # cached compact = the first dispatch; the same handle comes back
    (c_rows, c_idx, same_handle) = got["cached"]
    _check_rows(c_rows, ref["recv_x"], ref["recv_sf"], head)
    np.testing.assert_array_equal(c_idx[head], ref["recv_topk_idx"].numpy())
    assert same_handle
    # a second dispatch gives the same bits in the same order (deterministic)
    a_rows, a_idx, a_meta = got["again"]
    np.testing.assert_array_equal(a_rows[0][head], got["recv_x"][0][head])
    np.testing.assert_array_equal(a_idx[head], got["recv_topk_idx"][head])
    np.testing.assert_array_equal(a_meta[head, :1], got["meta"][head, :1])
    # combine: DeepEP's reference order, bit for bit; weights come back from the owners
    inp = everyone[rank]
    want = oracle.combine(shape, inp, rank, reduce_in_local=True)
    np.testing.assert_array_equal(got["combined"], oracle.bits(want))
    want_e = oracle.combine(shape, inp, rank, reduce_in_local=amr)
    np.testing.assert_array_equal(got["e_combined"], oracle.bits(want_e))
    np.testing.assert_array_equal(got["combined_w"], inp["topk_weights"].numpy())
    if amr:
        np.testing.assert_array_equal(got["e_combined_w"], inp["topk_weights"].numpy())
    # the all-ones check: each token gets its number of distinct destination ranks
    owners = [len({e // L for e in row if e >= 0}) for row in inp["topk_idx"].tolist()]
    np.testing.assert_array_equal(got["ones"], np.repeat(np.array(owners, np.float32)[:, None],
                                                         shape.hidden, axis=1))


def math_align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _run(shape: Shape, cases: list[Case], api: str, amr: bool) -> None:
    before = ubep_segments()
    results = launch(_flow, shape.num_ranks, shape, cases, api, amr, timeout_s=240)
    for rank, per_case in enumerate(results):
        for case, got in zip(cases, per_case, strict=True):
            try:
                _verify(shape, case, rank, got, amr)
            except AssertionError as exc:
                raise AssertionError(f"rank {rank}, {api}, amr={amr}, {case}: {exc}") from exc
    assert not leaked_since(before)


def _cases(switches: Any) -> list[Case]:
    return [Case(expert_alignment=a, fp8=f, num_bias=b, deferred=d, do_cpu_sync=s, skewed=k,
                 seed=i) for i, (a, f, b, d, s, k) in enumerate(switches)]


# Default run: every value of every switch at least once, mixed across cases.
_DEFAULT_2 = _cases(
    (a, f, b, i % 2 == 1, i % 3 != 2, i % 4 == 3)
    for i, (a, f, b) in enumerate(itertools.product((1, 4), (False, True), (0, 1, 2))))


def test_elastic_buffer_two_ranks() -> None:
    """DeepEP 2.1's ElasticBuffer, allow_multiple_reduction=True, 12 mixed cases."""
    _run(Shape(num_ranks=2), _DEFAULT_2, "ElasticBuffer", True)


def test_ep_buffer_two_ranks_single_reduction() -> None:
    """DeepEP 2.5's EPBuffer with allow_multiple_reduction=False (every expanded row returns
    on its own), deferred epilogues."""
    cases = _cases([(4, True, 2, True, False, True), (1, False, 1, True, True, False),
                    (2, False, 0, False, True, True)])
    _run(Shape(num_ranks=2), cases, "EPBuffer", False)


def test_ep_buffer_four_ranks() -> None:
    """A lean 4-rank subset (two local experts per rank)."""
    cases = _cases([(4, True, 1, True, True, True), (1, False, 2, False, False, False)])
    _run(Shape(num_ranks=4), cases, "EPBuffer", True)


@pytest.mark.matrix
@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize(("api", "amr"), [("ElasticBuffer", True), ("EPBuffer", True),
                                          ("EPBuffer", False)])
def test_full_matrix(num_ranks: int, api: str, amr: bool) -> None:
    """alignment x FP8 x bias x deferred x CPU sync x skew, every combination."""
    switches = itertools.product((1, 4), (False, True), (0, 1, 2), (False, True), (False, True),
                                 (False, True))
    _run(Shape(num_ranks=num_ranks), _cases(switches), api, amr)


def _engine_calls(group: Any, api: str) -> list[tuple[dict[str, int], bool]]:
    """Per combine (without bias, with one, with ``topk_weights``), the ubep Buffer calls it
    made, counted on the Buffer class (every Buffer of this rank, made before or during the
    combine), and whether its result is DeepEP's, bit for bit."""
    from ubep.buffer import Buffer
    from ubep.deep_ep import ElasticBuffer, EPBuffer

    shape, case = Shape(num_ranks=group.num_ranks), Case(num_bias=1)
    cls = EPBuffer if api == "EPBuffer" else ElasticBuffer
    buf = cls(group, num_max_tokens_per_rank=shape.num_max_tokens_per_rank, hidden=shape.hidden,
              num_topk=shape.num_topk, explicitly_destroy=True, timeout_s=60.0)
    inp = oracle.inputs(shape, case, group.rank)
    counts = {"dispatch": 0, "combine": 0}
    for name in counts:
        method = getattr(Buffer, name)

        def counted(self: Any, *args: Any, _name: str = name, _method: Any = method,
                    **kwargs: Any) -> Any:
            counts[_name] += 1
            return _method(self, *args, **kwargs)

        setattr(Buffer, name, counted)
    out = []
    for bias, weights in ((None, False), (inp["bias"][0], False), (None, True)):
        _, recv_idx, recv_w, handle = buf.dispatch(
            inp["x"], inp["topk_idx"], inp["topk_weights"], num_experts=shape.num_experts)[:4]
        valid = handle.num_valid_recv_tokens
        y = oracle.local_partial(handle.recv_src_metadata[:valid, 0].long(), recv_idx[:valid],
                                 shape.hidden)
        before = dict(counts)
        combined, combined_w, _ = buf.combine(y, handle, bias=bias,
                                              topk_weights=recv_w if weights else None)
        want = oracle.combine(shape, {**inp, "bias": () if bias is None else (bias,)},
                              group.rank, reduce_in_local=True)
        exact = bool(np.array_equal(oracle.bits(combined), oracle.bits(want)))
        if weights:
            exact = exact and torch.equal(combined_w, inp["topk_weights"])
        out.append(({k: counts[k] - before[k] for k in counts}, exact))
    buf.destroy()
    return out


@pytest.mark.parametrize("api", ["ElasticBuffer", "EPBuffer"])
def test_combine_is_one_core_combine(api: str) -> None:
    """On two ranks a compact combine is the dispatch Buffer's combine, once: no dispatch (no
    rows back by a dispatch, no gate switch, no Buffer made), with or without bias; combined
    weights add the one float32 dispatch that sums them at their sources (and the switches to
    its Buffer and back). Each result is DeepEP's."""
    for rank, per_call in enumerate(launch(_engine_calls, 2, api, timeout_s=120)):
        plain, biased, weighted = per_call
        assert plain == ({"dispatch": 0, "combine": 1}, True), (rank, plain)
        assert biased == ({"dispatch": 0, "combine": 1}, True), (rank, biased)
        assert weighted[1] and weighted[0]["combine"] == 1, (rank, weighted)


def _mixed_reduction(group: Any) -> str:
    from ubep.deep_ep import EPBuffer

    try:
        EPBuffer(group, num_max_tokens_per_rank=4, hidden=64, num_topk=2, timeout_s=30.0,
                 allow_multiple_reduction=group.rank == 1)
    except Exception as exc:  # the outcome is the test's
        return f"{type(exc).__name__}: {exc}"
    return "constructed"


def test_allow_multiple_reduction_differs_between_ranks() -> None:
    """Where a combine's rows lie follows allow_multiple_reduction: a value that differs
    between ranks fails the construction on every rank, naming it."""
    before = ubep_segments()
    for got in launch(_mixed_reduction, 2, timeout_s=120):
        assert got.startswith("InvalidArgumentError") and "allow_multiple_reduction" in got, got
    assert not leaked_since(before)
