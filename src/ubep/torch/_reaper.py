"""The cleaner of a torch.distributed-backed ubep group: what ``ubep.launch``'s parent does for
its children, for jobs that ``torchrun`` (or any other launcher) started.

Run by path with the standard library only (``python -I -S _reaper.py PARENT_PID PARENT_START``),
so it starts in a few tens of milliseconds and imports neither ubep nor torch. Protocol with
group rank 0, its parent:

1. it creates a private directory (``mkdtemp``, mode 0700) and prints its path on stdout;
2. it reads one JSON line on stdin: ``[[pid, start_time], ...]``, every rank of the group;
   until then (and if stdin closes without one) it watches its parent alone;
3. once none of the watched processes is alive, it unlinks every shared-memory segment still
   recorded by a ``segment.<name>`` marker in the directory (a rank killed between creating a
   segment and unlinking it after every peer mapped it), removes the directory and exits.

So nothing of the group survives its processes, even if every one of them is SIGKILLed. It runs
in its own session: signals sent to the job's process group (Ctrl-C, torchrun stopping its
workers) do not reach it, and it exits on its own within ``_PERIOD_S`` of the last rank.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import shutil
import sys
import tempfile
import time
from types import ModuleType

_PERIOD_S = 0.1


def _runtime_reaper() -> ModuleType:
    """``ubep/runtime/reaper.py``, loaded by path: standard library only too, it holds the
    liveness test and the marker sweep (this file runs with ``-I``, outside the ubep package)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "runtime", "reaper.py")
    spec = importlib.util.spec_from_file_location("_ubep_runtime_reaper", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_RUNTIME = _runtime_reaper()
alive = _RUNTIME.alive


def clean(directory: str) -> None:
    """Unlink the marked segments, then remove ``directory``."""
    _RUNTIME.remove_marked_segments(directory)
    shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str]) -> int:
    watched = [(int(argv[1]), int(argv[2]))]
    directory = tempfile.mkdtemp(prefix="ubep-torch-")  # mode 0700
    try:
        sys.stdout.write(directory + "\n")
        sys.stdout.flush()
        sys.stdout.close()
        stdin_open = True
        while True:
            if stdin_open:
                ready, _, _ = select.select([sys.stdin], [], [], _PERIOD_S)
                if ready:
                    line = sys.stdin.readline()
                    stdin_open = False
                    if line.strip():
                        watched = [(int(p), int(s)) for p, s in json.loads(line)]
            else:
                time.sleep(_PERIOD_S)
            if not any(alive(pid, start) for pid, start in watched):
                return 0
    finally:
        clean(directory)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
