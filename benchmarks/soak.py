"""Soak: thousands of dispatch/combine calls with random shapes, skews and modes, every one
checked bit for bit against ``ubep.reference``.

    python -m benchmarks.soak                      # 10,000 iterations (2, 3 and 4 ranks)
    python -m benchmarks.soak --quick              # 500 iterations, < 60 s on 2 cores
    python -m benchmarks.soak --iterations 2000 --seed 7 --ranks 2,3

The run is a list of *blocks*, all drawn from ``--seed``: one Buffer per block (engine x sync x
layout x dtype, hidden, top-k, experts, max tokens per rank, cores per rank, zero-copy
combine or not), then a series of calls on it, each with its own tokens per rank (0 to the
maximum, sometimes 0 on a rank), routing (uniform with masked slots, Zipf, hot experts, every
token to one expert) and payload seed. Consecutive calls on one Buffer are the point: reused
receive regions, epochs, parity slots and SP resets are what a long run exercises.

Every rank rebuilds all ranks' inputs from the seed, runs the call and compares its own result
with the reference (every dispatch field and the combined output, bit for bit: a NaN result is
the canonical quiet NaN on both sides, ``ubep.dtypes.CANONICAL_NAN``); a progress bar runs on
rank 0. The exit status is 0 only if every call matched. ``--json`` writes the findings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ubep import reference, routing
from ubep.buffer import Buffer, BufferConfig
from ubep.runtime import launch

__all__ = ["Block", "Call", "make_blocks", "run_soak"]

_STORAGE: dict[str, Any] = {"bf16": np.uint16, "fp16": np.float16, "fp32": np.float32,
                            "int8": np.int8, "uint8": np.uint8}
_FIELDS = ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert",
           "recv_src_rank", "recv_src_token", "recv_src_k")


@dataclass(frozen=True)
class Call:
    tokens: tuple[int, ...]  # per rank
    routing: str  # uniform / zipf / hot / one
    seed: int


@dataclass(frozen=True)
class Block:
    engine: str
    sync: str
    layout: str
    dtype: str
    hidden: int
    num_topk: int
    num_experts: int
    max_tokens: int
    num_cores: int
    zero_copy: bool
    calls: tuple[Call, ...] = field(default=())

    def config(self) -> BufferConfig:
        return BufferConfig(
            max_tokens_per_rank=self.max_tokens, hidden=self.hidden, num_topk=self.num_topk,
            num_experts=self.num_experts, dtype=self.dtype, layout=self.layout,
            engine=self.engine, sync=self.sync, num_cores=self.num_cores, timeout_s=60.0,
        )

    def mode(self) -> str:
        return f"{self.engine}:{self.sync}:{self.layout}:{self.dtype}"


def make_blocks(num_ranks: int, iterations: int, seed: int, calls_per_block: int = 12) -> list[
        Block]:
    """Random blocks totalling ``iterations`` calls (deterministic in ``seed``)."""
    rng = np.random.default_rng([seed, num_ranks])
    blocks: list[Block] = []
    left = iterations
    while left > 0:
        sync = str(rng.choice(["sw", "tff", "dc", "sp"]))
        dtypes = ["bf16", "fp16", "fp32"] + ([] if sync == "sp" else ["int8", "uint8"])
        local = int(rng.choice([1, 2, 4]))
        num_experts = local * num_ranks
        num_topk = int(rng.integers(1, min(8, num_experts) + 1))
        max_tokens = int(rng.choice([1, 4, 16, 33, 64]))
        n = int(min(left, calls_per_block))
        calls = []
        for _ in range(n):
            tokens = rng.integers(0, max_tokens + 1, size=num_ranks)
            if rng.random() < 0.15:
                tokens[rng.integers(num_ranks)] = 0
            if rng.random() < 0.2:
                tokens[:] = max_tokens
            kind = str(rng.choice(["uniform", "zipf", "hot", "one"], p=[0.4, 0.25, 0.25, 0.1]))
            calls.append(Call(tuple(int(t) for t in tokens), kind, int(rng.integers(1 << 30))))
        blocks.append(Block(
            engine=str(rng.choice(["asp", "bsp"])),
            sync=sync,
            layout=str(rng.choice(["expert", "rank"])),
            dtype=str(rng.choice(dtypes)),
            hidden=int(rng.choice([8, 56, 256, 520, 2048])),
            num_topk=num_topk,
            num_experts=num_experts,
            max_tokens=max_tokens,
            num_cores=int(rng.choice([1, 2, 3])),
            zero_copy=bool(rng.random() < 0.3),
            calls=tuple(calls),
        ))
        left -= n
    return blocks


def _payload(rng: np.random.Generator, dtype: str, tokens: int, hidden: int) -> np.ndarray:
    if dtype == "bf16":
        bits = rng.integers(0, 1 << 16, size=(tokens, hidden), dtype=np.uint16)
        bits[bits == 0x7FA5] = 0x3F80  # any bits but the SP sentinel (NaN/Inf included)
        return bits
    if dtype == "fp16":
        bits = rng.integers(0, 1 << 16, size=(tokens, hidden), dtype=np.uint16)
        bits[bits == 0x7CA5] = 0x3C00
        return bits.view(np.float16)
    if dtype == "fp32":
        bits = rng.integers(0, 1 << 32, size=(tokens, hidden), dtype=np.uint32)
        bits[bits == 0x7FA5A5A5] = 0x3F800000
        return bits.view(np.float32)
    info = np.iinfo(_STORAGE[dtype])
    return rng.integers(info.min, info.max + 1, size=(tokens, hidden), dtype=_STORAGE[dtype])


def _routing(call: Call, rank: int, tokens: int, num_experts: int, num_topk: int) -> np.ndarray:
    seed = call.seed * 1000 + rank
    if call.routing == "zipf":
        return routing.zipf_topk(tokens, num_experts, num_topk, alpha=1.2, seed=seed,
                                 mask_prob=0.05)
    if call.routing == "hot" and num_experts > 1:
        hot = max(1, min(num_experts - 1, 2))
        return routing.hot_experts_topk(tokens, num_experts, num_topk, hot_experts=hot,
                                        hot_share=0.7, seed=seed, mask_prob=0.05)
    if call.routing == "one":
        idx = np.full((tokens, num_topk), -1, np.int64)
        idx[:, 0] = call.seed % num_experts
        return idx
    return routing.uniform_topk(tokens, num_experts, num_topk, seed=seed, mask_prob=0.1)


def _inputs(block: Block, call: Call) -> tuple[list[np.ndarray], list[np.ndarray],
                                               list[np.ndarray]]:
    xs, idxs, ws = [], [], []
    for r, t in enumerate(call.tokens):
        rng = np.random.default_rng([call.seed, r])
        xs.append(_payload(rng, block.dtype, t, block.hidden))
        idxs.append(_routing(call, r, t, block.num_experts, block.num_topk))
        ws.append((rng.standard_normal((t, block.num_topk)) * 2).astype(np.float32))
    return xs, idxs, ws


def _outputs(block: Block, refs: list[Any], seed: int) -> list[np.ndarray]:
    """Expert outputs: recv_x itself (float payloads; NaN/Inf included) or seeded bf16."""
    if block.dtype in ("bf16", "fp16", "fp32"):
        return [np.ascontiguousarray(ref.recv_x) for ref in refs]
    outs = []
    for q, ref in enumerate(refs):
        rng = np.random.default_rng([seed, q, 7])
        outs.append(_payload(rng, "bf16", ref.recv_x.shape[0], block.hidden))
    return outs


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)))


def _worker(group: Any, blocks: list[Block], progress: bool) -> dict[str, Any]:
    r = group.rank
    bar: Any = None
    if progress and r == 0:
        try:
            import threading

            from tqdm import tqdm

            # a thread lock: tqdm's default multiprocessing lock leaks a semaphore per rank
            tqdm.set_lock(threading.RLock())
            bar = tqdm(total=sum(len(b.calls) for b in blocks), unit="call",
                       desc=f"soak {group.num_ranks} ranks", file=sys.stderr, mininterval=0.5)
        except ImportError:
            bar = None
    errors: list[str] = []
    calls = 0
    for bi, block in enumerate(blocks):
        with Buffer(group, block.config()) as buf:
            for ci, call in enumerate(block.calls):
                where = f"block {bi} ({block.mode()} hidden {block.hidden}) call {ci}"
                xs, idxs, ws = _inputs(block, call)
                res = buf.dispatch(xs[r], idxs[r], ws[r])
                refs = reference.dispatch(xs, idxs, ws, block.num_experts, layout=block.layout)
                np.seterr(over="ignore", invalid="ignore")  # NaN/Inf payloads are valid data
                for f in _FIELDS:
                    if not _same(getattr(res, f), getattr(refs[r], f)):
                        errors.append(f"{where}: dispatch {f} differs")
                outs = _outputs(block, refs, call.seed)
                if block.zero_copy:
                    eo = buf.get_combine_buffer(res.handle)
                    eo[...] = outs[r]
                else:
                    eo = outs[r]
                y = buf.combine(eo, res.handle)
                if not _same(y, reference.combine(outs, refs)[r]):
                    errors.append(f"{where}: combine differs")
                calls += 1
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return {"rank": r, "calls": calls, "errors": errors[:50], "num_errors": len(errors)}


def run_soak(iterations: int, ranks: list[int], seed: int, *, progress: bool = True,
             timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run the soak; return ``{"ranks": {R: [per-rank findings]}, "seconds", "ok"}``."""
    share = [iterations // len(ranks) + (i < iterations % len(ranks)) for i in range(len(ranks))]
    out: dict[str, Any] = {"ranks": {}, "blocks": {}, "seconds": {}}
    for num_ranks, n in zip(ranks, share, strict=True):
        if not n:
            continue
        blocks = make_blocks(num_ranks, n, seed)
        t0 = time.monotonic()
        found = launch(_worker, num_ranks, blocks, progress, timeout_s=timeout_s)
        out["seconds"][num_ranks] = time.monotonic() - t0
        out["ranks"][num_ranks] = found
        out["blocks"][num_ranks] = len(blocks)
    out["ok"] = all(f["num_errors"] == 0 for v in out["ranks"].values() for f in v)
    out["calls"] = sum(f["calls"] for v in out["ranks"].values() for f in v[:1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="500 iterations (CI)")
    parser.add_argument("--ranks", default="2,3,4", help="rank counts, comma-separated")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the findings here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    iterations = 500 if args.quick else args.iterations
    ranks = [int(v) for v in args.ranks.split(",")]
    result = run_soak(iterations, ranks, args.seed, progress=not args.no_progress)
    for num_ranks, found in result["ranks"].items():
        bad = sum(f["num_errors"] for f in found)
        print(f"{num_ranks} ranks: {found[0]['calls']} calls in {result['blocks'][num_ranks]} "
              f"buffers, {result['seconds'][num_ranks]:.1f} s, mismatches: {bad}")
        for f in found:
            for e in f["errors"][:10]:
                print(f"  rank {f['rank']}: {e}")
    print("soak:", "PASS" if result["ok"] else "FAIL", f"({result['calls']} calls, seed "
          f"{args.seed})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result | {"settings": vars(args)}, fh, indent=1, default=str)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

