"""``ubep.vllm.hosts.launch_error``: which EP groups across hosts are one MPI job, without vLLM
(the whole path runs in tests/vllm/test_vllm_multihost.py)."""

from __future__ import annotations

import pytest

from ubep.errors import UbepError
from ubep.vllm.hosts import launch_error


def test_ranks_of_one_mpi_job_are_served() -> None:
    assert launch_error([0, 1]) is None
    assert launch_error([1, 0, 2]) is None  # vLLM's rank order need not be MPI's


@pytest.mark.parametrize("ranks, named", [([None, 1], r"EP rank\(s\) \[0\] were not started"),
                                          ([0, None, None], r"EP rank\(s\) \[1, 2\] were not"),
                                          ([0, 0], r"MPI ranks \[0, 0\]: they are not one")])
def test_a_group_that_is_not_one_mpi_job_is_told_to_launch_with_mpiexec(
        ranks: list[int | None], named: str) -> None:
    error = launch_error(ranks)
    assert isinstance(error, UbepError)
    with pytest.raises(UbepError, match=named + r".*mpiexec .*VLLM_DP_RANK=\$OMPI_COMM_WORLD_RANK"):
        raise error
