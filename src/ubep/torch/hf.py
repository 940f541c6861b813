"""Hugging Face transformers integration: an experts implementation named ``"ubep"``.

transformers >= 5 routes every MoE experts module decorated with ``@use_experts_implementation``
(Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4-MoE, OLMoE, ...) through ``ExpertsInterface``: the
module's ``forward(hidden_states, top_k_index, top_k_weights)`` is replaced by the function
registered under ``config._experts_implementation``. :func:`register` adds ``"ubep"``, which runs
the experts expert-parallel::

    import ubep.torch.hf
    ubep.torch.hf.register(group, layout="expert")           # once per process
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="ubep")

Every rank runs the whole model on its own batch (data-parallel attention, as DeepEP's users
do); inside each MoE block the router's picks are dispatched to the rank that owns the expert
(rank ``r`` owns experts ``[r*E/R, (r+1)*E/R)``), that rank applies its experts to the rows it
received (one batched matmul per local expert), and combine returns ``sum_k w[t, k] *
expert(t, k)`` (float32 accumulation) to the token's rank. Every rank therefore has to call every
MoE layer the same number of times: for ``generate()`` use a fixed length
(``min_new_tokens == max_new_tokens``) or ``synced_gpus``.

The model is built on every rank with all experts (same seed = same weights); ubep only ever
reads the local ones, and :func:`shard_experts` drops the rest to save memory.

Accuracy (tested on a tiny seeded config): float32 logits equal the eager single-process
model's within ``rtol=atol=1e-4`` (eager adds the experts' outputs in expert-id order in the model
dtype, ubep in top-k order in float32: the same sum, associated differently).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgumentError
from .backend import EPBackend
from .ops import combine, dispatch

__all__ = ["attach", "experts_forward", "register", "shard_experts"]

NAME = "ubep"

_lock = threading.Lock()
_registry: dict[str, Any] = {}  # the group and Buffer options given to register()
_buffers: dict[tuple[Any, ...], EPBackend] = {}  # lazily built runtime buffers, by shape


def register(group: Any = None, *, name: str = NAME, **buffer_options: Any) -> None:
    """Register the experts implementation ``name`` (``"ubep"``) with transformers.

    Args:
        group: the ubep process group (``ubep.launch`` hands one to each rank). None is allowed
            when every model gets its backend from :func:`attach`.
        name: the key for ``experts_implementation=``.
        buffer_options: ``ubep.BufferConfig`` fields (``layout``, ``engine``, ``sync``,
            ``max_tokens_per_rank``, ...). Buffers are created on first use per
            ``(hidden, num_topk, num_experts, dtype)``; that first MoE forward is collective.
    """
    from transformers.integrations.moe import ExpertsInterface

    with _lock:
        _registry["group"] = group
        _registry["options"] = dict(buffer_options)
        _buffers.clear()
    ExpertsInterface.register(name, experts_forward)


def attach(model: nn.Module, backend: EPBackend) -> int:
    """Make every experts module of ``model`` use ``backend`` (overrides :func:`register`'s
    group). Returns how many modules were bound."""
    count = 0
    for module in _experts_modules(model):
        module._ubep_backend = backend
        count += 1
    return count


def shard_experts(model: nn.Module, rank: int, num_ranks: int) -> int:
    """Keep only rank ``rank``'s experts in every experts module (frees the others' memory).

    Returns how many modules were sharded. The model then only runs with ``"ubep"``.
    """
    count = 0
    for module in _experts_modules(model):
        num_experts = int(module.num_experts)
        if num_experts % num_ranks:
            raise InvalidArgumentError(
                "num_ranks", num_ranks, f"must divide num_experts={num_experts}"
            )
        if getattr(module, "_ubep_first_expert", None) is not None:
            continue
        per_rank = num_experts // num_ranks
        lo = rank * per_rank
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.shape[:1] == (num_experts,):
                setattr(module, pname, nn.Parameter(param.data[lo : lo + per_rank].clone()))
        module._ubep_first_expert = lo
        count += 1
    return count


def _experts_modules(model: nn.Module) -> list[Any]:
    return [
        m
        for m in model.modules()
        if hasattr(m, "gate_up_proj") or hasattr(m, "up_proj")
        if hasattr(m, "down_proj") and hasattr(m, "num_experts")
    ]


def _backend_for(module: Any, hidden_states: torch.Tensor, num_topk: int) -> EPBackend:
    backend = getattr(module, "_ubep_backend", None)
    if backend is not None:
        return backend
    group = _registry.get("group")
    if group is None:
        raise InvalidArgumentError(
            "group", None, "call ubep.torch.hf.register(group, ...) or attach(model, backend) first"
        )
    key = (
        id(group),
        hidden_states.shape[-1],
        num_topk,
        int(module.num_experts),
        hidden_states.dtype,
    )
    with _lock:
        if key not in _buffers:
            from ._runtime import make_backend

            _buffers[key] = make_backend(
                group,
                hidden=int(hidden_states.shape[-1]),
                num_topk=num_topk,
                num_experts=int(module.num_experts),
                dtype=hidden_states.dtype,
                **_registry.get("options", {}),
            )
        return _buffers[key]


def _linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x @ weight if transposed else nn.functional.linear(x, weight)


def _expert_ffn(module: Any, e: int, rows: torch.Tensor) -> torch.Tensor:
    """One expert on its rows, the way transformers' grouped implementations do it."""
    transposed = bool(getattr(module, "is_transposed", False))
    has_gate = bool(getattr(module, "has_gate", True))
    has_bias = bool(getattr(module, "has_bias", False))
    up = module.gate_up_proj if has_gate else module.up_proj
    h = _linear(rows, up[e], transposed)
    if has_bias:
        h = h + (module.gate_up_proj_bias if has_gate else module.up_proj_bias)[e]
    h = module._apply_gate(h) if has_gate else module.act_fn(h)
    out = _linear(h, module.down_proj[e], transposed)
    if has_bias:
        out = out + module.down_proj_bias[e]
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out


