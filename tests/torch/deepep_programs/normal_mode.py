"""A DeepEP normal-mode (intranode) program that runs on ubep by changing its import.

Written as a DeepEP user writes one: ``torch.multiprocessing.spawn`` starts one process per
rank, each joins a gloo process group and hands a ``dist.new_group`` group to
``deep_ep.Buffer``; ``from ubep import deep_ep`` stands where ``import deep_ep`` would. It makes
every normal-mode call DeepEP's own intranode test makes, and a few more:

* ``get_dispatch_layout`` (plain, and with ``previous_event`` / ``async_finish`` /
  ``allocate_on_comm_stream``);
* ``dispatch`` of BF16 rows and of FP8 ``(values, scales)`` tuples, with and without
  ``topk_idx``/``topk_weights``, with ``config=``, ``expert_alignment``, the three event modes;
  ``num_worst_tokens``; cached dispatch (``handle=``) of other values along the same routing;
* ``combine`` with and without ``topk_weights``, with no bias, one bias tensor or two;
* ``Config``, ``Buffer.set_num_sms``/``get_dispatch_config``/``get_combine_config``,
  ``is_sm90_compiled``, ``capture``, ``topk_idx_t``, ``destroy``.

Every result is checked against a reference built here from every rank's inputs (each rank
rebuilds the others' from their seeds): the received rows are the source rows the routing
names, the handle's prefix matrices are the cumulative counts, combine is the sum of what the
receivers sent back. Nothing DeepEP leaves open is asserted (the order of rows within one
source's block, padding contents, channel counts), so the checks are meant to hold on DeepEP
too.

    python normal_mode.py --num-processes 4
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from support import (
    BF16_TOL,
    RankInputs,
    Sizes,
    assert_within,
    cast_to_fp8,
    dequantize,
    everyone,
    join_group,
    leave_group,
    parse_args,
    report,
    sizes_of,
    spawn,
)

from ubep import deep_ep  # a DeepEP program has `import deep_ep` here

SEED = 11
DEFAULTS = Sizes(num_tokens=24, hidden=256, num_topk=4, num_experts=16)
NUM_MASKED = 6  # router slots per rank set to -1 (besides the last token, routed nowhere)
NUM_NVL_BYTES = 1 << 30  # what a DeepEP program reserves for NVLink; ubep sizes its own memory
EVENT_MODES = ("sync", "async", "previous")


@dataclass(frozen=True)
class Case:
    """One dispatch/combine round.

    ``events``: "sync" (plain calls), "async" (``async_finish`` + waiting on the returned
    event), "previous" (also ``previous_event=buffer.capture()`` and
    ``allocate_on_comm_stream``). The expert alignment and the number of combine biases ride on
    the event mode, so each value of each runs four times without a bigger product.
    """

    fp8: bool
    with_topk: bool
    events: str

    @property
    def expert_alignment(self) -> int:
        return 4 if self.events == "async" else 1

    @property
    def num_biases(self) -> int:
        return EVENT_MODES.index(self.events)

    def __str__(self) -> str:
        payload = "FP8" if self.fp8 else "BF16"
        topk = "with" if self.with_topk else "without"
        return f"{payload} {topk} top-k, {self.events}"


class NormalModeProgram:
    """This rank's side of the program: the Buffer, everyone's inputs and the references."""

    def __init__(self, rank: int, group: dist.ProcessGroup, sizes: Sizes) -> None:
        self.rank, self.sizes = rank, sizes
        self.num_ranks = group.size()
        self.num_local_experts = sizes.num_experts // self.num_ranks
        self.inputs = everyone(SEED, sizes, self.num_ranks, NUM_MASKED)
        self.mine: RankInputs = self.inputs[rank]
        # [tokens, num_ranks] bool per source rank: where each token must go.
        self.dest = [i.ranks_of_tokens(sizes.num_experts, self.num_ranks) for i in self.inputs]
        self.fp8 = [cast_to_fp8(i.x) for i in self.inputs]
        self.fp8_again = [cast_to_fp8(i.x_again) for i in self.inputs]
        self.buffer = deep_ep.Buffer(
            group, NUM_NVL_BYTES, 0, low_latency_mode=False, num_qps_per_rank=1,
            explicitly_destroy=True,
        )
        self.topk_idx = self.mine.topk_idx.to(deep_ep.topk_idx_t)
        self.layout: tuple[Any, ...] = ()

    # ---------------------------------------------------------------- references
    def tokens_from(self, src: int) -> list[int]:
        """Tokens of rank ``src`` this rank must receive, ascending."""
        return torch.nonzero(self.dest[src][:, self.rank]).flatten().tolist()

    def rank_prefix_matrix(self) -> torch.Tensor:
        sent = torch.stack([d.sum(dim=0) for d in self.dest])  # [src, dst] tokens
        return sent.cumsum(dim=0).to(torch.int32)

    def recv_per_local_expert(self) -> list[int]:
        first = self.rank * self.num_local_experts
        return [
            sum(int((i.topk_idx == first + e).sum()) for i in self.inputs)
            for e in range(self.num_local_experts)
        ]

    def payload(self, src: int, case: Case, again: bool) -> Any:
        if case.fp8:
            return (self.fp8_again if again else self.fp8)[src]
        return self.inputs[src].x_again if again else self.inputs[src].x

    # ---------------------------------------------------------------- layout
    def check_layout(self, events: str) -> None:
        per_rank, per_rdma_rank, per_expert, in_rank, event = self.buffer.get_dispatch_layout(
            self.topk_idx, self.sizes.num_experts, **self.event_kwargs(events)
        )
        self.finish(event, events)
        valid = self.mine.topk_idx[self.mine.topk_idx >= 0]
        expected_per_expert = torch.bincount(valid, minlength=self.sizes.num_experts)
        assert per_rdma_rank is None, "one node: no per-RDMA-rank counts"
        assert per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
        assert torch.equal(in_rank, self.dest[self.rank]), "is_token_in_rank"
        assert torch.equal(per_rank, self.dest[self.rank].sum(dim=0).int()), "num_tokens_per_rank"
        assert torch.equal(per_expert, expected_per_expert.int()), "num_tokens_per_expert"
        self.layout = (per_rank, per_rdma_rank, per_expert, in_rank)

    def event_kwargs(self, events: str) -> dict[str, Any]:
        if events == "sync":
            return {}
        kwargs: dict[str, Any] = {"async_finish": True}
        if events == "previous":
            kwargs.update(previous_event=self.buffer.capture(), allocate_on_comm_stream=True)
        return kwargs

    @staticmethod
    def finish(event: Any, events: str) -> None:
        if events != "sync":
            event.current_stream_wait()

    # ---------------------------------------------------------------- one round
    def run(self, case: Case) -> None:
        per_rank, per_rdma_rank, per_expert, in_rank = self.layout
        args: dict[str, Any] = dict(
            x=self.payload(self.rank, case, again=False),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            expert_alignment=case.expert_alignment,
            config=self.config(case),
        )
        if case.with_topk:
            args.update(topk_idx=self.topk_idx, topk_weights=self.mine.topk_weights)
        recv_x, recv_idx, recv_w, counts, handle, event = self.buffer.dispatch(
            **args, **self.event_kwargs(case.events)
        )
        self.finish(event, case.events)
        self.check_handle(handle)
        num_recv = self.check_rows(recv_x, handle, case, again=False)
        assert counts == [
            math.ceil(c / case.expert_alignment) * case.expert_alignment
            for c in self.recv_per_local_expert()
        ], f"{case}: num_recv_tokens_per_expert_list {counts}"
        if case.with_topk:
            assert recv_idx is not None and recv_w is not None, "top-k in, top-k out"
            self.check_topk(recv_idx, recv_w, handle)
            self.check_worst(args, case, recv_x, recv_idx, recv_w, num_recv)
        else:
            assert recv_idx is None and recv_w is None, "no top-k in, no top-k out"
            self.check_cached(handle, case)
        self.check_combine(recv_x, recv_w, handle, case)

    def config(self, case: Case) -> Any:
        if case.fp8:
            return deep_ep.Buffer.get_dispatch_config(self.num_ranks)
        return deep_ep.Config(deep_ep.Buffer.num_sms, 8, 256)

    def check_handle(self, handle: Any) -> None:
        assert len(handle) == 6, "a normal-mode handle has DeepEP's six entries"
        rank_prefix, channel_prefix, recv_channel_prefix, src_idx, in_rank, send_head = handle
        sent_here = self.dest[self.rank]
        assert rank_prefix.dtype == torch.int32
        assert torch.equal(rank_prefix, self.rank_prefix_matrix()), "rank_prefix_matrix"
        assert torch.equal(in_rank, sent_here), "handle's is_token_in_rank"
        # Channels are an implementation detail; these hold for any number of them: the last
        # inclusive prefix is everything sent to that rank, the first channel starts at 0.
        assert torch.equal(channel_prefix[:, -1], sent_here.sum(dim=0).int()), "channel prefix"
        assert bool((recv_channel_prefix[:, 0] == 0).all()), "recv_channel_prefix_matrix"
        assert int(src_idx.shape[0]) == int(rank_prefix[-1, self.rank]), "recv_src_idx length"
        assert torch.equal(send_head >= 0, sent_here), "send_head is -1 exactly where not sent"
        assert bool((send_head[~sent_here] == -1).all())

    def check_rows(self, recv_x: Any, handle: Any, case: Case, again: bool) -> int:
        """Rows from source ``s`` sit at ``rank_prefix[s-1][me] .. rank_prefix[s][me]``; each
        is that source's token ``recv_src_idx[row]``, byte for byte. Returns the rows seen."""
        rank_prefix, src_idx = handle[0], handle[3]
        start = 0
        for src in range(self.num_ranks):
            end = int(rank_prefix[src, self.rank])
            tokens = src_idx[start:end].long()
            assert sorted(tokens.tolist()) == self.tokens_from(src), f"{case}: tokens from {src}"
            expected = self.payload(src, case, again)
            if case.fp8:
                values, scales = recv_x
                assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
                assert torch.equal(
                    values[start:end].view(torch.uint8), expected[0][tokens].view(torch.uint8)
                ), f"{case}: FP8 values from {src}"
                assert torch.equal(scales[start:end], expected[1][tokens]), f"{case}: scales"
            else:
                assert recv_x.dtype == torch.bfloat16
                assert torch.equal(recv_x[start:end], expected[tokens]), f"{case}: rows from {src}"
            start = end
        return start

    def check_topk(self, recv_idx: torch.Tensor, recv_w: torch.Tensor, handle: Any) -> None:
        """Each row carries its token's top-k with this rank's experts renumbered from 0 and
        every other slot -1 (weight 0)."""
        assert recv_idx.dtype == deep_ep.topk_idx_t and recv_w.dtype == torch.float32
        rank_prefix, src_idx = handle[0], handle[3]
        first = self.rank * self.num_local_experts
        start = 0
        for src in range(self.num_ranks):
            end = int(rank_prefix[src, self.rank])
            tokens = src_idx[start:end].long()
            idx = self.inputs[src].topk_idx[tokens]
            here = (idx >= first) & (idx < first + self.num_local_experts)
            expected_idx = torch.where(here, idx - first, -1)
            expected_w = torch.where(here, self.inputs[src].topk_weights[tokens], 0.0)
            assert torch.equal(recv_idx[start:end], expected_idx), f"recv_topk_idx from {src}"
            assert torch.equal(recv_w[start:end], expected_w), f"recv_topk_weights from {src}"
            start = end

    def check_worst(
        self, args: dict[str, Any], case: Case, recv_x: Any, recv_idx: torch.Tensor,
        recv_w: torch.Tensor, num_recv: int,
    ) -> None:
        """``num_worst_tokens``: every output padded to that many rows, the received ones
        first and the same, top-k -1 after them, and no per-expert list."""
        worst = sum(i.num_tokens for i in self.inputs)  # every token of every rank could come
        w_x, w_idx, w_w, w_counts, _, event = self.buffer.dispatch(
            **args, num_worst_tokens=worst, **self.event_kwargs(case.events)
        )
        self.finish(event, case.events)
        assert w_counts == [], "num_worst_tokens leaves the per-expert list empty"
        assert w_idx is not None and w_w is not None
        padded, received = (w_x, recv_x) if case.fp8 else ((w_x,), (recv_x,))
        for got, ref in zip(padded, received, strict=True):
            assert got.shape[0] == worst, f"{case}: padded to num_worst_tokens"
            assert torch.equal(got[:num_recv].view(torch.uint8), ref.view(torch.uint8))
        assert w_idx.shape[0] == w_w.shape[0] == worst
        assert torch.equal(w_idx[:num_recv], recv_idx) and torch.equal(w_w[:num_recv], recv_w)
        assert bool((w_idx[num_recv:] == -1).all()), "padding rows select no expert"

    def check_cached(self, handle: Any, case: Case) -> None:
        """Cached dispatch (DeepEP: the backward of combine): other values, the same rows."""
        recv, *rest, event = self.buffer.dispatch(
            self.payload(self.rank, case, again=True), handle=handle, config=self.config(case),
            **self.event_kwargs(case.events),
        )
        self.finish(event, case.events)
        assert rest == [None] * 4, "cached dispatch returns only the rows"
        self.check_rows(recv, handle, case, again=True)

    def check_combine(self, recv_x: Any, recv_w: Any, handle: Any, case: Case) -> None:
        """Each rank sends back its rows times ``2**rank`` (exact in BF16); the combined token
        is its row times the sum of those factors over the ranks it went to, plus the biases.
        The top-k weights come back as the token's own (0 for an empty slot)."""
        rows = dequantize(*recv_x).to(torch.bfloat16) if case.fp8 else recv_x
        gen = torch.Generator().manual_seed(SEED * 7 + self.rank)
        shape = self.mine.x.shape
        biases = [torch.randn(shape, generator=gen).to(torch.bfloat16)
                  for _ in range(case.num_biases)]
        args: dict[str, Any] = dict(
            x=rows * 2.0**self.rank, handle=handle, config=deep_ep.Buffer.get_combine_config(
                self.num_ranks)
        )
        if case.with_topk:
            args["topk_weights"] = recv_w
        if biases:
            args["bias"] = biases[0] if len(biases) == 1 else (biases[0], biases[1])
        combined, combined_w, event = self.buffer.combine(**args, **self.event_kwargs(case.events))
        self.finish(event, case.events)

        mine = dequantize(*self.fp8[self.rank]).to(torch.bfloat16) if case.fp8 else self.mine.x
        factor = (self.dest[self.rank].double() * 2.0 ** torch.arange(self.num_ranks)).sum(dim=1)
        expected = mine.double() * factor[:, None]
        magnitude = expected.abs()
        for b in biases:
            expected, magnitude = expected + b.double(), magnitude + b.double().abs()
        assert combined.dtype == torch.bfloat16 and combined.shape == shape
        assert_within(combined, expected, BF16_TOL * magnitude, f"{case}: combined_x")
        if case.with_topk:
            assert combined_w is not None, "top-k weights in, combined weights out"
            own = torch.where(self.mine.topk_idx >= 0, self.mine.topk_weights, 0.0)
            assert torch.equal(combined_w, own), f"{case}: combined_topk_weights"
        else:
            assert combined_w is None


def run_rank(local_rank: int, num_processes: int, args: argparse.Namespace) -> None:
    rank, group = join_group(local_rank, num_processes, args.init_method)
    deep_ep.Buffer.set_num_sms(24)
    assert deep_ep.Buffer.num_sms == 24
    program = NormalModeProgram(rank, group, sizes_of(args))
    for events in ("previous", "sync"):  # the last one's outputs feed the dispatches
        program.check_layout(events)
    payloads = (False, True) if deep_ep.Buffer.is_sm90_compiled() else (False,)
    cases = [Case(*c) for c in itertools.product(payloads, (False, True), EVENT_MODES)]
    for case in cases:
        program.run(case)
    program.buffer.destroy()
    leave_group()
    report("normal_mode", rank, num_processes, 2 + len(cases))


if __name__ == "__main__":
    spawn(run_rank, parse_args(__doc__.splitlines()[0], DEFAULTS))
