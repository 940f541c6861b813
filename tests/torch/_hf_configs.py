"""Tiny seeded Hugging Face MoE configs shared by the torch tests (no download: built locally)."""

from __future__ import annotations

from typing import Any

import transformers

VOCAB = 96


def tiny_qwen3_moe(num_experts: int, top_k: int, *, norm_topk_prob: bool = False) -> Any:
    """A 2-layer Qwen3-MoE with every layer sparse, hidden 32, 4 heads of 8."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    cfg.head_dim = 8
    return cfg


def tiny_mixtral(num_experts: int, top_k: int = 2) -> Any:
    """A 2-layer Mixtral, hidden 32, 4 heads."""
    return transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
    )


def tiny_llama4(num_experts: int) -> Any:
    """A 2-layer Llama 4 text model, every layer MoE (top-1), hidden 32. Its experts module
    (``Llama4TextExperts``) does not go through transformers' ExpertsInterface."""
    return transformers.Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        intermediate_size_mlp=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=num_experts,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        max_position_embeddings=64,
        attention_chunk_size=64,
    )
