"""One decode step's dispatch and combine through every door a user comes in by, side by side.

    python -m benchmarks.bench_decode_step --quick                  # 2 ranks, hidden 2048
    python -m benchmarks.bench_decode_step --out benchmarks/results # 2 and 4 ranks, 2048 and 7168

Ranks under ``ubep.runtime.launch`` with a gloo process group beside them (a FileStore in the
launch directory); BF16 ``x [tokens, hidden]``, top-8 of 64 experts, seeded uniform routing,
16 tokens per rank (a decode step) and 128 (a prefill chunk). The paths, each its own Buffer:

* ``numpy``: ``ubep.Buffer`` on the launch group, ``layout="rank"``, numpy arrays in (BF16 as
  its ``uint16`` bits): ubep's own call;
* ``torch``: the same kind of Buffer, the torch tensors in (results come back as tensors);
* ``tgroup``: a Buffer on the torch group (``dist.group.WORLD``: what a torchrun program
  builds), torch tensors in;
* ``v1-ll``: ``ubep.deep_ep.Buffer`` low-latency mode (``use_fp8=False``,
  ``num_max_dispatch_tokens_per_rank=tokens``), the padded expert output sent back as is, its
  combine weighted;
* ``v1``: normal mode: ``get_dispatch_layout`` + ``dispatch`` in the dispatch's time,
  ``combine(recv_x, handle, topk_weights=recv_topk_weights)``; ``v1-now``: the same combine
  without ``topk_weights``;
* ``v2-elastic``, ``v2-ep``: ``ElasticBuffer`` (DeepEP 2.1) and ``EPBuffer`` (2.5);
* ``gloo``: what a user writes without an EP library (``torch.distributed.all_to_all_single``
  of the counts, the rows and their ids and weights, the rows back by one more, the sum in FP32
  at the source: the peers benchmark's torch rank-layout peer);
* ``floor``: each rank copies its dispatch's bytes (``np.copyto`` between two pre-faulted
  arrays) at the same moment, in the dispatch's slot and again in the combine's.

Bytes one rank sends = rows x hidden x 2, rows = the (token, destination rank) pairs of its
routing (rank layout; the combine sends the same rows back). The low-latency paths send one row
per (token, expert) pair, up to top-k times that (DeepEP's padded layout has a place per pair):
``numpy-ll`` is the Buffer call the low-latency facade makes (``layout="expert_padded"``, numpy
in) and ``floor-ll`` the copy of those bytes; ``v1-ll``'s ratios are against these two.

Timing: every call (a dispatch, then its combine) follows a shared-memory barrier (the launch
group's, never gloo's: its exit skew would land in every figure), and each rank times its own
call; a call's time is the slowest rank's (the maximum over ranks, call by call). The paths
alternate call by call, their order rotated each step; gloo runs after them, in the same
processes. A gloo call slows every call after it on this
kind of host, whatever the path and for longer than 10 ms (2 ranks, 16 tokens: the numpy
Buffer's median 8 -> 86 us with gloo in the rotation, 10 ms of sleep after each gloo call
did not bring it back), so in the rotation it would price gloo's aftermath into every other
path. min / median / max over the repeats;
ratios of medians to the numpy Buffer and to the floor. Every path's ``y`` is checked once,
untimed, against the closed form: rank layout sums a token's BF16 row once per rank it went to
(exact in FP32); the low-latency combine weighs each (token, expert) pair, which for the
benchmark's weights of 1/8 is ``x`` itself (exact: a BF16 row times a power of two).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from benchmarks import harness

TOPK, EXPERTS = 8, 64
QUICK = {"ranks": (2,), "hidden": (2048,), "tokens": (16, 128)}
FULL = {"ranks": (2, 4), "hidden": (2048, 7168), "tokens": (16, 128)}
PATHS = ("numpy", "numpy-ll", "torch", "tgroup", "v1-ll", "v1", "v1-now", "v2-elastic", "v2-ep",
         "gloo", "floor", "floor-ll")
#: what each path is measured against (``base``: ubep's own numpy call of the same layout;
#: ``floor``: the copy of the same bytes): the low-latency paths move one row per (token,
#: expert) pair into DeepEP's padded places, the others one per (token, rank)
LL_PATHS = ("numpy-ll", "v1-ll", "floor-ll")


def bases(name: str) -> tuple[str, str]:
    """``(base, floor)`` of path ``name``."""
    return ("numpy-ll", "floor-ll") if name in LL_PATHS else (BASE, "floor")
# what the ratios compare against
BASE = "numpy"


@dataclass(frozen=True)
class Shape:
    ranks: int
    hidden: int
    tokens: int


def _inputs(shape: Shape, rank: int) -> tuple[Any, Any, Any]:
    import torch

    from ubep import routing

    g = torch.Generator().manual_seed(1000 * shape.tokens + shape.hidden + rank)
    x = torch.randn(shape.tokens, shape.hidden, generator=g).to(torch.bfloat16)
    idx = torch.from_numpy(routing.uniform_topk(shape.tokens, EXPERTS, TOPK, seed=rank))
    w = torch.full((shape.tokens, TOPK), 1.0 / TOPK)  # powers of two: the LL oracle is exact
    return x, idx.to(torch.int64), w


def _dest_ranks(idx: Any, ranks: int) -> np.ndarray:
    """``[tokens, ranks]`` bool: whether a token has a pick on each rank."""
    owner = np.asarray(idx) // (EXPERTS // ranks)
    return np.stack([(owner == r).any(axis=1) for r in range(ranks)], axis=1)


def bytes_per_rank(shape: Shape, rank: int) -> int:
    """rows x hidden x 2 of ``rank``'s dispatch (rank layout)."""
    _, idx, _ = _inputs(shape, rank)
    return int(_dest_ranks(idx.numpy(), shape.ranks).sum()) * shape.hidden * 2


