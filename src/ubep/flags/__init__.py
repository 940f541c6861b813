"""Data-as-Flag codecs: pure-numpy reference encoders/decoders of the sync modes.

The byte formats are normative in docs/FORMATS.md; the native data plane in ``ubep.runtime``
writes the same bytes and is tested against these codecs.

* :class:`SwFlag`: stop-and-wait, one epoch flag word after all rows (the baseline).
* :class:`TffCodec`: token-flag fusion, an epoch word inside every block.
* :class:`DcCodec`: data checksum over each block's leading bytes plus the epoch, per batch.
* :class:`SpCodec`: sentinel polling, a signalling-NaN pre-fill the data overwrites.

Decoders raise :class:`NotReadyError` when data for the expected epoch is not complete.
"""

from ._common import NotReadyError, as_row_bytes
from .dc import DcCodec
from .sp import SpCodec
from .sw import SwFlag
from .tff import TffCodec

__all__ = ["DcCodec", "NotReadyError", "SpCodec", "SwFlag", "TffCodec", "as_row_bytes"]
