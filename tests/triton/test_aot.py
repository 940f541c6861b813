"""Every kernel of the engine compiles ahead of time for sm_90 and for every newer CUDA target
the installed Triton supports: the launches of a CPU run (every sync x layout, payload types
of each width) are recorded under the interpreter, then compiled, in a process without
``TRITON_INTERPRET``, for each target with the engine's options."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ubep
from ubep.modes import LAYOUTS, SYNCS

from ._ranks import Case, launch_log
from .conftest import needs_triton

pytestmark = needs_triton


def _cases() -> list[Case]:
    return ([Case(s, lay, "bf16") for s in SYNCS for lay in LAYOUTS]
            + [Case("tff", "expert", "fp32"), Case("dc", "rank", "uint8"),
               Case("sp", "expert", "fp16")])


@pytest.fixture(scope="module")
def launches() -> list[list[object]]:
    return ubep.launch(launch_log, 1, _cases(), timeout_s=600)[0]


def _compile(launches: list[list[object]], sample: bool) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["UBEP_AOT_SAMPLE"] = "1" if sample else "0"
    proc = subprocess.run([sys.executable, "-m", "ubep.triton.aot"], input=json.dumps(launches),
                          capture_output=True, text=True, env=env, timeout=1200, check=False)
    assert proc.stdout, proc.stderr[-3000:]
    report: dict[str, object] = json.loads(proc.stdout)
    assert not report["failures"], "\n".join(report["failures"])  # type: ignore[arg-type]
    assert proc.returncode == 0
    return report


def _check_coverage(report: dict[str, object]) -> None:
    assert 90 in report["archs"]  # type: ignore[operator]
    # every kernel the modules define was launched, hence compiled
    assert sorted(report["compiled"]) == report["kernels"]  # type: ignore[call-overload]


def test_every_kernel_compiles_for_sm90_and_newer(launches: list[list[object]]) -> None:
    """Every variant for sm_90, every kernel for each newer target."""
    _check_coverage(_compile(launches, sample=True))


@pytest.mark.matrix
def test_every_variant_compiles_for_every_target(launches: list[list[object]]) -> None:
    _check_coverage(_compile(launches, sample=False))