def ll_bytes_per_rank(shape: Shape, rank: int) -> int:
    """rows x hidden x 2 of ``rank``'s low-latency dispatch: one row per (token, expert)."""
    _, idx, _ = _inputs(shape, rank)
    return int((idx.numpy() >= 0).sum()) * shape.hidden * 2


class _Path:
    """A dispatch and the combine of its rows as they came (identity experts)."""

    def dispatch(self) -> None:
        raise NotImplementedError

    def combine(self) -> Any:
        raise NotImplementedError


class _Ubep(_Path):
    def __init__(self, buf: Any, x: Any, idx: Any, w: Any) -> None:
        self.buf, self.x, self.idx, self.w = buf, x, idx, w
        self.res: Any = None

    def dispatch(self) -> None:
        self.res = self.buf.dispatch(self.x, self.idx, self.w)

    def combine(self) -> Any:
        return self.buf.combine(self.res.recv_x, self.res.handle)


class _V1LowLatency(_Path):
    def __init__(self, buf: Any, x: Any, idx: Any, w: Any, tokens: int) -> None:
        self.buf, self.x, self.idx, self.w, self.tokens = buf, x, idx, w, tokens
        self.got: Any = None

    def dispatch(self) -> None:
        self.got = self.buf.low_latency_dispatch(self.x, self.idx, self.tokens, EXPERTS,
                                                 use_fp8=False)

    def combine(self) -> Any:
        recv_x, _, handle, _, _ = self.got
        return self.buf.low_latency_combine(recv_x, self.idx, self.w, handle)[0]


class _V1Normal(_Path):
    def __init__(self, buf: Any, x: Any, idx: Any, w: Any, weights: bool) -> None:
        self.buf, self.x, self.idx, self.w, self.weights = buf, x, idx, w, weights
        self.got: Any = None

    def dispatch(self) -> None:
        per_rank, _, per_expert, in_rank, _ = self.buf.get_dispatch_layout(self.idx, EXPERTS)
        self.got = self.buf.dispatch(
            self.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=self.idx, topk_weights=self.w)

    def combine(self) -> Any:
        recv_x, _, recv_w, _, handle, _ = self.got
        return self.buf.combine(recv_x, handle,
                                topk_weights=recv_w if self.weights else None)[0]


class _V2(_Path):
    def __init__(self, buf: Any, x: Any, idx: Any, w: Any) -> None:
        self.buf, self.x, self.idx, self.w = buf, x, idx, w
        self.got: Any = None

    def dispatch(self) -> None:
        self.got = self.buf.dispatch(self.x, topk_idx=self.idx, topk_weights=self.w,
                                     num_experts=EXPERTS)

    def combine(self) -> Any:
        recv_x, _, _, handle, _ = self.got
        return self.buf.combine(recv_x, handle)[0]


