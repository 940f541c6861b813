"""Hugging Face transformers integration: an experts implementation named ``"ubep"``.

transformers >= 5 routes every MoE experts module decorated with ``@use_experts_implementation``
(Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4-MoE, OLMoE, ...) through ``ExpertsInterface``: the
module's ``forward(hidden_states, top_k_index, top_k_weights)`` is replaced by the function
registered under ``config._experts_implementation``. :func:`register` adds ``"ubep"``, which runs
the experts expert-parallel::

    import ubep.torch.hf
    ubep.torch.hf.register(group, layout="expert")           # once per process
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="ubep")

``group`` is a ubep group (``ubep.launch``) or a ``torch.distributed`` group
(``dist.group.WORLD`` under torchrun, or an EP subgroup from ``dist.new_group``).

Every rank runs the whole model on its own batch (data-parallel attention, as DeepEP's users
do); inside each MoE block the router's picks are dispatched to the rank that owns the expert
(rank ``r`` owns experts ``[r*E/R, (r+1)*E/R)``), that rank applies its experts to the rows it
received (one batched matmul per local expert), and combine returns ``sum_k w[t, k] *
expert(t, k)`` (float32 accumulation) to the token's rank.

**Every rank has to call every MoE layer the same number of times.** In ``generate()`` a rank
whose sequences all hit EOS first would stop while the others still need its experts; use one of

* :func:`generate` (``ubep.torch.hf.generate(model, ids, ...)``): ``model.generate`` that keeps
  a finished rank running forward passes (serving its experts) until every rank of the
  expert-parallel group is done, agreed on by a small allgather per step over that group (any
  ubep group, torch.distributed or not);
* ``model.generate(..., synced_gpus=True)`` when torch.distributed is initialised: transformers'
  own mechanism, which agrees over the torch.distributed *world*;
* a fixed length (``min_new_tokens == max_new_tokens``) and no EOS stop.

Without them the waiting ranks fail with ``ubep.PeerLostError`` / ``ubep.TimeoutError`` whose
message names unequal generate() lengths as the likely cause.

Only modules that go through ``ExpertsInterface`` are driven by ubep. A model with an experts
module that bypasses it (Llama 4's ``Llama4TextExperts``, whose MoE block calls it directly) is
refused when it is built with ``experts_implementation="ubep"``, and by :func:`attach` and
:func:`shard_experts`: otherwise ubep would silently never run, and sharding would change what
the model computes.

The model is built on every rank with all experts (same seed = same weights); ubep only ever
reads the local ones, and :func:`shard_experts` drops the rest to save memory. For
data-parallel training, all-reduce the gradients of every *non-expert* parameter over the
data-parallel ranks (experts are rank-local; their gradients already arrive through combine's
backward): see examples/train_step.py.

Accuracy (tested on a tiny seeded config): float32 logits equal the eager single-process
model's within ``rtol=atol=1e-4`` (eager adds the experts' outputs in expert-id order in the model
dtype, ubep in top-k order in float32: the same sum, associated differently).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgumentError, PeerLostError, TimeoutError
from .backend import EPBackend
from .group import held
from .ops import combine, dispatch

__all__ = ["attach", "experts_forward", "generate", "register", "shard_experts"]

NAME = "ubep"

_lock = threading.Lock()
_registry: dict[str, Any] = {}  # the group and Buffer options given to register()
_buffers: dict[tuple[Any, ...], EPBackend] = {}  # lazily built runtime buffers, by shape
_names: set[str] = {NAME}  # every name "ubep" is registered under with transformers

_UNEQUAL_CALLS_HINT = (
    "; if this happened in generate(): the ranks ran different numbers of forward passes "
    "(unequal generate() lengths, e.g. one rank hit EOS first), and every rank must call every "
    "MoE layer equally often: use ubep.torch.hf.generate(model, ...), or "
    "model.generate(..., synced_gpus=True) under torch.distributed, or a fixed length "
    "(min_new_tokens == max_new_tokens)"
)


def register(group: Any = None, *, name: str = NAME, **buffer_options: Any) -> None:
    """Register the experts implementation ``name`` (``"ubep"``) with transformers.

    Args:
        group: the ubep process group (``ubep.launch`` hands one to each rank) or a
            ``torch.distributed`` group (``dist.group.WORLD``, ``dist.new_group(ranks)``). None
            is allowed when every model gets its backend from :func:`attach`.
        name: the key for ``experts_implementation=``.
        buffer_options: ``ubep.BufferConfig`` fields (``layout``, ``engine``, ``sync``,
            ``max_tokens_per_rank``, ...). Buffers are created on first use per
            ``(hidden, num_topk, num_experts, dtype)``; that first MoE forward is collective.
    """
    from transformers.integrations.moe import ExpertsInterface

    with _lock:
        # A torch group is torch's to free (dist.destroy_process_group): held weakly
        # (ubep.torch.group.held), so a registration never keeps its threads alive.
        _registry["group"] = None if group is None else held(group)
        _registry["options"] = dict(buffer_options)
        _buffers.clear()
        _names.add(name)
    ExpertsInterface.register(name, experts_forward)


def attach(model: nn.Module, backend: EPBackend) -> int:
    """Make every experts module of ``model`` use ``backend`` (overrides :func:`register`'s
    group). Returns how many modules were bound. Refuses a model with an experts module ubep
    cannot drive (module docstring)."""
    _check_driven(model, "attach()")
    count = 0
    for module in _experts_modules(model):
        module._ubep_backend = backend
        count += 1
    return count


def shard_experts(model: nn.Module, rank: int, num_ranks: int) -> int:
    """Keep only rank ``rank``'s experts in every experts module (frees the others' memory).

    Returns how many modules were sharded. The model then only runs with ``"ubep"``. Refuses a
    model with an experts module that does not go through transformers' experts interface:
    sharding it would change what the model computes.
    """
    _check_driven(model, "shard_experts()")
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


def generate(model: Any, *args: Any, **kwargs: Any) -> Any:
    """``model.generate(*args, **kwargs)`` on an expert-parallel model, safe when ranks finish
    at different steps (one rank's sequences all hit EOS first).

    Each decoding step, the ranks of the expert-parallel group agree (a small allgather over
    that group) whether any of them still generates; a finished rank keeps running forward
    passes, serving its experts to the others, until all are done (transformers' ``synced_gpus``
    loop, agreed over the EP group instead of the torch.distributed world, so it also works on
    ``ubep.launch`` groups). Each rank's result is what plain ``generate`` returns on its input.
    Collective: every rank of the group calls it.
    """
    if "synced_gpus" in kwargs:
        raise InvalidArgumentError(
            "synced_gpus", kwargs["synced_gpus"], "is implied by ubep.torch.hf.generate"
        )
    if not hasattr(type(model), "_has_unfinished_sequences"):
        raise InvalidArgumentError(
            "model", type(model).__name__,
            "this transformers version has no _has_unfinished_sequences to sync on: use "
            "model.generate(..., synced_gpus=True) with torch.distributed or a fixed length",
        )
    allgather = _group_allgather(model)

    def any_rank_unfinished(this_peer_finished: bool, synced_gpus: bool, device: Any) -> bool:
        return not all(allgather(bool(this_peer_finished)))

    # An instance attribute shadows the method for this call only (transformers' synced_gpus
    # loop asks it once per step; its own version all-reduces over the torch world).
    model._has_unfinished_sequences = any_rank_unfinished
    try:
        return model.generate(*args, synced_gpus=True, **kwargs)
    finally:
        del model._has_unfinished_sequences


def _group_allgather(model: nn.Module) -> Callable[[Any], list[Any]]:
    """The allgather of the group the model's experts run on (attached backend, else the
    registered group)."""
    for module in _experts_modules(model):
        backend = getattr(module, "_ubep_backend", None)
        if backend is not None:
            gather = getattr(backend, "allgather", None)
            if gather is None:
                raise InvalidArgumentError(
                    "backend", type(backend).__name__, "has no allgather(value) to sync steps on"
                )
            return gather
    group = _registered_group()
    from .group import as_ubep_group

    return as_ubep_group(group).allgather


_FORGOT_REGISTER = (
    'experts_implementation="ubep" needs a group: call ubep.torch.hf.register(group, ...) once '
    "per process before the first forward (group: dist.group.WORLD under torchrun, or the group "
    "ubep.launch passes), or bind a backend with ubep.torch.hf.attach(model, backend)"
)


# --------------------------------------------------------------------------- which modules
def _is_experts_like(m: nn.Module) -> bool:
    """A module holding stacked expert weights (what shard_experts would cut)."""
    return (
        (hasattr(m, "gate_up_proj") or hasattr(m, "up_proj"))
        and hasattr(m, "down_proj")
        and hasattr(m, "num_experts")
    )


def _is_driven(m: nn.Module) -> bool:
    """Whether transformers sends the module's forward through ``ExpertsInterface``: the
    ``@use_experts_implementation`` decorator's ``__init__`` sets these attributes, and nothing
    else does."""
    return hasattr(m, "is_concatenated") and hasattr(m, "has_gate")


def _experts_modules(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if _is_experts_like(m) and _is_driven(m)]


def _check_driven(model: nn.Module, what: str) -> None:
    bypass = sorted({type(m).__name__ for m in model.modules()
                     if _is_experts_like(m) and not _is_driven(m)})
    if bypass:
        raise InvalidArgumentError(
            "model", type(model).__name__,
            f"{what}: its experts module(s) {bypass} do not go through transformers' "
            "ExpertsInterface (no @use_experts_implementation; the MoE block calls them "
            'directly), so experts_implementation="ubep" would never run ubep and sharding them '
            "would change what the model computes. ubep cannot run this model expert-parallel; "
            'build it with experts_implementation="eager" (every rank holds every expert)',
        )


def _install_construction_check() -> None:
    """Refuse, when the model is built, ``experts_implementation="ubep"`` on a model whose
    experts bypass the interface.

    transformers never calls ubep for such a module, so model construction is the only place
    to notice: ``PreTrainedModel.post_init`` runs at the end of every model's ``__init__``, with
    all submodules built. It is wrapped once, and the check only runs for ubep's names."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.post_init
    if getattr(original, "_ubep_checks_experts", False):
        return

    @functools.wraps(original)
    def post_init(self: Any) -> None:
        original(self)
        impl = getattr(getattr(self, "config", None), "_experts_implementation", None)
        if impl in _names:
            _check_driven(self, f"experts_implementation={impl!r}")

    post_init._ubep_checks_experts = True  # type: ignore[attr-defined]
    PreTrainedModel.post_init = post_init


