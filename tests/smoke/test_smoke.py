"""The smoke suite: what must work on every CPython ubep claims (``requires-python``).

CI runs the whole suite on one interpreter and this package on every other one the machine has
(tests/smoke/run_pythons.sh): the native build, the result objects the native one-call path
builds (their layout changed in CPython 3.13), dispatch and combine in every engine x sync x
layout bit-exact against the reference, the MPI engine where mpi4py installs, and torch in,
torch out where torch installs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ubep
from ubep import reference, testing
from ubep.modes import Mode, enumerate_modes

_MODES = [str(m) for m in enumerate_modes(rotate_dtypes=True)]
_SHAPE = {"num_experts": 8, "num_topk": 2, "hidden": 256}
_TOKENS = [6, 3]


def _config(mode: Mode, **extra: Any) -> ubep.BufferConfig:
    return ubep.BufferConfig(max_tokens_per_rank=8, dtype=mode.dtype, engine=mode.engine,
                             sync=mode.sync, layout=mode.layout, **_SHAPE, **extra)


def _every_field(obj: Any) -> list[str]:
    """The fields of a frozen result that cannot be read (the 3.13 failure: in ``__dict__``,
    not found by attribute lookup)."""
    missing = []
    for f in dataclasses.fields(obj):
        try:
            getattr(obj, f.name)
        except AttributeError:
            missing.append(f"{type(obj).__name__}.{f.name}")
    return missing


def _worker_modes(group: Any, modes: list[str]) -> list[str]:
    errors: list[str] = []
    for seed, text in enumerate(modes):
        mode = Mode.parse(text)
        xs, idxs, ws = testing.inputs(mode.dtype, _SHAPE["num_experts"], _SHAPE["num_topk"],
                                      _SHAPE["hidden"], _TOKENS, seed, "uniform")
        with ubep.Buffer(group, _config(mode)) as buf:
            r = buf.rank
            # the one native call (exact numpy arrays), twice so a receive region is reused
            errors += [f"{text}: {e}" for e in testing.check_call(buf, xs, idxs, ws, seed)]
            res = buf.dispatch(xs[r], idxs[r], ws[r])
            errors += [f"{text}: {e}" for e in _every_field(res) + _every_field(res.handle)]
            # the general path (copy=True) and a split-phase call build the same result
            ref = reference.dispatch(xs, idxs, ws, _SHAPE["num_experts"],
                                     layout=mode.layout)[r]
            copied = buf.dispatch(xs[r], idxs[r], ws[r], copy=True)
            hooked = buf.dispatch(xs[r], idxs[r], ws[r], return_recv_hook=True).hook()
            for name, got in (("copy", copied), ("hook", hooked)):
                errors += [f"{text} {name}: {e}" for e in testing.compare(got, ref)]
    return errors


def test_every_engine_sync_layout_on_this_python() -> None:
    errors = ubep.launch(_worker_modes, 2, _MODES, timeout_s=300)
    assert errors == [[], []]


def test_mpi_engine_over_tcp_rma_on_this_python(tmp_path: Path) -> None:
    from tests.mpi.test_mpi import _TCP, _selftest

    _selftest(tmp_path, 2, _TCP, {"UBEP_DIST_FORCE_RMA": "1"}, hosts=2)


def _worker_torch(group: Any) -> list[str]:
    import torch

    mode = Mode.parse("asp:tff:expert:bf16")
    xs, idxs, ws = testing.inputs("bf16", _SHAPE["num_experts"], _SHAPE["num_topk"],
                                  _SHAPE["hidden"], _TOKENS, 7, "uniform")
    r = group.rank
    x = torch.from_numpy(xs[r]).view(torch.bfloat16)
    refs = reference.dispatch(xs, idxs, ws, _SHAPE["num_experts"], layout="expert")
    with ubep.Buffer(group, _config(mode)) as buf:
        res = buf.dispatch(x, torch.from_numpy(idxs[r]), torch.from_numpy(ws[r]))
        errors = [] if res.recv_x.dtype == torch.bfloat16 else [f"recv_x {res.recv_x.dtype}"]
        y = buf.combine(res.recv_x, res.handle)
    y_ref = reference.combine([ref.recv_x for ref in refs], refs)[r]
    if not (isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16):
        errors.append(f"y is {type(y).__name__} {getattr(y, 'dtype', None)}")
    elif not np.array_equal(y.view(torch.uint16).numpy(), y_ref):
        errors.append("combine differs")
    return errors


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed for this interpreter")
def test_torch_in_torch_out_on_this_python() -> None:
    assert ubep.launch(_worker_torch, 2) == [[], []]
