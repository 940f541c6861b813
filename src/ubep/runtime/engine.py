"""The one-host transport's row of the engine registry (``"shm"``): the native engine on a
rank's shared-memory segments. Its one-call path takes blocking calls and builds their results
in C; every other call it hands to the general path of :class:`~ubep.plane.host.HostEngine`."""

from __future__ import annotations

import functools
import os
import weakref

from .. import dtypes as _dt
from ..plane.host import HostEngine
from ..plane.layout import host_regions
from ..plane.protocol import PLAIN, EngineSpec, GlobalMemory
from ..plane.results import DispatchResult, RuntimeHandle
from .abi import engine_params, load_native

__all__ = ["open_shm"]


def open_shm(memory: GlobalMemory, spec: EngineSpec) -> HostEngine:
    """The native engine on ``memory`` (every peer's region load/store reachable here)."""
    if memory.addresses is None:
        raise ValueError("transport 'shm' needs every peer's region reachable with loads and "
                         "stores from this process (one host)")
    cfg, cores, ranks = spec.config, spec.num_cores, spec.num_ranks
    cpus = os.cpu_count() or 1
    threads = cfg.threads if cfg.threads is not None else cores * ranks <= cpus
    background = cfg.background
    if background is None:
        background = (cores + 1) * ranks <= cpus
    params = engine_params(cfg, spec.layout, rank=spec.rank, num_ranks=ranks, num_cores=cores,
                           threaded=bool(threads) and cores > 1, background=background)
    kernel = load_native().Engine(params, memory.addresses, memory.pids, memory.start_times)
    regions = host_regions(memory.local_array, spec.layout, spec.values, cfg.hidden,
                           spec.scale_cols)
    engine = HostEngine(kernel, spec, regions, fast=True)
    # the kernel holds the general path by a weak reference: no cycle through C, which the
    # collector cannot see
    me = weakref.proxy(engine)
    kernel.set_fast(
        DispatchResult, RuntimeHandle,
        {"buffer_uid": spec.uid, "rank": spec.rank, "layout": cfg.layout, "hidden": cfg.hidden,
         "num_ranks": ranks, "num_experts": cfg.num_experts, "x_dtype": spec.dtype_name},
        regions.recv_views, regions.scale_views or None, _dt.dtype_of(cfg.dtype).storage,
        spec.combine_storage,
        functools.partial(HostEngine.general_dispatch, me),
        functools.partial(HostEngine.general_combine, me), PLAIN)
    return engine
