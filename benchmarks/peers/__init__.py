"""``python -m benchmarks.peers``: ubep against the peers a user would pick instead (MPI wheels,
torch.distributed gloo, the memcpy floor), same routing, same tensors, one run.

A package without an import cycle, leaves first:

* ``workload.py``: shapes, the seeded inputs, the byte formula;
* ``kernels.py``, ``driver.py``, ``mpi_worker.py``, ``gloo_worker.py``: what runs inside a peer's
  own venv (numpy and mpi4py or torch, never ubep);
* ``env.py``: the peer venvs (``python -m benchmarks.peers.env`` builds them);
* ``ubep_runner.py``: ubep's side, on ranks started by ``ubep.launch``;
* ``sim.py``: the simulator's prediction of ubep's rows;
* ``run.py``: the parent: runs every system, the table, the floors, the plot (``main``).

Nothing is imported here: the peer venvs import ``benchmarks.peers.driver`` without ubep.
"""
