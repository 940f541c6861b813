"""The worlds the conformance suite runs a rank's body in, one per registered engine: the
native one-host engine (``"shm"``, processes of ``ubep.launch``), the MPI RMA engine (``"mpi"``,
ranks as threads on the in-process RMA transport of ``tests/mpi/_fake_rma.py``: the real
``RmaEngine``, no MPI needed), the pure-numpy engine (``"numpy"``, threads) and the Triton
engine (``"triton"``, processes of ``ubep.launch`` whose group names the transport, so each
body's config does: :func:`transport`; skipped without triton)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.mpi._fake_rma import FakeGroup, FakeWorld, run_ranks
from tests.plane.numpy_engine import NumpyGroup, NumpyWorld, register
from ubep import launch
from ubep.runtime.launch import LostRank
from ubep.triton import INSTALL_HINT, triton_available

__all__ = ["ENGINES", "LostRank", "TransportGroup", "die", "run", "transport"]

register()  # the numpy engine's one registry row

ENGINES = ("shm", "mpi", "numpy", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason=f"triton (or torch) is not installed: {INSTALL_HINT}")))


class TransportGroup:
    """A rank's group that names the transport its Buffers use (every other attribute is
    the group's)."""

    def __init__(self, group: Any, transport: str) -> None:
        self._group = group
        self.transport = transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def transport(group: Any) -> str | None:
    """The ``BufferConfig.transport`` of this world (``None``: the memory's)."""
    return getattr(group, "transport", None) if isinstance(group, TransportGroup) else None


def _in_triton_world(group: Any, body: Callable[..., Any], *args: Any) -> Any:
    return body(TransportGroup(group, "triton"), *args)


def run(engine: str, num_ranks: int, body: Callable[..., Any], *args: Any,
        timeout_s: float = 120.0, lossy: bool = False) -> list[Any]:
    """``body(group, *args)`` on every rank of a world of ``engine``; the results in rank order
    (``lossy``: a rank that died is a ``LostRank``)."""
    if engine == "shm":
        return launch(body, num_ranks, *args, timeout_s=timeout_s, keep_survivors=lossy)
    if engine == "triton":
        return launch(_in_triton_world, num_ranks, body, *args, timeout_s=timeout_s,
                      keep_survivors=lossy)
    if engine == "mpi":
        return run_ranks(FakeWorld(num_ranks), lambda g: body(g, *args), timeout_s)
    world = NumpyWorld(num_ranks)
    results: list[Any] = [None] * num_ranks
    errors: list[BaseException | None] = [None] * num_ranks

    def main(r: int) -> None:
        try:
            results[r] = body(world.groups[r], *args)
        except BaseException as exc:  # re-raised below
            errors[r] = exc

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a rank did not finish"
    for err in errors:
        if err is not None:
            raise err
    return results


def die(group: Any) -> Any:
    """This rank is lost: the process exits (one host), or its world marks it dead."""
    if isinstance(group, NumpyGroup):
        group.world.die(group.rank)
    elif isinstance(group, FakeGroup):
        group.world.dead.add(group.rank)
    else:
        os._exit(1)
    return LostRank(group.rank, "died", 1)
