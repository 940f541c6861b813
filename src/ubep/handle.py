"""The dispatch result and handles (``ubep.plane.results``, the data-plane contract's result
types), under their public name."""

from .plane.results import DispatchHandle, DispatchResult, PendingCall, RuntimeHandle

__all__ = ["DispatchHandle", "DispatchResult", "PendingCall", "RuntimeHandle"]
