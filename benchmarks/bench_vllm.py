"""vLLM on CPU: DP=1, TP=2 (vLLM's shared-memory TP) and DP=2 + EP over ubep, side by side.

Two random-initialised Qwen3-MoE models (``tests/vllm/_make_model.py``): ``tiny`` (hidden 128,
8 experts top-2) and ``wide`` (hidden 2048, 32 experts top-4), 2 layers, float32. For each
model the three modes' engines are started one after another under ``.venv-vllm`` (``make
venv-vllm``; ``benchmarks/vllm_worker.py`` per vLLM process, all in this process tree), then
stay up while their rounds alternate (round r starts with mode r mod 3): every mode sees the
same moments of this shared host's load. Per round:

* output tokens/s: the round's generated tokens (``BATCH`` prompts x ``MAX_TOKENS``, all DP
  ranks) over the slowest rank's wall time;
* decode step: the median interval between the starts of the engine's forwards in the round
  (``vllm_worker.py``'s hook), slowest rank;
* ubep's share of the MoE blocks' time: ubep's dispatch + combine over the time inside the
  ``Qwen3MoeSparseMoeBlock`` forwards (router, experts kernel, dispatch, combine), all ranks;
* ubep per MoE call: dispatch + combine time over calls, and the bytes they move on a rank:
  ``recv_rows * hidden * 4`` each way (rank layout: a row per (token, rank holding one of its
  experts), own rows included), against the memcpy floor of those bytes (``np.copyto``).

Min/median/max over rounds. Each engine computes on cores of its own choosing by
``VLLM_CPU_OMP_THREADS_BIND`` (``BIND``): vLLM 0.32 gives DP rank r the r-th ``|``-separated
entry, so the DP ranks are handed the whole list. Run::

    .venv/bin/python -m benchmarks.bench_vllm --rounds 5 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.vllm._procs import Watched, expect_lines, free_port, sweep_vllm_shm, vllm_env, vllm_shm

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
WORKER = ROOT / "benchmarks" / "vllm_worker.py"
MAKE_MODEL = ROOT / "tests" / "vllm" / "_make_model.py"
MODES = ("dp1", "tp2", "dp2ep")
HIDDEN = {"tiny": 128, "wide": 2048}  # tests/vllm/_make_model.py's shapes
# one compute thread per vLLM worker, one core each: DP=1 on core 0 (what vLLM picks by itself
# here, keeping core 1 for its frontend; two threads on both cores ran 10x slower on this busy
# host), TP=2 one core per TP worker, DP=2 one per DP rank. vLLM indexes the list by local DP
# rank (a DP rank given only its own entry finds an empty slice, its engine dies at start and
# the other rank waits for it in torch.distributed's rendezvous: what stalled this benchmark)
BIND = {"dp1": "0", "tp2": "0|1", "dp2ep": "0|1"}
# per decode step (mean over ranks, median over rounds): the model's forward, the MoE blocks
# in it, ubep's dispatch + combine in them, and torch.distributed.all_reduce (vLLM's DP sync)
PER_STEP = ("forward", "moe", "ubep", "all_reduce")
START_S = 600.0  # an engine's start (imports, weights, warm-up) on this busy 2-core host
ROUND_S = 600.0
STOP_S = 60.0  # a worker told to stop shuts its engine down (its shared memory unlinked)


def _env(**extra: str) -> dict[str, str]:
    return vllm_env({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                     "UBEP_VLLM_ALL2ALL": "1", "PYTHONUNBUFFERED": "1"}, **extra)


def _start(model: Path, mode: str, logdir: Path) -> list[Watched]:
    """The mode's vLLM processes (one per DP rank), up and warmed up."""
    ranks = 2 if mode == "dp2ep" else 1
    port = free_port()
    procs = []
    for rank in range(ranks):
        extra = ({"VLLM_DP_RANK": str(rank), "VLLM_DP_SIZE": "2",
                  "VLLM_DP_MASTER_IP": "127.0.0.1", "VLLM_DP_MASTER_PORT": str(port)}
                 if ranks > 1 else {})
        extra["VLLM_CPU_OMP_THREADS_BIND"] = BIND[mode]
        procs.append(Watched([str(VLLM_PY), str(WORKER), str(model), mode], _env(**extra),
                             logdir / f"{model.name}_{mode}_{rank}.log"))
    expect_lines(procs, "READY", START_S)
    return procs


def _round(procs: list[Watched]) -> list[dict[str, Any]]:
    for p in procs:  # the DP ranks together: each waits for the other in every MoE layer
        p.send("round")
    return [json.loads(line[len("RESULT "):]) for line in expect_lines(procs, "RESULT ", ROUND_S)]


