"""What the DeepEP-style programs share, none of it ubep: starting one process per rank the way
DeepEP programs do, every rank's inputs (seeded by rank, so any rank can rebuild any other's
without asking), and the reference computations the programs' checks compare against.

The programs reach ubep only through ``from ubep import deep_ep``; this module never imports it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

FP8_BLOCK = 128  # channels that share one FP8 scale (DeepEP's per-token, per-128 cast)
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4  # a block's amax is floored here before it becomes a scale (DeepEP's rule)
# BF16 keeps 8 significant bits: one rounding is off by at most 2**-8 of the value. Allow two
# (the reduction's, then the bias's), relative to the sum of the magnitudes that went in.
BF16_TOL = 2.0**-7
# Every wait on the gloo group ends: a rank that died fails the others within this.
GROUP_TIMEOUT = timedelta(seconds=120)

Worker = Callable[[int, int, argparse.Namespace], None]


@dataclass(frozen=True)
class Sizes:
    """A program's shapes; rank ``r`` holds ``num_tokens + r`` tokens (ranks differ on purpose)."""

    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int

    def tokens_of(self, rank: int) -> int:
        return self.num_tokens + rank


def parse_args(
    description: str, defaults: Sizes,
    more: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The programs' options (``more`` adds a program's own)."""
    parser = argparse.ArgumentParser(description=description)
    if more is not None:
        more(parser)
    parser.add_argument("--num-processes", type=int, default=2, help="ranks to spawn")
    parser.add_argument("--num-tokens", type=int, default=defaults.num_tokens)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--num-topk", type=int, default=defaults.num_topk)
    parser.add_argument("--num-experts", type=int, default=defaults.num_experts)
    parser.add_argument(
        "--init-method", default=None,
        help="torch.distributed rendezvous (default: a file:// path in a new temp directory)",
    )
    return parser.parse_args()


def sizes_of(args: argparse.Namespace) -> Sizes:
    return Sizes(args.num_tokens, args.hidden, args.num_topk, args.num_experts)


def spawn(worker: Worker, args: argparse.Namespace) -> None:
    """One process per rank, as DeepEP programs start; a rank's failure fails the spawn."""
    if args.init_method is None:
        # A file rendezvous needs no free port (several jobs share this machine).
        args.init_method = "file://" + os.path.join(tempfile.mkdtemp(), "rendezvous")
    torch.multiprocessing.spawn(
        worker, args=(args.num_processes, args), nprocs=args.num_processes
    )


def join_group(
    local_rank: int, num_ranks: int, init_method: str
) -> tuple[int, dist.ProcessGroup]:
    """Join the gloo world and return ``(rank, ep_group)``; the EP group is a
    ``dist.new_group`` over every rank, the object DeepEP programs hand to ``Buffer``."""
    dist.init_process_group(
        "gloo", init_method=init_method, rank=local_rank, world_size=num_ranks,
        timeout=GROUP_TIMEOUT,
    )
    torch.set_num_threads(1)  # the ranks share a few cores; more threads only contend
    # DeepEP's test helpers set a BF16 default dtype; the pytest wrapper's BF16 run asks for it
    default = os.environ.get("TESTS_TORCH_DEFAULT_DTYPE")
    if default:
        torch.set_default_dtype(getattr(torch, default))
    group = dist.new_group(list(range(num_ranks)))
    assert group is not None
    return dist.get_rank(), group


def leave_group() -> None:
    dist.barrier()
    dist.destroy_process_group()


def report(program: str, rank: int, num_ranks: int, num_cases: int) -> None:
    """The line the pytest wrapper counts: this rank reached the end with every case checked."""
    print(f"{program}: rank {rank} of {num_ranks}: {num_cases} cases passed", flush=True)


