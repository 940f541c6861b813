"""DeepEP's facades on ubep (V1 ``Buffer``, V2 ``ElasticBuffer``) beside gloo and the floor.

    python -m benchmarks.bench_deepep --quick                  # 16 tokens only, 10 repeats
    python -m benchmarks.bench_deepep --out benchmarks/results # 16 and 128 tokens per rank

2 ranks (``ubep.runtime.launch``; a gloo process group over a FileStore in each), BF16
``x [tokens, 2048]``, top-8 of 64 experts, seeded uniform routing, 16 tokens per rank (a decode
step) and 128 (a prefill chunk). One iteration is a dispatch and the combine of its rows as they
came (identity experts), through:

* ``ubep``: ``ubep.Buffer`` on the torch group, ``layout="rank"`` (torch tensors in and out):
  what the facades run underneath;
* ``v1``: ``ubep.deep_ep.Buffer``: ``get_dispatch_layout``, ``dispatch``, ``combine`` (normal
  mode, a DeepEP V1 program's calls);
* ``v2``: ``ubep.deep_ep.ElasticBuffer`` (DeepEP 2.1): ``dispatch(x, topk_idx=...)``,
  ``combine`` (``EPBuffer`` runs the same calls);
* ``gloo``: what a user writes without an EP library, with ``torch.distributed``: the peers
  benchmark's torch rank-layout peer (``benchmarks/peers/torch_kernels.py``): one
  ``all_to_all_single`` of the per-rank row counts, one of the rows (one row per token and
  destination rank) and one of their expert ids and weights, the rows back by one more, and
  the sum at the source in FP32, destination rank by rank, cast to BF16 once.

Bytes one rank sends = rows x hidden x 2, rows = the (token, destination rank) pairs of its
routing; the combine sends the same rows back. Floor: ``harness.concurrent_copy`` of twice those
bytes (dispatch and combine) by 2 processes at once, in the same run.

Timing: a shared-memory barrier (the launch group's: gloo's would let its exit skew into every
figure), then each rank times its own iteration; an iteration's time is the
maximum over ranks; min / median / max over the repeats, the systems alternating round by
round. Ratios of medians: each system / gloo, each / the floor, v2 / v1. Every system's combined
``y`` is checked once, untimed, against the closed form: a token's BF16 row times the number of
ranks it went to (exact in FP32), cast to BF16.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from typing import Any

import numpy as np

from benchmarks import harness

RANKS, HIDDEN, TOPK, EXPERTS = 2, 2048, 8, 64
TOKENS = (16, 128)
SYSTEMS = ("ubep", "v1", "v2", "gloo")


def _inputs(tokens: int, rank: int) -> tuple[Any, Any, Any]:
    import torch

    from ubep import routing

    g = torch.Generator().manual_seed(1000 * tokens + rank)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.from_numpy(routing.uniform_topk(tokens, EXPERTS, TOPK, seed=rank))
    w = torch.rand(tokens, TOPK, generator=g)
    return x, idx.to(torch.int64), w


def _dest_ranks(idx: Any) -> np.ndarray:
    """``[tokens, RANKS]`` bool: whether a token has a pick on each rank."""
    owner = idx.numpy() // (EXPERTS // RANKS)
    return np.stack([(owner == r).any(axis=1) for r in range(RANKS)], axis=1)


class _Gloo:
    """The peers benchmark's torch rank-layout peer (``benchmarks.peers.torch_kernels``) over
    the gloo group: a dispatch, then the received rows straight back as the experts' outputs."""

    def __init__(self, x: Any, idx: Any, w: Any) -> None:
        from benchmarks.peers.gloo_worker import GlooExchange
        from benchmarks.peers.torch_kernels import TorchRankLayoutPeer

        bf16 = np.dtype(np.uint16)  # the peers' storage of BF16 bits
        self.peer = TorchRankLayoutPeer(GlooExchange(), num_experts=EXPERTS, num_topk=TOPK,
                                        max_tokens=x.shape[0], hidden=HIDDEN, x_dtype=bf16,
                                        out_dtype=bf16)
        self.x, self.idx, self.w = x, idx, w

    def __call__(self) -> Any:
        from benchmarks.peers.torch_kernels import as_torch

        got = self.peer.dispatch(self.x, self.idx, self.w)
        return as_torch(self.peer.combine(as_torch(got.recv_x)))


def _systems(tokens: int) -> dict[str, Any]:
    """Each system's iteration (returns the combined ``y``) on this rank's inputs."""
    import torch.distributed as dist

    import ubep
    from ubep import deep_ep

    x, idx, w = _inputs(tokens, dist.get_rank())
    buf = ubep.Buffer(dist.group.WORLD, ubep.BufferConfig(
        max_tokens_per_rank=tokens, hidden=HIDDEN, num_topk=TOPK, num_experts=EXPERTS,
        dtype="bf16", layout="rank"))
    v1 = deep_ep.Buffer(dist.group.WORLD, int(1e8), 0)
    v2 = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=tokens, hidden=HIDDEN,
                               num_topk=TOPK)

    def run_ubep() -> Any:
        res = buf.dispatch(x, idx, w)
        return buf.combine(res.recv_x, res.handle)

    def run_v1() -> Any:
        per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(idx, EXPERTS)
        recv_x, _, _, _, handle, _ = v1.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        return v1.combine(recv_x, handle)[0]

    def run_v2() -> Any:
        recv_x, _, _, handle, _ = v2.dispatch(x, topk_idx=idx, topk_weights=w,
                                              num_experts=EXPERTS)
        return v2.combine(recv_x, handle)[0]

    return {"ubep": run_ubep, "v1": run_v1, "v2": run_v2, "gloo": _Gloo(x, idx, w),
            "_oracle": (x, idx)}


