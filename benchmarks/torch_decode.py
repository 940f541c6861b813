"""``ubep decode`` (or ``python -m benchmarks.torch_decode``): end-to-end decode TPOT of a
Qwen3-30B-A3B-shaped MoE model on 2 ranks.

The model is Hugging Face transformers' Qwen3-MoE with the MoE layer shape of Qwen3-30B-A3B
(hidden 2048, 128 experts, top-8, 32 query / 4 KV heads of 128) but fewer layers, a narrower
expert FFN and a small vocabulary so that it fits this machine; weights are random (seeded),
generated on every rank identically, each rank keeping only its 64 experts. Every rank decodes
its own batch (data-parallel attention, expert-parallel MoE) and the MoE layers move tokens
either through ubep (``experts_implementation="ubep"``) or through a baseline written the usual
way with ``torch.distributed`` gloo ``all_to_all_single`` (counts, expert ids, rows there; rows
back). Both run in the same processes on the same weights and inputs.

Reported per backend: TPOT (wall time of one decode step: one new token for every sequence)
P50/P99 over ``--steps`` steps after ``--warmup`` steps, the time spent inside dispatch/combine
(resp. the all-to-alls) per step, and its share of the step. torch is imported lazily, so
``ubep --help`` works without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from ubep.modes import FLOAT_DTYPE_NAMES, LAYOUTS

__all__ = ["DecodeConfig", "DecodeResult", "register", "run_decode"]


@dataclass(frozen=True)
class DecodeConfig:
    """Model and run shape (defaults: Qwen3-30B-A3B MoE shape, shrunk depth/width/vocab)."""

    hidden: int = 2048
    num_experts: int = 128
    top_k: int = 8
    moe_ffn: int = 256  # Qwen3-30B-A3B: 768
    num_layers: int = 2  # Qwen3-30B-A3B: 48
    num_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 4096  # Qwen3: 151936
    batch: int = 4  # sequences per rank
    prompt_len: int = 16
    steps: int = 100
    warmup: int = 5
    dtype: str = "bf16"
    layout: str = "expert"
    engine: str = "asp"
    sync: str = "sp"
    seed: int = 0
    num_ranks: int = 2


@dataclass(frozen=True)
class DecodeResult:
    """One backend's numbers (milliseconds), measured on rank 0."""

    backend: str
    tpot_p50_ms: float
    tpot_p99_ms: float
    tpot_min_ms: float
    tpot_max_ms: float
    comm_p50_ms: float
    comm_share: float  # sum(comm) / sum(step) over the measured steps
    tokens_match_ubep: bool  # greedy tokens equal to the ubep run's (same model, same inputs)


def _qwen3_config(cfg: DecodeConfig) -> Any:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.moe_ffn * 4,
        moe_intermediate_size=cfg.moe_ffn,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=cfg.prompt_len + cfg.steps + cfg.warmup + 8,
        tie_word_embeddings=False,
    )
    config.head_dim = cfg.head_dim  # Qwen3 decouples head_dim from hidden / heads (128)
    return config


