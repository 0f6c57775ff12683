"""The group_norm family's benchmark workloads (``flaggems bench``): ``native_group_norm``,
``group_norm`` (the composite op routed) and ``flaggems::group_norm_silu``.

Each module declares the ``WORKLOADS`` of one bench op (its ``OP``); ``WORKLOADS``
here is theirs, concatenated in report order.
"""

from __future__ import annotations

from flaggems.bench.workload import Workload

from . import group_norm, group_norm_silu, native_group_norm

WORKLOADS: tuple[Workload, ...] = (*native_group_norm.WORKLOADS, *group_norm.WORKLOADS, *group_norm_silu.WORKLOADS)
