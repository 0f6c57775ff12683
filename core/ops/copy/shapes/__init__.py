"""The copy family's benchmark workloads (``flaggems bench``): ``copy_``, then ``_to_copy``.

Each module declares the ``WORKLOADS`` of one bench op (its ``OP``); ``WORKLOADS``
here is theirs, concatenated in report order.
"""

from __future__ import annotations

from flaggems.bench.workload import Workload

from . import _to_copy, copy_

WORKLOADS: tuple[Workload, ...] = (*copy_.WORKLOADS, *_to_copy.WORKLOADS)