class _Timer:
    """Accumulates seconds spent in communication during the current step."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


class _TimedBackend:
    """Wraps an EPBackend, adding the wall time of every dispatch/combine to a timer."""

    def __init__(self, inner: Any, timer: _Timer) -> None:
        self.inner, self.timer = inner, timer
        self.rank, self.num_ranks = inner.rank, inner.num_ranks
        self.num_experts, self.layout = inner.num_experts, inner.layout

    def dispatch(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner.dispatch(*args)
        finally:
            self.timer.seconds += time.perf_counter() - t0

    def combine(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner.combine(*args)
        finally:
            self.timer.seconds += time.perf_counter() - t0


def gloo_experts_forward(
    self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any
) -> Any:
    """Baseline experts implementation: torch.distributed ``all_to_all_single`` over gloo.

    One row per (token, k) pair, sorted by expert: an all-to-all of the per-rank counts, one of
    the expert ids, one of the rows; local experts run on their rows (one matmul per expert);
    one all-to-all brings the rows back and the source adds ``w * out`` in float32.
    """
    import torch
    import torch.distributed as dist

    from ubep.torch.hf import _expert_ffn

    timer: _Timer = self._ubep_gloo_timer
    _WIRE = torch.float16 if hidden_states.element_size() == 2 else hidden_states.dtype
    num_ranks, rank = dist.get_world_size(), dist.get_rank()
    num_tokens, hidden = hidden_states.shape
    per_rank = int(self._ubep_num_experts) // num_ranks
    idx = top_k_index.reshape(num_tokens, -1).to(torch.int64)
    flat = idx.reshape(-1)
    valid = torch.nonzero(flat >= 0).squeeze(1)
    order = valid[torch.argsort(flat[valid], stable=True)]
    token_of = order // idx.shape[1]
    experts = flat[order]
    send_counts = torch.bincount(experts // per_rank, minlength=num_ranks)
    send_rows = hidden_states[token_of].contiguous()

    t0 = time.perf_counter()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    recv_experts = torch.empty(sum(rc), dtype=torch.int64)
    dist.all_to_all_single(recv_experts, experts, rc, sc)
    recv_rows = torch.empty((sum(rc), hidden), dtype=hidden_states.dtype)
    # gloo has no bfloat16; a float16 view moves the same bytes bit for bit (no arithmetic).
    dist.all_to_all_single(recv_rows.view(_WIRE), send_rows.view(_WIRE), rc, sc)
    timer.seconds += time.perf_counter() - t0

    local = recv_experts - rank * per_rank
    perm = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=per_rank).tolist()
    out = torch.empty_like(recv_rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = perm[start : start + n]
            out[rows] = _expert_ffn(self, e, recv_rows[rows]).to(out.dtype)
        start += n

    t0 = time.perf_counter()
    back = torch.empty_like(send_rows)
    dist.all_to_all_single(back.view(_WIRE), out.view(_WIRE), sc, rc)
    timer.seconds += time.perf_counter() - t0

    w = top_k_weights.reshape(num_tokens, -1).to(torch.float32).reshape(-1)[order]
    y = torch.zeros((num_tokens, hidden), dtype=torch.float32)
    y.index_add_(0, token_of, back.to(torch.float32) * w[:, None])
    return y.to(hidden_states.dtype)


def _decode_worker(
    group: Any, cfg: DecodeConfig, backends: tuple[str, ...]
) -> list[dict[str, Any]]:
    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.integrations.moe import ExpertsInterface

    import ubep.torch.hf as hf
    from ubep.torch._runtime import make_backend

    torch.set_num_threads(1)  # two ranks share this host's cores
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[cfg.dtype]
    store = dist.FileStore(os.path.join(group.rendezvous, "torch-filestore"), group.num_ranks)
    dist.init_process_group("gloo", store=store, rank=group.rank, world_size=group.num_ranks)
    try:
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(_qwen3_config(cfg), dtype=dtype).eval()
        hf.register(None)
        ExpertsInterface.register("gloo_a2a", gloo_experts_forward)
        hf.shard_experts(model, group.rank, group.num_ranks)
        timer = _Timer()
        max_tokens = cfg.batch * cfg.prompt_len
        if "ubep" in backends:
            backend = make_backend(
                group,
                hidden=cfg.hidden,
                num_topk=cfg.top_k,
                num_experts=cfg.num_experts,
                dtype=dtype,
                max_tokens_per_rank=max_tokens,
                layout=cfg.layout,
                engine=cfg.engine,
                sync=cfg.sync,
            )
            hf.attach(model, _TimedBackend(backend, timer))
        for m in hf._experts_modules(model):
            m._ubep_gloo_timer = timer
            m._ubep_num_experts = cfg.num_experts
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + group.rank)
        prompt = torch.randint(0, cfg.vocab, (cfg.batch, cfg.prompt_len), generator=gen)
        out: list[dict[str, Any]] = []
        for name in backends:
            model.set_experts_implementation("ubep" if name == "ubep" else "gloo_a2a")
            step_s, comm_s, tokens = _decode(model, prompt, cfg, timer, group)
            out.append(
                {"backend": name, "step_s": step_s, "comm_s": comm_s, "tokens": np.asarray(tokens)}
            )
        return out
    finally:
        dist.destroy_process_group()


def _decode(
    model: Any, prompt: Any, cfg: DecodeConfig, timer: _Timer, group: Any
) -> tuple[list[float], list[float], list[list[int]]]:
    import torch
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=prompt, cache=cache, use_cache=True).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        timer.take()
        step_s, comm_s, tokens = [], [], []
        for step in range(cfg.warmup + cfg.steps):
            group.barrier()  # start every step together, so a step's time is its own
            t0 = time.perf_counter()
            logits = model(input_ids=nxt, cache=cache, use_cache=True).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            dt = time.perf_counter() - t0
            comm = timer.take()
            tokens.append(nxt.squeeze(1).tolist())
            if step >= cfg.warmup:
                step_s.append(dt)
                comm_s.append(comm)
    return step_s, comm_s, tokens


def run_decode(
    cfg: DecodeConfig, backends: tuple[str, ...] = ("ubep", "gloo"), *, timeout_s: float = 900.0
) -> list[DecodeResult]:
    """Launch ``cfg.num_ranks`` ranks, decode with each backend, return rank 0's numbers."""
    import numpy as np

    from ubep.runtime import launch

    per_rank = launch(_decode_worker, cfg.num_ranks, cfg, backends, timeout_s=timeout_s)
    rank0 = per_rank[0]
    ubep_tokens = next((r["tokens"] for r in rank0 if r["backend"] == "ubep"), None)
    results = []
    for r in rank0:
        step = np.asarray(r["step_s"]) * 1e3
        comm = np.asarray(r["comm_s"]) * 1e3
        results.append(
            DecodeResult(
                backend=r["backend"],
                tpot_p50_ms=float(np.percentile(step, 50)),
                tpot_p99_ms=float(np.percentile(step, 99)),
                tpot_min_ms=float(step.min()),
                tpot_max_ms=float(step.max()),
                comm_p50_ms=float(np.percentile(comm, 50)),
                comm_share=float(comm.sum() / step.sum()),
                tokens_match_ubep=bool(
                    ubep_tokens is not None and np.array_equal(r["tokens"], ubep_tokens)
                ),
            )
        )
    return results


