"""Hugging Face Qwen3-MoE with its experts expert-parallel through ubep, on 2 ranks.

    python examples/hf_qwen3_moe.py

A tiny random Qwen3-MoE (seeded, nothing downloaded) is built on every rank; each rank generates
from its own prompt while the MoE layers send tokens to the rank that owns their experts. The
result is compared with the plain eager model in this process.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import ubep.torch.hf
from ubep.runtime import Group, launch


def tiny_config() -> Qwen3MoeConfig:
    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        mlp_only_layers=[],
    )
    cfg.head_dim = 16
    return cfg


def build(impl: str) -> torch.nn.Module:
    torch.manual_seed(0)  # same weights on every rank and in the reference
    return AutoModelForCausalLM.from_config(tiny_config(), experts_implementation=impl).eval()


def prompt(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(rank))


def generate(group: Group) -> list[int]:
    ubep.torch.hf.register(group, layout="expert", max_tokens_per_rank=64)
    model = build("ubep")
    ubep.torch.hf.shard_experts(model, group.rank, group.num_ranks)  # keep only local experts
    with torch.no_grad():
        # Same number of steps on every rank: each step is a collective in every MoE layer.
        out = model.generate(
            prompt(group.rank),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            attention_mask=torch.ones(1, 8, dtype=torch.long),
        )
    return out[0].tolist()  # plain data back to the parent (tensors would not survive the rank)


if __name__ == "__main__":
    outs = launch(generate, 2, timeout_s=300)
    eager = build("eager")
    for rank, out in enumerate(outs):
        with torch.no_grad():
            ref = eager.generate(
                prompt(rank),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                attention_mask=torch.ones(1, 8, dtype=torch.long),
            )
        print(f"rank {rank}: {out}  same as eager: {out == ref[0].tolist()}")
