"""What the DeepEP facades' call paths share: :class:`FacadeCore`.

The V1 ``Buffer`` (:mod:`ubep.torch.deep_ep`) builds one core and hands it to each of its call
paths (low-latency, internode, the mask buffer), and the V2 buffers
(:mod:`ubep.torch.deep_ep_v2`) take the core of the V1 ``Buffer`` they are built over. A path
reads what it needs through the core's public names and never holds the facade, so no class
reaches another's private state and nothing refers back to the facade.

The core itself is frozen (the group, this rank's place, the options, the roles); what changes
lives in the two objects it holds: :class:`Backends` (the ubep Buffers made per call shape, and
the dispatch that sends through them) and :class:`Exchange` (the exchanges the calls that still
need every rank's value make).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from ..errors import InvalidArgumentError, RemoteError
from ..modes import Layout
from ..quant import quantize
from ..trace.recorder import name_buffer
from ._convert import to_numpy
from .backend import EPBackend, LocalBackend, issue_dispatch
from .deep_ep_agree import Board, RowCarrier, open_board, send_backend, sum_at_sources
from .deep_ep_checks import CallGate
from .deep_ep_m2n import M2NRoles
from .deep_ep_shrink import MaskedBackend, ShrinkGroup

__all__ = ["Backends", "Exchange", "FacadeCore", "Sent"]

T = TypeVar("T")

_UNOPENED = object()  # Exchange.board before the first exchange
_TRACE_NAMES = {"rank": "deep_ep normal", "expert": "deep_ep low-latency",  # by ubep layout
                "expert_padded": "deep_ep low-latency"}
# what Backends.send returns: receive (the result and the received float32 scales, or None)
# and the backend the rows went through
Sent = tuple[Callable[[], tuple[Any, np.ndarray | None]], EPBackend]


class Backends:
    """A facade's ubep Buffers (as ``EPBackend``s), one per call shape, made on first use
    (collective, every rank moving to it together: :class:`.deep_ep_checks.CallGate`), or over
    shrink mode's members; and the dispatch that sends a call's rows through them.

    ``ep``: the facade's ubep group (or the in-process world, which has one backend a layout);
    ``options``: the ``BufferConfig`` options every Buffer takes (the facade's
    ``ubep_options``)."""

    def __init__(self, ep: Any, options: dict[str, Any], gate: CallGate,
                 shrink: ShrinkGroup | None, group_size: int) -> None:
        self.ep = ep
        self.local = isinstance(ep, LocalBackend)
        self.options = options
        self.gate = gate
        self.shrink = shrink
        self.group_size = group_size
        # by (layout, hidden, num_topk, num_experts, dtype, max_tokens, combine_dtype, quant,
        # round_scale)
        self.table: dict[tuple[Any, ...], EPBackend] = {}
        self.closed = False

    def check_alive(self) -> None:
        if self.closed:
            raise InvalidArgumentError("self", "destroyed", "this Buffer was destroyed")

    def get(
        self,
        layout: Layout,
        hidden: int,
        num_topk: int,
        num_experts: int,
        dtype: torch.dtype,
        max_tokens: int,
        combine_dtype: torch.dtype | None = None,
        quant: str | None = None,
        round_scale: bool = False,
    ) -> EPBackend:
        """The backend of these shapes, taking the next call (made first if there is none)."""
        self.check_alive()
        if self.local:
            return self.ep.with_layout(layout)
        key = (layout, hidden, num_topk, num_experts, dtype, max_tokens, combine_dtype, quant,
               round_scale)
        cached = self.table.get(key)
        if cached is not None and (
            self.shrink is None or self.shrink.current(getattr(cached, "buffer", None))
        ):
            return cached if self.shrink is not None else self.gate.enter(cached, key)
        from ._runtime import buffer_config, make_backend, ubep_dtype_name

        options = dict(self.options)
        if combine_dtype is not None:
            options["combine_dtype"] = ubep_dtype_name(combine_dtype)
        if quant is not None:
            options.update(quant=quant, quant_round_scale=round_scale)
        one_byte = dtype in (torch.uint8, torch.int8) or quant is not None
        if one_byte and options.get("sync") == "sp":
            # FP8 rows have no free bit pattern for SP's sentinel: use token-flag fusion.
            options["sync"] = "tff"
        shape = dict(hidden=hidden, num_topk=num_topk, num_experts=num_experts, dtype=dtype,
                     max_tokens_per_rank=max_tokens, layout=layout, **options)
        if self.shrink is None:  # every rank moves to it, or none (deep_ep_checks.CallGate)
            self.table[key] = self.gate.made(key, lambda: make_backend(self.ep, **shape))
        else:  # over the members (a shrink-mode facade: ubep.torch.deep_ep_shrink)
            config = buffer_config(on_peer_loss="mask", **shape)
            self.table[key] = MaskedBackend(self.shrink.build(config))
        if (buffer := getattr(self.table[key], "buffer", None)) is not None:  # ubep's
            name_buffer(buffer, _TRACE_NAMES[layout])
        return self.table[key]

    def cached(self, layout: Layout, hidden: int, num_topk: int, num_experts: int,
               dtype: torch.dtype, max_tokens: int, combine_dtype: torch.dtype | None = None,
               quant: str | None = None, round_scale: bool = False) -> EPBackend | None:
        """As :meth:`get`, where the backend of these shapes exists already (a decode loop's:
        its configuration was checked when it was made) on ubep's Buffers without shrink mode;
        else None (nothing done)."""
        if self.local or self.shrink is not None or self.closed:
            return None
        key = (layout, hidden, num_topk, num_experts, dtype, max_tokens, combine_dtype, quant,
               round_scale)
        cached = self.table.get(key)
        return None if cached is None else self.gate.enter(cached, key)

    def send(
        self,
        layout: Layout,
        x: torch.Tensor,
        scales: torch.Tensor | None,
        idx: np.ndarray,
        w: np.ndarray,
        num_experts: int,
        max_tokens: int,
        split: bool = False,
        round_scale: bool | None = None,
    ) -> Sent:
        """Dispatch ``x``. Returns ``receive``, which returns the dispatch's result and the
        received float32 scales (or None), and the backend the rows go through. With ``split``
        the dispatch is only issued (``return_recv_hook``) and ``receive`` runs its receive half.

        FP8 (DeepEP's FP8 dispatch / BF16 combine) is one dispatch on a quantising Buffer
        (``BufferConfig.quant``, combine in BF16): with ``round_scale`` not None (low-latency,
        ``x`` BF16) the engine quantises each token once; with ``scales`` (normal mode, ``x``
        already FP8) values and scales travel as they are. The in-process world has no
        engine: values and scales take two of its (reference) dispatches.
        """
        def issue(x: torch.Tensor, scales: torch.Tensor | None, split: bool) -> Sent:
            send = functools.partial(issue_dispatch, split=split)
            shape = (layout, x.shape[1], idx.shape[1], num_experts)
            fp8 = round_scale is not None or scales is not None
            if fp8 and not self.local:
                backend = send_backend(self, layout, x.shape[1], idx.shape[1], num_experts,
                                       x.dtype, max_tokens, scales is not None, round_scale)
                if scales is None:
                    call = send(backend, to_numpy(x), idx, w)
                else:
                    call = send(backend, to_numpy(x.contiguous().view(torch.uint8)), idx, w,
                                to_numpy(scales.to(torch.float32).contiguous()))
                return (lambda: _with_scales(call.hook())), backend
            if round_scale is not None:  # the in-process world quantises with ubep.quant
                values_np, scales_np = quantize(to_numpy(x), "e4m3", round_scale=round_scale)
                x, scales = torch.from_numpy(values_np), torch.from_numpy(scales_np)
            backend = self.get(*shape, torch.uint8 if fp8 else x.dtype, max_tokens)
            rows = send(backend, to_numpy(x.contiguous().view(torch.uint8) if fp8 else x), idx, w)
            if scales is None:
                return (lambda: (rows.hook(), None)), backend
            scale_rows = send(self.get(layout, scales.shape[1], idx.shape[1], num_experts,
                                       torch.float32, max_tokens),
                              to_numpy(scales.to(torch.float32).contiguous()), idx, w)
            return (lambda: (rows.hook(), np.array(scale_rows.hook().recv_x))), backend

        if self.shrink is not None:  # masking Buffers run blocking calls
            return self.shrink.call(lambda: issue(x, scales, False))
        return issue(x, scales, split)

    def weights_back(self, backend: EPBackend, values: torch.Tensor, recv_counts: np.ndarray,
                     in_rank: np.ndarray, most_received: int, capacity: int) -> torch.Tensor:
        """A combine's float32 weights ``values`` (a row per received row) summed at their
        sources (:func:`.deep_ep_agree.sum_at_sources`; the V1 and V2 facades'): as rows of the
        dispatch's ``backend`` where they carry them (:class:`.deep_ep_agree.RowCarrier`; no
        carrier without a Buffer, in-process or in shrink mode), that call signed as the
        combine's weights (a rank that passed none, its next call another, fails with it);
        else a float32 rank-layout Buffer of their width (``capacity`` rows a rank), entered by
        a switch and left with none (``CallGate.back_to``). ``most_received``: the rows the
        busiest rank sends back (every rank's same)."""
        width = int(values.shape[1])
        config = getattr(getattr(backend, "buffer", None), "config", None)
        carrier = None if config is None or self.shrink is not None else RowCarrier.of(
            config, width, most_received)
        if carrier is not None:
            self.gate.note("combine_weights")
            self.gate.enter(backend, next(k for k, b in self.table.items() if b is backend))
            return sum_at_sources(backend, values, recv_counts, in_rank, carrier)
        back = self.get("rank", width, 1, self.group_size, torch.float32, capacity)
        summed = sum_at_sources(back, values, recv_counts, in_rank)
        if self.shrink is None and not self.local:
            self.gate.back_to(backend)  # no switch back: the next call is there
        return summed

    def close(self) -> None:
        """Release every Buffer; later calls raise (``check_alive``)."""
        for backend in self.table.values():
            close = getattr(backend, "close", None)
            if close is not None:
                close()
        self.table.clear()
        self.closed = True


class Exchange:
    """The exchanges of the calls that still need a value of every rank: through shared memory
    on one host (:class:`.deep_ep_agree.Board`, opened by the first), else the group's
    all-gather."""

    def __init__(self, ep: Any, rank: int) -> None:
        self.ep = ep
        self.rank = rank
        self.board: object = _UNOPENED  # a Board, or None where there is none (or closed)

    def opened_board(self) -> Board | None:
        """The Board, opened by the first call that needs it (collective), or None where there
        is none (another host, another machine than x86-64, closed)."""
        if self.board is _UNOPENED:
            self.board = open_board(self.ep)
        return self.board if isinstance(self.board, Board) else None

    def allgather(self, value: Any) -> list[Any]:
        """Every rank's JSON ``value`` (collective)."""
        gather: Callable[[Any], list[Any]] = self.ep.allgather
        board = self.opened_board()
        if board is not None:
            return board.allgather(value, gather)
        return list(gather(value))

    def agree(self, check: Callable[[], Any], summary: Callable[[Any], Any]) -> tuple[Any, list]:
        """Run the local ``check`` then exchange ``summary(result)`` with every rank, so that a
        rank's bad input fails the call on every rank (RemoteError on the others) instead of
        leaving them waiting in a collective. Returns ``(result, everyone's summaries)``."""
        failure: InvalidArgumentError | None = None
        try:
            result = check()
            mine: list[Any] = [None, summary(result)]
        except InvalidArgumentError as exc:
            failure, result, mine = exc, None, [f"rank {self.rank}: {exc}", None]
        everyone = self.allgather(mine)
        if failure is not None:
            raise failure
        for r, (error, _) in enumerate(everyone):
            if error is not None:
                raise RemoteError(r, error)
        return result, [s for _, s in everyone]

    def close(self) -> None:
        if isinstance(self.board, Board):
            self.board.close()
        self.board = None


@dataclass(frozen=True, eq=False)
class FacadeCore:
    """What a facade's call paths share (module docstring): the group (``ep``, the in-process
    world too), this rank and the group's size, each rank's host, the normal-mode capacity, the
    ``BufferConfig`` options of every call's Buffer, M2N's roles, shrink mode's members (None
    without it), the call gate, the Buffers per call shape and the exchanges."""

    ep: Any
    rank: int
    group_size: int
    host_of: np.ndarray  # [group_size] host index of every rank
    max_tokens_per_rank: int
    options: dict[str, Any]
    roles: M2NRoles
    shrink: ShrinkGroup | None
    gate: CallGate
    backends: Backends
    exchange: Exchange

    @property
    def local(self) -> bool:
        """Whether the group is the in-process world (no ubep Buffer under it)."""
        return self.backends.local

    def check_alive(self) -> None:
        self.backends.check_alive()

    def collective(self, run: Callable[[], T]) -> T:
        """Run one low-latency call; in shrink mode over the members (a rank lost in it is
        masked, ubep.torch.deep_ep_shrink)."""
        return run() if self.shrink is None else self.shrink.call(run)

    @functools.cached_property
    def num_hosts(self) -> int:
        """Hosts of the group (read on every normal-mode call: counted once)."""
        return int(self.host_of.max(initial=0)) + 1

    def tokens_per_host(self, in_rank: np.ndarray) -> np.ndarray:
        """``[num_tokens, num_hosts]`` bool: the token goes to a rank of that host."""
        out = np.zeros((in_rank.shape[0], self.num_hosts), dtype=bool)
        for h in range(out.shape[1]):
            out[:, h] = in_rank[:, self.host_of == h].any(axis=1)
        return out


def _with_scales(res: Any) -> tuple[Any, np.ndarray | None]:
    return res, res.recv_x_scales