def format_table(cfg: DecodeConfig, results: list[DecodeResult]) -> str:
    head = (
        f"# decode: {cfg.num_ranks} ranks x batch {cfg.batch}, hidden {cfg.hidden}, "
        f"{cfg.num_experts} experts top-{cfg.top_k}, moe_ffn {cfg.moe_ffn}, "
        f"{cfg.num_layers} layers, {cfg.dtype}, ubep layout={cfg.layout} engine={cfg.engine} "
        f"sync={cfg.sync}; {cfg.steps} steps after {cfg.warmup} warm-up"
    )
    cols = (
        "backend",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "tpot_min_ms",
        "tpot_max_ms",
        "comm_p50_ms",
        "comm_share",
        "tokens_match_ubep",
    )
    lines = [head, "  ".join(f"{c:>17}" for c in cols)]
    for r in results:
        row = asdict(r)
        lines.append(
            "  ".join(
                f"{row[c]:>17.3f}" if isinstance(row[c], float) else f"{row[c]!s:>17}" for c in cols
            )
        )
    return "\n".join(lines)


def _main(args: argparse.Namespace) -> int:
    cfg = DecodeConfig(
        moe_ffn=args.moe_ffn,
        num_layers=args.layers,
        batch=args.batch,
        prompt_len=args.prompt_len,
        steps=args.steps,
        warmup=args.warmup,
        dtype=args.dtype,
        layout=args.layout,
        engine=args.engine,
        sync=args.sync,
        seed=args.seed,
    )
    if cfg.steps < 1:
        raise SystemExit("--steps must be >= 1")
    backends = tuple(b for b in args.backends.split(",") if b)
    results = run_decode(cfg, backends, timeout_s=args.timeout)
    print(format_table(cfg, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": asdict(cfg), "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


def register(subparsers: Any) -> None:
    """Add ``ubep decode`` to the CLI."""
    p = subparsers.add_parser(
        "decode",
        help="decode TPOT of a Qwen3-MoE-shaped model on 2 ranks: ubep vs gloo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = DecodeConfig()
    p.add_argument("--steps", type=int, default=d.steps, help="measured decode steps (>= 100)")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per rank")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--moe-ffn", type=int, default=d.moe_ffn, help="expert FFN width")
    p.add_argument("--dtype", choices=FLOAT_DTYPE_NAMES, default=d.dtype)
    p.add_argument("--layout", choices=LAYOUTS, default=d.layout)
    p.add_argument("--engine", default=d.engine)
    p.add_argument("--sync", default=d.sync)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--backends", default="ubep,gloo", help="comma list of ubep, gloo")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    p.add_argument("--json", help="also write the results here")
    p.set_defaults(func=_main)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.torch_decode [options]`` (the options of ``ubep decode``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch_decode")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["decode", *(sys.argv[1:] if argv is None else argv)])
    return _main(args)


if __name__ == "__main__":
    sys.exit(main())
