"""Two-batch overlap: a decode step of MoE layers with and without split-phase dispatch/combine.

    python -m benchmarks.bench_overlap --quick                 # 16 tokens, 2 layers (~10 s)
    python -m benchmarks.bench_overlap --out benchmarks/results    # full run (~1-2 min, 2 cores)

The step: ``--layers`` MoE layers shaped like Qwen3-30B-A3B (hidden 2048, 128 experts, top-8,
BF16 rows, layout=expert: DeepEP's low-latency layout) on 2 ranks (``ubep.launch``), two
micro-batches A and B of ``tokens`` tokens per rank. Per layer and micro-batch:

* **attention** (stand-in): ``q = h @ Wq [2048, n]``, ``o = (q mod 4) @ Wo [n, 2048]``, then
  ``h_attn = (h + o) mod 8 - 4``. Every value is a small integer in float32, so every sum is
  exact: the result does not depend on BLAS's summation order or thread count, only the time
  does. The width ``n`` is calibrated (per token count, in the ranks, before timing) so that one
  micro-batch-layer's attention takes about as long as its dispatch + combine (both the
  minimum over repeats: the undisturbed cost). The router and experts add their own time on
  top (reported), so a micro-batch's compute is somewhat more than its communication;
* **router**: integer logits ``h_attn @ Wg [2048, 128]``, top-8 (ties by lower expert id),
  softmax weights; ``x`` = ``h_attn`` in BF16 (exact: small integers);
* **experts** (cheap, per row): the rows of odd experts are negated (XOR of the BF16 sign bit),
  those of even experts pass unchanged;
* **residual**: ``h = (h_attn + rint(y)) mod 8 - 4`` with ``y`` the combine output.

Schedules (one step = every layer for both micro-batches; every rank runs the same):

* ``serial``: blocking calls, micro-batch A's layer, then B's;
* ``overlap``: DeepEP's two-batch overlap with ``return_recv_hook=True``, per layer
  ``attn(A); dA = dispatch(A); attn(B); rA = dA.hook(); dB = dispatch(B); expert(rA);
  cA = combine(A); rB = dB.hook(); expert(rB); cB = combine(B); yA = cA.hook();
  yB = cB.hook()``. Never more than two calls are in flight on the Buffer;
* ``overlap_x``: the same, with each combine hook moved to just before that micro-batch's next
  attention (after the last layer: at the end), so B's combine is in flight during the next
  layer's ``attn(A)``: the order ``python -m benchmarks.torch_decode --overlap`` runs in;
* ``compute``: the serial step without dispatch/combine (experts read the rows and residuals
  the ``y`` the serial step received, recorded once);
* ``comm``: only the serial step's dispatch/combine calls, on its recorded inputs.

floor = max(compute, comm) (medians); hidden = serial - overlap. The overlapped and serial
outputs of every timed iteration are compared bit for bit inside the ranks, and the serial
outputs once against the same step run in one process on ``ubep.reference`` (the oracle).

Skew (``--skews``): ``none``; ``rank1``: rank 1 runs its attention matmuls twice (always the
slower rank); ``alternate``: rank 0 does so for micro-batch A and rank 1 for B (each rank is the
slow one once per layer, as when the micro-batches' sequences differ per rank); ``experts``: the
same alternating extra time (one more attention-sized matmul pair), but spent before the
experts, i.e. between a dispatch's hook and the combine (an expert load imbalance). Outputs do
not change with skew (the extra matmuls compute values that are thrown away or the same).

What can overlap here: a rank is one process on one core (``num_cores=1``: no engine threads)
and BLAS is pinned to one thread (``ubep.launch`` sets ``OPENBLAS_NUM_THREADS=1``; recorded), so
a row copy is CPU work on the same core as the compute. Overlap cannot run a copy beside a
matmul; it can only fill time a rank would spend *waiting* (for a peer's rows, for a slower
peer, for a wake-up) with the other micro-batch's compute.

Timing: barrier, each rank times its own step (``harness.time_collective``), an iteration's time
is the maximum over ranks; min / median / max over ``--repeats`` split over ``--rounds`` passes
through all cases (``harness.round_repeats``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from benchmarks.harness import (
    Stats,
    format_table,
    int_list,
    machine_since,
    round_repeats,
    save_results,
    time_collective,
)

HIDDEN = 2048
NUM_EXPERTS = 128
NUM_TOPK = 8
NUM_RANKS = 2
MICRO = ("A", "B")
SKEWS = ("none", "rank1", "alternate", "experts")
SCHEDULES = ("serial", "overlap", "overlap_x", "compute", "comm")
SKEW_REPEATS = 2  # the slow side runs its attention matmuls this many times
WIDTH_STEP = 16  # attention widths are multiples of this
CALIBRATION_WIDTHS = (64, 512)  # compute time is fitted as a line through these two widths
SEED = 15


@dataclass(frozen=True)
class Case:
    tokens: int  # per micro-batch per rank
    skew: str
    layers: int


@dataclass(frozen=True)
class LayerWeights:
    """One layer's stand-in weights: small integers (-1, 0, 1) in float32."""

    wq: np.ndarray  # [HIDDEN, n]
    wo: np.ndarray  # [n, HIDDEN]
    wg: np.ndarray  # [HIDDEN, NUM_EXPERTS]


