"""DeepEP's low-latency pair on ubep (``ubep.deep_ep.Buffer``, ``low_latency_mode=True``) beside
the numpy ``ubep.Buffer`` and the floor.

    python -m benchmarks.bench_lowlatency --quick                  # hidden 2048 only
    python -m benchmarks.bench_lowlatency --out benchmarks/results

2 ranks (``ubep.runtime.launch``; every system on the launch group), BF16, top-8 of 64
experts, seeded uniform routing. Shapes: hidden 2048 at 16 and 128 tokens per rank
(``num_max_dispatch_tokens_per_rank`` = the tokens), and a decode server's, hidden 7168 with
``num_max_dispatch_tokens_per_rank=128`` and 16 tokens. One iteration is a dispatch and the
combine of its rows as they came (identity experts, the dispatch's weights), through:

* ``numpy``: ``ubep.Buffer``, ``layout="expert"``, numpy arrays in and out: ubep's own call;
* ``v1_ll``: ``low_latency_dispatch`` (``use_fp8=False``) and ``low_latency_combine`` of
  ``recv_x`` itself: the Buffer runs ``layout="expert_padded"``, so ``recv_x``, ``recv_count``
  and the combine's input are views of its regions (``ubep.torch.deep_ep_lowlatency``);
* ``v1_ll_zero_copy``: the same dispatch, then ``low_latency_combine(..., zero_copy=True)`` of
  ``get_next_low_latency_combine_buffer(handle)``, into which the rows were written once,
  untimed (a DeepEP expert kernel writes its outputs there: the combine then reads them where
  they lie);
* ``v1_ll_packed``: the same calls through the packed path (a ``layout="expert"`` Buffer and
  ``[num_local_experts, slots, hidden]`` tensors built, zeroed and packed every call): what the
  in-process world and shrink mode still run, and what every low-latency call ran before.

Bytes one rank sends = rows x hidden x 2, rows = the valid (token, k) pairs of its routing (one
row per pair, the expert layout's); the combine sends as many back. Floor:
``harness.concurrent_copy`` of twice those bytes (dispatch and combine) by 2 processes at once,
in the same run.

Timing: the launch group's shared-memory barrier before every iteration, then each rank times
its own; an iteration's time is the maximum over ranks; min / median / max over the repeats,
the systems alternating round by round. Ratios of medians: each system / numpy, each / the
floor. Every system's combined ``y`` is checked once, untimed, against the closed form: a
token's BF16 row times the sum of its valid weights, in float32, cast to BF16 (the combine
reduces in float32 in ascending ``k``; the rows are the token's own, so the sum is that
order's).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

import numpy as np

from benchmarks import harness

RANKS, TOPK, EXPERTS = 2, 8, 64
# (tokens, hidden, num_max_dispatch_tokens_per_rank)
SHAPES = ((16, 2048, 16), (128, 2048, 128), (16, 7168, 128))
SYSTEMS = ("numpy", "v1_ll", "v1_ll_zero_copy", "v1_ll_packed")


def _inputs(tokens: int, hidden: int, rank: int) -> tuple[Any, Any, Any]:
    import torch

    from ubep import routing

    g = torch.Generator().manual_seed(1000 * tokens + hidden + rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.from_numpy(routing.uniform_topk(tokens, EXPERTS, TOPK, seed=rank))
    w = torch.rand(tokens, TOPK, generator=g)
    return x, idx.to(torch.int64), w


def _expected(x: Any, idx: Any, w: Any) -> Any:
    """The closed form of a combine of identity experts: ``x[t] * sum_k w[t, k]``, the products
    and the sum in float32 (ascending k), cast to BF16."""
    import torch

    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        term = w[:, k, None].float() * x.float()
        acc = acc + torch.where(idx[:, k, None] >= 0, term, torch.zeros_like(term))
    return acc.to(torch.bfloat16)


def _systems(group: Any, tokens: int, hidden: int, max_tokens: int) -> dict[str, Any]:
    """Each system's iteration (returns the combined ``y``) on this rank's inputs."""
    import torch

    import ubep
    from ubep import deep_ep
    from ubep.torch._convert import from_numpy

    x, idx, w = _inputs(tokens, hidden, group.rank)
    x_np, idx_np, w_np = x.view(torch.uint16).numpy(), idx.numpy(), w.numpy()
    buf = ubep.Buffer(group, ubep.BufferConfig(
        max_tokens_per_rank=max_tokens, hidden=hidden, num_topk=TOPK, num_experts=EXPERTS,
        dtype="bf16", layout="expert"))
    v1 = deep_ep.Buffer(group, low_latency_mode=True)
    # the packed path on a real Buffer (the in-process world's and shrink mode's): its
    # low-latency path told so before its first call
    packed = deep_ep.Buffer(group, low_latency_mode=True)
    packed._low_latency.padded = False

    def run_numpy() -> Any:
        res = buf.dispatch(x_np, idx_np, w_np)
        return from_numpy(buf.combine(res.recv_x, res.handle), torch.bfloat16)

    def ll(facade: Any) -> Any:
        def run() -> Any:
            recv_x, _count, handle, _, _ = facade.low_latency_dispatch(
                x, idx, max_tokens, EXPERTS, use_fp8=False)
            return facade.low_latency_combine(recv_x, idx, w, handle)[0]
        return run

    def run_zero_copy() -> Any:
        recv_x, _count, handle, _, _ = v1.low_latency_dispatch(x, idx, max_tokens, EXPERTS,
                                                               use_fp8=False)
        return v1.low_latency_combine(recv_x, idx, w, handle, zero_copy=True)[0]

    # the expert outputs in both combine regions (the dispatches alternate between them), as
    # the rows every dispatch of these inputs receives
    for _ in range(2):
        recv_x, _count, handle, _, _ = v1.low_latency_dispatch(x, idx, max_tokens, EXPERTS,
                                                               use_fp8=False)
        v1.get_next_low_latency_combine_buffer(handle).copy_(recv_x)
        v1.low_latency_combine(recv_x, idx, w, handle, zero_copy=True)

    return {"numpy": run_numpy, "v1_ll": ll(v1), "v1_ll_zero_copy": run_zero_copy,
            "v1_ll_packed": ll(packed), "_oracle": _expected(x, idx, w)}


def _rank_main(group: Any, shapes: tuple[tuple[int, int, int], ...], warmup: int,
               per_round: list[int]) -> list[dict[str, list[float]]]:
    """This rank's samples (us) per shape and system, the systems alternating each round."""
    import torch

    torch.set_num_threads(1)  # two ranks share this host's cores
    out = []
    for tokens, hidden, max_tokens in shapes:
        systems = _systems(group, tokens, hidden, max_tokens)
        want = systems.pop("_oracle")
        for name, fn in systems.items():
            if not torch.equal(fn().view(torch.int16), want.view(torch.int16)):
                raise AssertionError(f"{name}: the combined rows differ from the closed form")
        samples: dict[str, list[float]] = {name: [] for name in systems}
        for repeats in per_round:
            for name, fn in systems.items():
                ns = harness.time_collective(group.barrier, fn, warmup, repeats)
                samples[name] += (ns / 1e3).tolist()
        out.append(samples)
    return out


