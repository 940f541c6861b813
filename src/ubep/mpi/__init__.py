"""``ubep.mpi``: the same :class:`ubep.Buffer` across hosts, on MPI-3 one-sided communication.

Run under ``mpiexec -n N python script.py`` and build the group with :func:`init`::

    import ubep, ubep.mpi
    group = ubep.mpi.init()                    # MPI.COMM_WORLD
    with ubep.Buffer(group, cfg) as buf:        # exactly as with a group from ubep.launch
        res = buf.dispatch(x, topk_idx, topk_weights)

* Ranks that share a host map each other's memory (``MPI_Win_allocate_shared`` +
  ``MPI_Win_shared_query``). When every rank is on one host the native engine runs on those
  addresses unchanged: real loads and stores, as with ``ubep.launch``.
* Between hosts, rows move by ``MPI_Put`` into the receiver's window under one passive-target
  epoch (``MPI_Win_lock_all``); flags are 8-byte epoch words put after ``MPI_Win_flush``, and
  receivers poll their own window (``MPI_Win_sync``), so SW/TFF/DC and the ASP/BSP engines keep
  the meaning of docs/FORMATS.md. SP is refused across hosts (see :mod:`ubep.mpi.engine`).
* Topology: ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` gives the ranks of each host; same
  host = hop 1, another host = hop 2 (hierarchical scheduler input).

docs/MULTIHOST.md says how to run on real hosts. ``UBEP_MPI_FORCE_RMA=1`` or
``UBEP_MPI_RANKS_PER_HOST=k`` (or ``init(ranks_per_host=k)``) make one machine look like
several hosts, to test the cross-host path.
"""

from .group import MpiGroup, init

__all__ = ["MpiGroup", "init"]
