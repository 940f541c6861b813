"""The fixtures every vLLM test module shares, built once a session: whether .venv-vllm runs
vLLM, the tiny model, and its DP=1 greedy tokens (the oracle)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.vllm._runs import (
    HERE,
    START_S,
    VLLM_PY,
    engine_env,
    results,
    start,
    tail,
    wait_all,
    why_no_vllm,
)


@pytest.fixture(scope="session")
def vllm_ready() -> None:
    reason = why_no_vllm()
    if reason is not None:
        print(f"tests/vllm skipped: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def model_dir(vllm_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3moe")
    subprocess.run([str(VLLM_PY), str(HERE / "_make_model.py"), str(out / "tiny"), "tiny"],
                   check=True, timeout=300, capture_output=True)
    return out / "tiny"


@pytest.fixture(scope="session")
def dp1_tokens(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> dict[tuple[int, ...], list[int]]:
    log = tmp_path_factory.mktemp("dp1") / "dp1.log"
    proc = start(["_offline.py", str(model_dir)], engine_env(UBEP_VLLM_ALL2ALL="0"), log)
    wait_all([proc], START_S, [log])
    tokens = results(log)
    assert len(tokens) == 5 and all(len(t) == 8 for t in tokens.values()), tail(log)
    return tokens
