"""One vLLM process of bench_vllm.py (run under .venv-vllm): time greedy generation rounds.

``python vllm_worker.py MODEL MODE ROUNDS`` with MODE ``dp1``, ``tp2`` or ``dp2ep`` (then one
process per DP rank, vLLM's ``VLLM_DP_*`` variables set by the driver). Each round generates
``BATCH`` prompts' worth of tokens (this rank's share under DP) twice: ``1`` token (prefill
only) and ``MAX_TOKENS`` tokens, ``ignore_eos``; the decode step is their difference over the
``MAX_TOKENS - 1`` decode steps. The MoE blocks' time (forward hooks on each
``Qwen3MoeSparseMoeBlock``: router, experts, dispatch and combine) and ubep's dispatch and
combine time are read from the model's process with ``collective_rpc``. Prints one ``RESULT``
JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

BATCH = 8
PROMPT_LEN = 16
MAX_TOKENS = 32


def _install_hooks(worker: Any) -> int:

    model = worker.model_runner.model
    state = {"ns": 0, "t0": 0}

    def pre(_module: Any, _args: Any) -> None:
        state["t0"] = time.perf_counter_ns()

    def post(_module: Any, _args: Any, _out: Any) -> None:
        state["ns"] += time.perf_counter_ns() - state["t0"]

    blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    for block in blocks:
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
    worker._bench_moe = state
    return len(blocks)


def _read_times(worker: Any) -> dict[str, int]:
    from vllm.distributed.parallel_state import get_ep_group

    out = {"moe_ns": int(worker._bench_moe["ns"]), "dispatch_ns": 0, "combine_ns": 0}
    try:
        manager = get_ep_group().device_communicator.all2all_manager
    except (AssertionError, AttributeError):
        manager = None
    exchange = getattr(manager, "exchange", None)
    if exchange is not None:
        out["dispatch_ns"] = exchange.stats.dispatch_ns
        out["combine_ns"] = exchange.stats.combine_ns
    return out


def _reset(worker: Any) -> None:
    worker._bench_moe["ns"] = 0
    from vllm.distributed.parallel_state import get_ep_group

    try:
        manager = get_ep_group().device_communicator.all2all_manager
    except (AssertionError, AttributeError):
        return
    exchange = getattr(manager, "exchange", None)
    if exchange is not None:
        exchange.stats.dispatch_ns = exchange.stats.combine_ns = 0


def main(model: str, mode: str, rounds: str) -> None:
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
    samples = []
    for _ in range(int(rounds)):
        start = time.perf_counter()
        llm.generate(prompts, prefill, use_tqdm=False)
        t_prefill = time.perf_counter() - start
        llm.collective_rpc(_reset)
        start = time.perf_counter()
        outs = llm.generate(prompts, full, use_tqdm=False)
        t_full = time.perf_counter() - start
        times = llm.collective_rpc(_read_times)[0]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        samples.append({"prefill_s": t_prefill, "full_s": t_full, "tokens": tokens, **times})
    print("RESULT " + json.dumps({"mode": mode, "dp_rank": dp_rank, "max_tokens": MAX_TOKENS,
                                  "samples": samples}),
          flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
