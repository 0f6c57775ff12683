"""Benchmark workloads: every op family's ``shapes`` part, then the plugins'.

An op family (``flaggems/ops/<family>/``, see :class:`flaggems.families.OpSpec`)
declares its workloads in its ``shapes`` part (``shapes.py``, or a ``shapes/``
package): ``WORKLOADS``, a tuple of :class:`~flaggems.bench.workload.Workload`.
Each workload names its bench op (``Workload.op``: ``copy_``, ``rms_norm``...),
the name ``--op`` selects. Adding an op's benchmarks is adding that part to its
family's folder; no list here names the families.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from .workload import Workload, normalize_dtype


def all_workloads() -> list[Workload]:
    """Every op family's workloads, in report order (:func:`flaggems.families.specs`), then those of plugins
    (``flaggems_bench_workloads``)."""
    from .. import families
    from ..runtime import RUNTIME

    found: list[Workload] = []
    for record in families.specs():
        found.extend(record.workloads())
    for plugin, result in RUNTIME.manager.call_each("flaggems_bench_workloads"):
        extra = [result] if isinstance(result, Workload) else list(result)
        bad = [w for w in extra if not isinstance(w, Workload)]
        if bad:
            raise TypeError(f"plugin {plugin!r}: flaggems_bench_workloads gave {type(bad[0]).__name__}, "
                            f"expected flaggems.bench.workload.Workload")
        found.extend(extra)
    return found


def known_ops(workloads: Iterable[Workload]) -> set[str]:
    """Names ``--op`` accepts: the workloads' bench ops and the aten ops they route."""
    return {w.op for w in workloads} | {route for w in workloads for route in w.routes}


def select(workloads: Iterable[Workload], ops: Iterable[str] = (), dtypes: Iterable[str] = (),
           names: Iterable[str] = ()) -> list[Workload]:
    """Filter by op, dtype and name (globs: ``'*vs F.rms_norm*'``); empty filters keep everything.

    An op names a bench op (``index_copy``: a ``Workload.op``) or, when no workload has that
    op, an aten op a workload routes (``index_copy_``, ``repeat_interleave.Tensor``).
    """
    workloads = list(workloads)
    bench_ops = {w.op for w in workloads}
    wanted_ops, wanted_dtypes = set(ops), {normalize_dtype(d) for d in dtypes}

    def op_matches(w: Workload) -> bool:
        return any(w.op == op if op in bench_ops else op in w.routes for op in wanted_ops)

    patterns = list(names)
    return [w for w in workloads
            if (not wanted_ops or op_matches(w)) and (not wanted_dtypes or w.dtypes() & wanted_dtypes)
            and (not patterns or any(fnmatch.fnmatchcase(w.name, p) for p in patterns))]
