"""flaggems plugin for Hygon DCUs.

Hygon DCUs run a ROCm/HIP build of torch, which names its devices ``cuda``
and dispatches on the ``CUDA`` key. Detection (HIP build, device name or GCN
architecture) is in :mod:`flaggems_hygon.probe`.

The DCU runs the generic kernels: its differences are configuration. Its
64-wide wavefronts come from the device facts (:func:`flaggems_hygon.probe.facts`),
and the kernels size themselves by them: ``repeat_interleave``'s scan looks
back one wavefront of predecessor chunks per step, and its programs' warp
count is their thread count (the scan policy's ``threads``) over the
wavefront width. ``repeat_interleave`` with ``output_size`` (the ``.Tensor``
overload and the values API ``.self_Tensor``) sizes its output from it and
never reads the device; ``index_select`` runs no separate range-check pass
(both are the generic contract, which the DCU keeps). No Hygon kernel exists:
no algorithm differs. No tuning either, yet: the one candidate tried (256
threads a program, four wavefronts) made the expand 23-41% slower on an H200
standing in for a DCU, and no DCU was at hand to show
otherwise (a measured value would go to a ``flaggems_tuning`` hook here).
"""

from __future__ import annotations

from collections.abc import Sequence

from flaggems import Backend, hookimpl

_DESCRIPTION = "Hygon DCUs through ROCm/HIP torch"

@hookimpl
def flaggems_backends() -> Sequence[Backend]:
    """Hygon backend record (probe and device facts referenced lazily)."""
    hygon = Backend("hygon", vendor="hygon", device_type="cuda", dispatch_key="CUDA",
                    probe="flaggems_hygon.probe:probe", facts="flaggems_hygon.probe:facts",
                    description=_DESCRIPTION)
    return (hygon,)

