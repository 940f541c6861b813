"""The part of a peer worker that does not depend on the transport: read a plan, time, write.

Runs inside a peer venv (numpy, and torch where it imports; see kernels.py and
torch_kernels.py). Every case runs once per local-work variant: ``torch`` (torch ops, what an MoE
user writes) when torch imports, then ``numpy`` (kernels.py). The parent
(benchmarks/peers/launch.py or tests/benchmarks/test_peers.py) writes ``plan.json`` and one
``<input>.r<rank>.npz`` per rank into a work directory; every rank of the worker reads the plan,
runs each case and writes back:

* ``<case>.times.npz`` (rank 0): per variant ``V``, ``V.dispatch_ns`` and ``V.combine_ns`` (none
  for ``torch+q``: its combine is ``torch``'s), one
  entry per timed iteration, each the maximum over ranks of that iteration (barrier before
  every iteration), and ``V.rows_sent`` ``[num_ranks]``, the payload rows each rank sent in
  dispatch; once per case, ``dispatch_exchange_ns`` and ``combine_exchange_ns``, the payload
  exchange alone (the already-packed rows' Alltoallv / all_to_all_single: the transport's share);
* with ``"check": true``, ``<case>.<V>.r<rank>.out.npz`` on every rank: the dispatch result and
  the combine output of variant ``V``, for comparison with ubep.reference in the parent;
* ``worker.json`` (rank 0): the library's version string, the variants run, the settings.

Plan format::

    {"warmup": 5, "repeats": 20, "rounds": 1, "check": false,
     "cases": [{"id": "c0", "input": "i0", "layout": "rank", "num_experts": 64,
                "out_dtype": "uint16", "seed": 7}]}

An input file holds ``x`` (storage dtype), ``topk_idx`` (int64) and ``topk_weights`` (float32),
for an FP8 case (``"quant": "e4m3"`` and ``"hidden"`` in the case) also ``x_bf16``: then ``x`` is
the quantised rows packed as they travel (``uint8``, values then scales), which the ``torch`` and
``numpy`` variants move, and ``x_bf16`` the BF16 tokens the ``torch+q`` variant quantises itself
(torch ops, torch_kernels.TorchFp8Quantiser) before the same dispatch; and optionally
``expert_out`` (the combine input, in receive order; only the parent knows the
reference row count, so it is given in check mode). Without it the worker makes a seeded one of
the right row count after the first dispatch, outside the timed region.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import round_repeats, time_collective
from benchmarks.peers.kernels import Exchange, PeerDispatch, decode_fields, make_peer

__all__ = ["run_plan", "time_op"]


def time_op(ex: Exchange, fn: Callable[[], object], warmup: int, repeats: int) -> np.ndarray:
    """Per-iteration time in ns, the maximum over ranks, of ``repeats`` calls after ``warmup``.

    A barrier precedes every iteration so all ranks start together; each rank times only its
    own call, and one reduction at the end takes the maximum per iteration (a reduction inside
    the loop would add its own latency to the next iteration's skew).
    """
    return ex.max_over_ranks(time_collective(ex.barrier, fn, warmup, repeats))


def _synthetic_expert_out(rows: int, hidden: int, dtype: np.dtype, seed: int) -> np.ndarray:
    # Finite values of modest magnitude in any float storage type (BF16 as uint16 bits).
    values = np.random.default_rng(seed).standard_normal((rows, hidden), dtype=np.float32)
    if dtype == np.uint16:
        return (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return values.astype(dtype)


def local_work_variants() -> tuple[str, ...]:
    """The local-work kernels this venv can run: torch first (what an MoE user writes) when
    torch imports, numpy always (the extra row)."""
    try:
        import torch
    except ImportError:
        return ("numpy",)
    torch.set_num_threads(1)  # one rank = one thread of compute, as for ubep's ranks
    return ("torch", "numpy")


QUANT_VARIANT = "torch+q"  # an FP8 case's torch peer that quantises BF16 x itself first


def case_variants(case: dict[str, Any], variants: tuple[str, ...]) -> tuple[str, ...]:
    """The variants of one case: the venv's, and for an FP8 case (``"quant"`` in the plan)
    with torch, also the one that quantises before it dispatches (the whole FP8 dispatch)."""
    if case.get("quant") and "torch" in variants:
        return (*variants, QUANT_VARIANT)
    return variants


def _make(variant: str, layout: str, ex: Exchange, **kw: Any) -> Any:
    if variant == QUANT_VARIANT:
        from benchmarks.peers.torch_kernels import make_torch_quantising_peer

        return make_torch_quantising_peer(layout, ex, **kw)
    if variant == "torch":
        from benchmarks.peers.torch_kernels import make_torch_peer

        return make_torch_peer(layout, ex, **kw)
    return make_peer(layout, ex, **kw)


def _run_variant(
    ex: Exchange, workdir: Path, case: dict[str, Any], plan: dict[str, Any], repeats: int,
    times: dict[str, list[np.ndarray]], variant: str, data: Any, time_exchange: bool,
) -> None:
    quantises = variant == QUANT_VARIANT
    # An FP8 case's input holds both x (the packed rows the other variants move) and x_bf16
    # (what the quantising variant starts from); combine rows are hidden (BF16) wide.
    x_np = data["x_bf16"] if quantises else data["x"]
    topk_idx_np, w_np = data["topk_idx"], data["topk_weights"]
    hidden = int(case.get("hidden", x_np.shape[1]))
    out_dtype = np.dtype(case["out_dtype"])
    peer = _make(
        variant,
        case["layout"],
        ex,
        num_experts=int(case["num_experts"]),
        num_topk=int(topk_idx_np.shape[1]),
        max_tokens=int(case.get("max_tokens", x_np.shape[0])),
        hidden=hidden,
        x_dtype=x_np.dtype,
        out_dtype=out_dtype,
        x_width=int(x_np.shape[1]),
    )
    # The caller's tensors in the peer's own type (torch views), outside the timed region.
    x, topk_idx, topk_weights = peer.prepare(x_np, topk_idx_np, w_np)
    first: PeerDispatch = peer.dispatch(x, topk_idx, topk_weights)
    if "expert_out" in data:
        expert_out_np = np.ascontiguousarray(data["expert_out"])
    else:
        expert_out_np = _synthetic_expert_out(
            first.num_recv_rows, hidden, out_dtype, int(case.get("seed", 0)) + ex.rank
        )
    (expert_out,) = peer.prepare(expert_out_np)
    if plan.get("check"):
        fields: dict[str, Any] = decode_fields(
            first, case["layout"], ex.rank, int(topk_idx_np.shape[1])
        )
        fields.update(
            recv_x=first.recv_x.copy(),
            num_recv_tokens_per_expert=first.num_recv_tokens_per_expert,
        )
        fields["combined"] = peer.combine(expert_out).copy()
        np.savez(workdir / f"{case['id']}.{variant}.r{ex.rank}.out.npz", **fields)
    warmup = int(plan["warmup"])
    times.setdefault(f"{variant}.dispatch_ns", []).append(
        time_op(ex, lambda: peer.dispatch(x, topk_idx, topk_weights), warmup, repeats))
    if time_exchange:  # the same bytes whatever the local work: timed once per case
        times.setdefault("dispatch_exchange_ns", []).append(
            time_op(ex, peer.payload_exchange, warmup, repeats))
    # Combine reuses the last dispatch's bookkeeping (the "handle"); same routing every time.
    # The quantising variant's combine is the torch variant's, already timed.
    if not quantises:
        times.setdefault(f"{variant}.combine_ns", []).append(
            time_op(ex, lambda: peer.combine(expert_out), warmup, repeats))
    if time_exchange:
        times.setdefault("combine_exchange_ns", []).append(
            time_op(ex, peer.combine_exchange, warmup, repeats))
    # Rows each rank sent (one-hot max = an all-gather): the parent checks the byte formula.
    rows_sent = np.zeros(ex.num_ranks)
    rows_sent[ex.rank] = first.num_sent_rows
    times[f"{variant}.rows_sent"] = [ex.max_over_ranks(rows_sent)]


def _run_case(
    ex: Exchange, workdir: Path, case: dict[str, Any], plan: dict[str, Any], repeats: int,
    times: dict[str, list[np.ndarray]], variants: tuple[str, ...],
) -> None:
    with np.load(workdir / f"{case['input']}.r{ex.rank}.npz") as npz:
        data = {name: npz[name] for name in npz.files}
    # The exchange alone is timed by the first variant that moves the given rows as they are
    # (the quantising one times no combine, whose exchange would repeat).
    timer = next(v for v in variants if v != QUANT_VARIANT)
    for variant in variants:
        # One variant's buffers at a time (the 4-rank shapes hold several hundred MB each).
        _run_variant(ex, workdir, case, plan, repeats, times, variant, data,
                     time_exchange=variant == timer)


def run_plan(ex: Exchange, workdir: Path, library_version: str) -> None:
    """Run every case of ``workdir/plan.json`` on this rank (all ranks call it together)."""
    plan = json.loads((workdir / "plan.json").read_text())
    variants = local_work_variants()
    if ex.rank == 0:
        info = {"library_version": library_version, "num_ranks": ex.num_ranks,
                "variants": list(variants)}
        (workdir / "worker.json").write_text(json.dumps(info))
    times: dict[str, dict[str, list[np.ndarray]]] = {c["id"]: {} for c in plan["cases"]}
    for i, repeats in enumerate(round_repeats(int(plan["repeats"]), int(plan.get("rounds", 1)))):
        for j, case in enumerate(plan["cases"]):
            # Which variant goes first alternates over cases and rounds, so a drift in outside
            # load (or a warm cache) does not favour one of them everywhere.
            mine = case_variants(case, variants)
            order = mine if (i + j) % 2 == 0 else mine[::-1]
            _run_case(ex, workdir, case, plan, repeats, times[case["id"]], order)
            ex.barrier()
    if ex.rank == 0:
        for case_id, got in times.items():
            np.savez(workdir / f"{case_id}.times.npz",
                     **{k: np.concatenate(v) for k, v in got.items()})
