"""DeepEP programs run with torch's default dtype set to BF16 (DeepEP's own test helpers set it,
and programs built on them do): every facade test runs a second time under
``torch.set_default_dtype(torch.bfloat16)``, in this process and in every process it starts
(``ubep.launch`` ranks, torchrun workers and the DeepEP programs read ``DEFAULT_DTYPE_ENV``:
``tests/torch/__init__.py`` and ``deepep_programs/support.py`` apply it).

The BF16 run of the tests in ``BF16_BY_DEFAULT`` is in the default selection; the BF16 run of
every other facade test is under ``-m matrix``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.torch import DEFAULT_DTYPE_ENV

#: the facade's test modules (DeepEP V1, V2, their programs, FP8)
FACADE_MODULES = frozenset({
    "test_deep_ep_agree", "test_deep_ep_errors", "test_deep_ep_layouts", "test_deep_ep_surface",
    "test_deep_ep_v2",
    "test_deep_ep_v2_layout", "test_deep_ep_v2_programs", "test_deepep_programs",
    "test_fail_together", "test_torch_deep_ep", "test_torch_deep_ep_m2n", "test_torch_fp8",
})
#: the representative cases whose BF16 run is in the default selection
BF16_BY_DEFAULT = frozenset({
    "test_facade_errors_name_deepep_arguments_on_every_rank_and_the_next_call_works",
    "test_v1_low_latency_fails_together_and_the_next_call_is_exact",
    "test_normal_mode_round_trip_matches_dense",
    "test_low_latency_round_trip_matches_dense",
    "test_normal_mode_fp8_tuple_arrives_bit_for_bit",
    "test_numpy_equals_torch",
    "test_elastic_buffer_two_ranks",
    "test_reduce_at_source_bitwise",
})


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    if "default_dtype" not in metafunc.fixturenames or module not in FACADE_MODULES:
        return
    marks = () if metafunc.function.__name__ in BF16_BY_DEFAULT else (pytest.mark.matrix,)
    metafunc.parametrize("default_dtype", [
        "float32", pytest.param("bfloat16", marks=marks, id="bf16default")], indirect=True)


@pytest.fixture(autouse=True)
def default_dtype(request: pytest.FixtureRequest,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """torch's default dtype for the test (``float32`` unless parametrized)."""
    name = getattr(request, "param", "float32")
    if name == "float32":
        yield name
        return
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, name))
    monkeypatch.setenv(DEFAULT_DTYPE_ENV, name)
    try:
        yield name
    finally:
        torch.set_default_dtype(before)
