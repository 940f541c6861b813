"""The Triton engine on a CUDA GPU through the user's doors: the contract's conformance suite
on the device, bit-exact checks of the engine, ``ubep.Buffer(transport="triton")`` and
``deep_ep.Buffer(..., transport="triton")`` on CUDA tensors, then dispatch and combine of both
doors timed against the device's copy floor. One table, in under 5 minutes.

    python benchmarks/gpu_check.py [--ranks 2] [--tokens 128] [--hidden 7168] [--repeats 20]

Ranks are processes (``ubep.launch``), rank ``r`` on GPU ``r % device_count`` (ranks sharing a
GPU run time-sliced: correct, and slower than on GPUs of their own); their device buffers are
shared by CUDA IPC handles (``ubep.triton.memory.CudaIpcArena``). Steps:

0. **Conformance** (``--conformance``, on by default where ``tests/`` is at hand): the
   contract's suite, world ``"triton"``, in a pytest subprocess: every Buffer it builds runs on
   the device (the row's ``engine_device``).
1. **Checks**: every sync mode x layout, BF16 and FP32 (and a 1-byte dispatch), three calls
   each, every field of every rank's dispatch result and its combine compared bit for bit with
   ``ubep.reference``; then the same through ``ubep.Buffer(transport="triton")`` on CUDA
   tensors (results and handle on the device), and ``deep_ep.Buffer(..., transport="triton")``
   (normal dispatch of CUDA tensors, identity experts, combine: each token back once per
   rank it met, checked exactly).
2. **Benchmark** (BF16, ``--sync``, expert layout, uniform top-8 routing over ``8 * ranks``
   experts), each door (``ubep.Buffer``, ``deep_ep.Buffer``) in turn, alternated per repeat:
   a barrier, then one dispatch and one combine, each timed on rank 0 from a device
   synchronisation to the next (the host's relaunches of waiting kernels included: they are
   part of the call).
3. **Copy floor**: a device-to-device ``torch`` copy of the same bytes as each call moves from
   this rank: ``dispatch bytes = sent rows * hidden * 2`` (one row per valid (token, k) pair,
   rows to this rank itself included), ``combine bytes = received rows * hidden * 2``.

Printed: min / median / max in microseconds over the repeats, the bytes, and the ratio of the
medians to the floor's. Without a CUDA GPU the script says so and skips the device parts; its
door checks (:func:`door_checks`) run on CPU tensors under Triton's interpreter in
``tests/triton/test_gpu_check.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
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


def _buffer(group: Any, sync: str, tokens: int, hidden: int, topk: int) -> Any:
    cfg = ubep.BufferConfig(max_tokens_per_rank=tokens, hidden=hidden, num_topk=topk,
                            num_experts=8 * group.num_ranks, dtype="bf16", sync=sync,
                            transport="triton", timeout_s=60.0)
    return ubep.Buffer(group, cfg)


def _facade(group: Any, tokens: int) -> Any:
    from ubep import deep_ep

    return deep_ep.Buffer(group, num_nvl_bytes=1 << 20, max_tokens_per_rank=tokens,
                          transport="triton", timeout_s=60.0, explicitly_destroy=True)


def _bf16(a: np.ndarray, device: Any) -> Any:
    import torch

    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)


def _tensors(r: int, R: int, tokens: list[int], hidden: int, topk: int, seed: int,
             device: Any) -> tuple[Any, ...]:
    """Every rank's numpy inputs and this rank's as tensors of ``device``."""
    import torch

    xs, idxs, ws = testing.inputs("bf16", 8 * R, topk, hidden, tokens, seed, "uniform")
    return (xs, idxs, ws, _bf16(xs[r], device), torch.from_numpy(idxs[r]).to(device),
            torch.from_numpy(ws[r]).to(device))


def door_checks(group: Any, device: str, sync: str = "tff", hidden: int = 256) -> list[str]:
    """``ubep.Buffer`` and ``deep_ep.Buffer`` with ``transport="triton"`` on tensors of
    ``device``: results (and the Buffer's handle) on the device, bit for bit against
    ``ubep.reference`` and the facade's closed form; the mismatches."""
    import torch

    r, R, topk, errors = group.rank, group.num_ranks, 4, []
    tokens = [(5 * q + 3) % 16 + 1 for q in range(R)]
    xs, idxs, ws, x, idx, w = _tensors(r, R, tokens, hidden, topk, 5, device)
    refs = reference.dispatch(xs, idxs, ws, 8 * R)
    with _buffer(group, sync, 16, hidden, topk) as buf:
        res = buf.dispatch(x, idx, w)
        for f in testing.FIELDS:
            got = getattr(res, f)
            if not (isinstance(got, torch.Tensor) and got.device == torch.device(device)):
                errors.append(f"ubep.Buffer: {f} is not a tensor of {device}")
                continue
            got = _storage(got) if f == "recv_x" else got.cpu().numpy()
            if not testing.same_bits(got, getattr(refs[r], f)):
                errors.append(f"ubep.Buffer: {f} differs from the reference")
        if not isinstance(res.handle.send_dst_row, torch.Tensor):
            errors.append("ubep.Buffer: the handle of a call of tensors is not on the device")
        outs = [testing.expert_outputs("bf16", ref.recv_x, 50 + q) for q, ref in enumerate(refs)]
        y = buf.combine(_bf16(outs[r], device), res.handle)
        if not testing.same_bits(_storage(y), reference.combine(outs, refs)[r]):
            errors.append("ubep.Buffer: combine differs from the reference")
    ep = _facade(group, 16)
    try:
        per_rank, _, per_expert, in_rank, _ = ep.get_dispatch_layout(idx, 8 * R)
        recv_x, _, _, _, handle, _ = ep.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        y, _, _ = ep.combine(recv_x, handle)  # identity experts: once per rank it met
        want = (x.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)
        if not torch.equal(y.cpu().view(torch.int16), want.cpu().view(torch.int16)):
            errors.append("deep_ep.Buffer: combine of identity experts differs from "
                          "x * ranks met")
    finally:
        ep.destroy()
    return errors


def _now_us() -> float:
    """Microseconds, once the device has finished everything queued."""
    import torch

    torch.cuda.synchronize()
    return time.perf_counter() * 1e6


def _timed(group: Any, times: list[float], call: Any) -> Any:
    group.barrier()
    t0 = _now_us()
    got = call()
    times.append(_now_us() - t0)
    return got


def _bench(group: Any, sync: str, tokens: int, hidden: int, repeats: int) -> dict[str, Any]:
    """Both doors, alternated per repeat, and the copy floor of the same bytes."""
    import torch

    r, R, topk = group.rank, group.num_ranks, 8
    _, idxs, _, x, idx, w = _tensors(r, R, [tokens] * R, hidden, topk, 3, "cuda")
    doors = ("ubep.Buffer", "deep_ep.Buffer")
    times = {d: {"dispatch": [], "combine": []} for d in doors}
    ep = _facade(group, tokens)
    try:
        layout = ep.get_dispatch_layout(idx, 8 * R)
        per_rank, _, per_expert, in_rank, _ = layout
        with _buffer(group, sync, tokens, hidden, topk) as buf:
            def own(t: dict[str, list[float]]) -> int:
                res = _timed(group, t["dispatch"], lambda: buf.dispatch(x, idx, w))
                _timed(group, t["combine"], lambda: buf.combine(res.recv_x, res.handle))
                return int(res.recv_x.shape[0])

            def facade(t: dict[str, list[float]]) -> int:
                got = _timed(group, t["dispatch"], lambda: ep.dispatch(
                    x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                    is_token_in_rank=in_rank, num_tokens_per_expert=per_expert))
                _timed(group, t["combine"], lambda: ep.combine(got[0], got[4]))
                return int(got[0].shape[0])

            runs = {"ubep.Buffer": own, "deep_ep.Buffer": facade}
            for d in doors:  # warm-up: compiles every kernel
                runs[d]({"dispatch": [], "combine": []})
            for _ in range(repeats):
                for d in doors:
                    received = runs[d](times[d])
    finally:
        ep.destroy()
    sent = int((idxs[r] >= 0).sum())
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
    errors = _checks(group) + door_checks(group, f"cuda:{torch.cuda.current_device()}")
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
    for door, times in result["times"].items():
        lines.append(f"{door}:")
        for name in ("dispatch", "combine"):
            t = np.array(times[name])
            f = np.array(result["floor"][name])
            nbytes = result["bytes"][name]
            lines.append(f"{name:<16}{nbytes:>12}{t.min():>10.1f}{np.median(t):>11.1f}"
                         f"{t.max():>10.1f}{np.median(t) / np.median(f):>9.2f}")
    for name in ("dispatch", "combine"):
        f = np.array(result["floor"][name])
        nbytes = result["bytes"][name]
        lines.append(f"{'copy ' + name:<16}{nbytes:>12}{f.min():>10.1f}{np.median(f):>11.1f}"
                     f"{f.max():>10.1f}{1.0:>9.2f}")
    return "\n".join(lines)


def _conformance(timeout_s: float) -> str:
    """The contract's conformance suite, world ``"triton"``, on the device (a pytest run)."""
    root = Path(__file__).resolve().parent.parent
    suite = root / "tests" / "plane" / "test_conformance.py"
    if not suite.exists():
        return "conformance: tests/ not at hand: skipped"
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", str(suite), "-k",
                               "triton"], cwd=root, capture_output=True, text=True,
                              timeout=timeout_s, env=dict(os.environ), check=False)
    except subprocess.TimeoutExpired:
        return f"conformance: not finished in {timeout_s:.0f} s"
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    verdict = "passed" if proc.returncode == 0 else "FAILED"
    return f"conformance (world triton, on the device): {verdict}: {tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sync", default="tff")
    p.add_argument("--conformance", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as e:
        print(f"gpu_check: {e.name} is not installed: nothing run")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine: the device parts (conformance, checks, "
              "timings) are skipped. The Triton engine's proof here is tests/triton (Triton's "
              "interpreter on CPU, every kernel compiled ahead of time for sm_90 and newer; "
              "this script's door checks on CPU tensors: tests/triton/test_gpu_check.py).")
        return 0
    device = torch.cuda.get_device_name(0)
    if args.conformance:
        print(_conformance(120.0))
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
