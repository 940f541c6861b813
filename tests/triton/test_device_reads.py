"""The Triton engine's calls on tensors read the device back once each: every device-to-host
read goes through ``ubep.triton._tensors.to_host`` (spied on here), no tensor is turned into
host data any other way on the way (``.cpu``, ``.numpy``, ``.item``, ``.tolist``, ``int``,
``bool``, ``__array__`` called from the engine's modules, the Buffer's or the torch bridge's
are spied on too), the results and the handle stay tensors of the engine's device, and they
are bit-exact against ``ubep.reference``; the same through ``ubep.Buffer(transport="triton")``.
A tensor the device check refuses is refused as a host array is."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import ubep
from ubep import Buffer, BufferConfig, reference, testing
from ubep.errors import InvalidArgumentError, RemoteError
from ubep.sched import schedule
from ubep.topology import host
from ubep.trace import spans_of
from ubep.triton import open_engine
from ubep.triton.config import TritonConfig

from ._ranks import NUM_TOPK, Case, storage
from .conftest import needs_triton

pytestmark = needs_triton

# what turns a tensor into host data besides the engine's one read helper
_RAW = ("cpu", "numpy", "item", "tolist", "__array__", "__int__", "__bool__", "__float__",
        "__index__")
# A wait's first pass ends when its peer arrives within the wait's spins; one that does not runs
# again, with a read of its own (by design). The interpreter's default spins (64 polls, a few
# milliseconds) are shorter than a loaded host keeps a peer's process off its CPU, so these
# calls take a GPU's (2^20): every wait here ends by a peer's arrival or its notice, and the
# reads counted are the first pass's.
_SPINS = 1 << 20
_SPIED_FILES = ("triton/engine.py", "triton/units.py", "triton/plane.py", "buffer/buffer.py",
                "buffer/checks.py", "buffer/inflight.py", "torch_bridge.py", "torch/_runtime.py")


class _Reads:
    """Counts the reads of the engine's modules while installed."""

    def __init__(self) -> None:
        self.helper = 0
        self.raw: list[str] = []


@contextmanager
def _spied() -> Iterator[_Reads]:
    import torch

    from ubep.triton import _tensors

    reads = _Reads()
    real_to_host = _tensors.to_host

    def to_host(t: Any) -> np.ndarray:
        reads.helper += 1
        return real_to_host(t)

    def spy(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if caller.endswith(_SPIED_FILES):
                reads.raw.append(f"{name} from {caller.rsplit('/', 1)[-1]}")
            return real(self, *args, **kwargs)
        return method

    saved = {n: getattr(torch.Tensor, n) for n in _RAW}
    _tensors.to_host = to_host
    for n, real in saved.items():
        setattr(torch.Tensor, n, spy(n, real))
    try:
        yield reads
    finally:
        _tensors.to_host = real_to_host
        for n, real in saved.items():
            setattr(torch.Tensor, n, real)


def _tensor(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))


def _one_call(eng: Any, case: Case, tokens: list[int], seed: int,
              plan_of: Callable[[np.ndarray], Any] | None = None) -> list[str]:
    """A dispatch and a combine of tensors (``eng``: the engine or a Buffer; ``plan_of``: the
    engine's ``plan`` for this rank's routing): one read each, device results, bit-exact."""
    import torch

    r, E = eng.rank, eng.config.num_experts
    device = getattr(eng, "device", None) or torch.device("cpu")
    xs, idxs, ws = testing.inputs(case.dtype, E, NUM_TOPK, case.hidden, tokens, seed, "uniform")
    refs = reference.dispatch(xs, idxs, ws, E, layout=case.layout)
    outs = [testing.expert_outputs(case.dtype, ref.recv_x, seed * 10 + q)
            for q, ref in enumerate(refs)]
    errors: list[str] = []
    with _spied() as reads:
        extra = {} if plan_of is None else {"plan": plan_of(idxs[r])}
        res = eng.dispatch(_tensor(xs[r]), _tensor(idxs[r]), _tensor(ws[r]), **extra)
    if (reads.helper, reads.raw) != (1, []):
        errors.append(f"{case}: a dispatch read the device {reads.helper} times through "
                      f"to_host and {reads.raw} otherwise")
    h = res.handle
    for name in ("topk_idx", "topk_weights", "recv_src_rank", "recv_src_token", "recv_src_k",
                 "num_recv_rows_per_rank", "send_dst_row"):
        if not (isinstance(getattr(h, name), torch.Tensor)
                and getattr(h, name).device == device):
            errors.append(f"{case}: handle.{name} is not a tensor of {device}")
    for f in testing.FIELDS:
        got = getattr(res, f)
        if not (isinstance(got, torch.Tensor) and got.device == device):
            errors.append(f"{case}: {f} is not a tensor of {device}")
            continue
        got = storage(got, case.dtype) if f == "recv_x" else got.numpy()
        if not testing.same_bits(got, getattr(refs[r], f)):
            errors.append(f"{case} seed {seed}: {f} differs from the reference")
    if not testing.same_bits(h.send_dst_row.numpy(), refs[r].handle.send_dst_row):
        errors.append(f"{case} seed {seed}: handle.send_dst_row differs from the reference")
    with _spied() as reads:
        y = eng.combine(_tensor(outs[r]), h)
    if (reads.helper, reads.raw) != (1, []):
        errors.append(f"{case}: a combine read the device {reads.helper} times through "
                      f"to_host and {reads.raw} otherwise")
    out_dtype = getattr(eng.config, "out_dtype", None) or case.dtype
    if not (isinstance(y, torch.Tensor) and y.device == device):
        errors.append(f"{case}: y is not a tensor of {device}")
    elif not testing.same_bits(storage(y, out_dtype), reference.combine(outs, refs)[r]):
        errors.append(f"{case} seed {seed}: combine differs from the reference")
    return errors


