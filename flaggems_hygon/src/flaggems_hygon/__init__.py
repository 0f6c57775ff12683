"""flaggems plugin for Hygon DCUs.

Hygon DCUs run a ROCm/HIP build of torch, which names its devices ``cuda``
and dispatches on the ``CUDA`` key. Detection (HIP build, device name or GCN
architecture) is in :mod:`flaggems_hygon.probe`.
"""

from __future__ import annotations

from collections.abc import Sequence

from flaggems import Backend, OpImpl, hookimpl

_DESCRIPTION = "Hygon DCUs through ROCm/HIP torch"


@hookimpl
def flaggems_backends() -> Sequence[Backend]:
    """Hygon backend record (probe referenced lazily)."""
    hygon = Backend("hygon", vendor="hygon", device_type="cuda", dispatch_key="CUDA",
                    probe="flaggems_hygon.probe:probe", description=_DESCRIPTION)
    return (hygon,)


@hookimpl
def flaggems_operators(backend: Backend) -> Sequence[OpImpl]:
    """Nothing Hygon-specific so far (operators are added by later issues)."""
    return ()
