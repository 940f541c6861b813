"""The Triton engine on a CUDA GPU: bit-exact checks on the device, then dispatch and combine
timed against the device's copy floor. One table, in under 5 minutes.

    python benchmarks/gpu_check.py [--ranks 2] [--tokens 128] [--hidden 7168] [--repeats 20]

Ranks are processes (``ubep.launch``), rank ``r`` on GPU ``r % device_count`` (ranks sharing a
GPU run time-sliced: correct, and slower than on GPUs of their own); their device buffers are
shared by CUDA IPC handles (``ubep.triton.memory.CudaIpcArena``). Steps:

1. **Checks**: every sync mode x layout, BF16 and FP32 (and a 1-byte dispatch), three calls
   each, every field of every rank's dispatch result and its combine compared bit for bit with
   ``ubep.reference``.
2. **Benchmark** (BF16, ``--sync``, expert layout, uniform top-8 routing over ``8 * ranks``
   experts): per repeat, a barrier, then one dispatch and one combine, each timed on rank 0
   from a device synchronisation to the next (the host's relaunches of waiting kernels
   included: they are part of the engine's call).
3. **Copy floor**: a device-to-device ``torch`` copy of the same bytes as each call moves from
   this rank: ``dispatch bytes = sent rows * hidden * 2`` (one row per valid (token, k) pair,
   rows to this rank itself included), ``combine bytes = received rows * hidden * 2``.

Printed: min / median / max in microseconds over the repeats, the bytes, and the ratio of the
medians to the floor's. Without a CUDA GPU the script says so and runs nothing (the engine's
CPU proof is ``tests/triton``, under Triton's interpreter).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import ubep
from ubep import reference, testing

_MODES = [(s, lay, d) for s in ("sw", "tff", "dc", "sp") for lay in ("expert", "rank")
          for d in ("bf16", "fp32")] + [("tff", "expert", "uint8"), ("dc", "rank", "int8")]


def _storage(t: Any) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    return t.cpu().numpy()


def _engine(group: Any, sync: str, layout: str, dtype: str, tokens: int, hidden: int,
            topk: int) -> Any:
    import torch

    from ubep.triton import TritonConfig, open_engine

    cfg = TritonConfig(max_tokens_per_rank=tokens, hidden=hidden, num_topk=topk,
                       num_experts=8 * group.num_ranks, dtype=dtype, layout=layout, sync=sync,
                       device=f"cuda:{torch.cuda.current_device()}", num_send_programs=16,
                       num_count_programs=4, timeout_s=60.0)
    return open_engine(group, cfg)


def _checks(group: Any) -> list[str]:
    """Every mode, three calls, bit for bit against the reference; the mismatches."""
    r, R = group.rank, group.num_ranks
    errors: list[str] = []
    for sync, layout, dtype in _MODES:
        with _engine(group, sync, layout, dtype, 32, 256, 4) as eng:
            for step, kind in enumerate(("uniform", "hot", "uniform")):
                seed = 7 * step + 1
                tokens = [(5 * q + 11 * step) % 32 + 1 for q in range(R)]
                xs, idxs, ws = testing.inputs(dtype, 8 * R, 4, 256, tokens, seed, kind)
                res = eng.dispatch(xs[r], idxs[r], ws[r])
                refs = reference.dispatch(xs, idxs, ws, 8 * R, layout=layout)
                for f in testing.FIELDS:
                    got = getattr(res, f)
                    got = _storage(got) if f == "recv_x" else got.cpu().numpy()
                    if not testing.same_bits(got, getattr(refs[r], f)):
                        errors.append(f"{sync}:{layout}:{dtype} step {step}: {f} differs")
                outs = [testing.expert_outputs(dtype, ref.recv_x, seed * 10 + q)
                        for q, ref in enumerate(refs)]
                y = eng.combine(outs[r], res.handle)
                if not testing.same_bits(_storage(y), reference.combine(outs, refs)[r]):
                    errors.append(f"{sync}:{layout}:{dtype} step {step}: combine differs")
    return errors


def _now_us() -> float:
    """Microseconds, once the device has finished everything queued."""
    import torch

    torch.cuda.synchronize()
    return time.perf_counter() * 1e6


def _bench(group: Any, sync: str, tokens: int, hidden: int, repeats: int) -> dict[str, Any]:
    import torch

    r, R = group.rank, group.num_ranks
    topk = 8
    xs, idxs, ws = testing.inputs("bf16", 8 * R, topk, hidden, [tokens] * R, 3, "uniform")
    x = torch.from_numpy(xs[r].view(np.int16)).view(torch.bfloat16).cuda()
    times: dict[str, list[float]] = {"dispatch": [], "combine": []}
    with _engine(group, sync, "expert", "bf16", tokens, hidden, topk) as eng:
        res = eng.dispatch(x, idxs[r], ws[r])  # warm-up: compiles every kernel
        eng.combine(res.recv_x, res.handle)
        for _ in range(repeats):
            group.barrier()
            t0 = _now_us()
            res = eng.dispatch(x, idxs[r], ws[r])
            times["dispatch"].append(_now_us() - t0)
            group.barrier()
            t0 = _now_us()
            eng.combine(res.recv_x, res.handle)
            times["combine"].append(_now_us() - t0)
        sent = int((idxs[r] >= 0).sum())
        received = int(res.recv_x.shape[0])
    sizes = {"dispatch": sent * hidden * 2, "combine": received * hidden * 2}
    floor: dict[str, list[float]] = {}
    for name, nbytes in sizes.items():
        src = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        floor[name] = []
        for _ in range(repeats):
            t0 = _now_us()
            dst.copy_(src)
            floor[name].append(_now_us() - t0)
    return {"times": times, "floor": floor, "bytes": sizes}


def _rank(group: Any, sync: str, tokens: int, hidden: int, repeats: int) -> Any:
    import torch

    # one GPU per rank where there are enough (ranks sharing a GPU run time-sliced)
    torch.cuda.set_device(group.rank % torch.cuda.device_count())
    started = time.perf_counter()
    errors = _checks(group)
    checks_s = time.perf_counter() - started
    out = _bench(group, sync, tokens, hidden, repeats)
    return {"errors": errors, "checks_s": checks_s, **out}


def _table(result: dict[str, Any], args: argparse.Namespace, device: str) -> str:
    lines = [f"Triton engine on {device}: {args.ranks} ranks (processes), BF16, "
             f"sync={args.sync}, expert layout, {args.tokens} tokens x top-8 per rank, "
             f"hidden {args.hidden}, {args.repeats} repeats (rank 0)",
             "dispatch bytes = sent rows * hidden * 2; combine bytes = received rows * hidden "
             "* 2; floor = device-to-device torch copy of the same bytes",
             f"{'':<16}{'bytes':>12}{'min us':>10}{'median us':>11}{'max us':>10}"
             f"{'x floor':>9}"]
    for name in ("dispatch", "combine"):
        t = np.array(result["times"][name])
        f = np.array(result["floor"][name])
        nbytes = result["bytes"][name]
        lines.append(f"{name:<16}{nbytes:>12}{t.min():>10.1f}{np.median(t):>11.1f}"
                     f"{t.max():>10.1f}{np.median(t) / np.median(f):>9.2f}")
        lines.append(f"{'  copy floor':<16}{nbytes:>12}{f.min():>10.1f}{np.median(f):>11.1f}"
                     f"{f.max():>10.1f}{1.0:>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sync", default="tff")
    args = p.parse_args(argv)
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as e:
        print(f"gpu_check: {e.name} is not installed: nothing run")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine: nothing run. The Triton engine's proof "
              "here is tests/triton (Triton's interpreter on CPU, every kernel compiled ahead "
              "of time for sm_90 and newer); this script is for a machine with a GPU.")
        return 0
    device = torch.cuda.get_device_name(0)
    results = ubep.launch(_rank, args.ranks, args.sync, args.tokens, args.hidden, args.repeats,
                          timeout_s=290)
    errors = [e for res in results for e in res["errors"]]
    print(f"checks: {len(_MODES)} modes x 3 calls on {args.ranks} ranks, bit-exact against "
          f"ubep.reference: {'FAILED' if errors else 'passed'} "
          f"({results[0]['checks_s']:.0f} s, kernel compilation included)")
    for e in errors:
        print("  " + e)
    print(_table(results[0], args, device))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