def _install() -> None:
    """At import: make ``"ubep"`` a known name (so a forgotten :func:`register` gets ubep's
    message at the first forward, not transformers' generic "not supported") and install the
    construction check."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)
    _install_construction_check()


def _registered_group() -> Any:
    """The group given to :func:`register` (a torch group is held weakly)."""
    ref = _registry.get("group")
    if ref is None:
        raise InvalidArgumentError("group", None, _FORGOT_REGISTER)
    group = ref()
    if group is None:
        raise InvalidArgumentError(
            "group", "destroyed", "the torch.distributed group given to register() is gone "
            "(dist.destroy_process_group ran): register() a live group"
        )
    return group


# --------------------------------------------------------------------------- the forward
def _backend_for(module: Any, hidden_states: torch.Tensor, num_topk: int) -> EPBackend:
    backend = getattr(module, "_ubep_backend", None)
    if backend is not None:
        return backend
    group = _registered_group()
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
    num_tokens = hidden_states.shape[0]
    top_k_index = top_k_index.to(torch.int64).reshape(num_tokens, -1)
    top_k_weights = top_k_weights.reshape(num_tokens, -1).to(torch.float32)
    backend = _backend_for(self, hidden_states, top_k_index.shape[1])
    x = hidden_states.contiguous()
    try:
        res = dispatch(backend, x, top_k_index, top_k_weights)
        return combine(_local_experts(self, backend, res, x), res.handle)
    except (PeerLostError, TimeoutError) as exc:
        raise type(exc)(f"{exc}{_UNEQUAL_CALLS_HINT}") from exc


def _local_experts(self: Any, backend: EPBackend, res: Any, x: torch.Tensor) -> torch.Tensor:
    """This rank's experts on the rows it received, one output row per received row."""
    hidden = x.shape[1]
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
        return torch.cat(pieces).to(x.dtype) if pieces else x.new_zeros((0, hidden))
    acc = torch.zeros((res.recv_x.shape[0], hidden), dtype=torch.float32)
    for local in range(per_rank):
        rows, slot = torch.nonzero(res.recv_topk_idx == local, as_tuple=True)
        if rows.numel():
            h = _expert_ffn(self, base + local, res.recv_x[rows]).to(torch.float32)
            acc = acc.index_add(0, rows, h * res.recv_topk_weights[rows, slot, None])
    return acc.to(x.dtype)


_install()
