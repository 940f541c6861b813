"""A DeepEP low-latency program that runs on ubep by changing its import.

Started as DeepEP programs start (``torch.multiprocessing.spawn``, a gloo process group, a
``dist.new_group`` group handed to ``deep_ep.Buffer`` built with ``low_latency_mode=True``);
``from ubep import deep_ep`` stands where ``import deep_ep`` would. It makes every low-latency
call DeepEP's own low-latency test makes:

* ``Buffer.get_low_latency_rdma_size_hint`` and the low-latency constructor arguments;
* ``low_latency_dispatch`` of BF16 rows and with ``use_fp8``, ``round_scale``, ``use_ue8m0``,
  each with ``async_finish`` (waiting on the event) and with ``return_recv_hook`` (calling the
  hook), accumulating ``cumulative_local_expert_recv_stats``; top-k slots set to -1;
* ``low_latency_combine`` from ``x`` and zero-copy from
  ``get_next_low_latency_combine_buffer(handle)``, into ``out=``, with either wait, and once
  with ``use_logfmt``;
* ``clean_low_latency_buffer`` (then the same round again, which must give the same result).

(The shrink mode's mask buffer, with failing ranks, is ``shrink_mode.py``'s, built on this
program's rounds and references.)

Each result is checked against a reference built from every rank's inputs (each rank
rebuilds the others' from their seeds): per local expert, the rows from source rank ``j`` are
those ``layout_range[e][j]`` names, ``src_info`` lists exactly the tokens of ``j`` routed to the
expert, each row is that token (BF16 exactly; FP8 within e4m3's rounding of DeepEP's
per-128-channel scales, the scales themselves checked), and combine is the top-k weighted sum of
what the experts sent back. Nothing DeepEP leaves open (row order within a source, rows past
``recv_count``, the begin of an empty range) is asserted.

    python low_latency_mode.py --num-processes 4
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from support import (
    BF16_TOL,
    FP8_BLOCK,
    Sizes,
    assert_within,
    decode_ue8m0,
    dequantize,
    everyone,
    fp8_error_bound,
    fp8_scales,
    join_group,
    leave_group,
    parse_args,
    relative_sq_error,
    report,
    sizes_of,
    spawn,
)

from ubep import deep_ep  # a DeepEP program has `import deep_ep` here

SEED = 23
# hidden: a multiple of 512, so UE8M0 scales (four per int32, one per 128 channels) pack whole.
DEFAULTS = Sizes(num_tokens=12, hidden=512, num_topk=4, num_experts=16)
NUM_MASKED = 5  # router slots per rank set to -1 (besides the last token, routed nowhere)
UE8M0_PER_INT32 = 4
LOW_32_BITS = (1 << 32) - 1
LOGFMT_MAX_ERROR = 1e-5  # whole-tensor relative squared error DeepEP accepts from LogFMT


@dataclass(frozen=True)
class Mode:
    """The FP8 options of one dispatch (``use_ue8m0`` needs the other two, as in DeepEP)."""

    use_fp8: bool = False
    round_scale: bool = False
    use_ue8m0: bool = False

    def __str__(self) -> str:
        on = [name for name in ("use_fp8", "round_scale", "use_ue8m0") if getattr(self, name)]
        return "+".join(on) or "BF16"


MODES = (Mode(), Mode(True), Mode(True, True), Mode(True, True, True))


def expert_factor(expert: int) -> float:
    """What expert ``expert`` multiplies its rows by: a power of two, exact in BF16, and
    different for neighbouring experts so that a row combined under the wrong one shows."""
    return 2.0 ** (expert % 3 - 1)


class LowLatencyProgram:
    """This rank's side of the program: the Buffer, everyone's inputs and the references."""

    shrink = False  # DeepEP's enable_shrink (shrink_mode.py's program sets it)

    def __init__(self, rank: int, group: dist.ProcessGroup, sizes: Sizes) -> None:
        self.rank, self.sizes = rank, sizes
        self.num_ranks = group.size()
        self.num_local_experts = sizes.num_experts // self.num_ranks
        # Every rank passes the same bound, at least any rank's token count.
        self.num_max_tokens = sizes.num_tokens + self.num_ranks
        self.slots = self.num_max_tokens * self.num_ranks
        self.inputs = everyone(SEED, sizes, self.num_ranks, NUM_MASKED)
        self.mine = self.inputs[rank]
        self.topk_idx = self.mine.topk_idx.to(deep_ep.topk_idx_t)
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            self.num_max_tokens, sizes.hidden, self.num_ranks, sizes.num_experts
        )
        # A byte count for BF16 rows: at least one local expert's receive slots.
        assert isinstance(hint, int) and hint >= self.slots * sizes.hidden * 2, hint
        self.buffer = deep_ep.Buffer(
            group, num_rdma_bytes=hint, low_latency_mode=True,
            num_qps_per_rank=self.num_local_experts, allow_nvlink_for_low_latency_mode=True,
            explicitly_destroy=True, allow_mnnvl=False, enable_shrink=self.shrink,
        )
        self.stats = torch.zeros(self.num_local_experts, dtype=torch.int32)
        self.expected_stats = torch.zeros(self.num_local_experts, dtype=torch.int32)
        # ranks the references leave out (shrink_mode.py masks failed ranks; here none)
        self.masked: set[int] = set()

    def owner(self, expert: int) -> int:
        return expert // self.num_local_experts

    def tokens_from(self, src: int, expert: int) -> list[int]:
        """Rank ``src``'s tokens routed to ``expert`` (none from a masked rank)."""
        return [] if src in self.masked else self.inputs[src].tokens_for_expert(expert)

    # ---------------------------------------------------------------- references
    def expected_counts(self) -> list[int]:
        first = self.rank * self.num_local_experts
        return [
            sum(len(self.tokens_from(src, first + e)) for src in range(self.num_ranks))
            for e in range(self.num_local_experts)
        ]

    def expected_combined(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum_k w_k * factor(expert_k) * x, the same sum of magnitudes)`` in float64, over
        the slots whose expert lives on a rank that is not masked."""
        x = self.mine.x.double()
        total = torch.zeros_like(x)
        magnitude = torch.zeros_like(x)
        for t, k in torch.nonzero(self.mine.topk_idx >= 0).tolist():
            if self.owner(int(self.topk_idx[t, k])) in self.masked:
                continue
            term = float(self.mine.topk_weights[t, k]) * expert_factor(int(self.topk_idx[t, k]))
            total[t] += term * x[t]
            magnitude[t] += abs(term) * x[t].abs()
        return total, magnitude

    def ranges(self, handle: Any, e: int) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """``(source rank, begin, count, source tokens)`` of local expert ``e``'s rows, from
        the handle (``layout_range`` packs ``begin << 32 | count``; ``src_info`` the tokens)."""
        src_info, layout_range = handle[0][e], handle[1][e]
        for src in range(self.num_ranks):
            packed = int(layout_range[src])
            begin, count = packed >> 32, packed & LOW_32_BITS
            yield src, begin, count, src_info[begin : begin + count].long()

    # ---------------------------------------------------------------- calls
    @staticmethod
    def wait(event: Any, hook: Any, use_hook: bool) -> None:
        if use_hook:
            assert callable(hook), "return_recv_hook=True returns a hook"
            hook()
        else:
            event.current_stream_wait()

    def dispatch(self, mode: Mode, use_hook: bool) -> tuple[Any, torch.Tensor, Any]:
        recv_x, recv_count, handle, event, hook = self.buffer.low_latency_dispatch(
            self.mine.x, self.topk_idx, self.num_max_tokens, self.sizes.num_experts,
            cumulative_local_expert_recv_stats=self.stats, use_fp8=mode.use_fp8,
            round_scale=mode.round_scale, use_ue8m0=mode.use_ue8m0,
            async_finish=not use_hook, return_recv_hook=use_hook,
        )
        self.wait(event, hook, use_hook)
        self.expected_stats += torch.tensor(self.expected_counts(), dtype=torch.int32)
        assert torch.equal(self.stats, self.expected_stats), "cumulative_local_expert_recv_stats"
        return recv_x, recv_count, handle

    def combine(
        self, handle: Any, rows: torch.Tensor, zero_copy: bool, use_hook: bool,
        use_logfmt: bool = False,
    ) -> torch.Tensor:
        out = torch.empty(self.mine.x.shape, dtype=torch.bfloat16) if zero_copy else None
        x = rows
        if zero_copy:
            staged = self.buffer.get_next_low_latency_combine_buffer(handle)
            assert staged.shape == rows.shape and staged.dtype == torch.bfloat16
            staged[:, :, :] = rows
            x = torch.zeros_like(rows)  # zero-copy combines the staged rows, not x
        combined, event, hook = self.buffer.low_latency_combine(
            x, self.topk_idx, self.mine.topk_weights, handle, use_logfmt=use_logfmt,
            zero_copy=zero_copy, async_finish=not use_hook, return_recv_hook=use_hook, out=out,
        )
        self.wait(event, hook, use_hook)
        if out is not None:
            assert combined.data_ptr() == out.data_ptr(), "combine writes into out="
        return combined

    # ---------------------------------------------------------------- checks
    def check_dispatch(
        self, recv_x: Any, recv_count: torch.Tensor, handle: Any, mode: Mode
    ) -> None:
        L, S, H = self.num_local_experts, self.slots, self.sizes.hidden
        values, scales = recv_x if mode.use_fp8 else (recv_x, None)
        assert values.shape == (L, S, H)
        assert values.dtype == (torch.float8_e4m3fn if mode.use_fp8 else torch.bfloat16)
        if scales is not None:
            scales = scales.contiguous()  # DeepEP's scales are column-major per expert
            if mode.use_ue8m0:
                assert scales.dtype == torch.int32
                assert scales.shape == (L, S, H // FP8_BLOCK // UE8M0_PER_INT32)
                scales = decode_ue8m0(scales)
            assert scales.dtype == torch.float32 and scales.shape == (L, S, H // FP8_BLOCK)
        assert len(handle) == 5 and tuple(handle[2:]) == (
            self.num_max_tokens, H, self.sizes.num_experts
        ), "handle[2:] = (num_max_dispatch_tokens_per_rank, hidden, num_experts)"
        assert recv_count.dtype == torch.int32
        assert recv_count.tolist() == self.expected_counts(), f"{mode}: recv_count"
        for e in range(L):
            self.check_expert(e, values[e], None if scales is None else scales[e], handle,
                              int(recv_count[e]), mode)

    def check_expert(
        self, e: int, values: torch.Tensor, scales: torch.Tensor | None, handle: Any,
        count: int, mode: Mode,
    ) -> None:
        """The sources' ranges tile ``0 .. count`` and each holds the right tokens' rows."""
        expert = self.rank * self.num_local_experts + e
        covered = torch.zeros(count, dtype=torch.bool)
        for src, begin, n, tokens in self.ranges(handle, e):
            expected_tokens = self.tokens_from(src, expert)
            assert n == len(expected_tokens), f"{mode}: expert {expert} from rank {src}: {n}"
            if n == 0:
                continue  # DeepEP leaves an empty range's begin unspecified
            assert begin + n <= count and not bool(covered[begin : begin + n].any())
            covered[begin : begin + n] = True
            assert sorted(tokens.tolist()) == expected_tokens, f"{mode}: src_info, rank {src}"
            source = self.inputs[src].x[tokens]
            got = values[begin : begin + n]
            if scales is None:
                assert torch.equal(got, source), f"expert {expert}: BF16 rows from rank {src}"
            else:
                self.check_fp8(got, scales[begin : begin + n], source, mode)
        assert bool(covered.all()), f"{mode}: expert {expert}'s ranges leave rows unnamed"

    @staticmethod
    def check_fp8(
        values: torch.Tensor, scales: torch.Tensor, source: torch.Tensor, mode: Mode
    ) -> None:
        expected = fp8_scales(source, mode.round_scale)
        if mode.round_scale:  # powers of two: no rounding can differ
            assert torch.equal(scales, expected), f"{mode}: scales"
        else:
            torch.testing.assert_close(scales, expected, rtol=1e-6, atol=0)
        bound = fp8_error_bound(source, expected)
        assert_within(dequantize(values, scales), source, bound, f"{mode}: FP8 values")

    def expert_outputs(self, handle: Any, recv_count: torch.Tensor) -> torch.Tensor:
        """``[L, slots, hidden]`` BF16: each valid row is ``expert_factor(e)`` times the
        token's original row (for FP8, the row before its cast, so the combine reference
        carries no FP8 error); rows past ``recv_count`` are NaN, which combine must not read."""
        out = torch.full(
            (self.num_local_experts, self.slots, self.sizes.hidden), float("nan"),
            dtype=torch.bfloat16,
        )
        for e in range(self.num_local_experts):
            factor = expert_factor(self.rank * self.num_local_experts + e)
            for src, begin, n, tokens in self.ranges(handle, e):
                if n:
                    out[e, begin : begin + n] = self.inputs[src].x[tokens] * factor
        assert int(torch.isnan(out[:, :, 0]).logical_not().sum()) == int(recv_count.sum())
        return out

    def check_combined(self, combined: torch.Tensor, what: str) -> None:
        expected, magnitude = self.expected_combined()
        assert combined.dtype == torch.bfloat16 and combined.shape == self.mine.x.shape
        assert_within(combined, expected, BF16_TOL * magnitude, what)

    # ---------------------------------------------------------------- rounds
    def round_trip(self, mode: Mode, use_hook: bool) -> torch.Tensor:
        """Dispatch, check, combine from x and zero-copy; returns the combined tokens."""
        recv_x, recv_count, handle = self.dispatch(mode, use_hook)
        self.check_dispatch(recv_x, recv_count, handle, mode)
        rows = self.expert_outputs(handle, recv_count)
        results = []
        for zero_copy in (False, True):
            combined = self.combine(handle, rows, zero_copy, use_hook)
            self.check_combined(combined, f"{mode}, hook={use_hook}, zero_copy={zero_copy}")
            results.append(combined)
        assert torch.equal(results[0], results[1]), "zero-copy combines what x-combine does"
        if mode == MODES[0] and not use_hook:
            logfmt = self.combine(handle, rows, zero_copy=False, use_hook=False, use_logfmt=True)
            expected, _ = self.expected_combined()
            assert relative_sq_error(logfmt, expected) < LOGFMT_MAX_ERROR, "use_logfmt combine"
        return results[0]

def run_rank(local_rank: int, num_processes: int, args: argparse.Namespace) -> None:
    rank, group = join_group(local_rank, num_processes, args.init_method)
    program = LowLatencyProgram(rank, group, sizes_of(args))
    first: torch.Tensor | None = None
    num_rounds = 0
    for use_hook in (False, True):
        for mode in MODES:
            combined = program.round_trip(mode, use_hook)
            first = combined if first is None else first
            num_rounds += 1
    # DeepEP programs clean the buffer after using it otherwise; the next round must not care.
    sizes = program.sizes
    program.buffer.clean_low_latency_buffer(
        program.num_max_tokens, sizes.hidden, sizes.num_experts
    )
    again = program.round_trip(MODES[0], use_hook=False)
    assert first is not None and torch.equal(again, first), "the same round, the same result"
    program.buffer.destroy()
    leave_group()
    report("low_latency_mode", rank, num_processes, num_rounds + 1)


if __name__ == "__main__":
    spawn(run_rank, parse_args(__doc__.splitlines()[0], DEFAULTS))
