"""``tests/vllm/_procs.py``'s waits without vLLM: plain Python processes stand in for vLLM's DP
ranks. A rank that dies while its peer waits for it (in vLLM: the peer blocks in
torch.distributed's rendezvous, whose timeout outlasts the caller's) must fail the wait at
once with the dead rank's log, not at the deadline, and one that never answers must be named
when the deadline passes."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm._procs import Watched, expect_lines

# answers each "round" line with a numbered RESULT, as benchmarks/vllm_worker.py does
ECHO = ("import sys\nprint('READY', flush=True)\nfor n, line in enumerate(sys.stdin):\n"
        "    if line.strip() != 'round': break\n    print('log line', flush=True)\n"
        "    print(f'RESULT {n}', flush=True)\n")
DIES = "import sys\nprint('engine start failed: no CPU ids', flush=True)\nsys.exit(3)\n"
SILENT = "import time\ntime.sleep(300)\n"


def _watched(tmp_path: Path, name: str, code: str) -> Watched:
    return Watched([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"}, tmp_path / name)


@contextlib.contextmanager
def _ranks(tmp_path: Path, *codes: str, grace_s: float = 0.0) -> Iterator[list[Watched]]:
    """Rank r runs ``codes[r]`` (its log ``rank<r>.log``); every rank is stopped after."""
    procs = [_watched(tmp_path, f"rank{r}.log", code) for r, code in enumerate(codes)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop(grace_s=grace_s)


def test_rounds_are_answered_in_order_and_other_output_goes_to_the_log(tmp_path: Path) -> None:
    with _ranks(tmp_path, ECHO, ECHO, grace_s=30.0) as procs:
        assert expect_lines(procs, "READY", 60.0) == ["READY", "READY"]
        for n in range(3):
            for p in procs:
                p.send("round")
            assert expect_lines(procs, "RESULT ", 60.0) == [f"RESULT {n}"] * 2
    assert all(p.proc.returncode == 0 for p in procs)  # stdin closed: the loop ends
    assert procs[0].log.read_text().count("log line") == 3


def test_a_rank_that_dies_fails_the_wait_with_its_log_before_the_deadline(
        tmp_path: Path) -> None:
    # the peer never answers: a wait that watched only rank 0 would run to the deadline and
    # raise TimeoutError; the dead rank must be reported instead, with its own output
    with _ranks(tmp_path, SILENT, DIES) as procs, pytest.raises(
            RuntimeError, match=r"rank1\.log: exited 3(.|\n)*no CPU ids"):
        expect_lines(procs, "READY", 30.0)


def test_a_rank_that_never_answers_is_named_at_the_deadline(tmp_path: Path) -> None:
    with _ranks(tmp_path, ECHO, SILENT) as procs, pytest.raises(
            TimeoutError, match=r"from rank1\.log:"):
        expect_lines(procs, "READY", 3.0)
    assert procs[1].proc.returncode is not None  # stopped, not left behind
