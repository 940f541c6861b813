"""One vLLM process of bench_vllm.py (run under .venv-vllm): greedy generation rounds on cue.

``python vllm_worker.py MODEL MODE`` with MODE ``dp1``, ``tp2`` or ``dp2ep`` (then one process
per DP rank, vLLM's ``VLLM_DP_*`` variables set by the driver). The worker builds its engine,
warms it up and prints ``READY``; then each ``round`` line on stdin runs one round and prints
one ``RESULT`` JSON line, and ``stop`` (or the end of stdin) ends it. The driver cues the modes'
rounds in turn, so every mode's engine stays up and rounds of the modes alternate.

A round generates ``BATCH`` prompts' worth of tokens (this rank's share under DP), ``MAX_TOKENS``
each, ``ignore_eos``, after a ``1``-token generate (prefill only, the time to first token).
Engine steps are timed in the model's process: a forward pre-hook on the model records when
each forward starts, so the intervals between them are the engine's steps (scheduling,
forward, sampling; the DP ranks' synchronisation under DP), and the forwards themselves and
``torch.distributed.all_reduce`` (vLLM's DP ranks agree on every step's batch with one) are
timed too. The MoE blocks' time (forward hooks on
each ``Qwen3MoeSparseMoeBlock``: router, experts, dispatch and combine) and ubep's dispatch and
combine time are read from the model's process with ``collective_rpc`` (which vLLM's DP engine
answers between its steps: no collective of the EP group is involved).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from typing import Any

BATCH = 8
PROMPT_LEN = 16
MAX_TOKENS = 32


def _install_hooks(worker: Any) -> int:
    import torch.distributed as dist

    model = worker.model_runner.model
    state: dict[str, Any] = {"ns": 0, "t0": 0, "forwards": [], "forward_ns": 0,
                             "all_reduce_ns": 0}

    def pre(_module: Any, _args: Any) -> None:
        state["t0"] = time.perf_counter_ns()

    def post(_module: Any, _args: Any, _out: Any) -> None:
        state["ns"] += time.perf_counter_ns() - state["t0"]

    def step(_module: Any, _args: Any) -> None:
        state["forwards"].append(time.perf_counter_ns())

    def step_done(_module: Any, _args: Any, _out: Any) -> None:
        state["forward_ns"] += time.perf_counter_ns() - state["forwards"][-1]

    blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    for block in blocks:
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
    model.register_forward_pre_hook(step)
    model.register_forward_hook(step_done)
    # vLLM's DP ranks agree on each step's batch with a gloo all_reduce (dp_utils looks
    # torch.distributed.all_reduce up at each call, so wrapping it here times them)
    all_reduce = dist.all_reduce

    def timed_all_reduce(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return all_reduce(*args, **kwargs)
        finally:
            state["all_reduce_ns"] += time.perf_counter_ns() - start

    dist.all_reduce = timed_all_reduce
    worker._bench_moe = state
    return len(blocks)


def _exchange(worker: Any) -> Any:
    """ubep's exchange of this worker's EP group, or None (no EP group or not ubep's)."""
    from vllm.distributed.parallel_state import get_ep_group

    try:
        manager = get_ep_group().device_communicator.all2all_manager
    except (AssertionError, AttributeError):
        return None
    return getattr(manager, "exchange", None)


def _read_times(worker: Any) -> dict[str, Any]:
    state = worker._bench_moe
    starts = state["forwards"]
    out = {"moe_ns": int(state["ns"]), "dispatch_ns": 0, "combine_ns": 0,
           "calls": 0, "recv_rows": 0, "forwards": len(starts),
           "forward_ns": state["forward_ns"], "all_reduce_ns": state["all_reduce_ns"],
           "step_ns": [b - a for a, b in itertools.pairwise(starts)]}
    exchange = _exchange(worker)
    if exchange is not None:
        stats = exchange.stats
        out.update(dispatch_ns=stats.dispatch_ns, combine_ns=stats.combine_ns,
                   calls=stats.calls, recv_rows=stats.recv_rows)
    return out


def _reset(worker: Any) -> None:
    state = worker._bench_moe
    state["ns"] = state["forward_ns"] = state["all_reduce_ns"] = 0
    state["forwards"].clear()
    exchange = _exchange(worker)
    if exchange is not None:
        stats = exchange.stats
        stats.dispatch_ns = stats.combine_ns = stats.calls = stats.recv_rows = 0


def main(model: str, mode: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    dp_size = int(os.environ.get("VLLM_DP_SIZE", "1"))
    dp_rank = int(os.environ.get("VLLM_DP_RANK", "0"))
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=256, max_num_seqs=BATCH, max_num_batched_tokens=256,
              gpu_memory_utilization=0.05, enable_expert_parallel=mode == "dp2ep",
              tensor_parallel_size=2 if mode == "tp2" else 1)
    llm.collective_rpc(_install_hooks)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 500 + 1 for j in range(PROMPT_LEN)])
               for i in range(BATCH)][dp_rank::dp_size]
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    full = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          detokenize=False)
    llm.generate(prompts, full, use_tqdm=False)  # warm-up
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        start = time.perf_counter()
        llm.generate(prompts, prefill, use_tqdm=False)
        t_prefill = time.perf_counter() - start
        llm.collective_rpc(_reset)
        start = time.perf_counter()
        outs = llm.generate(prompts, full, use_tqdm=False)
        t_full = time.perf_counter() - start
        times = llm.collective_rpc(_read_times)[0]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RESULT " + json.dumps({"mode": mode, "dp_rank": dp_rank,
                                      "max_tokens": MAX_TOKENS, "first_token_s": t_prefill,
                                      "full_s": t_full, "tokens": tokens, **times}),
              flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
