"""``dist.destroy_process_group`` frees the default gloo group of a torchrun program that keeps
ubep objects past it (tests/torch/_teardown_worker.py, 2 ranks).

Why it matters: a gloo group that outlives ``destroy_process_group`` keeps its worker threads
into interpreter shutdown, and a worker still releasing the tensors of a finished collective
there cannot take the GIL; the thread is unwound through C++ code that may not throw and the
rank aborts ("terminate called without an active exception") after the program succeeded
(examples/train_step.py did, about one run in seven). Whether that abort happens is a race;
whether the group is freed is not, and that is what is checked here: the group object is gone
(a weak reference), no function default holds it, and the process has as many threads after
``destroy_process_group`` as before ``init_process_group`` (the gloo workers were joined). A
ubep group kept past that point refuses a collective with an error that says why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")  # the worker registers the Hugging Face experts
pytestmark = pytest.mark.torch

from tests.torch.test_torchrun import _ok, _torchrun  # noqa: E402

WORKER = "tests.torch._teardown_worker"


def test_destroy_process_group_frees_the_group_ubep_ran_over(tmp_path: Path) -> None:
    _ok(_torchrun(2, WORKER, str(tmp_path)))
    for rank in range(2):
        got = json.loads((tmp_path / f"teardown.{rank}.json").read_text())
        assert not got["pinned_by_defaults"], (rank, got)
        assert got["group_freed"], (rank, got)
        assert got["threads_after_destroy"] == got["threads_before_init"], (rank, got)
        assert got["deepep_group"] == [True, True], got  # DeepEP's Buffer.group, then None
        # A ubep object kept past destroy_process_group says so, instead of using a freed group.
        assert f"rank {rank}: the torch.distributed group" in got["barrier_after_destroy"], got
        assert "destroy_process_group ran" in got["barrier_after_destroy"], got