def experts_forward(
    self: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``"ubep"`` experts implementation (signature fixed by transformers).

    ``hidden_states [num_tokens, hidden]``, ``top_k_index [num_tokens, top_k]`` (global expert
    ids), ``top_k_weights [num_tokens, top_k]`` -> ``[num_tokens, hidden]``.
    """
    num_tokens, hidden = hidden_states.shape
    top_k_index = top_k_index.to(torch.int64).reshape(num_tokens, -1)
    top_k_weights = top_k_weights.reshape(num_tokens, -1).to(torch.float32)
    backend = _backend_for(self, hidden_states, top_k_index.shape[1])
    x = hidden_states.contiguous()
    res = dispatch(backend, x, top_k_index, top_k_weights)
    per_rank = backend.num_experts // backend.num_ranks
    first = backend.rank * per_rank
    # Parameter index of local expert 0: the global id, or 0 once shard_experts() cut the rest.
    base = first if getattr(self, "_ubep_first_expert", None) is None else 0
    if backend.layout == "expert":
        pieces, start = [], 0
        for local, n in enumerate(res.num_recv_tokens_per_expert):
            if n:
                pieces.append(_expert_ffn(self, base + local, res.recv_x[start : start + n]))
            start += n
        out = torch.cat(pieces).to(x.dtype) if pieces else x.new_zeros((0, hidden))
    else:
        acc = torch.zeros((res.recv_x.shape[0], hidden), dtype=torch.float32)
        for local in range(per_rank):
            rows, slot = torch.nonzero(res.recv_topk_idx == local, as_tuple=True)
            if rows.numel():
                h = _expert_ffn(self, base + local, res.recv_x[rows]).to(torch.float32)
                acc = acc.index_add(0, rows, h * res.recv_topk_weights[rows, slot, None])
        out = acc.to(x.dtype)
    return combine(out, res.handle)
