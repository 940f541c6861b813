"""The one-call path of blocking calls (runtime/native/fastpath.c): a blocking dispatch or
combine of exact numpy arrays is checked, run and its result built in one native call.

Its results must be the general path's, field for field: the same values (both bit-exact
against ``ubep.reference``), dtypes, shapes, writeability and types; and it must hand every case
that is not its own (other dtypes or array types, bad shapes, foreign or stale handles) to the
general path, which converts or raises the error that names the argument (a non-contiguous
array of its own dtype it copies into its layout itself: tests/buffer/test_one_offer.py).
"""

from __future__ import annotations

import dataclasses
import pickle
import tracemalloc
from typing import Any

import numpy as np
import pytest

from tests._engine_spy import EngineSpy
from ubep import reference, testing
from ubep.buffer import Buffer, BufferConfig
from ubep.errors import InvalidArgumentError, UbepError
from ubep.runtime import launch

E, K, H = 16, 4, 256

class _Sub(np.ndarray):
    """A numpy array of a subclass: never offered to the one-call path as it is."""


def _same(a: Any, b: Any, name: str) -> list[str]:
    """Fast vs general: the same kind of object, value, dtype, shape and writeability."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (type(a) is type(b) is np.ndarray):
            return [f"{name}: {type(a).__name__} vs {type(b).__name__}"]
        if (a.dtype, a.shape, a.flags.writeable) != (b.dtype, b.shape, b.flags.writeable):
            return [f"{name}: {a.dtype}{a.shape} w={a.flags.writeable} vs "
                    f"{b.dtype}{b.shape} w={b.flags.writeable}"]
        return [] if np.array_equal(testing.bits(a), testing.bits(b)) else [f"{name}: values"]
    return [] if type(a) is type(b) and a == b else [f"{name}: {a!r} vs {b!r}"]


def _compare_results(fast: Any, general: Any) -> list[str]:
    errors = []
    for f in dataclasses.fields(fast):
        if f.name != "handle":
            errors += _same(getattr(fast, f.name), getattr(general, f.name), f.name)
    if type(fast.handle) is not type(general.handle):
        return [*errors, "handle type"]
    for f in dataclasses.fields(fast.handle):
        if f.name != "dispatch_index":
            errors += _same(getattr(fast.handle, f.name), getattr(general.handle, f.name),
                            f"handle.{f.name}")
    return errors


def _worker(group: Any, layout: str, sync: str, quant: str | None, cores: int) -> dict[str, Any]:
    dtype = "bf16"
    cfg = BufferConfig(max_tokens_per_rank=12, hidden=H, num_topk=K, num_experts=E, dtype=dtype,
                       layout=layout, sync=sync, quant=quant, num_cores=cores)
    r, errors = group.rank, []
    with Buffer(group, cfg) as buf:
        spy = EngineSpy(buf._fast)
        buf._fast = spy  # type: ignore[assignment]
        for seed, tokens in enumerate(([12, 7], [0, 5], [3, 3])):
            xs, idxs, ws = testing.inputs(dtype, E, K, H, tokens, seed, "uniform")
            fast = buf.dispatch(xs[r], idxs[r], ws[r])
            # the general path: int32 ids are converted there, never taken by the fast path
            general = buf.dispatch(xs[r], idxs[r].astype(np.int32), ws[r])
            errors += [f"seed {seed}: {e}" for e in _compare_results(fast, general)]
            if general.handle.dispatch_index != fast.handle.dispatch_index + 1:
                errors.append(f"seed {seed}: dispatch_index {fast.handle.dispatch_index}, "
                              f"then {general.handle.dispatch_index}")
            refs = reference.dispatch(xs, idxs, ws, E, layout=layout)
            if quant is None:  # (quantised rows: ubep.quant's tests own their values)
                errors += [f"seed {seed} vs reference: {e}" for e in testing.compare(fast, refs[r])]
            # every rank's expert outputs, from the reference's row counts (the same routing)
            outs = [testing.payload(np.random.default_rng(seed * 10 + q), dtype,
                                    len(ref.recv_x), H) for q, ref in enumerate(refs)]
            y_fast = buf.combine(outs[r], fast.handle)
            # another array type: the Buffer's checks take it, the general path
            y_general = buf.combine(outs[r].view(_Sub), fast.handle)
            errors += _same(y_fast, y_general, f"seed {seed} combine")
            errors += _same(y_fast, reference.combine(outs, refs)[r],
                            f"seed {seed} combine vs reference")
            back = pickle.loads(pickle.dumps(fast.handle))  # arrays come back writeable
            for f in dataclasses.fields(back):
                a, b = getattr(back, f.name), getattr(fast.handle, f.name)
                same = np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                if not same or type(back) is not type(fast.handle):
                    errors.append(f"seed {seed}: pickled handle.{f.name}")
        ran = dict(spy.ran)
        # bad input reaches the general path's checks: the error names the argument
        xs, idxs, ws = testing.inputs(dtype, E, K, H, [4, 4], 9, "uniform")
        caught = []
        for bad in ({"x": xs[r][:, :-1]}, {"topk_weights": ws[r].astype(np.float64)},
                    {"topk_idx": idxs[r][:, :-1]}):
            args = {"x": xs[r], "topk_idx": idxs[r], "topk_weights": ws[r]} | bad
            with pytest.raises(InvalidArgumentError) as info:
                buf.dispatch(args["x"], args["topk_idx"], args["topk_weights"])
            caught.append(info.value.argument)
        res = buf.dispatch(xs[r], idxs[r], ws[r])  # and the next call works
        eo = testing.payload(np.random.default_rng(r), dtype, len(res.recv_x), H)
        foreign = dataclasses.replace(res.handle, buffer_uid=res.handle.buffer_uid ^ 1)
        with pytest.raises(InvalidArgumentError) as info:
            buf.combine(eo, foreign)
        caught.append(info.value.argument)
        y = buf.combine(eo, res.handle)
        buf.resync()
        with pytest.raises(InvalidArgumentError) as info:  # a handle from before the resync
            buf.combine(eo, res.handle)
        caught.append(info.value.argument)
        return {"errors": errors, "ran": ran, "caught": caught, "y_shape": y.shape}


@pytest.mark.parametrize(("layout", "sync", "quant", "cores"), [
    ("rank", "sp", None, 1),
    ("expert", "sw", None, 2),  # two cores: the cached core split rides along
    ("expert", "tff", "e4m3", 1),  # quantised: recv_x_scales built in C too
])
def test_fast_path_equals_general_path(layout: str, sync: str, quant: str | None,
                                       cores: int) -> None:
    for got in launch(_worker, 2, layout, sync, quant, cores, timeout_s=120):
        assert got["errors"] == [], "\n".join(got["errors"])
        # every blocking call of exact arrays took the fast path; the others did not
        assert got["ran"] == {"dispatch": 3, "combine": 3}
        assert got["caught"] == ["x", "topk_weights", "topk_idx", "handle", "handle"]
        assert got["y_shape"] == (4, H)


def _worker_leak(group: Any) -> int:
    cfg = BufferConfig(max_tokens_per_rank=8, hidden=H, num_topk=K, num_experts=E,
                       dtype="bf16", layout="rank", num_cores=1)
    xs, idxs, ws = testing.inputs("bf16", E, K, H, [8, 8], 1, "uniform")
    r = group.rank
    with Buffer(group, cfg) as buf:
        eo = np.array(buf.dispatch(xs[r], idxs[r], ws[r]).recv_x)

        def calls(n: int) -> None:
            for _ in range(n):
                res = buf.dispatch(xs[r], idxs[r], ws[r])
                buf.combine(eo, res.handle)

        calls(50)
        tracemalloc.start()
        calls(200)
        before = tracemalloc.get_traced_memory()[0]
        calls(400)
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
    return grown


def test_fast_path_leaks_nothing() -> None:
    # every call allocates ~3 KB of results (numpy reports them to tracemalloc): 400 leaked
    # calls would add > 1 MB
    for grown in launch(_worker_leak, 2, timeout_s=120):
        assert grown < 64 * 1024


def _worker_review(group: Any) -> dict[str, Any]:
    """Two findings of the review of the one-call path, as regressions."""
    cfg = BufferConfig(max_tokens_per_rank=8, hidden=H, num_topk=K, num_experts=E,
                       dtype="bf16", layout="rank", num_cores=1)
    xs, idxs, ws = testing.inputs("bf16", E, K, H, [8, 8], 2, "uniform")
    r, out = group.rank, {}
    buf = Buffer(group, cfg)
    res = buf.dispatch(xs[r], idxs[r], ws[r])
    eo = np.array(res.recv_x)
    # a handle whose recv_src_rank was forced to a 0-d array: the one-call path must hand it
    # to the general path (which rejects it on every rank), never read its missing dimension
    forged = dataclasses.replace(res.handle)
    object.__setattr__(forged, "recv_src_rank", np.array(3))
    try:
        buf.combine(eo, forged)
        out["forged"] = "accepted"
    except UbepError as exc:
        out["forged"] = type(exc).__name__
    out["next_call_right"] = testing.check_call(buf, xs, idxs, ws, 3) == []
    # close() drops every mapping of the segments, the engine's views included, while the
    # Buffer object itself is still referenced
    names = [seg.name for seg in buf._memory.segments]
    del res, forged  # the caller's own views (recv_x) keep a mapping alive, by design
    buf.close()
    with open("/proc/self/maps") as f:
        maps = f.read()
    out["still_mapped"] = [n for n in names if n in maps]
    return out


def test_forged_handle_and_close_after_review() -> None:
    for got in launch(_worker_review, 2, timeout_s=120):
        assert got["forged"] in ("UbepError", "InvalidArgumentError", "RemoteError")
        assert got["next_call_right"]
        assert got["still_mapped"] == []


POOL_T, POOL_H = 256, 2048  # y of 256 x 2048 BF16 = 1 MiB, with the pool's threshold lowered


def _worker_y_pool(group: Any) -> dict[str, Any]:
    """Big combine outputs come from the Buffer's two blocks (the threshold lowered to 1 MiB by
    the test hook), and a block goes out again only when nothing of the caller's views it."""
    from ubep.runtime import _native

    old = _native.y_pool_min_bytes(1 << 20)
    try:
        return _y_pool_calls(group)
    finally:
        _native.y_pool_min_bytes(old)


