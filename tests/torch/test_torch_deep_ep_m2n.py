"""The DeepEP facade's M2N mode (``Buffer(..., expert_ranks=)``): the low-latency pair from
attention ranks to disjoint expert ranks and back, on 4 processes of the real runtime, bit for
bit against ``ubep.reference`` given the same roles (BF16, and one FP8 dispatch against
``ubep.quant``'s values and scales). One ``launch`` runs every role set.

Senders get per-expert tensors with 0 local experts (``[0, slots, hidden]``), expert ranks
``num_experts // len(expert_ranks)``; the normal-mode calls, shrink mode and the in-process
world refuse ``expert_ranks``, naming it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from ubep import reference, testing  # noqa: E402
from ubep.errors import InvalidArgumentError, RemoteError  # noqa: E402
from ubep.quant import quantize  # noqa: E402
from ubep.runtime import launch  # noqa: E402
from ubep.torch import LocalWorld  # noqa: E402
from ubep.torch.deep_ep import Buffer  # noqa: E402

R, E, H, K, MAX_TOKENS = 4, 12, 128, 4, 16  # 12 experts divide over 1, 2 and 3 expert ranks

# name -> (expert_ranks, tokens per rank, ubep options, receive with a hook)
CASES: dict[str, tuple[tuple[int, ...], list[int], dict[str, str], bool]] = {
    "1->3": ((1, 2, 3), [16, 0, 0, 0], {"engine": "asp", "sync": "sw"}, False),
    "3->1": ((3,), [16, 9, 13, 0], {"engine": "bsp", "sync": "tff"}, False),
    "2->2": ((3, 2), [11, 16, 0, 0], {"engine": "asp", "sync": "sp"}, True),  # order (3, 2)
}
FP8 = ((1, 3), [16, 0, 12, 0], {"engine": "asp", "sync": "dc"})  # FP8 dispatch, BF16 combine


def _fp8_inputs() -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    return testing.inputs("bf16", E, K, H, FP8[1], 23, "uniform")


def _fp8_outputs(rank: int, rows: int) -> np.ndarray:
    """Seeded BF16 expert outputs of a rank's received rows (its FP8 rows are not BF16)."""
    return testing.payload(np.random.default_rng([29, rank]), "bf16", rows, H)


def _inputs(name: str) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    _, tokens, _, _ = CASES[name]
    return testing.inputs("bf16", E, K, H, tokens, 7 + len(name), "uniform")


def _bf16(a: np.ndarray) -> Any:
    return torch.from_numpy(np.ascontiguousarray(a)).view(torch.bfloat16)


def _flow(group: Any, name: str) -> dict[str, Any]:
    """One role set's low-latency round trip on this rank; expert outputs are the received
    rows themselves (so the combine's sums are of the inputs)."""
    expert_ranks, _, options, hook = CASES[name]
    rank = group.rank
    xs, idxs, ws = _inputs(name)
    buf = Buffer(group, low_latency_mode=True, expert_ranks=expert_ranks, **options)
    recv, count, handle, _, recv_hook = buf.low_latency_dispatch(
        _bf16(xs[rank]), torch.from_numpy(idxs[rank]), MAX_TOKENS, E, use_fp8=False,
        return_recv_hook=hook)
    if hook:
        recv_hook()
    y, _, _ = buf.low_latency_combine(recv.clone(), torch.from_numpy(idxs[rank]),
                                      torch.from_numpy(ws[rank]), handle)
    return {"recv": recv.view(torch.uint16).numpy().copy(), "count": count.numpy().copy(),
            "src_info": handle.src_info.numpy().copy(),
            "y": y.view(torch.uint16).numpy().copy()}


def _fp8_flow(group: Any) -> dict[str, Any]:
    """FP8 dispatch (the engine quantises each token) and a BF16 combine of seeded outputs."""
    rank = group.rank
    xs, idxs, ws = _fp8_inputs()
    buf = Buffer(group, low_latency_mode=True, expert_ranks=FP8[0], **FP8[2])
    (q, scales), count, handle, _, _ = buf.low_latency_dispatch(
        _bf16(xs[rank]), torch.from_numpy(idxs[rank]), MAX_TOKENS, E, use_fp8=True)
    rows = _bf16(_fp8_outputs(rank, int(count.sum())))
    out = torch.zeros((q.shape[0], q.shape[1], H), dtype=torch.bfloat16)
    start = 0
    for e, n in enumerate(count.tolist()):
        out[e, :n] = rows[start:start + n]
        start += n
    y, _, _ = buf.low_latency_combine(out, torch.from_numpy(idxs[rank]),
                                      torch.from_numpy(ws[rank]), handle)
    return {"q": q.view(torch.uint8).numpy().copy(), "scales": scales.numpy().copy(),
            "count": count.numpy().copy(), "y": y.view(torch.uint16).numpy().copy()}


def _refusals(group: Any) -> list[str]:
    """Normal mode and a bad num_experts refused naming expert_ranks, on every rank; the next
    call works."""
    seen = []
    xs, idxs, ws = _inputs("3->1")
    x, idx = _bf16(xs[group.rank]), torch.from_numpy(idxs[group.rank])
    buf = Buffer(group, low_latency_mode=True, expert_ranks=(3,))
    try:
        buf.get_dispatch_layout(idx, E)  # local: no collective to fail
        buf.dispatch(x, topk_idx=idx, topk_weights=torch.from_numpy(ws[group.rank]),
                     num_tokens_per_rank=torch.zeros(R, dtype=torch.int32))
        seen.append("normal mode ran")
    except InvalidArgumentError as exc:
        seen.append(f"normal: {exc.argument}")
    buf2 = Buffer(group, low_latency_mode=True, expert_ranks=(2, 3))
    try:  # 9 experts over 2 expert ranks
        buf2.low_latency_dispatch(x, idx % 9, MAX_TOKENS, 9, use_fp8=False)
        seen.append("9 over 2 ran")
    except (InvalidArgumentError, RemoteError) as exc:
        seen.append(f"9 experts: {getattr(exc, 'argument', type(exc).__name__)}")
    recv, *_ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, E, use_fp8=False)
    seen.append(f"next call: {tuple(recv.shape)}")
    return seen


