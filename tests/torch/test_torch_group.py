"""Unit checks of the torch.distributed adapter that need no torch processes: torch dtypes, the
same-host check, group detection, and that ``import ubep`` stays torch-free. The adapter itself
runs under a real torchrun in tests/test_torchrun.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

import ubep  # noqa: E402
from ubep.dtypes import BF16, FP16, FP32, INT8, UINT8, dtype_of  # noqa: E402
from ubep.torch.group import TorchGroup, check_same_host  # noqa: E402
from ubep.torch_bridge import as_process_group, is_torch_group  # noqa: E402

TORCH_TO_UBEP = [
    (torch.bfloat16, BF16),
    (torch.float16, FP16),
    (torch.float32, FP32),
    (torch.int8, INT8),
    (torch.uint8, UINT8),
    (torch.float8_e4m3fn, UINT8),
    (torch.float8_e5m2, UINT8),
]


@pytest.mark.parametrize(("tdtype", "want"), TORCH_TO_UBEP)
def test_torch_dtypes_map_to_the_ubep_type_of_the_same_bits(
    tdtype: torch.dtype, want: object
) -> None:
    got = dtype_of(tdtype)
    assert got == want
    assert dtype_of(torch.zeros(2, 3, dtype=tdtype)) == want  # a tensor: its dtype
    # Same width, and the storage view holds the tensor's very bytes.
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(tdtype)
    assert t.element_size() == got.itemsize
    raw = t.view(torch.uint8).numpy().tobytes()
    assert t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.itemsize]).numpy().view(
        got.storage).tobytes() == raw


def test_buffer_config_takes_torch_dtypes() -> None:
    shape = {"max_tokens_per_rank": 8, "hidden": 16, "num_topk": 2, "num_experts": 4}
    assert ubep.BufferConfig(**shape, dtype=torch.bfloat16).dtype == "bf16"
    fp8 = ubep.BufferConfig(**shape, dtype=torch.float8_e4m3fn, sync="tff",
                            combine_dtype=torch.bfloat16)
    assert (fp8.dtype, fp8.combine_dtype) == ("uint8", "bf16")
    with pytest.raises(ubep.InvalidArgumentError, match=r"^dtype=torch\.float64"):
        ubep.BufferConfig(**shape, dtype=torch.float64)
    with pytest.raises(ubep.InvalidArgumentError, match=r"^combine_dtype"):
        ubep.BufferConfig(**shape, dtype=torch.uint8, sync="tff", combine_dtype=torch.int8)


def _hello(host: str, boot: str) -> dict[str, str]:
    return {"host": host, "boot_id": boot}


def test_same_host_check() -> None:
    check_same_host([_hello("a", "b1")] * 3)  # one host: fine
    cases = [
        ([_hello("a", "b1"), _hello("a", "b1"), _hello("c", "b2"), _hello("c", "b2")],
         r"on 2 hosts \(a \(boot b1\): ranks \[0, 1\]; c \(boot b2\): ranks \[2, 3\]\)"),
        # The same name with another boot id is another machine (containers share names).
        ([_hello("a", "b1"), _hello("a", "b2")], r"on 2 hosts .*ranks \[0\];.*ranks \[1\]"),
    ]
    for hellos, where in cases:
        with pytest.raises(ubep.UbepError, match=where + r".*use ubep\.mpi"):
            check_same_host(hellos)


def test_only_torch_process_groups_are_adapted() -> None:
    class LooksLikeAGroup:
        rank, num_ranks = 0, 1

    fake = LooksLikeAGroup()
    assert not is_torch_group(fake) and as_process_group(fake) is fake
    with pytest.raises(ubep.InvalidArgumentError, match=r"^group="):
        TorchGroup(fake)


def test_import_ubep_and_its_dtypes_stay_torch_free() -> None:
    code = (
        "import sys, ubep, numpy as np\n"
        "from ubep.torch_bridge import as_process_group\n"
        "g = object(); assert as_process_group(g) is g\n"
        "assert ubep.dtypes.dtype_of(np.uint16).name == 'bf16'\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
