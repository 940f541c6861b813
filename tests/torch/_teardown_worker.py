"""One rank of the teardown job (tests/torch/test_torch_teardown.py), run under torchrun.

After ``init_process_group`` the rank builds a Buffer on the default group and closes it, keeps
every ubep object that refers to the group past ``dist.destroy_process_group`` (the closed
Buffer, its ubep group, a DeepEP Buffer, a Hugging Face registration), and builds an optimizer
(the first one imports ``torch._dynamo`` and with it ``torch.distributed.nn.functional``; so
does ``ubep.torch.hf``, imported here after init as a program may). Then it destroys the group
and records whether the group object was freed, whether a function of that torch module holds
it as a default argument, how many threads the process has before init and after destroy (a
live gloo group keeps its worker threads), what the DeepEP Buffer's ``group`` was before and
after, and what the kept ubep group says when asked for a barrier afterwards.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import weakref

import torch
import torch.distributed as dist

import ubep
import ubep.torch  # before init_process_group, as a program imports it
from ubep import deep_ep
from ubep.torch.group import from_torch

KEPT: list[object] = []  # ubep objects kept to the end, as a program's globals are
PINNING_MODULE = "torch.distributed.nn.functional"


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def pinned_by_defaults(group: object) -> bool:
    """Whether a function of PINNING_MODULE holds ``group`` as a default argument."""
    module = sys.modules.get(PINNING_MODULE)
    return module is not None and any(
        value is group
        for fn in vars(module).values() if callable(fn)
        for value in (getattr(fn, "__defaults__", None) or ())
    )


def main(out: str) -> int:
    threads_before_init = threads()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    ref = weakref.ref(dist.group.WORLD)
    cfg = ubep.BufferConfig(max_tokens_per_rank=4, hidden=8, num_topk=1, num_experts=2,
                            dtype=torch.float32)
    buffer = ubep.Buffer(dist.group.WORLD, cfg)
    buffer.close()
    kept_group = from_torch(dist.group.WORLD)
    deepep = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=0)
    deepep_group_before = deepep.group is dist.group.WORLD
    KEPT.extend([buffer, kept_group, deepep])
    from ubep.torch import hf  # after init: its imports include PINNING_MODULE

    hf.register(dist.group.WORLD)
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # imports torch._dynamo
    pinned = pinned_by_defaults(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    record = {"group_freed": ref() is None, "pinned_by_defaults": pinned,
              "threads_before_init": threads_before_init, "threads_after_destroy": threads()}
    # DeepEP's Buffer.group: the group given while it lives, None once torch freed it.
    record["deepep_group"] = [deepep_group_before, deepep.group is None]
    try:  # the kept ubep group, asked for a collective over the destroyed group
        kept_group.barrier()
        record["barrier_after_destroy"] = ""
    except ubep.UbepError as exc:
        record["barrier_after_destroy"] = str(exc)
    with open(os.path.join(out, f"teardown.{rank}.json"), "w") as f:
        json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
