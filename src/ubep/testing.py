"""Seeded inputs and bit-exact comparison with :mod:`ubep.reference`, shared by the tests,
the benchmarks and ``python -m ubep.tools.mpi_selftest`` (which users run on their own MPI
jobs).

Every rank of a check regenerates *all* ranks' inputs from one seed (:func:`inputs`), so each
can compute the reference on its own and compare only its own result (:func:`check_call`).
Comparisons are of raw bytes (:func:`bits`): NaN payloads and ``-0.0`` compare exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import dtypes as _dt
from . import reference, routing
from .modes import FLOAT_DTYPE_NAMES
from .torch_bridge import on_host

__all__ = [
    "FIELDS",
    "any_bits_payload",
    "bits",
    "check_call",
    "compare",
    "defined",
    "expert_outputs",
    "inputs",
    "oracle_options",
    "payload",
    "same_bits",
]

#: The dispatch result's fields a backend must match bit for bit (the handle aside).
FIELDS = ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert",
          "recv_src_rank", "recv_src_token", "recv_src_k", "num_sent_rows_per_rank")


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bytes of an array (or of a tensor's storage, on the host), so NaN payloads and
    -0 compare exactly."""
    return np.ascontiguousarray(on_host(a)).view(np.uint8)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Same shape, same dtype, same bytes (a tensor: of its storage, BF16 as uint16)."""
    a, b = on_host(a), on_host(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(bits(a), bits(b)))


def defined(ref: Any) -> np.ndarray | slice:
    """The rows of reference result ``ref``'s ``recv_x`` that hold a row: all of them, but in
    the ``expert_padded`` layout the first ``num_recv_tokens_per_expert[e]`` of each expert's
    block (the rest an engine leaves as they were)."""
    h = ref.handle
    if h.layout != "expert_padded":
        return slice(None)
    counts = np.asarray(ref.num_recv_tokens_per_expert)
    slots = h.num_recv_rows // max(len(counts), 1)
    return reference.defined_rows(counts, slots)


def compare(res: Any, ref: Any) -> list[str]:
    """The :data:`FIELDS` of dispatch result ``res`` that differ from ``ref``'s, described
    (fields may be tensors of an engine's device: compared as their storage on the host);
    ``recv_x`` on its :func:`defined` rows."""
    bad = []
    for f in FIELDS:
        a, b = on_host(getattr(res, f)), on_host(getattr(ref, f))
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{f}: {a.dtype}{a.shape} vs reference {b.dtype}{b.shape}")
        elif f == "recv_x":
            rows = defined(ref)
            if not np.array_equal(bits(a[rows]), bits(b[rows])):
                bad.append(f"{f}: values differ")
        elif not np.array_equal(bits(a), bits(b)):
            bad.append(f"{f}: values differ")
    return bad


def oracle_options(cfg: Any) -> dict[str, Any]:
    """What :func:`ubep.reference.dispatch` needs of a Buffer's config beyond the layout: the
    padded layout's ``max_tokens``."""
    if cfg.layout == "expert_padded":
        return {"max_tokens": cfg.max_tokens_per_rank}
    return {}


def payload(rng: np.random.Generator, dtype: str, tokens: int, hidden: int) -> np.ndarray:
    """Seeded payload: finite floats of moderate size (never an SP sentinel) or any bytes."""
    storage = _dt.dtype_of(dtype).storage
    if dtype == "bf16":
        raw = rng.integers(0x3000, 0x4F80, size=(tokens, hidden), dtype=np.uint16)
        return raw | (rng.integers(0, 2, size=(tokens, hidden), dtype=np.uint16) << 15)
    if dtype in FLOAT_DTYPE_NAMES:
        return (rng.standard_normal((tokens, hidden)) * 4).astype(storage)
    info = np.iinfo(storage)
    return rng.integers(info.min, info.max + 1, size=(tokens, hidden), dtype=storage)


def any_bits_payload(rng: np.random.Generator, dtype: str, tokens: int,
                     hidden: int) -> np.ndarray:
    """Seeded payload of any bit patterns (NaN and Inf included) but the SP sentinel, which
    becomes 1.0: what a long soak moves."""
    dt = _dt.dtype_of(dtype)
    if dt.sentinel is None:
        return payload(rng, dtype, tokens, hidden)  # every byte pattern already
    raw = rng.integers(0, 1 << (8 * dt.itemsize), size=(tokens, hidden), dtype=dt.bits_dtype)
    one = dt.from_float32(np.ones(1, np.float32)).view(dt.bits_dtype)[0]
    raw[raw == dt.sentinel] = one
    return raw.view(dt.storage)


def inputs(dtype: str, num_experts: int, num_topk: int, hidden: int, tokens: list[int],
           seed: int, kind: str) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per-rank ``x``, ``topk_idx``, ``topk_weights`` (seeded; identical on every rank).

    ``kind``: ``"uniform"`` (10% masked slots), ``"hot"`` (70% of picks on 2 experts) or
    ``"one"`` (every token to expert 0 and nothing else).
    """
    xs, idxs, ws = [], [], []
    for r, t in enumerate(tokens):
        rng = np.random.default_rng([seed, r])
        xs.append(payload(rng, dtype, t, hidden))
        if kind == "one":
            idx = np.full((t, num_topk), -1, dtype=np.int64)
            idx[:, 0] = 0
        elif kind == "hot":
            idx = routing.hot_experts_topk(t, num_experts, num_topk, hot_experts=2,
                                           hot_share=0.7, seed=seed * 1000 + r)
        else:
            idx = routing.uniform_topk(t, num_experts, num_topk, seed=seed * 1000 + r,
                                       mask_prob=0.1)
        idxs.append(idx)
        ws.append(rng.random((t, num_topk), dtype=np.float32))
    return xs, idxs, ws


def expert_outputs(dtype: str, recv_x: np.ndarray, seed: int) -> np.ndarray:
    """Expert outputs for ``recv_x``: itself for float payloads, seeded BF16 for 1-byte ones."""
    if dtype in FLOAT_DTYPE_NAMES:
        return np.ascontiguousarray(recv_x)
    rng = np.random.default_rng(seed)
    return payload(rng, "bf16", recv_x.shape[0], recv_x.shape[1])


def check_call(buf: Any, xs: list[np.ndarray], idxs: list[np.ndarray], ws: list[np.ndarray],
               seed: int, *, zero_copy: bool = False) -> list[str]:
    """One dispatch and one combine on ``buf`` (this rank: ``buf.rank``) with every rank's
    inputs given, compared with the reference bit for bit; returns the mismatches. Expert
    outputs: :func:`expert_outputs` seeded ``seed * 10 + rank``; ``zero_copy``: written into
    ``buf.get_combine_buffer`` first."""
    cfg, r = buf.config, buf.rank
    res = buf.dispatch(xs[r], idxs[r], ws[r])
    routing: dict[str, Any] = {} if cfg.expert_map is None else {
        "expert_map": cfg.expert_map, "topology": buf.group.topology}  # redundant experts
    m2n = getattr(cfg, "expert_ranks", None)
    if m2n is not None:  # M2N: the oracle takes the roles (and the logical num_experts)
        routing = {"expert_ranks": m2n, "topology": buf.group.topology}
    refs = reference.dispatch(xs, idxs, ws, cfg.num_experts, layout=cfg.layout, **routing,
                              **oracle_options(cfg))
    errors = compare(res, refs[r])
    outs = [expert_outputs(cfg.dtype, ref.recv_x, seed * 10 + q) for q, ref in enumerate(refs)]
    if zero_copy:
        eo = buf.get_combine_buffer(res.handle)
        eo[...] = outs[r]
    else:
        eo = outs[r]
    y = buf.combine(eo, res.handle)
    y_ref = reference.combine(outs, refs)[r]
    y = on_host(y)
    if y.dtype != y_ref.dtype or not np.array_equal(bits(y), bits(y_ref)):
        errors.append("combine differs")
    return errors
