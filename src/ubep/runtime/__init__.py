"""The real runtime: ranks as processes on one host, POSIX shared memory as the global address
space, and a native (C11) data plane that runs the BSP and ASP engines.

* :func:`launch` / :class:`Group` / :func:`group_from_env`: start ranks and join them.
* :class:`ubep.buffer.Buffer`: dispatch/combine on a group.
"""

from .group import Group, group_from_env
from .launch import LostRank, launch

__all__ = ["Group", "LostRank", "group_from_env", "launch"]
