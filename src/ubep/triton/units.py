"""A dispatch's send units built on the engine's device from its routing, with no read back to
the host: each unit's slot in its receive bucket, the units in canonical order (destination,
bucket, token), dealt to the send programs, and where each row lands once the prefix offsets
are known (the handle's ``send_dst_row``).

A unit is what ``ubep.sched``'s Plan calls one: a valid ``(token, k)`` pair in the expert layout
(bucket: the destination's local expert), a ``(token, destination)`` pair that some expert of
the token lives on in the rank layout (one bucket per destination). Rows of one bucket are in
ascending token order, as the Plan's ``send_slot`` says. Every candidate pair has a place in
the arrays; the valid ones come first, and the number of them stays a device scalar: the send
programs' shares (``core_ptr``) are computed from it on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceUnits", "device_units"]


@dataclass(frozen=True, slots=True)
class DeviceUnits:
    """One call's units (module docstring), every field a device tensor.

    Attributes:
        token, dst, bucket, slot: ``[C]`` int64 per unit in canonical order (the first
            ``num_units`` are valid; the rest are never read).
        core_ptr: ``[num_send_programs + 1]`` int64: program ``j`` sends units
            ``[core_ptr[j], core_ptr[j+1])`` (equal contiguous shares).
        dest_ptr: ``[num_ranks + 1]`` int64: the units to destination ``d`` are
            ``[dest_ptr[d], dest_ptr[d+1])`` (the batch a destination checks).
        cand_valid, cand_dst, cand_bucket, cand_slot: ``[T, K]`` (expert layout) or
            ``[T, num_ranks]`` (rank layout) per candidate pair, for ``send_dst_row``.
    """

    token: Any
    dst: Any
    bucket: Any
    slot: Any
    core_ptr: Any
    dest_ptr: Any
    cand_valid: Any
    cand_dst: Any
    cand_bucket: Any
    cand_slot: Any

    def send_dst_row(self, offs: Any, num_buckets: int) -> Any:
        """Each candidate's row at its destination (-1: none), from the prefix offsets
        ``offs`` ``[num_ranks * num_buckets]`` the prefix launch wrote."""
        import torch

        flat = (self.cand_dst * num_buckets + self.cand_bucket).clamp(min=0)
        row = offs[flat.reshape(-1)].reshape(flat.shape) + self.cand_slot
        return torch.where(self.cand_valid, row, torch.full_like(row, -1))


def device_units(idx: Any, num_ranks: int, local_experts: int, rank_layout: bool,
                 num_send_programs: int) -> DeviceUnits:
    """The units of routing ``idx`` (``[T, K]`` int64 on the device, validated) for
    ``num_send_programs`` send programs (module docstring)."""
    import torch

    dev, T = idx.device, int(idx.shape[0])
    R, L = num_ranks, local_experts
    if rank_layout:  # a candidate per (token, destination): some expert of it lives there
        owner = torch.where(idx >= 0, torch.div(idx, L, rounding_mode="floor"), -1)
        ranks = torch.arange(R, dtype=torch.int64, device=dev)
        valid = (owner[:, :, None] == ranks).any(dim=1)  # [T, R]
        group = ranks.expand(T, R)  # the bucket key: the destination
        groups, per_dst = R, 1
    else:
        valid = idx >= 0  # [T, K]
        group = idx.clamp(min=0)  # the bucket key: the expert
        groups, per_dst = R * L, L
    tok = torch.arange(T, dtype=torch.int64, device=dev)[:, None].expand_as(group)
    # canonical order: (bucket key, token); invalid pairs after every valid one, in place order
    pos = torch.arange(valid.numel(), dtype=torch.int64, device=dev).reshape(valid.shape)
    key = torch.where(valid, group * T + tok, groups * T + pos).reshape(-1)
    sorted_key, order = torch.sort(key, stable=True)
    g, token = torch.div(sorted_key, T, rounding_mode="floor"), sorted_key % T
    first = torch.searchsorted(sorted_key, (g * T).clamp(max=groups * T))
    slot = torch.arange(key.numel(), dtype=torch.int64, device=dev) - first
    dst = torch.div(g, per_dst, rounding_mode="floor").clamp(max=R - 1)
    bucket = g - dst * per_dst if not rank_layout else torch.zeros_like(g)
    bounds = torch.arange(R + 1, dtype=torch.int64, device=dev) * (per_dst * T)
    dest_ptr = torch.searchsorted(sorted_key, bounds)
    num_units = dest_ptr[R:]  # a device scalar: the keys below R * per_dst * T are the valid
    P = max(1, int(num_send_programs))
    core_ptr = torch.div(torch.arange(P + 1, dtype=torch.int64, device=dev) * num_units, P,
                         rounding_mode="floor")
    cand_slot = torch.empty_like(slot).scatter_(0, order, slot).reshape(valid.shape)
    cand_dst = torch.div(group, per_dst, rounding_mode="floor")
    cand_bucket = group - cand_dst * per_dst if not rank_layout else torch.zeros_like(group)
    return DeviceUnits(token=token, dst=dst, bucket=bucket, slot=slot, core_ptr=core_ptr,
                       dest_ptr=dest_ptr, cand_valid=valid, cand_dst=cand_dst,
                       cand_bucket=cand_bucket, cand_slot=cand_slot)
