"""Write a random-initialised Qwen3-MoE (config + safetensors, fixed seed) to a directory.

Run under .venv-vllm (its transformers): ``python _make_model.py DIR [tiny|wide]``. ``tiny``: 2
layers, 8 experts top-2, hidden 128, float32 (the tests); ``wide``: hidden 2048, 32 experts
top-4 (the benchmark's shape where expert parallelism matters). The router and embeddings get
a wide initialisation so that greedy tokens are decided by margins far above float32 rounding.
"""

from __future__ import annotations

import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                 num_experts_per_tok=2),
    "wide": dict(hidden_size=2048, intermediate_size=4096, moe_intermediate_size=256,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=32,
                 num_experts_per_tok=4),
}


def main(out: str, shape: str = "tiny") -> None:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=512, num_hidden_layers=2, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, max_position_embeddings=512, initializer_range=0.2,
        tie_word_embeddings=False, **SHAPES[shape])
    cfg.dtype = torch.float32
    Qwen3MoeForCausalLM(cfg).to(torch.float32).save_pretrained(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