# --------------------------------------------------------------------------- the model
def make_weights(layers: int, width: int, seed: int = SEED) -> list[LayerWeights]:
    """The same on every rank (seeded by layer and width)."""
    out = []
    for layer in range(layers):
        rng = np.random.default_rng([seed, layer, width])

        def ternary(*shape: int, rng: np.random.Generator = rng) -> np.ndarray:
            return rng.integers(-1, 2, size=shape).astype(np.float32)

        out.append(LayerWeights(ternary(HIDDEN, width), ternary(width, HIDDEN),
                                ternary(HIDDEN, NUM_EXPERTS)))
    return out


def initial_state(tokens: int, rank: int, micro: int, seed: int = SEED) -> np.ndarray:
    """``[tokens, HIDDEN]`` float32 integers in [-4, 4]: one rank's micro-batch entering layer 0."""
    rng = np.random.default_rng([seed, 1000 + rank, micro, tokens])
    return rng.integers(-4, 4, size=(tokens, HIDDEN), endpoint=True).astype(np.float32)


def attention(h: np.ndarray, lw: LayerWeights, repeats: int = 1) -> np.ndarray:
    """The attention stand-in (module doc). ``repeats > 1`` redoes the matmuls (skew): the
    same values, more time."""
    for _ in range(repeats):
        q = h @ lw.wq  # |q| <= 4 * 2048: exact in float32 in any summation order
        o = _wrap(q, 3) @ lw.wo  # |o| <= 3 * n: exact
    return _wrap(h + o, 7) - 4.0


def _wrap(a: np.ndarray, mask: int) -> np.ndarray:
    """``a mod (mask + 1)`` of float32 integers, as float32 (``mask + 1`` a power of two; an
    int32 AND: float ``np.remainder`` costs ~40 ns an element)."""
    return (a.astype(np.int32) & np.int32(mask)).astype(np.float32)


