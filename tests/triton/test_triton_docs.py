"""docs/TRITON.md's programs run as written (each from an empty directory, under the installed
ubep) and check themselves: each prints its ranks' verdicts, which must all be ``True``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton.conftest import needs_triton

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
BLOCKS = _FENCE.findall((ROOT / "docs" / "TRITON.md").read_text())


def test_the_doc_has_its_two_programs() -> None:
    assert len(BLOCKS) == 2 and all('if __name__ == "__main__":' in b for b in BLOCKS)


@needs_triton
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_triton_doc_program_runs_as_written(index: int, tmp_path: Path) -> None:
    program = tmp_path / "program.py"
    program.write_text(BLOCKS[index])
    proc = subprocess.run([sys.executable, str(program)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=""))
    assert proc.returncode == 0, f"block {index}:\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "[True, True]", proc.stdout