def _model_rows(model: Path, rounds: int, logdir: Path) -> list[dict[str, Any]]:
    engines: dict[str, list[Watched]] = {}
    before = vllm_shm()
    try:
        for mode in MODES:
            engines[mode] = _start(model, mode, logdir)
        samples: dict[str, list[list[dict[str, Any]]]] = {mode: [] for mode in MODES}
        for r in range(rounds):
            for i in range(len(MODES)):
                mode = MODES[(r + i) % len(MODES)]
                samples[mode].append(_round(engines[mode]))
    finally:
        every = [p for procs in engines.values() for p in procs]
        for p in every:  # all at once: a DP rank's shutdown may wait for its peer's
            p.close_input()
        for p in every:
            p.stop(grace_s=STOP_S)
        sweep_vllm_shm(before)
    hidden = HIDDEN[model.name]
    return [{"model": model.name, "hidden": hidden, "mode": mode,
             **summarise(samples[mode], hidden), "samples": samples[mode]} for mode in MODES]


def _mmm(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def summarise(rounds: list[list[dict[str, Any]]], hidden: int,
              floor_us: float | None = None) -> dict[str, Any]:
    """Per round, aggregates over the DP ranks (``rounds[i]``: every rank's RESULT); then
    min/median/max over rounds. ``floor_us``: the memcpy floor measured with the rounds (else
    measured now)."""
    tps, step_ms, best_ms, first_ms, share, call_us, call_bytes = [], [], [], [], [], [], []
    per_step: list[dict[str, float]] = []
    for ranks in rounds:
        tps.append(sum(s["tokens"] for s in ranks) / max(s["full_s"] for s in ranks))
        # the median interval between forwards: the prefill's and a DP tail's few are outliers
        step_ms.append(max(statistics.median(s["step_ns"]) for s in ranks) / 1e6)
        best_ms.append(max(min(s["step_ns"]) for s in ranks) / 1e6)
        first_ms.append(max(s["first_token_s"] for s in ranks) * 1e3)
        moe = sum(s["moe_ns"] for s in ranks)
        for s in ranks:
            s["ubep_ns"] = s["dispatch_ns"] + s["combine_ns"]
        ubep = sum(s["ubep_ns"] for s in ranks)
        share.append(ubep / moe if moe else 0.0)
        per_step.append({k: statistics.mean(s[f"{k}_ns"] / max(s["forwards"], 1)
                                            for s in ranks) / 1e6 for k in PER_STEP})
        calls = sum(s["calls"] for s in ranks)
        if calls:
            call_us.append(ubep / calls / 1e3)
            # both ways: dispatch brings recv_rows rows, combine sends as many back (float32)
            call_bytes.append(2 * sum(s["recv_rows"] for s in ranks) * hidden * 4 / calls)
    out: dict[str, Any] = {"rounds": len(rounds), "tokens_per_s": _mmm(tps),
                           "decode_step_ms": _mmm(step_ms), "fastest_step_ms": min(best_ms),
                           "first_token_ms": _mmm(first_ms),
                           "ubep_share_of_moe": _mmm(share),
                           "per_step_ms": {k: statistics.median(d[k] for d in per_step)
                                           for k in PER_STEP}}
    if call_us:
        size = int(statistics.median(call_bytes))
        out.update(ubep_us_per_call=_mmm(call_us), bytes_per_call=size,
                   memcpy_us=memcpy_us(size) if floor_us is None else floor_us)
    return out


def memcpy_us(size_bytes: int, repeats: int = 200) -> float:
    """Median time of one ``np.copyto`` of ``size_bytes`` (the floor of moving them)."""
    src = np.ones(max(size_bytes // 4, 1), np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        np.copyto(dst, src)
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def _vllm_version() -> str:
    out = subprocess.run([str(VLLM_PY), "-c", "import importlib.metadata as m;"
                          "print(m.version('vllm-cpu'), m.version('torch'))"],
                         capture_output=True, text=True, timeout=300, check=True)
    vllm, torch = out.stdout.split()
    return f"vllm-cpu {vllm}, torch {torch}"


def _header(meta: dict[str, Any]) -> str:
    from benchmarks.vllm_worker import BATCH, MAX_TOKENS, PROMPT_LEN

    def load(v: list[float]) -> str:
        return " ".join(f"{x:.2f}" for x in v)

    return "\n".join([
        f"vLLM on CPU ({meta['versions']}), {meta['cores']} cores; load average (1/5/15 min) "
        f"at start {load(meta['load_start'])}, at end {load(meta['load_end'])}",
        f"{BATCH} prompts of {PROMPT_LEN} tokens, {MAX_TOKENS} greedy tokens each (ignore_eos), "
        f"float32, enforce_eager; {meta['rounds']} rounds per mode, modes alternated, engines up "
        "throughout",
        "tiny: 2 layers, hidden 128, 8 experts top-2; wide: 2 layers, hidden 2048, 32 experts "
        "top-4",
        "dp1: one engine; tp2: vLLM's shared-memory TP=2; dp2ep: DP=2 + expert parallel, "
        "ubep's all2all (UBEP_VLLM_ALL2ALL=1); one core per vLLM worker",
        "tok/s: all ranks' tokens / slowest rank's round; step: median interval between "
        "the engine's forwards in a round, slowest rank; fastest: the shortest interval of "
        "all rounds",
        "ubep/MoE: ubep dispatch + combine time / time inside the MoE blocks (all ranks), "
        "over rounds; us/call: dispatch + combine per MoE layer call (median);",
        "bytes/call = 2 x recv_rows x hidden x 4 (rows in, partial sums back; own rows "
        "included), memcpy: np.copyto of those bytes",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="tiny,wide")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    parser.add_argument("--tables-from", type=Path, default=None,
                        help="a vllm.json: summarise its rounds again (no vLLM run)")
    args = parser.parse_args()
    if args.tables_from is not None:
        _write(args.out, **_resummarise(json.loads(args.tables_from.read_text())))
        return
    if not VLLM_PY.exists():
        raise SystemExit(f"{VLLM_PY} is absent: make venv-vllm")
    versions = _vllm_version()
    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = Path(tmp) / name
            subprocess.run([str(VLLM_PY), str(MAKE_MODEL), str(model), name], check=True,
                           capture_output=True, timeout=600)
            for row in _model_rows(model, args.rounds, Path(tmp)):
                rows.append(row)
                print(_line(row), flush=True)
    meta = {"versions": versions, "cores": os.cpu_count(), "load_start": load_start,
            "load_end": os.getloadavg(), "rounds": args.rounds}
    _write(args.out, meta, rows)


def _resummarise(saved: dict[str, Any]) -> dict[str, Any]:
    rows = [{"model": r["model"], "hidden": r["hidden"], "mode": r["mode"],
             **summarise(r["samples"], r["hidden"], r.get("memcpy_us")),
             "samples": r["samples"]}
            for r in saved["rows"]]
    return {"meta": saved["meta"], "rows": rows}


def _write(out: Path | None, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    text = _header(meta) + "\n" + _table(rows)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "vllm.txt").write_text(text + "\n")
        (out / "vllm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1)
                                       + "\n")


def _line(row: dict[str, Any]) -> str:
    t, s = row["tokens_per_s"], row["decode_step_ms"]
    return (f"{row['model']:5} {row['mode']:6} {t[0]:7.1f} {t[1]:7.1f} {t[2]:7.1f}   "
            f"{s[0]:7.2f} {s[1]:7.2f} {s[2]:7.2f}  {row['fastest_step_ms']:7.2f}")


def _table(rows: list[dict[str, Any]]) -> str:
    mmm = f"{'min':>7} {'median':>7} {'max':>7}"
    out = [f"{'':13}{'output tokens/s':^23}   {'decode step ms':^23}",
           f"{'model':5} {'mode':6} {mmm}   {mmm}  fastest  tok/s vs dp1  step vs dp1"]
    base = {r["model"]: r for r in rows if r["mode"] == "dp1"}
    for r in rows:
        b = base.get(r["model"])
        tps = r["tokens_per_s"][1] / b["tokens_per_s"][1] if b else float("nan")
        step = r["decode_step_ms"][1] / b["decode_step_ms"][1] if b else float("nan")
        out.append(f"{_line(r)}  x{tps:11.2f}  x{step:10.2f}")
    out += ["", "ms per forward (mean in a round, median over rounds): the forward, its MoE "
            "blocks, ubep's dispatch + combine in them, DP all_reduce (outside the forward)",
            "model mode   forward    moe   ubep  all_reduce  ubep/MoE min   med   max  "
            "us/call  bytes/call  memcpy_us  vs_memcpy"]
    for r in rows:
        p = r["per_step_ms"]
        line = (f"{r['model']:5} {r['mode']:6} {p['forward']:7.2f} {p['moe']:6.2f} "
                f"{p['ubep']:6.2f} {p['all_reduce']:11.2f}")
        if "ubep_us_per_call" in r:
            u, c = r["ubep_share_of_moe"], r["ubep_us_per_call"]
            ratio = c[1] / r["memcpy_us"]
            line += (f"  {u[0]:12.1%} {u[1]:5.1%} {u[2]:5.1%}  {c[1]:7.0f}  "
                     f"{r['bytes_per_call']:10d}  {r['memcpy_us']:9.2f}  x{ratio:8.0f}")
        out.append(line)
    return "\n".join(line.rstrip() for line in out)


if __name__ == "__main__":
    main()