# --------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class RankInputs:
    """One rank's tokens and routing: a pure function of (seed, rank, sizes)."""

    x: torch.Tensor  # [tokens, hidden] bfloat16
    x_again: torch.Tensor  # [tokens, hidden] bfloat16, other values on the same routing
    topk_idx: torch.Tensor  # [tokens, num_topk] int64, distinct experts per token, -1 = none
    topk_weights: torch.Tensor  # [tokens, num_topk] float32, positive

    @property
    def num_tokens(self) -> int:
        return int(self.x.shape[0])

    def tokens_for_expert(self, expert: int) -> list[int]:
        """This rank's tokens routed to ``expert``, ascending."""
        return torch.nonzero((self.topk_idx == expert).any(dim=1)).flatten().tolist()

    def ranks_of_tokens(self, num_experts: int, num_ranks: int) -> torch.Tensor:
        """``[tokens, num_ranks]`` bool: the ranks owning at least one of a token's experts
        (experts are split into equal contiguous runs, rank ``r`` owning the ``r``-th)."""
        owner = torch.div(self.topk_idx, num_experts // num_ranks, rounding_mode="floor")
        owner = torch.where(self.topk_idx >= 0, owner, -1)
        return torch.stack([(owner == r).any(dim=1) for r in range(num_ranks)], dim=1)


def rank_inputs(seed: int, rank: int, sizes: Sizes, num_masked: int) -> RankInputs:
    """Random BF16 tokens and a router's top-k: ``num_masked`` slots set to -1, and the last
    token routed nowhere (every slot -1), as a router that drops tokens produces."""
    gen = torch.Generator().manual_seed(seed * 1_000 + rank)
    n, h = sizes.tokens_of(rank), sizes.hidden
    x = torch.randn(n, h, generator=gen).to(torch.bfloat16)
    x_again = torch.randn(n, h, generator=gen).to(torch.bfloat16)
    scores = torch.rand(n, sizes.num_experts, generator=gen)
    idx = scores.argsort(dim=1, descending=True)[:, : sizes.num_topk].clone()
    masked = torch.randperm(idx.numel(), generator=gen)[:num_masked]
    idx.view(-1)[masked] = -1
    idx[-1] = -1
    weights = torch.rand(n, sizes.num_topk, generator=gen) + 0.25
    return RankInputs(x, x_again, idx.to(torch.int64), weights)


def everyone(seed: int, sizes: Sizes, num_ranks: int, num_masked: int) -> list[RankInputs]:
    return [rank_inputs(seed, r, sizes, num_masked) for r in range(num_ranks)]


# --------------------------------------------------------------------------- FP8 references
def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, FP8_BLOCK))


def power_of_two_ceil(v: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each (positive) element, from the float's own exponent."""
    mantissa, exponent = torch.frexp(v)  # v = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(v), exponent)


def fp8_scales(x: torch.Tensor, round_scale: bool = False) -> torch.Tensor:
    """``[..., hidden // 128]`` float32: ``max(amax, 1e-4) / 448`` per block, or with
    ``round_scale`` the power of two at or above it."""
    scale = _blocks(x).abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / E4M3_MAX
    return power_of_two_ceil(scale) if round_scale else scale


def cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A user's own FP8 cast for normal-mode dispatch: ``(values e4m3, scales)``, the scales
    stored column-major as GEMM kernels want them (a strided, non-contiguous view)."""
    scales = fp8_scales(x)
    values = (_blocks(x) / scales.unsqueeze(-1)).flatten(-2).to(torch.float8_e4m3fn)
    return values, scales.T.contiguous().T


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``values * scale`` per 128-channel block."""
    return (_blocks(values) * scales.unsqueeze(-1)).flatten(-2)


def fp8_error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """How far ``dequantize(cast(x))`` may be from ``x``: e4m3 keeps 3 mantissa bits, so
    rounding moves a normal value by at most 2**-4 of itself and a subnormal one by half the
    subnormal step of 2**-9 (times the scale); allowing the whole step, and a little relative
    slack, covers a cast that divides or multiplies by the inverse scale."""
    per_channel = scales.repeat_interleave(FP8_BLOCK, dim=-1).double()
    return x.double().abs() * (2.0**-4 + 1e-6) + per_channel * 2.0**-9


def decode_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Packed UE8M0 scales (int32, four exponent bytes each, first scale in the lowest byte)
    -> float32 ``2 ** (byte - 127)``, four times as many."""
    exponent = packed.contiguous().view(torch.uint8).to(torch.int32) - 127
    return torch.ldexp(torch.ones(exponent.shape, dtype=torch.float32), exponent)


# --------------------------------------------------------------------------- comparisons
def assert_within(
    actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str
) -> None:
    """``|actual - expected| <= bound`` everywhere (NaN fails)."""
    err = (actual.double() - expected.double()).abs()
    ok = err <= bound
    if not bool(ok.all()):
        where = tuple(int(i) for i in torch.nonzero(~ok)[0])
        raise AssertionError(
            f"{what}: at {where} got {float(actual[where])}, expected {float(expected[where])} "
            f"(allowed {float(bound[where]):.3g})"
        )


def relative_sq_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``sum((a - e)^2) / sum(a^2 + e^2)``: 0 when equal, whole-tensor and scale-free."""
    a, e = actual.double(), expected.double()
    return float(((a - e) ** 2).sum() / (a * a + e * e).sum().clamp(min=1e-300))
