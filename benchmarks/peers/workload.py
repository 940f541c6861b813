"""The peers benchmark's workload: shapes, the seeded inputs every system gets (the same
tensors), and the bytes a rank sends (the table's byte formula). Imported by the parent
(benchmarks/peers/launch.py), by ubep's ranks (ubep_runner.py) and by benchmarks/bench_dist.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ITEMSIZE", "NUM_EXPERTS", "NUM_TOPK", "QUANT", "STORAGE", "Inputs", "Shape",
           "bytes_per_rank", "hot_ids", "make_inputs", "pack_fp8", "peer_arrays", "row_bytes",
           "rows_sent"]

NUM_EXPERTS = 64
NUM_TOPK = 8
HOT_EXPERTS = 4  # hot-expert routing: half of all picks go to these 4 experts
HOT_SHARE = 0.5
STORAGE = {"bf16": np.dtype(np.uint16), "uint8": np.dtype(np.uint8)}
ITEMSIZE = {"bf16": 2, "uint8": 1}
# "fp8": x is BF16; what moves is each token quantised (ubep.quant, E4M3, one float32 scale per
# 128 channels), values then scales in one row of ubep.quant.row_bytes(hidden) bytes.
QUANT = "e4m3"


@dataclass(frozen=True)
class Shape:
    """One workload: ranks x tokens per rank x hidden x payload type x routing."""

    num_ranks: int
    tokens_per_rank: int
    hidden: int
    dtype: str  # dispatch payload: "bf16", "uint8" (1-byte, e.g. W8A8) or "fp8" (BF16 x, sent
    # quantised: E4M3 values + float32 scales per row, see QUANT)
    routing: str  # "uniform" or "hot"

    @property
    def combine_dtype(self) -> str:
        # Combine reduces in float: a 1-byte dispatch combines in BF16, as DeepEP's FP8/BF16.
        return self.dtype if self.dtype == "bf16" else "bf16"

    @property
    def quantised(self) -> bool:
        """x is BF16 and travels as FP8 rows (values + scales)."""
        return self.dtype == "fp8"

    @property
    def label(self) -> str:
        s = self
        return f"{s.num_ranks}r {s.tokens_per_rank}t {s.hidden}x{s.dtype} {s.routing}"


@dataclass(frozen=True)
class Inputs:
    """Per-rank tensors of one shape (identical for every system)."""

    shape: Shape
    xs: list[np.ndarray]
    topk_idxs: list[np.ndarray]
    topk_weights: list[np.ndarray]
    expert_outs: dict[str, list[np.ndarray]] = field(default_factory=dict)  # per layout (check)


def hot_ids(seed: int = 1234) -> np.ndarray:
    """The hot experts, the same on every rank (a model's hot experts are global)."""
    return np.sort(np.random.default_rng(seed).choice(NUM_EXPERTS, HOT_EXPERTS, replace=False))


def make_inputs(shape: Shape, seed: int = 0) -> Inputs:
    """Seeded tensors for every rank: BF16 normal values or random bytes, softmax weights."""
    from ubep.routing import hot_experts_topk, uniform_topk

    xs, idxs, ws = [], [], []
    for r in range(shape.num_ranks):
        rng = np.random.default_rng([seed, r, shape.hidden, shape.tokens_per_rank])
        t, h = shape.tokens_per_rank, shape.hidden
        if shape.dtype in ("bf16", "fp8"):
            vals = rng.standard_normal((t, h), dtype=np.float32)
            xs.append((vals.view(np.uint32) >> np.uint32(16)).astype(np.uint16))
        else:
            xs.append(rng.integers(0, 256, (t, h), dtype=np.uint8))
        rseed = seed * 1000 + r
        if shape.routing == "uniform":
            idxs.append(uniform_topk(t, NUM_EXPERTS, NUM_TOPK, seed=rseed))
        else:
            idxs.append(
                hot_experts_topk(
                    t, NUM_EXPERTS, NUM_TOPK, hot_experts=HOT_EXPERTS, hot_share=HOT_SHARE,
                    hot_ids=hot_ids(), seed=rseed,
                )
            )
        logits = rng.standard_normal((t, NUM_TOPK), dtype=np.float32)
        w = np.exp(logits)
        ws.append((w / w.sum(axis=1, keepdims=True)).astype(np.float32))
    return Inputs(shape, xs, idxs, ws)


def rows_sent(inputs: Inputs, layout: str) -> np.ndarray:
    """Payload rows each rank sends in dispatch (= rows it gets back in combine)."""
    local = NUM_EXPERTS // inputs.shape.num_ranks
    out = []
    for idx in inputs.topk_idxs:
        if layout == "expert":
            out.append(int((idx >= 0).sum()))
        else:
            owner = np.where(idx >= 0, idx // local, -1)
            ranks = range(inputs.shape.num_ranks)
            out.append(sum(int((owner == d).any(axis=1).sum()) for d in ranks))
    return np.asarray(out, dtype=np.int64)


def row_bytes(dtype: str, hidden: int) -> int:
    """Bytes of one payload row: hidden x bytes per element; for "fp8" the quantised row,
    ``hidden`` E4M3 values then ``hidden // 128`` float32 scales (= ubep.quant.row_bytes)."""
    if dtype == "fp8":
        from ubep.quant import row_bytes as quant_row_bytes

        return quant_row_bytes(hidden)
    return hidden * ITEMSIZE[dtype]


def bytes_per_rank(inputs: Inputs, layout: str, op: str) -> float:
    """Mean over ranks of rows sent x bytes per row (the op's payload type)."""
    dtype = inputs.shape.dtype if op == "dispatch" else inputs.shape.combine_dtype
    return float(rows_sent(inputs, layout).mean()) * row_bytes(dtype, inputs.shape.hidden)


def pack_fp8(x: np.ndarray) -> np.ndarray:
    """BF16 rows ``[t, hidden]`` quantised (ubep.quant.quantize, QUANT) and packed as they travel:
    ``uint8 [t, row_bytes]``, the E4M3 values then the float32 scales' bytes. The peers' input
    for an "fp8" shape (a caller that quantised already); the receiver's rows are the same."""
    from ubep.quant import quantize

    values, scales = quantize(x, QUANT)
    return np.ascontiguousarray(np.concatenate([values, scales.view(np.uint8)], axis=1))


def peer_arrays(inputs: Inputs, rank: int) -> dict[str, np.ndarray]:
    """One rank's input file for a peer worker (benchmarks/peers/driver.py): ``x`` as it moves
    (for "fp8" the packed quantised rows, plus ``x_bf16``, the tokens before quantisation),
    ``topk_idx`` and ``topk_weights``."""
    x = inputs.xs[rank]
    out = {"x": x, "topk_idx": inputs.topk_idxs[rank], "topk_weights": inputs.topk_weights[rank]}
    if inputs.shape.quantised:
        out |= {"x": pack_fp8(x), "x_bf16": x}
    return out
