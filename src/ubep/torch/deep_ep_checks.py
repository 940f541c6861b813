"""Argument checks of the DeepEP facade, in DeepEP's words: errors name DeepEP's arguments
(``x``, ``handle``) and the facade's knob that fixes them, not ubep's ``BufferConfig``
fields."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any, TypeVar

import numpy as np
import torch

from ..buffer.signature import Signature
from ..dtypes import dtype_of
from ..errors import InvalidArgumentError
from ..plane.results import PendingCall

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "DISPATCH_DTYPES", "CallGate", "check_device", "check_dispatch_x", "check_ubep_options",
    "deepep_error", "facade_group", "gated", "key_signature", "own_backend",
]

#: the dtypes of DeepEP's dispatched ``x`` (FP8 values travel as their bytes)
DISPATCH_DTYPES = frozenset(
    {torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8,
     torch.float8_e4m3fn, torch.float8_e5m2})


def check_device(**tensors: Any) -> None:
    """Each tensor given (None: not given) lies on the host, where ubep's engines read it: a
    device tensor (CUDA, ``meta``) is bad input naming the argument and its device."""
    for name, t in tensors.items():
        if t is None or (type(t) is torch.Tensor and t.is_cpu):  # a decode step's: the fast look
            continue
        if isinstance(t, tuple):  # (values, scales)
            check_device(**{name: t[0], f"{name}[1]": t[1]})
        elif isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise InvalidArgumentError(
                name, t.device, f"must be a CPU tensor (it is on device {t.device}): ubep's "
                "engines move host memory")


def _empty_call(buffer: Any) -> tuple[Any, Any, Any]:
    """The arguments of a dispatch of no tokens on ``buffer`` (a switch): numpy arrays, or
    tensors where its engine takes them (what reaches it is then a tensor, as every call)."""
    cfg = buffer.config
    hidden, k = int(cfg.hidden), int(cfg.num_topk)
    storage = dtype_of(cfg.dtype).storage
    if not getattr(buffer.engine, "takes_tensors", False):
        return (np.empty((0, hidden), storage), np.empty((0, k), np.int64),
                np.empty((0, k), np.float32))
    x = torch.from_numpy(np.empty((0, hidden), storage))
    return (x.view(torch.bfloat16) if cfg.dtype == "bf16" else x,
            torch.empty((0, k), dtype=torch.int64), torch.empty((0, k), dtype=torch.float32))


def check_dispatch_x(x: torch.Tensor, max_tokens_per_rank: int) -> None:
    """A normal-mode ``x`` the facade's Buffer can carry (its device, its dtype, its token
    count)."""
    check_device(x=x)
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


def deepep_error(exc: InvalidArgumentError) -> InvalidArgumentError:
    """An error of ubep's Buffer under the names of DeepEP's call: a combine's expert outputs
    are DeepEP's ``x``, which must keep the dispatched ``x``'s dtype (other errors as they
    are)."""
    if exc.argument != "expert_out":
        return exc
    problem = exc.problem.replace("must have combine_dtype", "must have the dtype of the "
                                  "dispatched x, as DeepEP's combine")
    return InvalidArgumentError("x", exc.value, problem)


def own_backend(handle: Any, backends: Any, gate: CallGate | None = None) -> Any:
    """The buffer ``handle``'s rows went through, if it is one of ``backends``' (the facade's
    :class:`.deep_ep_core.Backends`; the in-process world has one backend a layout, made
    anew); with ``gate``, the combine is the next call on it (:meth:`CallGate.combine_on`)."""
    backend = handle.backend
    if backends.local:
        return backend
    for mine in backends.table.values():
        if mine is backend:
            break
    else:
        raise InvalidArgumentError(
            "handle", type(handle).__name__,
            "comes from a dispatch of another deep_ep.Buffer: combine on the Buffer that "
            "dispatched it")
    if gate is not None:
        gate.combine_on(backend)
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


def key_signature(key: tuple[Any, ...], call: str | None = None,
                  dtype: torch.dtype | None = None) -> Signature:
    """The signature of a call on the facade's Buffer of ``key`` (``deep_ep_core.Backends``'
    key: layout, hidden, num_topk, num_experts, dtype, max_tokens, combine dtype, quant,
    round_scale); ``call`` and ``dtype`` where the call says more than its Buffer (V2's rows
    travel as bytes: their dtype is the caller's ``x``'s)."""
    layout, hidden, num_topk, num_experts, key_dtype, max_tokens, _, quant, round_scale = key
    expert = layout == "expert"
    flags = {"expert_layout"} if expert else set()
    if quant is not None:
        flags.add("use_fp8")
    if round_scale:
        flags.add("round_scale")
    return Signature(
        call=call or ("low_latency_dispatch" if expert else "dispatch"),
        dtype=str(dtype if dtype is not None else key_dtype).removeprefix("torch."),
        hidden=int(hidden), num_experts=int(num_experts), capacity=int(max_tokens),
        num_topk=int(num_topk), flags=frozenset(flags))


_NO_NOTE: tuple[str | None, torch.dtype | None] = (None, None)


class CallGate:
    """A facade's calls kept in step across its Buffers (one per shape, made on first use),
    with no round of their own.

    Every rank makes its calls on the Buffer of its previous call, ``last``, or moves: a rank
    whose call needs another Buffer first makes an empty dispatch on ``last`` signed with the
    next call's signature and the ``switch`` flag. A peer that stays makes its own call on
    ``last``, a peer that moves elsewhere its own switch: the words differ, and the engine's
    count round rejects the call on every rank, naming what differs, before any row moves
    (``ubep.buffer.signature``); ranks that all move the same way pair their switches and go
    on. So no rank enters one Buffer's collective (a call, or the first call's construction)
    while a peer is in another's. A call refused by the facade's own checks before it reached a
    Buffer is rejected on ``last`` (``Buffer.reject``), where the peers' call is, so theirs
    raises ``RemoteError`` at once; before any Buffer exists, through the construction's
    all-gather the peers are in (``ubep.Buffer``'s).
    """

    def __init__(self, ep: Any, rank: int) -> None:
        self._ep = ep
        self.rank = rank
        self.last: Any = None  # the backend of the previous call (every rank's)
        self.entered = 0  # calls that reached a Buffer (gated: which errors are the Buffer's)
        self._signed: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next: tuple[str | None, torch.dtype | None] = _NO_NOTE
        self._sigs: dict[tuple[Any, ...], Signature] = {}  # by (key, call, dtype)
        self._plain: tuple[Any, ...] | None = None  # last's key, signed with no note

    def note(self, call: str | None = None, dtype: torch.dtype | None = None) -> None:
        """What the next call says beyond its Buffer's key (taken by :meth:`signature`)."""
        self._next = (call, dtype)

    def signature(self, key: tuple[Any, ...]) -> Signature:
        """The next call's signature on the Buffer of ``key`` (with what :meth:`note` said),
        made once per distinct call (a decode step meets this on every call)."""
        call, dtype = self._next
        self._next = _NO_NOTE
        sig = self._sigs.get((key, call, dtype))
        if sig is None:
            sig = self._sigs[(key, call, dtype)] = key_signature(key, call, dtype)
        return sig

    def leave(self, sig: Signature) -> None:
        """This rank's next call is not on ``last`` (a Buffer still to be made, or another):
        the switch on ``last`` first (collective)."""
        last = self.last
        buffer = getattr(last, "buffer", None)
        if buffer is None:
            return
        self._plain = None
        self.entered += 1
        if not self._sign(last, dataclasses.replace(sig, flags=sig.flags | {"switch"}).word):
            return  # an engine that compares no words would pair the switch with a real call
        got = buffer.dispatch(*_empty_call(buffer))
        if isinstance(got, PendingCall):  # calls in flight there: this one is split too
            got.hook()

    def enter(self, backend: Any, key: tuple[Any, ...]) -> Any:
        """The next call is on ``backend``, the Buffer of ``key`` (made already): switch to it
        if it is not ``last``, and sign it. Returns ``backend``."""
        if backend is self.last and self._next is _NO_NOTE and key == self._plain:
            self.entered += 1  # the previous call's Buffer, signed alike: nothing to do
            return backend
        plain = self._next is _NO_NOTE
        sig = self.signature(key)
        if backend is not self.last and self.last is not None:
            self.leave(sig)
        self.arrive(backend, sig)
        self._plain = key if plain else None
        return backend

    def made(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """The next call is on a new Buffer of ``key``: the switch on ``last``, then ``make``
        (the construction, collective), and sign it. Returns the new backend."""
        sig = self.signature(key)
        self.leave(sig)
        backend = make()
        self.arrive(backend, sig)
        return backend

    def combine_on(self, backend: Any) -> None:
        """The next call is a combine on ``backend`` (its dispatch's): a switch first if the
        last call was elsewhere (a combine carries no signature of its own: its dispatch's
        index, which every rank's must match, is the engine's check)."""
        if backend is not self.last and self.last is not None:
            cfg = getattr(getattr(backend, "buffer", None), "config", None)
            self.leave(Signature("combine", hidden=int(getattr(cfg, "hidden", 0)),
                                 num_experts=int(getattr(cfg, "num_experts", 0))))
        self.entered += 1
        self.last = backend

    def back_to(self, backend: Any) -> None:
        """``backend`` takes the next call again, with no switch from the Buffer of the call
        just made: only after a call that every rank making it entered by a switch from
        ``backend`` (a combine's weights through a Buffer of their own). A rank whose next
        call is elsewhere then switches from ``backend``, where every peer's next call is; a
        rank that made no such call never left ``backend`` and fails with the peers' switch."""
        self._plain = None
        self.last = backend

    def arrive(self, backend: Any, sig: Signature) -> None:
        """``backend`` (just made, or switched to) takes the next call."""
        self._plain = None
        self.entered += 1
        self._sign(backend, sig.word)
        self.last = backend

    def _sign(self, backend: Any, word: int) -> bool:
        """Sign ``backend``'s Buffer with ``word``; False where its engine compares none."""
        buffer = getattr(backend, "buffer", None)
        if buffer is None:
            return False
        if self._signed.get(backend) == word:
            return True
        sign = getattr(buffer, "sign", None)
        if sign is None or not sign(word):
            return False
        self._signed[backend] = word
        return True

    def reject(self, error: InvalidArgumentError) -> BaseException:
        """This rank's call failed the facade's checks: fail it where the peers' call is (the
        Buffer of the previous call, or the first Buffer's construction). Returns the
        exception to raise."""
        buffer = getattr(self.last, "buffer", None)
        if buffer is not None:
            return buffer.reject(error)
        # the in-process world (its backends are the world's, never ``last``): the failure
        # takes this rank's inputs' place in the peers' exchange
        post = getattr(self._ep if self.last is None else self.last, "reject", None)
        if post is not None:
            post(f"rank {self.rank}: {error}")
            return error
        if self.last is None and hasattr(self._ep, "allgather") and not hasattr(
            self._ep, "with_layout"  # the in-process world: no collective to pair with
        ):
            # the record ubep.Buffer's construction exchanges: its peers raise RemoteError
            self._ep.allgather({"config": None, "error": f"rank {self.rank}: {error}",
                                "uid": 0})
        return error


def gated(method: F) -> F:
    """A facade call whose checks fail on every rank: an ``InvalidArgumentError`` raised
    before the call reached a Buffer is rejected through the facade's :class:`CallGate`
    (``self.core.gate``, its ``deep_ep_core.FacadeCore``'s); one a Buffer raised was already
    told to the peers."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        core = self.core
        # shrink mode: the masking Buffers' agreement handles a silent rank
        gate: CallGate | None = core.gate if core.shrink is None else None
        mark = -1 if gate is None else gate.entered
        try:
            return method(self, *args, **kwargs)
        except InvalidArgumentError as exc:
            if gate is None or gate.entered != mark:
                raise
            raise gate.reject(exc) from None

    return call  # type: ignore[return-value]


def facade_group(group: Any, comm: Any) -> Any:
    """The ubep group behind DeepEP's ``group`` (or ``comm``): a bad one is named."""
    if group is None and comm is None:
        raise InvalidArgumentError("group", None, "either 'group' or 'comm' must be given")
    if group is None:
        from ..mpi import init

        return init(comm)
    from .backend import LocalBackend

    if isinstance(group, LocalBackend):
        return group
    from .group import from_torch, is_torch_group
    if is_torch_group(group):
        # Collective the first time per torch group; every ubep buffer of it shares the result.
        return from_torch(group)
    if all(isinstance(getattr(group, a, None), int) for a in ("rank", "num_ranks")) and hasattr(
        group, "allgather"
    ):
        return group
    raise InvalidArgumentError(
        "group", type(group).__name__,
        "must be a torch.distributed ProcessGroup or a ubep group (ubep.launch, ubep.mpi)",
    )