def _worker(group: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {name: _flow(group, name) for name in CASES}
    out["fp8"] = _fp8_flow(group)
    out["refusals"] = _refusals(group)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(_worker, R, timeout_s=300)


@pytest.mark.parametrize("name", list(CASES))
def test_low_latency_m2n_is_bit_exact_against_the_oracle_with_the_roles(
        results: list[dict[str, Any]], name: str) -> None:
    expert_ranks, tokens, _, _ = CASES[name]
    xs, idxs, ws = _inputs(name)
    ones = [np.ones(w.shape, np.float32) for w in ws]  # the pair sends unit weights
    refs = reference.dispatch(xs, idxs, ones, E, expert_ranks=expert_ranks)
    ys = reference.combine([ref.recv_x for ref in refs], refs, topk_weights=ws)
    per_rank = E // len(expert_ranks)
    slots = MAX_TOKENS * R
    for r in range(R):
        got, ref = results[r][name], refs[r]
        local = per_rank if r in expert_ranks else 0
        assert got["recv"].shape == (local, slots, H), (name, r)
        assert got["count"].tolist() == ref.num_recv_tokens_per_expert.tolist(), (name, r)
        start = 0
        for e in range(local):
            n = int(got["count"][e])
            assert np.array_equal(got["recv"][e, :n], ref.recv_x[start:start + n]), (name, r, e)
            # the rows after them are undefined (as DeepEP's): the padded receive region's
            assert got["src_info"][e, :n].tolist() == ref.recv_src_token[
                start:start + n].tolist()
            # logical expert p * S + e, p = this rank's place in expert_ranks (closed form)
            assert set(ref.recv_topk_idx[start:start + n].tolist()) <= {
                expert_ranks.index(r) * per_rank + e}
            start += n
        # every valid pick of an expert on r, from every rank (closed form)
        picks = 0 if r not in expert_ranks else sum(
            int((i[i >= 0] // per_rank == expert_ranks.index(r)).sum()) for i in idxs)
        assert start == ref.recv_x.shape[0] == picks, (name, r)
        assert np.array_equal(got["y"], ys[r]), (name, r)
        assert got["y"].shape == (tokens[r], H)


def test_low_latency_m2n_fp8_is_bit_exact_against_the_quantised_oracle(
        results: list[dict[str, Any]]) -> None:
    # the oracle: ubep.quant's E4M3 values and scales, each dispatched with the roles; the
    # combine reduces the seeded BF16 outputs of the received rows with the real weights
    expert_ranks, tokens, _ = FP8
    xs, idxs, ws = _fp8_inputs()
    ones = [np.ones(w.shape, np.float32) for w in ws]
    quantised = [quantize(x, "e4m3") for x in xs]
    refs = reference.dispatch([v for v, _ in quantised], idxs, ones, E, expert_ranks=expert_ranks)
    ref_scales = reference.dispatch([s for _, s in quantised], idxs, ones, E,
                                    expert_ranks=expert_ranks)
    outs = [_fp8_outputs(r, ref.recv_x.shape[0]) for r, ref in enumerate(refs)]
    ys = reference.combine(outs, refs, topk_weights=ws)
    per_rank = E // len(expert_ranks)
    for r in range(R):
        got, ref = results[r]["fp8"], refs[r]
        local = per_rank if r in expert_ranks else 0
        assert got["q"].shape == (local, MAX_TOKENS * R, H)
        assert got["scales"].shape == (local, MAX_TOKENS * R, H // 128)
        assert got["count"].tolist() == ref.num_recv_tokens_per_expert.tolist()
        start = 0
        for e, n in enumerate(got["count"].tolist()):
            assert np.array_equal(got["q"][e, :n], ref.recv_x[start:start + n]), (r, e)
            assert np.array_equal(got["scales"][e, :n].view(np.uint32),
                                  ref_scales[r].recv_x[start:start + n].view(np.uint32))
            start += n
        assert np.array_equal(got["y"], ys[r]) and got["y"].shape == (tokens[r], H), r


def test_normal_mode_and_bad_expert_counts_are_refused_naming_expert_ranks(
        results: list[dict[str, Any]]) -> None:
    want = ["normal: expert_ranks", "9 experts: expert_ranks"]
    for r in range(R):
        assert results[r]["refusals"][:2] == want, r
        local = E if r == 3 else 0
        assert results[r]["refusals"][2] == f"next call: {(local, MAX_TOKENS * R, H)}"


def test_the_constructor_refuses_bad_expert_ranks_naming_them() -> None:
    world = LocalWorld(2, 4)
    for bad, kwargs in (((), {}), ((1, 1), {}), ((5,), {}), ((1,), {"enable_shrink": True}),
                        ((1,), {})):  # the last: the in-process world has no ubep Buffer
        with pytest.raises(InvalidArgumentError) as info:
            Buffer(world.backend(0), low_latency_mode=True, expert_ranks=bad, **kwargs)
        assert info.value.argument == "expert_ranks", bad
