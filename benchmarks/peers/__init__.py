"""``python -m benchmarks.peers``: ubep against the peers a user would pick instead (MPI wheels,
torch.distributed gloo, the memcpy floor), same routing, same tensors, one run.

A package without an import cycle, leaves first:

* ``workload.py``: shapes, the seeded inputs, the byte formula;
* ``kernels.py``, ``driver.py``, ``mpi_worker.py``, ``gloo_worker.py``: what runs inside a peer's
  own venv (numpy and mpi4py or torch, never ubep);
* ``env.py``: the peer venvs (``python -m benchmarks.peers.env`` builds them);
* ``ubep_runner.py``: ubep's side, on ranks started by ``ubep.launch``;
* ``sim.py``: the simulator's prediction of ubep's rows;
* ``launch.py``: the peers' processes (work directory, command lines, wait, clean-up);
* ``check.py``: each peer variant bit for bit against ``ubep.reference`` before it is timed;
* ``report.py``: the rows, the table, the floors, the plot;
* ``run.py``: the parent: runs every selected system and collects its rows;
* ``cli.py``: the command line (``main``), then the report.

Nothing is imported here: the peer venvs import ``benchmarks.peers.driver`` without ubep.
"""
