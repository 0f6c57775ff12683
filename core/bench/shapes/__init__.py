"""Benchmark shapes: one module per op, each declaring ``WORKLOADS`` (see :class:`~flaggems.bench.workload.Workload`).

Adding an op is adding a module here and naming it in :data:`MODULES`.
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Iterable

from ..workload import Workload, normalize_dtype

#: Shape modules, in report order (module name == bench op name).
MODULES = ("copy_", "_to_copy", "index_copy", "index_select", "repeat_interleave", "native_group_norm", "group_norm",
           "unfold", "rms_norm", "rotary", "glu", "group_norm_silu")


def all_workloads() -> list[Workload]:
    """Every workload of every shape module, in :data:`MODULES` order, then those of plugins
    (``flaggems_bench_workloads``)."""
    from ...runtime import RUNTIME

    found: list[Workload] = []
    for name in MODULES:
        found.extend(importlib.import_module(f"{__name__}.{name}").WORKLOADS)
    for plugin, result in RUNTIME.manager.call_each("flaggems_bench_workloads"):
        extra = [result] if isinstance(result, Workload) else list(result)
        bad = [w for w in extra if not isinstance(w, Workload)]
        if bad:
            raise TypeError(f"plugin {plugin!r}: flaggems_bench_workloads gave {type(bad[0]).__name__}, "
                            f"expected flaggems.bench.workload.Workload")
        found.extend(extra)
    return found


def known_ops(workloads: Iterable[Workload]) -> set[str]:
    """Names ``--op`` accepts: shape modules and the aten ops they route."""
    return {w.op for w in workloads} | {route for w in workloads for route in w.routes}


def select(workloads: Iterable[Workload], ops: Iterable[str] = (), dtypes: Iterable[str] = (),
           names: Iterable[str] = ()) -> list[Workload]:
    """Filter by op, dtype and name (globs: ``'*vs F.rms_norm*'``); empty filters keep everything.

    An op names a shape module (``index_copy``) or, when no module has that
    name, an aten op a workload routes (``index_copy_``, ``repeat_interleave.Tensor``).
    """
    workloads = list(workloads)
    modules = {w.op for w in workloads}
    wanted_ops, wanted_dtypes = set(ops), {normalize_dtype(d) for d in dtypes}

    def op_matches(w: Workload) -> bool:
        return any(w.op == op if op in modules else op in w.routes for op in wanted_ops)

    patterns = list(names)
    return [w for w in workloads
            if (not wanted_ops or op_matches(w)) and (not wanted_dtypes or w.dtypes() & wanted_dtypes)
            and (not patterns or any(fnmatch.fnmatchcase(w.name, p) for p in patterns))]
