"""What the step pipeline hands a backend, defined below both: the work items and the scalars of one update
(:mod:`.items`), the options of a bucket resolved once (:mod:`.record`) and the step counts and scalars of a
capturable step, kept on the device (:mod:`.capture`). The backends (the Triton kernels, the native CPU kernels)
import this, never the pipeline or the optimizer."""

from __future__ import annotations

from . import capture
from .items import Item, Update
from .record import BucketRecord

__all__ = ["Item", "Update", "BucketRecord", "capture"]
