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

``--overlap`` adds two ubep rows that split every rank's batch into two micro-batches of
``batch / 2`` sequences (each with its own KV cache): ``ubep-2mb`` runs them one after the
other with blocking calls, ``ubep-tbo`` with DeepEP's two-batch overlap: every MoE layer issues
``ubep.torch.dispatch(..., return_recv_hook=True)`` and hands over to the other micro-batch,
whose attention runs while the rows travel; back at the hook it runs its experts, issues
``combine(..., return_recv_hook=True)`` and hands over again (the two micro-batches are two
threads of which exactly one runs at a time, handing over at these points, so the model code
stays transformers'). The prefill runs blocking for both. ``ubep-tbo`` must give the same
logits as ``ubep-2mb`` bit for bit at every step (``exact_vs_2mb``); its comm time is the time
spent blocked in the issue and hook calls (what overlap did not hide).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
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
    timeout_s: float = 120.0  # deadline of one hand-over between micro-batches (--overlap)


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
    exact_vs_2mb: bool | None = None  # ubep-tbo: every step's logits equal ubep-2mb's, bit for bit


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

    def time(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its wall time added (also when it raises)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0


class _TimedBackend:
    """Wraps an EPBackend, adding the wall time of every dispatch/combine to a timer."""

    def __init__(self, inner: Any, timer: _Timer) -> None:
        self.inner, self.timer = inner, timer
        self.rank, self.num_ranks = inner.rank, inner.num_ranks
        self.num_experts, self.layout = inner.num_experts, inner.layout

    def dispatch(self, *args: Any) -> Any:
        return self.timer.time(self.inner.dispatch, *args)

    def combine(self, *args: Any) -> Any:
        return self.timer.time(self.inner.combine, *args)

    # split-phase (ubep.torch's return_recv_hook): the issue and the hook are both timed
    def dispatch_async(self, *args: Any) -> Any:
        return _TimedPending(self.timer.time(self.inner.dispatch_async, *args), self.timer)

    def combine_async(self, *args: Any) -> Any:
        return _TimedPending(self.timer.time(self.inner.combine_async, *args), self.timer)


class _TimedPending:
    """A ``ubep.PendingCall`` whose hook adds its wall time to a timer."""

    def __init__(self, inner: Any, timer: _Timer) -> None:
        self.inner, self.timer = inner, timer

    def hook(self) -> Any:
        return self.timer.time(self.inner.hook)

    wait = hook


class TwoBatch:
    """Two micro-batches as two threads of which exactly one runs: ``run(fa, fb)`` runs ``fa``
    here and ``fb`` on a helper thread, starting with ``fa``; :meth:`switch` hands over to the
    other (unless it has finished) and returns when it hands back. What runs, and in which
    order, is therefore fixed by the switch points (deterministic, no data race). Every wait
    has a deadline (``timeout_s``)."""

    def __init__(self, timeout_s: float) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [True, True]
        self._timeout_s = timeout_s
        self._local = threading.local()

    def switch(self) -> None:
        me = getattr(self._local, "index", None)
        if me is None:
            raise RuntimeError("TwoBatch.switch() outside TwoBatch.run()")
        with self._cond:
            if self._done[1 - me]:
                return
            self._turn = 1 - me
            self._cond.notify_all()
            self._wait_turn(me)

    def _wait_turn(self, me: int) -> None:
        if not self._cond.wait_for(lambda: self._turn == me, timeout=self._timeout_s):
            raise TimeoutError(f"micro-batch {me}: the other micro-batch did not hand back "
                               f"within {self._timeout_s} s")

    def run(self, fa: Callable[[], Any], fb: Callable[[], Any]) -> list[Any]:
        results: list[Any] = [None, None]
        errors: list[BaseException] = []

        def body(index: int, fn: Callable[[], Any]) -> None:
            self._local.index = index
            try:
                with self._cond:
                    self._wait_turn(index)
                results[index] = fn()
            except BaseException as exc:  # re-raised by run() on the calling thread
                errors.append(exc)
            finally:
                with self._cond:
                    self._done[index] = True
                    self._turn = 1 - index
                    self._cond.notify_all()
                self._local.index = None

        with self._cond:
            self._done, self._turn = [False, False], 0
        helper = threading.Thread(target=body, args=(1, fb), name="micro-batch-B", daemon=True)
        helper.start()
        body(0, fa)
        helper.join(self._timeout_s)
        if helper.is_alive():
            raise TimeoutError(f"micro-batch B did not finish within {self._timeout_s} s")
        if errors:
            raise errors[0]
        return results


TBO_NAME = "ubep_tbo"


def tbo_experts_forward(
    self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any
) -> Any:
    """The ``ubep_tbo`` experts implementation: ubep's experts forward with both calls
    split-phase, handing over to the other micro-batch while each is in flight."""
    import torch

    from ubep.torch.hf import _local_experts
    from ubep.torch.ops import combine, dispatch

    two: TwoBatch = self._ubep_two_batch
    backend = self._ubep_backend
    if getattr(backend, "dispatch_async", None) is None:
        raise TypeError(f"{type(backend).__name__} has no split-phase calls (dispatch_async): "
                        "ubep_tbo would run blocking")
    num_tokens = hidden_states.shape[0]
    idx = top_k_index.to(torch.int64).reshape(num_tokens, -1)
    w = top_k_weights.reshape(num_tokens, -1).to(torch.float32)
    x = hidden_states.contiguous()
    pending = dispatch(backend, x, idx, w, return_recv_hook=True)
    two.switch()  # the other micro-batch's attention runs while these rows travel
    res = pending.hook()
    done = combine(_local_experts(self, backend, res, x), res.handle, return_recv_hook=True)
    two.switch()
    return done.hook()


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
        ExpertsInterface.register(TBO_NAME, tbo_experts_forward)
        hf.shard_experts(model, group.rank, group.num_ranks)
        timer = _Timer()
        max_tokens = cfg.batch * cfg.prompt_len
        if any(b.startswith("ubep") for b in backends):
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
        two = TwoBatch(cfg.timeout_s)
        for m in hf._experts_modules(model):
            m._ubep_gloo_timer = timer
            m._ubep_num_experts = cfg.num_experts
            m._ubep_two_batch = two
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + group.rank)
        prompt = torch.randint(0, cfg.vocab, (cfg.batch, cfg.prompt_len), generator=gen)
        out: list[dict[str, Any]] = []
        for name in backends:
            if name in MICRO_BACKENDS:
                step_s, comm_s, tokens, digests = _decode_micro(
                    model, prompt, cfg, timer, group, two if name == "ubep-tbo" else None)
            else:
                model.set_experts_implementation("ubep" if name == "ubep" else "gloo_a2a")
                step_s, comm_s, tokens = _decode(model, prompt, cfg, timer, group)
                digests = []
            out.append({"backend": name, "step_s": step_s, "comm_s": comm_s,
                        "tokens": np.asarray(tokens), "digests": digests})
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


MICRO_BACKENDS = ("ubep-2mb", "ubep-tbo")
BACKENDS = ("ubep", "gloo", *MICRO_BACKENDS)


def _digest(logits: Any) -> str:
    """The bits of a step's logits (float32 holds every BF16/FP16 value exactly)."""
    return hashlib.sha256(logits.float().contiguous().numpy().tobytes()).hexdigest()


def _decode_micro(
    model: Any, prompt: Any, cfg: DecodeConfig, timer: _Timer, group: Any, two: TwoBatch | None
) -> tuple[list[float], list[float], list[list[int]], list[str]]:
    """Decode the batch as two micro-batches (own KV caches): one after the other with blocking
    calls (``two`` None) or overlapped (``two``: the ``ubep_tbo`` experts and two threads).
    Returns step seconds, comm seconds, tokens and per-step logits digests."""
    import torch
    from transformers import DynamicCache

    half = prompt.shape[0] // 2
    parts = [prompt[:half], prompt[half:]]
    caches = [DynamicCache(config=model.config) for _ in parts]

    def forward(i: int, ids: Any) -> Any:
        with torch.no_grad():  # grad mode is per thread: the helper thread sets its own
            return model(input_ids=ids, cache=caches[i], use_cache=True).logits[:, -1]

    model.set_experts_implementation("ubep")
    nxt = [forward(i, p).argmax(-1, keepdim=True) for i, p in enumerate(parts)]
    if two is not None:
        model.set_experts_implementation(TBO_NAME)
    timer.take()
    step_s, comm_s, tokens, digests = [], [], [], []
    try:
        for step in range(cfg.warmup + cfg.steps):
            group.barrier()  # start every step together, so a step's time is its own
            t0 = time.perf_counter()
            if two is None:
                logits = [forward(0, nxt[0]), forward(1, nxt[1])]
            else:
                logits = two.run(functools.partial(forward, 0, nxt[0]),
                                 functools.partial(forward, 1, nxt[1]))
            nxt = [lg.argmax(-1, keepdim=True) for lg in logits]
            dt = time.perf_counter() - t0
            comm = timer.take()
            tokens.append(torch.cat(nxt).squeeze(1).tolist())
            digests.append(_digest(torch.cat(logits)))
            if step >= cfg.warmup:
                step_s.append(dt)
                comm_s.append(comm)
    finally:
        model.set_experts_implementation("ubep")
    return step_s, comm_s, tokens, digests


def run_decode(
    cfg: DecodeConfig, backends: tuple[str, ...] = ("ubep", "gloo"), *, timeout_s: float = 900.0
) -> list[DecodeResult]:
    """Launch ``cfg.num_ranks`` ranks, decode with each backend, return rank 0's numbers."""
    import numpy as np

    from ubep.runtime import launch

    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"backends {unknown}: must be among {BACKENDS}")
    if any(b in MICRO_BACKENDS for b in backends) and (cfg.batch < 2 or cfg.batch % 2):
        raise ValueError(f"batch={cfg.batch}: two micro-batches need an even batch >= 2")
    per_rank = launch(_decode_worker, cfg.num_ranks, cfg, backends, timeout_s=timeout_s)
    rank0 = per_rank[0]
    ubep_tokens = next((r["tokens"] for r in rank0 if r["backend"] == "ubep"), None)
    # the overlapped schedule against the serial one, on every rank, every step
    by_name = [{r["backend"]: r for r in rank} for rank in per_rank]
    exact = None
    if "ubep-tbo" in backends and "ubep-2mb" in backends:
        exact = all(
            len(rk["ubep-tbo"]["digests"]) == cfg.warmup + cfg.steps
            and rk["ubep-tbo"]["digests"] == rk["ubep-2mb"]["digests"]
            and np.array_equal(rk["ubep-tbo"]["tokens"], rk["ubep-2mb"]["tokens"])
            for rk in by_name)
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
                exact_vs_2mb=exact if r["backend"] == "ubep-tbo" else None,
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
    if any(r.exact_vs_2mb is not None for r in results):
        cols = (*cols, "exact_vs_2mb")
        head += ("\n# ubep-2mb / ubep-tbo: two micro-batches of batch/2, blocking / two-batch "
                 "overlap (return_recv_hook); comm = time blocked in dispatch/combine and hooks")
    lines = [head, "  ".join(f"{c:>17}" for c in cols)]
    for r in results:
        row = asdict(r)
        lines.append(
            "  ".join(
                f"{row[c]:>17.3f}" if isinstance(row[c], float)
                else f"{'-' if row[c] is None else row[c]!s:>17}" for c in cols
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
    if args.overlap:
        backends += tuple(b for b in MICRO_BACKENDS if b not in backends)
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
    p.add_argument("--backends", default="ubep,gloo",
                   help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--overlap", action="store_true",
                   help="also two micro-batches per rank: ubep-2mb (blocking) and ubep-tbo "
                        "(two-batch overlap with return_recv_hook), checked bit for bit")
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
