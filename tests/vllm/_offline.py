"""One vLLM DP rank, offline: greedy tokens of its share of the prompts, as JSON on stdout.

Run under .venv-vllm: ``python _offline.py MODEL_DIR``. vLLM's data-parallel pattern: one
process per DP rank with ``VLLM_DP_RANK`` / ``VLLM_DP_SIZE`` / ``VLLM_DP_MASTER_IP`` /
``VLLM_DP_MASTER_PORT``; DP > 1 turns expert parallelism on. Rank ``r`` of ``n`` takes prompts
``r, r + n, ...`` and prints ``RESULT {"prompt": [...], "tokens": [...]}`` per prompt.
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12], [20, 21, 22, 23], [100, 7, 300, 2]]
MAX_TOKENS = 8
# what every test process of vLLM shares: a small KV cache, eager mode, token ids only
ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
              gpu_memory_utilization=0.05)


def main(model: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    dp_size = int(os.environ.get("VLLM_DP_SIZE", "1"))
    dp_rank = int(os.environ.get("VLLM_DP_RANK", "0"))
    llm = LLM(model=model, enable_expert_parallel=dp_size > 1, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    mine = PROMPTS[dp_rank::dp_size]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in mine], params)
    for prompt, out in zip(mine, outs, strict=True):
        print("RESULT " + json.dumps({"prompt": prompt, "tokens": list(out.outputs[0].token_ids)}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
