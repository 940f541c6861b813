"""Bit-exactness of every peer variant against ``ubep.reference``, run by the benchmark itself.

Before a peer is timed at a rank count, its worker runs a check plan in its own venv (the same
worker, kernels and launcher as the timed run): small inputs of every payload type, both
routings, with masked slots and a rank with no tokens, both layouts, every local-work variant
the venv has (torch and numpy), and FP8 rows (values + scales, quantised by the parent, and by
the ``torch+q`` variant itself in torch ops: both must equal ``ubep.quant.quantize`` of the
reference's received BF16 rows). Every rank's dispatch fields and combine output must equal the
reference's bit for bit; a variant that differs is not timed (the run reports why), since its
time would be that of other work. tests/benchmarks/test_peers.py runs the same comparison at 4
ranks.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peers import launch, workload
from benchmarks.peers.driver import case_variants
from ubep import quant, reference
from ubep.routing import hot_experts_topk, uniform_topk
from ubep.testing import FIELDS

__all__ = ["PeerCheckError", "assert_same", "check_inputs", "check_peer", "expected"]

NUM_EXPERTS = workload.NUM_EXPERTS
NUM_TOPK = workload.NUM_TOPK
CHECK_TIMEOUT_S = 180.0
#: the dispatch fields a peer returns: all of ubep's but the R x R matrix of every source's rows
#: to every rank, which an all-to-all of counts never shows any one rank
PEER_FIELDS = tuple(f for f in FIELDS if f != "num_sent_rows_per_rank")


class PeerCheckError(RuntimeError):
    """A peer variant's result differs from ubep.reference; the message says where."""


def _bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    vals = rng.standard_normal(shape, dtype=np.float32)
    return (vals.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def make_check_inputs(
    tokens: list[int], hidden: int, dtype: str, routing: str, mask_prob: float, seed: int,
    out_dtype: str,
) -> workload.Inputs:
    """Per-rank inputs (token counts may differ) with expert outputs per layout.

    FP32 expert outputs make the check sensitive to the float32 summation order (a BF16 result
    would round most order differences away).
    """
    rng = np.random.default_rng(seed)
    xs, idxs, ws = [], [], []
    for r, t in enumerate(tokens):
        xs.append(_bf16(rng, (t, hidden)) if dtype in ("bf16", "fp8")
                  else rng.integers(0, 256, (t, hidden), dtype=np.uint8))
        if dtype == "fp8" and t:
            xs[-1][0, :quant.QUANT_BLOCK] = 0  # a zero block: the floor scale
        if routing == "uniform":
            idx = uniform_topk(t, NUM_EXPERTS, NUM_TOPK, seed=seed + r, mask_prob=mask_prob)
        else:
            idx = hot_experts_topk(t, NUM_EXPERTS, NUM_TOPK, hot_experts=3, hot_share=0.6,
                                   seed=seed + r, mask_prob=mask_prob)
        idxs.append(idx)
        ws.append(rng.random((t, NUM_TOPK), dtype=np.float32))
    shape = workload.Shape(len(tokens), max(tokens), hidden, dtype, routing)
    inp = workload.Inputs(shape, xs, idxs, ws)
    for layout in ("expert", "rank"):
        ref = reference.dispatch(xs, idxs, ws, NUM_EXPERTS, layout=layout)
        inp.expert_outs[layout] = [
            _bf16(rng, (len(res.recv_x), hidden)) if out_dtype == "bf16"
            else rng.standard_normal((len(res.recv_x), hidden), dtype=np.float32)
            for res in ref
        ]
    return inp


# tokens per rank, hidden, x dtype, routing, mask probability, seed, combine dtype. A 1-byte x
# combines in any float type (reference, "Types"): FP32 here, BF16 in the timed run.
CHECK_SETS = [
    ([23, 0, 17, 9], 64, "bf16", "uniform", 0.15, 3, "bf16"),
    ([12, 31, 5, 20], 48, "uint8", "hot", 0.0, 11, "fp32"),
    # FP8: BF16 tokens that travel quantised (two scale blocks per row), combine in BF16
    ([9, 14, 0, 21], 256, "fp8", "uniform", 0.1, 5, "bf16"),
]


def check_inputs(num_ranks: int) -> list[workload.Inputs]:
    """The check sets cut to ``num_ranks`` ranks (1 to 4)."""
    return [make_check_inputs(tokens[:num_ranks], h, d, rt, m, s, o)
            for tokens, h, d, rt, m, s, o in CHECK_SETS]


def expected(inp: workload.Inputs, layout: str) -> tuple[list[Any], list[np.ndarray]]:
    """The reference's per-rank dispatch results and combine outputs. For an FP8 shape the
    expected ``recv_x`` is ``ubep.quant.quantize`` of the reference's received BF16 rows,
    packed as the rows travel (values, then the scales' bytes): equal bytes = equal values and
    equal scales. Combine takes BF16 expert outputs either way."""
    ref = reference.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, NUM_EXPERTS, layout=layout)
    y = reference.combine(inp.expert_outs[layout], ref)
    if inp.shape.quantised:
        ref = [dataclasses.replace(res, recv_x=workload.pack_fp8(res.recv_x)) for res in ref]
    return ref, y


