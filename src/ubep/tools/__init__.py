"""Programs over the library, on the user floor beside :mod:`ubep.cli`: what a user runs, not
what a program imports.

* :mod:`ubep.tools.trace_run`, :mod:`ubep.tools.trace_cli`: ``ubep trace run|plot|merge``;
* :mod:`ubep.tools.mpi_selftest`: ``python -m ubep.tools.mpi_selftest`` on an MPI job.
"""
