"""``python -m benchmarks.soak``: long runs of checked dispatch/combine calls.

* ``plan.py``: the random blocks and calls, inputs and the reference diff (shared);
* ``calls.py``: the call soak, every call checked bit for bit;
* ``faults.py``: the fault soak (``--faults``), faults injected between and during calls;
* ``cli.py``: the command line (``main``).
"""