def device_reads(group: Any, case: Case) -> list[str]:
    """Calls of tensors, one read each; a routing tensor refused on the device on rank 1
    (every peer a clean ``RemoteError``) and the next call exact again."""
    r = group.rank
    out: list[str] = []
    with open_engine(group, case.config(group.num_ranks, 9, timeout_s=120.0,
                                        spins=_SPINS)) as eng:
        out += _one_call(eng, case, [4, 5], 1)
        xs, idxs, ws = testing.inputs(case.dtype, eng.config.num_experts, NUM_TOPK,
                                      case.hidden, [4, 5], 2, "uniform")
        if r == 1:
            idxs[1][2, 1] = idxs[1][2, 0] if idxs[1][2, 0] >= 0 else 0  # one expert twice
            idxs[1][2, 2] = idxs[1][2, 1]
        out += _refused(lambda: eng.dispatch(_tensor(xs[r]), _tensor(idxs[r]), _tensor(ws[r])),
                        r, 1, "topk_idx", "a dispatch with a bad topk_idx tensor on rank 1")
        out += _one_call(eng, case, [6, 3], 3)
        # a whole Plan of the scheduler's (hierarchical issue order, 3 send programs), run as
        # it is; one of another rank is refused by name on the rank given it
        def plan_of(idx: np.ndarray, rank: int = r) -> Any:
            return schedule(idx, host(group.num_ranks, 4), rank=rank,
                            num_experts=eng.config.num_experts, policy="hierarchical",
                            num_send_cores=3, num_count_cores=1, layout=case.layout)

        out += _one_call(eng, case, [7, 4], 4, plan_of)
        xs, idxs, ws = testing.inputs(case.dtype, eng.config.num_experts, NUM_TOPK,
                                      case.hidden, [4, 5], 5, "uniform")
        out += _refused(lambda: eng.dispatch(_tensor(xs[r]), _tensor(idxs[r]), _tensor(ws[r]),
                                             plan=plan_of(idxs[r], 1 - r if r == 0 else r)),
                        r, 0, "plan", "a dispatch with rank 1's Plan on rank 0")
        out += _one_call(eng, case, [2, 6], 6)
    return out


def _refused(call: Callable[[], Any], r: int, culprit: int, argument: str,
             what: str) -> list[str]:
    """``call`` on rank ``r`` with bad input on rank ``culprit``: that rank must raise
    ``InvalidArgumentError`` naming ``argument``, the other a clean ``RemoteError``; what
    differs, described (nothing when both did)."""
    try:
        call()
    except InvalidArgumentError as e:
        return [] if r == culprit and e.argument == argument else [f"rank {r}: {e!r}"]
    except RemoteError as e:
        return [] if r != culprit and e.clean else [f"rank {r}: {e!r}"]
    return [f"rank {r}: {what} passed"]


def buffer_reads(group: Any, case: Case) -> list[str]:
    """The same calls through ``ubep.Buffer(transport="triton")``: the engine brings its own
    memory (the Buffer maps none: the only mapping is the engine's arena), tensors reach the
    engine unconverted, one read per call; the engine's call spans reach ``ubep.trace``
    through the contract (``Engine.trace_spans``)."""
    kinds: list[str] = []
    real_map = group.map_global

    def map_global(size_bytes: int, kind: str, timeout_s: float | None = None) -> Any:
        kinds.append(kind)
        return real_map(size_bytes, kind, timeout_s)

    group.map_global = map_global
    cfg = BufferConfig(max_tokens_per_rank=9, hidden=case.hidden, num_topk=NUM_TOPK,
                       num_experts=4 * group.num_ranks, dtype=case.dtype, layout=case.layout,
                       sync=case.sync, transport="triton", num_cores=2, timeout_s=120.0,
                       trace=True)
    with pytest.MonkeyPatch.context() as mp, Buffer(group, cfg) as buf:
        # the engine the Buffer opens polls as the engine's calls above (_SPINS)
        mp.setattr(TritonConfig, "poll_spins", property(lambda self: _SPINS))
        out = [] if kinds == ["triton"] else [f"mapped {kinds}, not the engine's arena alone"]
        out += _one_call(buf, case, [4, 5], 1) + _one_call(buf, case, [0, 7], 2)
        calls = [c.name for c in spans_of(buf).calls]
        if calls != ["dispatch", "combine"] * 2:
            out.append(f"the engine's call spans: {calls}, not two dispatch/combine pairs")
        return out


_CASES = [Case("tff", "expert", "fp32"), Case("dc", "rank", "fp16"), Case("sp", "expert", "fp32")]


def _assert_clean(results: list[list[str]]) -> None:
    errors = [e for rank in results for e in rank]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("case", _CASES, ids=str)
def test_one_device_read_per_call(case: Case) -> None:
    _assert_clean(ubep.launch(device_reads, 2, case, timeout_s=600))


@pytest.mark.parametrize("case", _CASES[:2], ids=str)
def test_a_buffer_hands_tensors_to_the_engine_unconverted(case: Case) -> None:
    _assert_clean(ubep.launch(buffer_reads, 2, case, timeout_s=600))
