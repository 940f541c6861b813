"""The one-call path of blocking calls (runtime/native/fastpath.c): a blocking dispatch or
combine of exact numpy arrays is checked, run and its result built in one native call.

Its results must be the general path's, field for field: the same values (both bit-exact
against ``ubep.reference``), dtypes, shapes, writeability and types; and it must hand every case
that is not its own (other dtypes, non-contiguous arrays, bad shapes, foreign or stale handles)
to the general path, which converts or raises the error that names the argument.
"""

from __future__ import annotations

import dataclasses
import pickle
import tracemalloc
from typing import Any

import numpy as np
import pytest

from ubep import reference, testing
from ubep.buffer import Buffer, BufferConfig
from ubep.errors import InvalidArgumentError, UbepError
from ubep.runtime import launch

E, K, H = 16, 4, 256


class _Spy:
    """The engine's fast entries, counting the calls they ran themselves (not None)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.ran = {"dispatch_fast": 0, "combine_fast": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _count(self, name: str, *args: Any) -> Any:
        got = getattr(self._engine, name)(*args)
        self.ran[name] += got is not None
        return got

    def dispatch_fast(self, *args: Any) -> Any:
        return self._count("dispatch_fast", *args)

    def combine_fast(self, *args: Any) -> Any:
        return self._count("combine_fast", *args)


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
        spy = _Spy(buf._fast)
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
            y_general = buf.combine(np.asfortranarray(outs[r]), fast.handle)  # not C order
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
        assert got["ran"] == {"dispatch_fast": 3, "combine_fast": 3}
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
    names = [seg.name for seg in buf._segments]
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


BIG_T, BIG_H = 512, 4096  # y of 512 x 4096 BF16 = 4 MiB: fastpath.c's Y_POOL_MIN_BYTES


def _worker_y_pool(group: Any) -> dict[str, Any]:
    """Big combine outputs come from the Buffer's blocks, and a block goes out again only when
    no array (or array holder) of the caller's views it any more."""
    cfg = BufferConfig(max_tokens_per_rank=BIG_T, hidden=BIG_H, num_topk=K, num_experts=E,
                       dtype="bf16", layout="rank", num_cores=1)
    xs, idxs, ws = testing.inputs("bf16", E, K, BIG_H, [BIG_T] * 2, 4, "uniform")
    r, errors = group.rank, []
    with Buffer(group, cfg) as buf:
        res = buf.dispatch(xs[r], idxs[r], ws[r])
        refs = reference.dispatch(xs, idxs, ws, E, layout="rank")
        outs = [[testing.payload(np.random.default_rng(v * 10 + q), "bf16", len(ref.recv_x),
                                 BIG_H) for q, ref in enumerate(refs)] for v in range(2)]
        want = [reference.combine(o, refs)[r] for o in outs]
        if np.array_equal(testing.bits(want[0]), testing.bits(want[1])):
            errors.append("the two payloads must give different y")

        def check(y: np.ndarray, v: int, name: str) -> None:
            if not np.array_equal(testing.bits(y), testing.bits(want[v])):
                errors.append(f"{name}: values")

        y1 = buf.combine(outs[0][r], res.handle)
        check(y1, 0, "y1")
        pooled = y1.base is not None and y1.base.nbytes == BIG_T * BIG_H * 2
        y2 = buf.combine(outs[1][r], res.handle)  # y1 is held: y2 must not be written over it
        y3 = buf.combine(outs[0][r], res.handle)  # both held: a new block
        check(y1, 0, "y1 after y2, y3")
        check(y2, 1, "y2 after y3")
        check(y3, 0, "y3")
        shared = [np.shares_memory(a, b) for a, b in ((y1, y2), (y1, y3), (y2, y3))]
        view = y1[:, :8]  # a view keeps y1's block
        del y1, y2, y3
        y4 = buf.combine(outs[1][r], res.handle)
        y5 = buf.combine(outs[1][r], res.handle)
        if not np.array_equal(testing.bits(view), testing.bits(want[0][:, :8])):
            errors.append("a view of y1 was written over")
        check(y4, 1, "y4")
        check(y5, 1, "y5")
        del y4, y5, view
        y6 = buf.combine(outs[0][r], res.handle)
        block = id(y6.base)  # (an id, not a reference: a reference would hold the block)
        del y6
        y7 = buf.combine(outs[1][r], res.handle)  # nothing holds the block: it is reused
        reused = id(y7.base) == block  # the pool kept the block alive: the id is its own
        check(y7, 1, "y7")
        torch_kept = None
        try:
            import torch
        except ImportError:
            pass
        else:
            t = torch.from_numpy(y7)
            del y7
            y8 = buf.combine(outs[0][r], res.handle)
            torch_kept = bool(np.array_equal(t.numpy(), want[1])) and not np.shares_memory(
                t.numpy(), y8)
            check(y8, 0, "y8")
            del y8
        kept = buf.combine(outs[0][r], res.handle)
    check(kept, 0, "y after the Buffer closed")  # its block outlives the Buffer
    return {"errors": errors, "pooled": pooled, "shared": shared, "reused": reused,
            "torch_kept": torch_kept}


def test_big_combine_outputs_reuse_a_block_only_when_nothing_views_it() -> None:
    for got in launch(_worker_y_pool, 2, timeout_s=120):
        assert got["errors"] == [], "\n".join(got["errors"])
        assert got["pooled"] and got["reused"]
        assert got["shared"] == [False, False, False]
        assert got["torch_kept"] in (None, True)