class _Gloo(_Path):
    def __init__(self, x: Any, idx: Any, w: Any, hidden: int) -> None:
        from benchmarks.peers.gloo_worker import GlooExchange
        from benchmarks.peers.torch_kernels import TorchRankLayoutPeer

        bf16 = np.dtype(np.uint16)  # the peers' storage of BF16 bits
        self.peer = TorchRankLayoutPeer(GlooExchange(), num_experts=EXPERTS, num_topk=TOPK,
                                        max_tokens=x.shape[0], hidden=hidden, x_dtype=bf16,
                                        out_dtype=bf16)
        self.x, self.idx, self.w = x, idx, w
        self.got: Any = None

    def dispatch(self) -> None:
        self.got = self.peer.dispatch(self.x, self.idx, self.w)

    def combine(self) -> Any:
        from benchmarks.peers.torch_kernels import as_torch

        return as_torch(self.peer.combine(as_torch(self.got.recv_x)))


class _Floor(_Path):
    def __init__(self, nbytes: int) -> None:
        self.src = np.ones(nbytes, np.uint8)
        self.dst = np.ones(nbytes, np.uint8)

    def dispatch(self) -> None:
        np.copyto(self.dst, self.src)

    def combine(self) -> Any:
        np.copyto(self.dst, self.src)
        return None


def _paths(group: Any, shape: Shape) -> tuple[dict[str, _Path], list[Any]]:
    """Every path on this rank's inputs, and what to close after."""
    import torch
    import torch.distributed as dist

    import ubep
    from ubep import deep_ep

    world = dist.group.WORLD
    x, idx, w = _inputs(shape, group.rank)
    cfg = ubep.BufferConfig(max_tokens_per_rank=shape.tokens, hidden=shape.hidden,
                            num_topk=TOPK, num_experts=EXPERTS, dtype="bf16", layout="rank")
    on_launch, on_numpy, on_torch = ubep.Buffer(group, cfg), ubep.Buffer(group, cfg), (
        ubep.Buffer(world, cfg))
    # the Buffer call the low-latency facade makes (its Buffer's config, numpy in)
    on_padded = ubep.Buffer(group, dataclasses.replace(cfg, layout="expert_padded"))
    ll = deep_ep.Buffer(world, 0, int(1e9), low_latency_mode=True, explicitly_destroy=True)
    # one facade each: a program combines with weights or without, not both in turn
    v1 = deep_ep.Buffer(world, int(1e8), 0, explicitly_destroy=True)
    v1now = deep_ep.Buffer(world, int(1e8), 0, explicitly_destroy=True)
    common = {"num_max_tokens_per_rank": shape.tokens, "hidden": shape.hidden, "num_topk": TOPK}
    v2e = deep_ep.ElasticBuffer(world, explicitly_destroy=True, **common)
    v2p = deep_ep.EPBuffer(world, explicitly_destroy=True, **common)
    x_np, idx_np, w_np = x.view(torch.uint16).numpy(), idx.numpy(), w.numpy()
    paths: dict[str, _Path] = {
        "numpy": _Ubep(on_numpy, x_np, idx_np, w_np),
        "numpy-ll": _Ubep(on_padded, x_np, idx_np, w_np),
        "torch": _Ubep(on_launch, x, idx, w),
        "tgroup": _Ubep(on_torch, x, idx, w),
        "v1-ll": _V1LowLatency(ll, x, idx, w, shape.tokens),
        "v1": _V1Normal(v1, x, idx, w, weights=True),
        "v1-now": _V1Normal(v1now, x, idx, w, weights=False),
        "v2-elastic": _V2(v2e, x, idx, w),
        "v2-ep": _V2(v2p, x, idx, w),
        "gloo": _Gloo(x, idx, w, shape.hidden),
        "floor": _Floor(bytes_per_rank(shape, group.rank)),
        "floor-ll": _Floor(ll_bytes_per_rank(shape, group.rank)),
    }
    return paths, [on_launch, on_numpy, on_torch, on_padded, ll, v1, v1now, v2e, v2p]


