"""Build hook for the native data plane (C11); everything else is in pyproject.toml.

The extension needs a C11 compiler (gcc or clang), the Python headers and numpy's headers (arrays
cross the boundary through the buffer protocol; the fast path of blocking calls builds its
results with numpy's C API: fastpath.c), no CPU flags beyond the baseline
(AVX2 / F16C kernels are compiled with target attributes and picked at run time).
``-ffp-contract=off`` keeps combine's product and sum separately rounded, bit-exact with
``ubep.reference``.
"""

import sys
from pathlib import Path

import numpy
from setuptools import Extension, setup

# -fvisibility=hidden: the parts of the core reach each other's globals without the GOT; only
# PyInit__native is exported.
_ARGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-strict-aliasing", "-fvisibility=hidden",
         "-Wall", "-Wextra"]

# Every C file of the native folder is part of the module (docs/ARCHITECTURE.md's table lists
# them, one line each; a test holds the table and the folder equal): no list to keep here.
_NATIVE = Path("src/ubep/runtime/native")
_SOURCES = sorted(str(p) for p in _NATIVE.glob("*.c"))
_HEADERS = sorted(str(p) for p in _NATIVE.glob("*.h"))

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "ubep.runtime._native",
            sources=_SOURCES,
            depends=_HEADERS,
            define_macros=[("_GNU_SOURCE", None)],
            include_dirs=[numpy.get_include()],
            extra_compile_args=_ARGS,
            libraries=["pthread"],
        )
    )

setup(ext_modules=ext_modules)
