"""Ahead-of-time compilation of the engine's kernels for GPUs this machine does not have.

``python -m ubep.triton.aot < launches.json`` compiles each launch a CPU run recorded
(``TritonEngine.launch_log``: kernel name, argument types, constexprs) for sm_90 and every
newer CUDA target the installed Triton compiles a probe kernel for, with the engine's compile
options, and prints a JSON report. It must run without ``TRITON_INTERPRET`` (under the
interpreter ``triton.jit`` makes no compilable kernels), hence a process of its own.
Environment: ``UBEP_AOT_ARCHS=90,100`` limits the targets; ``UBEP_AOT_SAMPLE=1`` compiles one
variant of each kernel for the targets past sm_90 (every variant for sm_90).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["CUDA_CANDIDATES", "REQUIRED_ARCH", "compile_launches", "main", "supported_archs"]

REQUIRED_ARCH = 90  # Hopper: the first target the engine is written for
CUDA_CANDIDATES = (90, 100, 103, 110, 120, 121)
OPTIONS = {"enable_fp_fusion": False}  # combine's products rounded before the add (no FMA)


def _modules() -> dict[str, Any]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset")
    from . import kernels_combine, kernels_dispatch

    return {n: getattr(m, n) for m in (kernels_dispatch, kernels_combine) for n in dir(m)
            if n.endswith("_kernel")}


def _compile(fn: Any, types: list[str], consts: dict[str, Any], arch: int) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    sig = dict(zip(names, types, strict=False))
    for name in consts:
        sig[name] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(consts))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(OPTIONS))


def supported_archs() -> list[int]:
    """The CUDA targets of :data:`CUDA_CANDIDATES` the installed Triton compiles a probe for
    (sm_90 always listed: it is required, a failure there is the check's failure)."""
    probe = _modules()["ready_kernel"]
    out = []
    for arch in CUDA_CANDIDATES:
        try:
            _compile(probe, ["*i64", "*i32", "i64", "i64", "i64"], {}, arch)
        except Exception:
            if arch == REQUIRED_ARCH:
                out.append(arch)
            continue
        out.append(arch)
    return out


def compile_launches(launches: list[list[Any]], archs: list[int], *,
                     sample_newer: bool = False) -> dict[str, Any]:
    """Compile every distinct launch for every target; the report (``failures`` empty when all
    compiled). ``sample_newer``: targets past sm_90 get one variant of each kernel (the first
    launched) instead of every variant."""
    kernels = _modules()
    seen: set[str] = set()
    names_seen: set[str] = set()
    failures: list[str] = []
    compiled: dict[str, int] = {}
    for name, types, consts in launches:
        key = json.dumps([name, types, consts], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        first = name not in names_seen
        names_seen.add(name)
        for arch in archs:
            if sample_newer and arch != REQUIRED_ARCH and not first:
                continue
            try:
                out = _compile(kernels[name], types, consts, arch)
                if not out.asm.get("cubin"):
                    raise RuntimeError("no cubin")
                compiled[name] = compiled.get(name, 0) + 1
            except Exception as e:
                failures.append(f"{name} {consts} sm_{arch}: {type(e).__name__}: "
                                f"{str(e)[:400]}")
    return {"archs": archs, "variants": len(seen), "compiled": compiled,
            "kernels": sorted(kernels), "failures": failures}


def main() -> int:
    launches = json.load(sys.stdin)
    archs = supported_archs()
    only = os.environ.get("UBEP_AOT_ARCHS")
    if only:
        archs = [a for a in archs if str(a) in only.split(",")]
    report = compile_launches(launches, archs,
                              sample_newer=os.environ.get("UBEP_AOT_SAMPLE") == "1")
    print(json.dumps(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