def _check(name: str, y: Any, shape: Shape, rank: int) -> None:
    """``y`` against the closed form (module docstring)."""
    import torch

    if name.startswith("floor"):
        return
    x, idx, _ = _inputs(shape, rank)
    if isinstance(y, np.ndarray):
        y = torch.from_numpy(y.view(np.int16)).view(torch.bfloat16)
    times = 1.0 if name in LL_PATHS else torch.from_numpy(
        _dest_ranks(idx.numpy(), shape.ranks).sum(axis=1).astype(np.float32))[:, None]
    want = (x.float() * times).to(torch.bfloat16)
    if not torch.equal(y.view(torch.int16), want.view(torch.int16)):
        raise AssertionError(f"{name} {shape}: the combined rows differ from the closed form")


def _close(objs: list[Any]) -> None:
    for obj in objs:
        if hasattr(obj, "destroy"):
            obj.destroy()
        else:
            obj.close()


def _rank_main(group: Any, shapes: list[Shape], warmup: int,
               repeats: int) -> list[dict[str, Any]]:
    """This rank's (dispatch_ns, combine_ns) per call, per shape and path; for the paths on a
    ``ubep.Buffer`` also each call's stamps and the engine's trace (``"trace:<path>"``)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share this host's cores
    store = dist.FileStore(os.path.join(group.rendezvous, "torch-filestore"), group.num_ranks)
    dist.init_process_group("gloo", store=store, rank=group.rank, world_size=group.num_ranks)
    barrier = group.barrier  # shared memory, a deadline
    clock = time.perf_counter_ns
    try:
        out = []
        for shape in shapes:
            paths, owned = _paths(group, shape)
            try:
                for name, path in paths.items():
                    path.dispatch()
                    _check(name, path.combine(), shape, group.rank)
                samples: dict[str, Any] = {n: [] for n in paths}
                traced = {n: p.buf._engine.kernel for n, p in paths.items() if isinstance(p, _Ubep)}
                for n in traced:
                    samples["trace:" + n] = []
                # gloo's own phase after the others' (module docstring)
                for names in ([n for n in paths if n != "gloo"], ["gloo"]):
                    for i in range(warmup + repeats):
                        k = i % len(names)
                        for name in names[k:] + names[:k]:
                            stamps = _timed(paths[name], barrier, clock)
                            if i < warmup:
                                continue
                            samples[name].append([stamps[1] - stamps[0], stamps[3] - stamps[2]])
                            if name in traced:
                                samples["trace:" + name].append(
                                    [*stamps, *traced[name].trace()])
                out.append(samples)
            finally:
                barrier(60.0)
                _close(owned)
        return out
    finally:
        dist.destroy_process_group()


def _timed(path: _Path, barrier: Any, clock: Any) -> tuple[int, int, int, int]:
    """One call of ``path`` after the group's barrier: its dispatch's and its combine's start
    and end stamps."""
    barrier(60.0)
    t0 = clock()
    path.dispatch()
    t1 = clock()
    barrier(60.0)
    t2 = clock()
    path.combine()
    return t0, t1, t2, clock()


def run(shapes: list[Shape], warmup: int, repeats: int) -> dict[str, Any]:
    from ubep.runtime import launch

    rows = []
    for ranks in sorted({s.ranks for s in shapes}):
        mine = [s for s in shapes if s.ranks == ranks]
        per_rank = launch(_rank_main, ranks, mine, warmup, repeats, timeout_s=3600)
        for i, shape in enumerate(mine):
            row: dict[str, Any] = {
                **asdict(shape),
                "bytes_per_rank": max(bytes_per_rank(shape, r) for r in range(ranks)),
                "ll_bytes_per_rank": max(ll_bytes_per_rank(shape, r) for r in range(ranks))}
            for name in PATHS:
                worst = np.max(np.array([r[i][name] for r in per_rank], dtype=np.float64),
                               axis=0) / 1e3  # [repeats, 2] us: the slowest rank, call by call
                row[name] = {
                    "dispatch": asdict(harness.Stats.from_samples_us(worst[:, 0].tolist())),
                    "combine": asdict(harness.Stats.from_samples_us(worst[:, 1].tolist()))}
            row["phases"] = _phases(per_rank[0][i])
            rows.append(row)
    return {"rows": rows}


def _phases(samples: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Rank 0's phases (us) of each path on a ``ubep.Buffer``, the median of each over the calls
    (``dispatch``, ``combine``) and its minimum (``dispatch_min``, ``combine_min``: what each
    phase costs when nothing else ran, the reading a loaded host still gives): ``py_in``
    (Python up to the native call), the engine's trace points, ``py_out`` (the native call's
    return through Python, the result's wrapping included)."""
    out = {}
    for key, rows in samples.items():
        if not key.startswith("trace:"):
            continue
        calls = {"dispatch": [[t0, t1, *tr] for t0, t1, _, _, *tr in rows],
                 "combine": [[t2, t3, *tr] for _, _, t2, t3, *tr in rows]}
        ops: dict[str, dict[str, float]] = {}
        for op, names in (("dispatch", harness.DISPATCH_PHASES),
                          ("combine", harness.COMBINE_PHASES)):
            ops[op] = dict(zip(names, harness.phase_medians(calls[op], op), strict=True))
            gaps = np.diff(np.array([[c[0], *harness.trace_marks(op, c[2:]), c[1]]
                                     for c in calls[op]], dtype=np.float64), axis=1) / 1e3
            ops[op + "_min"] = dict(zip(names, gaps.min(axis=0).tolist(), strict=True))
        out[key[len("trace:"):]] = ops
    return out


