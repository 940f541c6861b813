"""Per-core task timelines in one schema for the runtime and the simulator, exported to the
Chrome trace event format (Perfetto, ``chrome://tracing``) and drawn as per-core bars.

* :mod:`ubep.trace.spans`: the schema (:class:`Span`, :class:`Trace`) and the simulator's
  producer (:func:`from_sim`);
* :mod:`ubep.trace.chrome`: export, load and merge of trace event JSON;
* :mod:`ubep.trace.plot`: Figure 8/9-style per-core bars from any trace;
* :mod:`ubep.trace.recorder`: the runtime's producer: ``BufferConfig(trace=True)`` and
  ``with ubep.trace.record("step.json"): ...`` around any program;
* ``ubep trace run|plot|merge`` (:mod:`ubep.tools.trace_cli`, on the user floor).
"""

from .chrome import load, merge, to_chrome, write
from .recorder import record, spans_of
from .spans import TASK_KINDS, CallSpan, Span, Trace, from_sim

__all__ = ["TASK_KINDS", "CallSpan", "Span", "Trace", "from_sim", "load", "merge", "record",
           "spans_of", "to_chrome", "write"]