def _bytes_per_rank(tokens: int, hidden: int) -> int:
    """The larger of the ranks' dispatch bytes (valid (token, k) pairs x hidden x 2)."""
    return max(int((_inputs(tokens, hidden, r)[1] >= 0).sum()) * hidden * 2
               for r in range(RANKS))


def run(shapes: tuple[tuple[int, int, int], ...], warmup: int, repeats: int,
        rounds: int) -> dict[str, Any]:
    from ubep.runtime import launch

    per_round = harness.round_repeats(repeats, rounds)
    nbytes = [_bytes_per_rank(t, h) for t, h, _ in shapes]
    floor = harness.concurrent_copy(RANKS, [2 * b for b in nbytes], repeats=sum(per_round),
                                    warmup=warmup, rounds=len(per_round), destinations=2)
    per_rank = launch(_rank_main, RANKS, shapes, warmup, per_round, timeout_s=1800)
    rows = []
    for i, (tokens, hidden, max_tokens) in enumerate(shapes):
        row: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "max_tokens": max_tokens,
                               "bytes_per_rank": nbytes[i], "floor": asdict(floor[i])}
        for name in SYSTEMS:
            worst = np.max(np.array([r[i][name] for r in per_rank]), axis=0)
            row[name] = asdict(harness.Stats.from_samples_us(worst.tolist()))
        rows.append(row)
    return {"rows": rows}


def report(result: dict[str, Any]) -> str:
    cols = ["tokens", "hidden", "max_tok", "KB/rank", "system", "min_us", "med_us", "max_us",
            "/numpy", "/floor"]
    table: list[list[object]] = []
    for r in result["rows"]:
        shape = [r["tokens"], r["hidden"], r["max_tokens"]]
        for name in SYSTEMS:
            st = r[name]
            table.append([*shape, f"{r['bytes_per_rank'] / 1024:.0f}", name, st["min_us"],
                          st["median_us"], st["max_us"],
                          st["median_us"] / r["numpy"]["median_us"],
                          st["median_us"] / r["floor"]["median_us"]])
        table.append([*shape, "", "floor", r["floor"]["min_us"], r["floor"]["median_us"],
                      r["floor"]["max_us"], "", ""])
    return harness.format_table(cols, table, float_digits=1)


def main(argv: list[str] | None = None) -> int:
    ap = harness.rounds_parser(__doc__ or "", "hidden 2048 only, 20 repeats", "lowlatency", 60)
    args = ap.parse_args(argv)
    shapes = SHAPES[:2] if args.quick else SHAPES
    repeats = 20 if args.quick else args.repeats
    result, machine = harness.measured(lambda: run(shapes, args.warmup, repeats, args.rounds))
    head = (f"# python -m benchmarks.bench_lowlatency{' --quick' if args.quick else ''}; "
            f"{RANKS} ranks, BF16, top-{TOPK} of {EXPERTS}, {repeats} repeats in "
            f"{args.rounds} rounds, {machine}")
    harness.save_results(args.out, "lowlatency", head + "\n" + report(result), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
