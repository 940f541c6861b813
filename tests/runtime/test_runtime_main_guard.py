"""``ubep.launch`` in a script without the ``if __name__ == "__main__":`` guard: refused in the
caller, before any rank starts, with an error that names the guard and the line (each rank runs
the script again as ``__mp_main__``; multiprocessing's own error says nothing of the guard)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ubep.runtime.main_guard import _guarded

_WORKER = "def worker(group):\n    return group.rank\n\n"


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text("import ubep\n\n" + _WORKER + body)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env=dict(os.environ, PYTHONPATH=""),
                          check=False)


def test_an_unguarded_launch_names_the_missing_guard(tmp_path: Path) -> None:
    proc = _run(tmp_path, "print(ubep.launch(worker, 2))\n")
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ubep.errors.UbepError") or "UbepError" in last, proc.stderr[-2000:]
    assert 'if __name__ == "__main__":' in last and "prog.py (line 6)" in last
    assert "bootstrapping" not in proc.stderr  # refused before any rank process started


def test_a_guarded_launch_runs(tmp_path: Path) -> None:
    proc = _run(tmp_path, 'if __name__ == "__main__":\n    print(ubep.launch(worker, 2))\n')
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[0, 1]"


_SOURCE = '''import ubep
run()
if __name__ == "__main__":
    run()
if "__main__" == __name__ and ok:
    run()
try:
    if __name__ == "__main__":
        run()
except ImportError:
    run()
with ctx:
    run()
if other:
    run()
def f():
    run()
'''


@pytest.mark.parametrize(("line", "guarded"), [
    (2, False), (4, True), (6, True), (9, True), (11, False), (13, False), (15, False),
    (17, False),
])
def test_the_guard_is_found_where_python_would_skip_the_call(line: int, guarded: bool) -> None:
    assert _guarded(ast.parse(_SOURCE).body, line) is guarded
