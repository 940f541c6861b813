"""The one control-plane wait (``ubep.plane.control``), under the name the one-host groups have
always imported it by."""

from ..plane.control import LIVENESS_PERIOD_S, Backoff, wait_until

__all__ = ["LIVENESS_PERIOD_S", "Backoff", "wait_until"]