def _check(name: str, y: Any, x: Any, idx: Any) -> None:
    import torch

    times = torch.from_numpy(_dest_ranks(idx).sum(axis=1).astype(np.float32))
    want = (x.float() * times[:, None]).to(torch.bfloat16)
    if not torch.equal(y.view(torch.int16), want.view(torch.int16)):
        raise AssertionError(f"{name}: the combined rows differ from the closed form")


def _rank_main(group: Any, tokens_list: tuple[int, ...], warmup: int,
               per_round: list[int]) -> list[dict[str, list[float]]]:
    """This rank's samples (us) per shape and system, the systems alternating each round."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share this host's cores
    store = dist.FileStore(os.path.join(group.rendezvous, "torch-filestore"), group.num_ranks)
    dist.init_process_group("gloo", store=store, rank=group.rank, world_size=group.num_ranks)
    def barrier() -> None:
        group.barrier(60.0)

    try:
        out = []
        for tokens in tokens_list:
            systems = _systems(tokens)
            x, idx = systems.pop("_oracle")
            for name, fn in systems.items():
                _check(name, fn(), x, idx)
            samples: dict[str, list[float]] = {name: [] for name in systems}
            for repeats in per_round:
                for name, fn in systems.items():
                    ns = harness.time_collective(barrier, fn, warmup, repeats)
                    samples[name] += (ns / 1e3).tolist()
            out.append(samples)
        return out
    finally:
        dist.destroy_process_group()


def _bytes_per_rank(tokens: int) -> int:
    """The larger of the ranks' dispatch bytes (rows x hidden x 2)."""
    return max(int(_dest_ranks(_inputs(tokens, r)[1]).sum()) * HIDDEN * 2 for r in range(RANKS))


def run(tokens: tuple[int, ...], warmup: int, repeats: int, rounds: int) -> dict[str, Any]:
    from ubep.runtime import launch

    per_round = harness.round_repeats(repeats, rounds)
    nbytes = [_bytes_per_rank(t) for t in tokens]
    floor = harness.concurrent_copy(RANKS, [2 * b for b in nbytes], repeats=sum(per_round),
                            warmup=warmup, rounds=len(per_round))
    per_rank = launch(_rank_main, RANKS, tokens, warmup, per_round, timeout_s=1800)
    rows = []
    for i, t in enumerate(tokens):
        row: dict[str, Any] = {"tokens": t, "bytes_per_rank": nbytes[i],
                               "floor": asdict(floor[i])}
        for name in SYSTEMS:
            worst = np.max(np.array([r[i][name] for r in per_rank]), axis=0)
            row[name] = asdict(harness.Stats.from_samples_us(worst.tolist()))
        rows.append(row)
    return {"rows": rows}


def report(result: dict[str, Any]) -> str:
    cols = ["tokens", "KB/rank", "system", "min_us", "med_us", "max_us", "/gloo", "/floor"]
    table: list[list[object]] = []
    lines = []
    for r in result["rows"]:
        for name in SYSTEMS:
            st = r[name]
            table.append([r["tokens"], f"{r['bytes_per_rank'] / 1024:.0f}", name, st["min_us"],
                          st["median_us"], st["max_us"],
                          st["median_us"] / r["gloo"]["median_us"],
                          st["median_us"] / r["floor"]["median_us"]])
        table.append([r["tokens"], "", "floor", r["floor"]["min_us"], r["floor"]["median_us"],
                      r["floor"]["max_us"], "", ""])
        lines.append(f"{r['tokens']} tokens: v2 / v1 (medians) "
                     f"{r['v2']['median_us'] / r['v1']['median_us']:.2f}")
    return "\n".join([harness.format_table(cols, table, float_digits=1), *lines])


def main(argv: list[str] | None = None) -> int:
    ap = harness.rounds_parser(__doc__ or "", "16 tokens only, 10 repeats", "deepep", 60)
    args = ap.parse_args(argv)
    tokens = TOKENS[:1] if args.quick else TOKENS
    repeats = 10 if args.quick else args.repeats
    result, machine = harness.measured(lambda: run(tokens, args.warmup, repeats, args.rounds))
    head = (f"# python -m benchmarks.bench_deepep{' --quick' if args.quick else ''}; "
            f"{RANKS} ranks, hidden {HIDDEN} BF16, top-{TOPK} of {EXPERTS}, {repeats} repeats "
            f"in {args.rounds} rounds, {machine}")
    harness.save_results(args.out, "deepep", head + "\n" + report(result), result)
    return 0

if __name__ == "__main__":
    sys.exit(main())
