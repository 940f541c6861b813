"""vLLM's all2all manager interface served by :class:`~ubep.vllm.exchange.EpExchange`.

vLLM (0.32) calls, on the communicator of its EP group: ``dispatch(hidden_states,
topk_weights, topk_ids, is_sequence_parallel, extra_tensors)`` from the naive DP/EP
prepare step of its modular MoE kernel, and ``combine(hidden_states, is_sequence_parallel)``
from its finalize step (through ``combine_into_output``). ``dispatch_router_logits`` (routing
after the exchange) cannot send a token only to its experts' ranks, so it is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase
from vllm.logger import init_logger

from ..errors import InvalidArgumentError
from .exchange import EpExchange
from .hosts import ep_group, leave_mpi_at_exit, transport_of

__all__ = ["UbepAll2AllManager", "check_parallel_config"]

# under vLLM's logger, so its handlers print the line in every vLLM process
logger = init_logger("vllm.ubep")


def check_parallel_config(parallel: Any) -> None:
    """Refuse, naming the setting, what the exchange does not serve: TP inside DP (tokens
    replicated over a TP group would be dispatched once per TP rank), EPLB and any expert
    placement but ``linear`` (ubep places experts contiguously)."""
    if parallel.tensor_parallel_size != 1:
        raise InvalidArgumentError(
            "tensor_parallel_size", parallel.tensor_parallel_size,
            "must be 1 with UBEP_VLLM_ALL2ALL=1 (data parallel x expert parallel)")
    if parallel.enable_eplb:
        raise InvalidArgumentError("enable_eplb", True,
                                   "is not served with UBEP_VLLM_ALL2ALL=1")
    if parallel.expert_placement_strategy != "linear":
        raise InvalidArgumentError(
            "expert_placement_strategy", parallel.expert_placement_strategy,
            "must be 'linear' with UBEP_VLLM_ALL2ALL=1 (rank r holds experts "
            "[r*E/R, (r+1)*E/R))")


class UbepAll2AllManager(All2AllManagerBase):
    """The all2all of one vLLM EP group over ubep (shared memory on one host, ubep's MPI
    engine across hosts: :mod:`ubep.vllm.hosts`)."""

    def __init__(self, cpu_group: Any, tcp_store_group: Any = None) -> None:
        super().__init__(cpu_group, tcp_store_group)
        config = get_current_vllm_config()
        check_parallel_config(config.parallel_config)
        # collective: the EP ranks' ubep group (across hosts on ubep's MPI engine, which needs
        # the DP ranks launched by mpiexec; every rank raises alike otherwise)
        group = ep_group(cpu_group, self.internode)
        self.exchange = EpExchange(
            group, num_experts=config.model_config.get_num_experts(),
            max_tokens_per_rank=config.scheduler_config.max_num_batched_tokens)
        if int(getattr(group, "num_hosts", 1)) > 1:
            leave_mpi_at_exit(self.exchange, group)
        logger.info("ubep serves the all2all of the EP group (rank %d of %d, %d experts) over %s",
                    self.rank, self.world_size, self.exchange.num_experts, transport_of(group))

    def get_handle(self, kwargs: Any) -> Any:
        return self.exchange

    def dispatch_router_logits(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                               is_sequence_parallel: bool = False,
                               extra_tensors: list[torch.Tensor] | None = None) -> Any:
        raise InvalidArgumentError(
            "router_logits", "dispatch before routing",
            "ubep sends a token to its experts' ranks, so it needs topk_ids: a MoE method "
            "that routes inside its kernel (monolithic) is not served")

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, is_sequence_parallel: bool = False,
                 extra_tensors: list[torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if extra_tensors:
            raise InvalidArgumentError(
                "extra_tensors", len(extra_tensors),
                "quantised activations' scales and LoRA mappings are not dispatched by ubep")
        return self.exchange.dispatch(hidden_states, topk_weights, topk_ids)

    def combine(self, hidden_states: torch.Tensor,
                is_sequence_parallel: bool = False) -> torch.Tensor:
        return self.exchange.combine(hidden_states)

    def destroy(self) -> None:
        self.exchange.close()
