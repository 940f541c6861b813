"""A DeepEP shrink-mode program that runs on ubep by changing its import.

Modelled on DeepEP's ``test_low_latency.py --shrink-test``: started as DeepEP programs start
(``torch.multiprocessing.spawn``, a gloo process group, a ``dist.new_group`` group handed to
``deep_ep.Buffer(..., low_latency_mode=True, enable_shrink=True)``), with ``from ubep import
deep_ep`` where ``import deep_ep`` would stand. Three ranks fail as in DeepEP's test: one when
it first calls ``low_latency_dispatch``, one at its first ``low_latency_combine``, one at its
first ``clean_low_latency_buffer``. A failed rank stops calling (it skips the rest, then
destroys its buffer and waits at the final barrier, as in DeepEP's test), so the others find it
by their deadline.

After every dispatch, combine and clean each survivor queries the mask buffer
(``low_latency_query_mask_buffer``) and checks that it names exactly the ranks failed so far,
and checks the results against references built from every rank's inputs with those ranks
masked: a masked rank's tokens are not received (counts, ``layout_range``, ``src_info`` and the
rows exclude them), and combine is the top-k weighted sum over the slots whose expert lives on
a rank that is not masked (the checks of ``low_latency_mode.py``, given the mask).

    python shrink_mode.py --num-processes 5 --fail-ranks 1,3,4

(DeepEP's test fails ranks 1, 3 and 5 of 8.) The deadline that finds a silent rank is the
Buffer's ``timeout_s``: ``UBEP_TIMEOUT_S`` in the environment, as the program passes none.
"""

from __future__ import annotations

import argparse
from typing import Literal

import torch
from low_latency_mode import DEFAULTS, MODES, LowLatencyProgram, Mode
from support import join_group, leave_group, parse_args, report, sizes_of, spawn

from ubep import deep_ep  # a DeepEP program has `import deep_ep` here

Api = Literal["dispatch", "combine", "clean"]


class ShrinkProgram(LowLatencyProgram):
    """This rank's side: the low-latency program with DeepEP's simulated failures."""

    shrink = True

    def __init__(self, rank: int, group: torch.distributed.ProcessGroup,
                 args: argparse.Namespace) -> None:
        super().__init__(rank, group, sizes_of(args))
        dispatch, combine, clean = (int(r) for r in args.fail_ranks.split(","))
        # API -> the rank that fails when it first calls it (DeepEP's failed_api_ranks)
        self.failed_api_ranks: dict[Api, int] = {
            "dispatch": dispatch, "combine": combine, "clean": clean,
        }
        self.mask_status = torch.zeros(self.num_ranks, dtype=torch.int)
        self.num_checks = 0

    def simulate_failure_and_skip(self, api: Api) -> bool:
        """DeepEP's: True if this rank has failed (now, at its first call of ``api``, or
        before); every rank records the failure at the same point of the program."""
        if self.rank in self.masked:
            return True
        self.masked.add(self.failed_api_ranks[api])
        if self.failed_api_ranks[api] == self.rank:
            print(f"Rank {self.rank} failed when first calling {api} communication API, exit...",
                  flush=True)
            return True
        return False

    def query_mask_buffer_and_check(self, api: Api) -> None:
        buffer: deep_ep.Buffer = self.buffer
        buffer.low_latency_query_mask_buffer(self.mask_status)
        got = set(self.mask_status.nonzero().squeeze(-1).tolist())
        assert got == self.masked, f"after {api}: mask {sorted(got)}, failed {sorted(self.masked)}"
        self.num_checks += 1

    def shrink_round(self, mode: Mode, use_hook: bool, num_times: int) -> bool:
        """One round of DeepEP's shrink test; False once this rank has failed."""
        if self.simulate_failure_and_skip("dispatch"):
            return False
        for _ in range(num_times % 2 + 1):  # DeepEP dispatches once or twice per round
            recv_x, recv_count, handle = self.dispatch(mode, use_hook)
        self.query_mask_buffer_and_check("dispatch")
        self.check_dispatch(recv_x, recv_count, handle, mode)
        rows = self.expert_outputs(handle, recv_count)
        if self.simulate_failure_and_skip("combine"):
            return False
        for zero_copy in (False, True):
            combined = self.combine(handle, rows, zero_copy, use_hook)
            self.query_mask_buffer_and_check("combine")
            self.check_combined(combined, f"{mode}, hook={use_hook}, zero_copy={zero_copy}")
        if self.simulate_failure_and_skip("clean"):
            return False
        sizes = self.sizes
        self.buffer.clean_low_latency_buffer(self.num_max_tokens, sizes.hidden, sizes.num_experts)
        self.query_mask_buffer_and_check("clean")
        return True


def run_rank(local_rank: int, num_processes: int, args: argparse.Namespace) -> None:
    rank, group = join_group(local_rank, num_processes, args.init_method)
    program = ShrinkProgram(rank, group, args)
    num_times = 0
    for use_hook in (False, True):
        for mode in MODES:
            num_times += 1
            if not program.shrink_round(mode, use_hook, num_times):
                break
    program.buffer.destroy()
    leave_group()
    if rank in program.failed_api_ranks.values():
        print(f"shrink_mode: rank {rank} of {num_processes}: failed as planned", flush=True)
    else:
        report("shrink_mode", rank, num_processes, program.num_checks)


def fail_ranks_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fail-ranks", default="1,3,5",
        help="the ranks that fail at their first dispatch, combine and clean (DeepEP: 1,3,5)")


if __name__ == "__main__":
    spawn(run_rank, parse_args(__doc__.splitlines()[0], DEFAULTS, fail_ranks_option))