def _y_pool_calls(group: Any) -> dict[str, Any]:
    from ubep.runtime import _native

    cfg = BufferConfig(max_tokens_per_rank=POOL_T, hidden=POOL_H, num_topk=K, num_experts=E,
                       dtype="bf16", layout="rank", num_cores=1)
    xs, idxs, ws = testing.inputs("bf16", E, K, POOL_H, [POOL_T] * 2, 4, "uniform")
    r, errors = group.rank, []
    with Buffer(group, cfg) as buf:
        res = buf.dispatch(xs[r], idxs[r], ws[r])
        refs = reference.dispatch(xs, idxs, ws, E, layout="rank")
        outs = [[testing.payload(np.random.default_rng(v * 10 + q), "bf16", len(ref.recv_x),
                                 POOL_H) for q, ref in enumerate(refs)] for v in range(2)]
        want = [reference.combine(o, refs)[r] for o in outs]
        if np.array_equal(testing.bits(want[0]), testing.bits(want[1])):
            errors.append("the two payloads must give different y")

        def combine(v: int, name: str) -> np.ndarray:
            y = buf.combine(outs[v][r], res.handle)
            if not np.array_equal(testing.bits(y), testing.bits(want[v])):
                errors.append(f"{name}: values")
            return y

        def same(y: np.ndarray, v: int, name: str) -> None:
            if not np.array_equal(testing.bits(y), testing.bits(want[v][:, : y.shape[1]])):
                errors.append(f"{name} was written over")

        # ids, not references: a reference would hold a block (the pool keeps them alive)
        y1 = combine(0, "y1")
        y2 = combine(1, "y2")  # y1 holds block 0: block 1
        blocks = [id(y1.base), id(y2.base)]
        y3 = combine(0, "y3")  # both held: an array of its own
        own = [y3.base is None]
        same(y1, 0, "y1")
        same(y2, 1, "y2")
        shared = [np.shares_memory(a, b) for a, b in ((y1, y2), (y1, y3), (y2, y3))]
        view = y2[:, :8]  # keeps block 1
        del y1, y2, y3
        y4 = combine(1, "y4")  # block 0 again
        y5 = combine(1, "y5")  # block 0 held by y4, block 1 by the view: its own
        same(view, 1, "a view of y2")
        order = [id(y4.base) == blocks[0], y5.base is None]
        del y4, y5
        torch_kept = None
        try:
            import torch
        except ImportError:
            pass
        else:
            t = torch.from_numpy(combine(0, "y6"))  # block 0, held by the tensor only
            y7 = combine(1, "y7")  # both held: its own
            torch_kept = y7.base is None and bool(np.array_equal(t.numpy(), want[0]))
            del t, y7
        del view
        # a block holds at most twice its y: a quarter-size y (256 KiB, the threshold lowered
        # again) does not get a free 1 MiB block but one of its own size in its place
        _native.y_pool_min_bytes(64 << 10)
        small = buf.dispatch(xs[r][: POOL_T // 4], idxs[r][: POOL_T // 4],
                             ws[r][: POOL_T // 4])
        eo = testing.payload(np.random.default_rng(r), "bf16", len(small.recv_x), POOL_H)
        y_small = buf.combine(eo, small.handle)
        sizes = [y_small.base is not None and y_small.base.nbytes == y_small.nbytes]
        del y_small
        _native.y_pool_min_bytes(1 << 20)
        res = buf.dispatch(xs[r], idxs[r], ws[r])  # the full-size handle again
        kept = combine(0, "y after the Buffer closed")
    same(kept, 0, "y after the Buffer closed")  # its block outlives the Buffer
    return {"errors": errors, "blocks": blocks, "own": own, "shared": shared, "order": order,
            "torch_kept": torch_kept, "sizes": sizes}


def test_big_combine_outputs_reuse_a_block_only_when_nothing_views_it() -> None:
    for got in launch(_worker_y_pool, 2, timeout_s=120):
        assert got["errors"] == [], "\n".join(got["errors"])
        assert got["blocks"][0] != got["blocks"][1]  # two distinct blocks
        assert got["own"] == [True]
        assert got["shared"] == [False, False, False]
        assert got["order"] == [True, True]
        assert got["torch_kept"] in (None, True)
        assert got["sizes"] == [True]
