"""ubep under vLLM: a plugin that serves vLLM's expert-parallel all2all on CPU (docs/VLLM.md).

``pip install -e '.[vllm]'`` (or ``make venv-vllm``) registers :func:`register` as a
``vllm.general_plugins`` entry point; ``UBEP_VLLM_ALL2ALL=1`` turns it on. Importing this
package imports neither vLLM nor torch: :mod:`ubep.vllm.manager` (vLLM's interface) and
:mod:`ubep.vllm.exchange` (the Buffers) load when a communicator needs them.
"""

from .plugin import is_patched, register

__all__ = ["is_patched", "register"]
