"""``from ubep import deep_ep``: DeepEP's API on ubep, the documented import for DeepEP programs
(``import deep_ep`` -> ``from ubep import deep_ep``; ``from ubep.deep_ep import Buffer``), V1's
``Buffer`` and V2's ``ElasticBuffer`` (DeepEP 2.1) and ``EPBuffer`` (2.5).

A re-export: the facades live at their homes, :mod:`ubep.torch.deep_ep` and
:mod:`ubep.torch.deep_ep_v2` (they need torch).
"""

# the facades' own __all__ lists name what is public: one list each, not a copy here
from .torch import deep_ep as _v1
from .torch import deep_ep_v2 as _v2
from .torch import deep_ep_v2_types as _v2_types
from .torch.deep_ep import *  # noqa: F403
from .torch.deep_ep_v2 import *  # noqa: F403
from .torch.deep_ep_v2_types import *  # noqa: F403

__all__ = _v1.__all__ + _v2.__all__ + _v2_types.__all__