def assert_same(got: dict[str, np.ndarray], ref: Any, ref_y: np.ndarray, where: str) -> None:
    """Raise PeerCheckError unless every field and the combine output match bit for bit."""
    for name in PEER_FIELDS:
        want = np.asarray(getattr(ref, name))
        have = np.asarray(got[name])
        if have.shape != want.shape:
            raise PeerCheckError(f"{where} {name}: shape {have.shape} != {want.shape}")
        if have.dtype.kind != want.dtype.kind:
            raise PeerCheckError(f"{where} {name}: dtype {have.dtype} vs {want.dtype}")
        # Bit patterns, not values: -0.0 vs +0.0 or NaN payloads must match too.
        if have.tobytes() != want.astype(have.dtype).tobytes():
            raise PeerCheckError(f"{where} {name} differs from ubep.reference")
    y = np.asarray(got["combined"])
    if y.dtype != ref_y.dtype or y.tobytes() != ref_y.tobytes():
        raise PeerCheckError(f"{where} combine output differs from ubep.reference")


def check_peer(system: str, num_ranks: int, scratch: Path) -> list[str]:
    """Run the check plan on ``system`` at ``num_ranks``; returns the variants that matched.

    Raises PeerCheckError naming the first variant, case and rank that differ.
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"check-{system}{num_ranks}-", dir=scratch))
    inputs = check_inputs(num_ranks)
    settings = launch.Settings(warmup=0, repeats=1, timeout_s=CHECK_TIMEOUT_S)
    cases = launch.write_workdir(workdir, inputs, settings, check=True)
    info = launch.run_peer(system, num_ranks, workdir, CHECK_TIMEOUT_S)
    venv_variants = tuple(str(v) for v in info["variants"])
    variants: list[str] = []
    for case in cases:
        ref, ref_y = expected(inputs[case["index"]], case["layout"])
        # The worker's own count of rows each rank sent is the reference's (the byte formula).
        sent_by_ref = [int(sum((res.recv_src_rank == s).sum() for res in ref))
                       for s in range(num_ranks)]
        mine = case_variants(case, venv_variants)
        variants += [v for v in mine if v not in variants]
        with np.load(workdir / f"{case['id']}.times.npz") as times:
            sent = {v: times[f"{v}.rows_sent"].astype(np.int64).tolist() for v in mine}
        for variant in mine:
            if sent[variant] != sent_by_ref:
                raise PeerCheckError(f"{system}-{variant} x{num_ranks} {case['id']}: rows sent "
                                  f"{sent[variant]} != the reference's {sent_by_ref}")
            for r in range(num_ranks):
                with np.load(workdir / f"{case['id']}.{variant}.r{r}.out.npz") as data:
                    got = {name: data[name] for name in data.files}
                assert_same(got, ref[r], ref_y[r],
                            f"{system}-{variant} x{num_ranks} {case['id']} rank {r}")
    return variants