def report(result: dict[str, Any]) -> str:
    cols = ["ranks", "hidden", "tokens", "path", "d_min", "d_med", "d_max", "c_min", "c_med",
            "c_max", "d/base", "c/base", "d/floor", "c/floor"]
    table: list[list[object]] = []
    for r in result["rows"]:
        for name in PATHS:
            base, floor = (r[b] for b in bases(name))
            d, c = r[name]["dispatch"], r[name]["combine"]
            table.append([
                r["ranks"], r["hidden"], r["tokens"], name, d["min_us"], d["median_us"],
                d["max_us"], c["min_us"], c["median_us"], c["max_us"],
                d["median_us"] / base["dispatch"]["median_us"],
                c["median_us"] / base["combine"]["median_us"],
                d["median_us"] / floor["dispatch"]["median_us"],
                c["median_us"] / floor["combine"]["median_us"]])
    lines = [harness.format_table(cols, table, float_digits=1), "",
             "base: ubep.Buffer numpy of the same layout (numpy-ll for the low-latency paths, "
             "numpy for the others); floor: the copy of the same bytes (floor-ll, floor)", "",
             "rank 0's phases (us) of the paths on a ubep.Buffer, medians and (_min) minima over "
             "the calls (py_in: Python up to the native call; py_out: from its last phase "
             "through Python's return)"]
    for r in result["rows"]:
        for name, ops in r["phases"].items():
            for op, ph in ops.items():
                lines.append(f"{r['ranks']}r {r['hidden']} {r['tokens']}t {name:6s} {op:12s} "
                             + " ".join(f"{k} {v:.1f}" for k, v in ph.items()))
    return "\n".join(lines)


def shapes_of(grid: dict[str, tuple[int, ...]]) -> list[Shape]:
    return [Shape(r, h, t) for r in grid["ranks"] for h in grid["hidden"]
            for t in grid["tokens"]]


def main(argv: list[str] | None = None) -> int:
    ap = harness.rounds_parser(__doc__ or "", "2 ranks, hidden 2048, 16 and 128 tokens",
                               "decode_step", 150)
    args = ap.parse_args(argv)
    grid = QUICK if args.quick else FULL
    result, machine = harness.measured(
        lambda: run(shapes_of(grid), args.warmup, args.repeats))
    head = (f"# python -m benchmarks.bench_decode_step{' --quick' if args.quick else ''}; "
            f"BF16, top-{TOPK} of {EXPERTS}, {args.repeats} calls per path alternated (gloo's "
            f"after the others', in a phase of its own), a "
            f"shared-memory barrier before each; us, the slowest rank per call; "
            f"bytes/rank = rows x hidden x 2; {machine}")
    bytes_line = "bytes per rank (dispatch): " + ", ".join(
        f"{r['ranks']}r/{r['hidden']}/{r['tokens']}t {r['bytes_per_rank'] / 1024:.0f} KiB "
        f"(low-latency {r['ll_bytes_per_rank'] / 1024:.0f} KiB)"
        for r in result["rows"])
    harness.save_results(args.out, "decode_step" + ("_quick" if args.quick else ""),
                         "\n".join([head, report(result), bytes_line]), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
