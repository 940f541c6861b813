"""Argument checks of the DeepEP facade, in DeepEP's words: errors name DeepEP's arguments
(``x``, ``handle``) and the facade's knob that fixes them, not ubep's ``BufferConfig``
fields."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import fields
from typing import Any

import torch

from ..errors import InvalidArgumentError

__all__ = [
    "DISPATCH_DTYPES", "check_dispatch_x", "check_ubep_options", "deepep_names", "own_backend",
]

#: the dtypes of DeepEP's dispatched ``x`` (FP8 values travel as their bytes)
DISPATCH_DTYPES = frozenset(
    {torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8,
     torch.float8_e4m3fn, torch.float8_e5m2})


def check_dispatch_x(x: torch.Tensor, max_tokens_per_rank: int) -> None:
    """A normal-mode ``x`` the facade's Buffer can carry (its dtype, its token count)."""
    if x.dtype not in DISPATCH_DTYPES:
        raise InvalidArgumentError(
            "x", x.dtype, "must be torch.bfloat16, float16, float32, int8, uint8 or an FP8 "
            "type (with its scales: x=(values, scales)), as DeepEP's dispatch")
    num_tokens = int(x.shape[0])
    if num_tokens > max_tokens_per_rank:
        raise InvalidArgumentError(
            "x", tuple(x.shape),
            f"has {num_tokens} tokens, more than this Buffer holds per rank: pass "
            f"deep_ep.Buffer(group, ..., max_tokens_per_rank={num_tokens}) (ubep sizes its "
            "receive regions from it, not from num_nvl_bytes; docs/PORTING.md)")


@contextlib.contextmanager
def deepep_names() -> Iterator[None]:
    """Raise an error of ubep's Buffer under the names of DeepEP's call: a combine's expert
    outputs are DeepEP's ``x``, which must keep the dispatched ``x``'s dtype."""
    try:
        yield
    except InvalidArgumentError as exc:
        if exc.argument != "expert_out":
            raise
        problem = exc.problem.replace("must have combine_dtype", "must have the dtype of the "
                                      "dispatched x, as DeepEP's combine")
        raise InvalidArgumentError("x", exc.value, problem) from None


def own_backend(handle: Any, ep: Any, backends: Iterable[Any]) -> Any:
    """The buffer ``handle``'s rows went through, if it is one of this Buffer's ``backends``
    (``ep``: the Buffer's group; the in-process world has one backend a layout, made anew)."""
    from .backend import LocalBackend

    backend = handle.backend
    if isinstance(ep, LocalBackend):
        return backend
    if all(b is not backend for b in backends):
        raise InvalidArgumentError(
            "handle", type(handle).__name__,
            "comes from a dispatch of another deep_ep.Buffer: combine on the Buffer that "
            "dispatched it")
    return backend


def check_ubep_options(options: dict[str, Any], shape_fields: Iterable[str]) -> None:
    """Every extra keyword must be a ``ubep.BufferConfig`` option with a valid value, so a typo
    fails at construction, not at the first call (``shape_fields``: the fields the facade sets
    from each call's shape)."""
    from ..config import BufferConfig

    allowed = {f.name for f in fields(BufferConfig)} - set(shape_fields) - {"expert_ranks"}
    for name, value in options.items():
        if name not in allowed:
            raise InvalidArgumentError(
                name, value,
                f"is neither a DeepEP Buffer argument nor a ubep.BufferConfig option "
                f"({', '.join(sorted(allowed))})",
            )
    # The shape here is a placeholder; the options' own checks are what runs.
    BufferConfig(
        max_tokens_per_rank=1, hidden=1, num_topk=1, num_experts=1, dtype="bf16", **options
    )