def route(h_attn: np.ndarray, lw: LayerWeights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x BF16 bits uint16, topk_idx int64, topk_weights float32)`` of one micro-batch."""
    logits = h_attn @ lw.wg  # integers, exact
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :NUM_TOPK].astype(np.int64)
    top = np.take_along_axis(logits, idx, axis=1).astype(np.float64)
    e = np.exp((top - top[:, :1]) / 64.0)
    w = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    return to_bf16(h_attn), idx, w


def experts(recv_x: np.ndarray, recv_expert: np.ndarray) -> np.ndarray:
    """Every received row through its expert (expert layout: ``recv_expert`` = global id): odd
    experts negate the row, even ones pass it on (one XOR of the BF16 sign bit: exact, cheap)."""
    sign = ((np.asarray(recv_expert, dtype=np.int64) & 1) << 15).astype(np.uint16)
    return np.bitwise_xor(recv_x, sign[:, None])


def residual(h_attn: np.ndarray, y: np.ndarray) -> np.ndarray:
    return _wrap(h_attn + np.rint(from_bf16(y)), 7) - 4.0


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits; exact for the small integers the model carries (low bits zero)."""
    return (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> np.uint32(16)).astype(
        np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def attention_repeats(skew: str, rank: int, micro: int) -> int:
    """How many times this rank runs micro-batch ``micro``'s attention matmuls (module doc)."""
    if skew not in SKEWS:
        raise ValueError(f"skew={skew!r}: must be one of {SKEWS}")
    slow = (skew == "rank1" and rank == 1) or (skew == "alternate" and rank == micro)
    return SKEW_REPEATS if slow else 1


def expert_burns(skew: str, rank: int, micro: int) -> int:
    """How many extra attention-sized matmul pairs this rank runs before micro-batch ``micro``'s
    experts (the ``experts`` skew: an expert load imbalance, alternating like ``alternate``)."""
    return SKEW_REPEATS - 1 if skew == "experts" and rank == micro else 0


def reference_step(tokens: int, weights: Sequence[LayerWeights],
                   num_ranks: int = NUM_RANKS) -> list[list[np.ndarray]]:
    """The step for every rank in one process on ``ubep.reference``: ``[rank][micro]`` final
    ``h``. Micro-batches are independent, so their order does not matter."""
    from ubep import reference

    out = [[initial_state(tokens, r, m) for m in range(len(MICRO))] for r in range(num_ranks)]
    for lw in weights:
        for m in range(len(MICRO)):
            h_attn = [attention(out[r][m], lw) for r in range(num_ranks)]
            routed = [route(h, lw) for h in h_attn]
            refs = reference.dispatch([a[0] for a in routed], [a[1] for a in routed],
                                      [a[2] for a in routed], NUM_EXPERTS, layout="expert")
            outs = [experts(ref.recv_x, ref.recv_topk_idx) for ref in refs]
            ys = reference.combine(outs, refs)
            for r in range(num_ranks):
                out[r][m] = residual(h_attn[r], ys[r])
    return out


# --------------------------------------------------------------------------- one rank
class _Step:
    """One case on one rank: the schedules as callables, and what the serial step recorded."""

    def __init__(self, buf: Any, rank: int, case: Case, weights: list[LayerWeights]) -> None:
        self.buf, self.rank, self.case, self.weights = buf, rank, case, weights
        self.h0 = [initial_state(case.tokens, rank, m) for m in range(len(MICRO))]
        self.reps = [attention_repeats(case.skew, rank, m) for m in range(len(MICRO))]
        self.burns = [expert_burns(case.skew, rank, m) for m in range(len(MICRO))]
        # per (layer, micro): dispatch inputs, received rows + expert ids, expert outputs, y
        self.sent: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
        self.recv: list[list[tuple[np.ndarray, np.ndarray]]] = []
        self.outs: list[list[np.ndarray]] = []
        self.ys: list[list[np.ndarray]] = []
        self.expected = self._record()

    def _record(self) -> list[np.ndarray]:
        h = list(self.h0)
        for lw in self.weights:
            sent, recv, outs, ys = [], [], [], []
            for m in range(len(MICRO)):
                h_attn = attention(h[m], lw)
                x, idx, w = route(h_attn, lw)
                res = self.buf.dispatch(x, idx, w, copy=True)
                out = experts(res.recv_x, res.recv_topk_idx)
                y = self.buf.combine(out, res.handle)
                h[m] = residual(h_attn, y)
                sent.append((x, idx, w))
                recv.append((res.recv_x, np.array(res.recv_topk_idx)))
                outs.append(out)
                ys.append(y)
            self.sent.append(sent)
            self.recv.append(recv)
            self.outs.append(outs)
            self.ys.append(ys)
        return h

    def _experts(self, micro: int, h_attn: np.ndarray, lw: LayerWeights, recv_x: np.ndarray,
                 recv_expert: np.ndarray) -> np.ndarray:
        for _ in range(self.burns[micro]):
            attention(h_attn, lw)  # the experts skew: time, no effect on the values
        return experts(recv_x, recv_expert)

    def serial(self) -> list[np.ndarray]:
        buf, h = self.buf, list(self.h0)
        for lw in self.weights:
            for m in range(len(MICRO)):
                h_attn = attention(h[m], lw, self.reps[m])
                res = buf.dispatch(*route(h_attn, lw))
                y = buf.combine(self._experts(m, h_attn, lw, res.recv_x, res.recv_topk_idx),
                                res.handle)
                h[m] = residual(h_attn, y)
        return h

    def overlap(self) -> list[np.ndarray]:
        """DeepEP's two-batch schedule, layer by layer (both combine hooks end the layer)."""
        buf, (ra, rb) = self.buf, self.reps
        h_a, h_b = self.h0
        for lw in self.weights:
            a_attn = attention(h_a, lw, ra)
            d_a = buf.dispatch(*route(a_attn, lw), return_recv_hook=True)
            b_attn = attention(h_b, lw, rb)
            r_a = d_a.hook()
            d_b = buf.dispatch(*route(b_attn, lw), return_recv_hook=True)
            out_a = self._experts(0, a_attn, lw, r_a.recv_x, r_a.recv_topk_idx)
            c_a = buf.combine(out_a, r_a.handle, return_recv_hook=True)
            r_b = d_b.hook()
            out_b = self._experts(1, b_attn, lw, r_b.recv_x, r_b.recv_topk_idx)
            c_b = buf.combine(out_b, r_b.handle, return_recv_hook=True)
            h_a = residual(a_attn, c_a.hook())
            h_b = residual(b_attn, c_b.hook())
        return [h_a, h_b]

    def overlap_x(self) -> list[np.ndarray]:
        """:meth:`overlap` with each combine hook moved to just before that micro-batch's next
        attention: B's combine stays in flight during the next layer's ``attn(A)`` (what
        ``python -m benchmarks.torch_decode --overlap`` does)."""
        buf, (ra, rb) = self.buf, self.reps
        h_a, h_b = self.h0
        c_a = c_b = None  # combine calls in flight, with the h_attn they add to
        for lw in self.weights:
            if c_a is not None:
                h_a = residual(c_a[1], c_a[0].hook())
            a_attn = attention(h_a, lw, ra)
            d_a = buf.dispatch(*route(a_attn, lw), return_recv_hook=True)
            if c_b is not None:
                h_b = residual(c_b[1], c_b[0].hook())
            b_attn = attention(h_b, lw, rb)
            r_a = d_a.hook()
            d_b = buf.dispatch(*route(b_attn, lw), return_recv_hook=True)
            out_a = self._experts(0, a_attn, lw, r_a.recv_x, r_a.recv_topk_idx)
            c_a = (buf.combine(out_a, r_a.handle, return_recv_hook=True), a_attn)
            r_b = d_b.hook()
            out_b = self._experts(1, b_attn, lw, r_b.recv_x, r_b.recv_topk_idx)
            c_b = (buf.combine(out_b, r_b.handle, return_recv_hook=True), b_attn)
        assert c_a is not None and c_b is not None
        return [residual(c_a[1], c_a[0].hook()), residual(c_b[1], c_b[0].hook())]

    def compute(self) -> list[np.ndarray]:
        h = list(self.h0)
        for layer, lw in enumerate(self.weights):
            for m in range(len(MICRO)):
                h_attn = attention(h[m], lw, self.reps[m])
                route(h_attn, lw)
                self._experts(m, h_attn, lw, *self.recv[layer][m])
                h[m] = residual(h_attn, self.ys[layer][m])
        return h

    def comm(self) -> list[np.ndarray]:
        buf = self.buf
        for layer in range(len(self.weights)):
            for m in range(len(MICRO)):
                res = buf.dispatch(*self.sent[layer][m])
                buf.combine(self.outs[layer][m], res.handle)
        return self.expected


def _config(max_tokens: int, engine: str, sync: str, background: bool | None = None) -> Any:
    from ubep.buffer import BufferConfig

    # one core per rank, on the calling thread: 2 ranks on this 2-core host (module doc);
    # background: split-phase second halves on the engine's background core (None: when the
    # host has a hardware thread to spare per rank, BufferConfig.background)
    return BufferConfig(max_tokens_per_rank=max_tokens, hidden=HIDDEN, num_topk=NUM_TOPK,
                        num_experts=NUM_EXPERTS, dtype="bf16", layout="expert", engine=engine,
                        sync=sync, num_cores=1, threads=False, background=background)


def _min_us(group: Any, fn: Callable[[], object], repeats: int) -> float:
    """Minimum over ``repeats`` of the per-iteration maximum over ranks (barrier-started): the
    undisturbed cost, which outside load (this host is shared) only ever inflates."""
    ns = np.array(group.allgather(time_collective(group.barrier, fn, 2, repeats).tolist()))
    return float(ns.max(axis=0).min()) / 1e3


def _attention_us(group: Any, h: np.ndarray, width: int, repeats: int) -> float:
    lw = make_weights(1, width)[0]
    return _min_us(group, lambda: attention(h, lw), repeats)


def calibrate(group: Any, buf: Any, tokens: int, repeats: int) -> dict[str, Any]:
    """The attention width that makes one micro-batch-layer's attention take about its
    dispatch + combine: both measured here, attention fitted as a line in the width through two
    widths. Every rank gets the same answer (it is computed from gathered numbers)."""
    probe = _Step(buf, group.rank, Case(tokens, "none", 1), make_weights(1, WIDTH_STEP))
    comm_us = _min_us(group, probe.comm, repeats) / len(MICRO)
    h = probe.h0[0]
    other_us = (_min_us(group, probe.compute, repeats) / len(MICRO)
                - _attention_us(group, h, WIDTH_STEP, repeats))
    (w0, w1) = CALIBRATION_WIDTHS
    t0, t1 = (_attention_us(group, h, w, repeats) for w in CALIBRATION_WIDTHS)
    slope = max((t1 - t0) / (w1 - w0), 1e-9)
    width = max(WIDTH_STEP, round((w0 + (comm_us - t0) / slope) / WIDTH_STEP) * WIDTH_STEP)
    return {"tokens": tokens, "comm_us_per_micro_layer": comm_us,
            "attention_us_at": {str(w0): t0, str(w1): t1},
            "attention_us": t0 + (width - w0) * slope,
            "router_experts_residual_us": max(other_us, 0.0), "width": width}


def _collecting(fn: Callable[[], list[np.ndarray]],
                into: list[list[np.ndarray]]) -> Callable[[], None]:
    """``fn`` keeping its outputs (checked after the timed loop, outside the timing)."""
    return lambda: into.append(fn())


def _rank_main(group: Any, cases: list[Case], widths: dict[int, int], warmup: int,
               per_round: list[int], engine: str, sync: str,
               calibration_repeats: int, background: bool | None = None) -> dict[str, Any]:
    from ubep.buffer import Buffer

    blas = {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    samples = [{s: [] for s in SCHEDULES} for _ in cases]
    mismatches = [{s: 0 for s in SCHEDULES} for _ in cases]
    with Buffer(group, _config(max(c.tokens for c in cases), engine, sync, background)) as buf:
        calibration = []
        for tokens in sorted({c.tokens for c in cases}):
            if tokens not in widths:
                calibration.append(calibrate(group, buf, tokens, calibration_repeats))
                widths[tokens] = int(calibration[-1]["width"])
        steps = [_Step(buf, group.rank, c, make_weights(c.layers, widths[c.tokens]))
                 for c in cases]
        for repeats in per_round:
            for i, step in enumerate(steps):
                for sched in SCHEDULES:
                    got: list[list[np.ndarray]] = []
                    ns = time_collective(group.barrier, _collecting(getattr(step, sched), got),
                                         warmup, repeats)
                    samples[i][sched] += (ns / 1e3).tolist()
                    # outside the timed calls: every iteration's outputs, bit for bit
                    mismatches[i][sched] += sum(
                        not all(np.array_equal(a, b) for a, b in zip(h, step.expected, strict=True))
                        for h in got)
    return {"samples": samples, "mismatches": mismatches, "widths": widths,
            "calibration": calibration, "expected": [s.expected for s in steps], "blas": blas}


# --------------------------------------------------------------------------- the parent
def run(tokens: Sequence[int], skews: Sequence[str], layers: int, warmup: int, repeats: int,
        rounds: int, widths: dict[int, int] | None = None, engine: str = "asp", sync: str = "sp",
        calibration_repeats: int = 20, timeout_s: float = 1800.0,
        background: bool | None = None) -> dict[str, Any]:
    """Measure every case; returns ``{"rows", "calibration", "blas", "oracle_ok"}``."""
    from ubep.runtime import launch

    for s in skews:
        attention_repeats(s, 0, 0)  # a bad skew name fails here, not in the ranks
    cases = [Case(t, s, layers) for t in tokens for s in skews]
    per_rank = launch(_rank_main, NUM_RANKS, cases, dict(widths or {}), warmup,
                      round_repeats(repeats, rounds), engine, sync, calibration_repeats,
                      background, timeout_s=timeout_s)
    used = per_rank[0]["widths"]
    oracle: dict[int, list[list[np.ndarray]]] = {}
    rows = []
    for i, case in enumerate(cases):
        if case.tokens not in oracle:
            oracle[case.tokens] = reference_step(case.tokens, make_weights(layers,
                                                                           used[case.tokens]))
        want = oracle[case.tokens]
        row: dict[str, Any] = {**asdict(case), "width": used[case.tokens],
                               "exact_vs_reference": all(
                                   np.array_equal(a, b) for r in range(NUM_RANKS)
                                   for a, b in zip(per_rank[r]["expected"][i], want[r],
                                                   strict=True)),
                               "mismatches": {s: sum(p["mismatches"][i][s] for p in per_rank)
                                              for s in SCHEDULES}}
        for sched in SCHEDULES:
            worst = np.max(np.array([p["samples"][i][sched] for p in per_rank]), axis=0)
            row[sched] = asdict(Stats.from_samples_us(worst.tolist()))
        rows.append(derive(row))
    return {"rows": rows, "calibration": per_rank[0]["calibration"],
            "blas": [p["blas"] for p in per_rank],
            "oracle_ok": all(r["exact_vs_reference"] and not any(r["mismatches"].values())
                             for r in rows)}


STATS = ("median", "min")


def derive(row: dict[str, Any]) -> dict[str, Any]:
    """hidden, floor and the ratios, from the medians and from the minima (the undisturbed
    cost: outside load only ever adds time)."""
    out = dict(row)
    for stat in STATS:
        t = {s: row[s][f"{stat}_us"] for s in SCHEDULES}
        floor = max(t["compute"], t["comm"])
        out[stat] = {"hidden_us": t["serial"] - t["overlap"], "floor_us": floor,
                     "overlap_over_floor": t["overlap"] / floor,
                     "overlap_over_serial": t["overlap"] / t["serial"],
                     "overlap_x_over_serial": t["overlap_x"] / t["serial"],
                     "serial_over_floor": t["serial"] / floor}
    return out


def header(result: dict[str, Any]) -> str:
    st, cal = result["settings"], result["calibration"]
    lines = [
        f"decode step: {st['layers']} MoE layers (hidden {HIDDEN}, {NUM_EXPERTS} experts, top-"
        f"{NUM_TOPK}, BF16, layout=expert, {st['engine']}+{st['sync']}, 1 core per rank), "
        f"{NUM_RANKS} ranks, 2 micro-batches of `tokens` tokens per rank.",
        "serial = blocking calls, A then B per layer; overlap = DeepEP's two-batch schedule with",
        "  return_recv_hook; overlap_x = the same with the combine hooks moved to just before",
        "  the micro-batch's next attention (as ubep decode --overlap); compute = the step",
        "  without dispatch/combine; comm = only the calls;",
        "  floor = max(compute, comm); hidden = serial - overlap. Per case the median and the",
        "  minimum (us) over the repeats of the per-iteration maximum over ranks (outside load",
        "  only adds time, so the minimum is the undisturbed cost); max in the JSON.",
        "exact: every timed serial/overlap/compute iteration's outputs equal the recorded serial",
        "  step bit for bit on every rank, and that equals the step on ubep.reference.",
        "skew: rank1 = rank 1's attention x2 always; alternate = rank 0's x2 on A, rank 1's on B;",
        "  experts = that alternating extra time spent before the experts instead.",
        "compute stand-in: attention width n calibrated so one micro-batch-layer's attention ~",
        "  its dispatch+combine (minima, us per micro-batch-layer):" if cal else
        "  its dispatch+combine (here: widths given, no calibration)",
        *(f"  {c['tokens']} tokens: comm {c['comm_us_per_micro_layer']:.0f} -> n={c['width']}, "
          f"attention {c['attention_us']:.0f} + router/experts/residual "
          f"{c['router_experts_residual_us']:.0f}" for c in cal),
        f"BLAS threads per rank: {result['blas']}",
    ]
    return "\n".join(lines)


def table(result: dict[str, Any]) -> str:
    cols = ["tokens", "skew", "n", "stat", "serial_us", "overlap_us", "overlap_x_us",
            "compute_us", "comm_us", "hidden_us", "floor_us", "ovl/floor", "ovl/serial",
            "ovl_x/serial", "exact"]
    rows = []
    for r in result["rows"]:
        exact = "yes" if r["exact_vs_reference"] and not any(r["mismatches"].values()) else "NO"
        rows += [[r["tokens"], r["skew"], r["width"], stat,
                  *(r[s][f"{stat}_us"] for s in SCHEDULES), r[stat]["hidden_us"],
                  r[stat]["floor_us"], r[stat]["overlap_over_floor"],
                  r[stat]["overlap_over_serial"], r[stat]["overlap_x_over_serial"], exact]
                 for stat in STATS]
    return format_table(cols, rows, float_digits=2)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2), 4.5))
    bars = SCHEDULES
    width = 0.8 / (len(bars) + 1)
    x = np.arange(len(rows))
    for j, name in enumerate(bars):
        ax.bar(x + j * width, [r[name]["median_us"] / 1e3 for r in rows], width, label=name,
               yerr=[[(r[name]["median_us"] - r[name]["min_us"]) / 1e3 for r in rows],
                     [(r[name]["max_us"] - r[name]["median_us"]) / 1e3 for r in rows]],
               capsize=2)
    ax.bar(x + len(bars) * width, [r["median"]["floor_us"] / 1e3 for r in rows], width,
           color="black",
           label="floor max(compute, comm)")
    ax.set_xticks(x + width * len(bars) / 2,
                  [f"{r['tokens']} tok\n{r['skew']}" for r in rows])
    ax.set(ylabel="step time (ms), median, min-max", title=(
        f"two-batch overlap, {result['settings']['layers']} layers, {NUM_RANKS} ranks"))
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out: str | None) -> None:
    st, machine = result["settings"], result["machine"]
    text = (header(result) + "\n\n" + table(result) + f"\n\n({machine['seconds']:.0f} s, "
            f"{st['repeats']} repeats in {st['rounds']} rounds after {st['warmup']} warm-up each; "
            f"load {machine['load_before']:.2f} -> {machine['load_after']:.2f}, "
            f"{machine['cpus']} cpus)")
    save_results(out, "overlap", text, result, plot)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 tokens, 2 layers (~10 s)")
    parser.add_argument("--tokens", default=None, help="comma-separated tokens per micro-batch")
    parser.add_argument("--skews", default=None, help=f"comma list of {', '.join(SKEWS)}")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None,
                        help="attention width n for every token count (skips calibration)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--engine", default="asp")
    parser.add_argument("--sync", default="sp")
    parser.add_argument("--background", choices=("auto", "on", "off"), default="auto",
                        help="split-phase second halves on the engine's background core "
                             "(BufferConfig.background; auto: when a hardware thread is spare)")
    parser.add_argument("--out", default=None, help="write overlap.{txt,json,png} here")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    tokens = int_list(args.tokens, [16] if args.quick else [16, 64])
    skews = args.skews.split(",") if args.skews else list(SKEWS)
    layers = args.layers or (2 if args.quick else 4)
    # many short rounds: load from outside that comes and goes lands on every schedule alike
    repeats = args.repeats or (10 if args.quick else 60)
    rounds = args.rounds or (2 if args.quick else 12)
    widths = {t: args.width for t in tokens} if args.width else None
    load = os.getloadavg()[0]
    start = time.monotonic()
    result = run(tokens, skews, layers, args.warmup, repeats, rounds, widths, args.engine,
                 args.sync, calibration_repeats=10 if args.quick else 30, timeout_s=args.timeout,
                 background={"auto": None, "on": True, "off": False}[args.background])
    result["settings"] = {"tokens": tokens, "skews": skews, "layers": layers, "repeats": repeats,
                          "rounds": rounds, "warmup": args.warmup, "engine": args.engine,
                          "sync": args.sync, "background": args.background}
    result["machine"] = machine_since(load, start)
    write_outputs(result, args.out)
    return 0 if result["oracle_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
