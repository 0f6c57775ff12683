"""flaggems plugin for Huawei Ascend NPUs.

Ascend devices reach torch through ``torch_npu``, which registers the ``npu``
device type on the ``PrivateUse1`` dispatch key. This module only describes
the backend; its probe lives in :mod:`flaggems_ascend.probe` and is imported
lazily, when the core selects a backend.
"""

from __future__ import annotations

from flaggems import Backend, OpImpl, hookimpl

ASCEND = Backend(
    name="ascend",
    vendor="ascend",
    device_type="npu",
    dispatch_key="PrivateUse1",
    probe="flaggems_ascend.probe:probe",
    description="Huawei Ascend NPUs through torch_npu",
)


@hookimpl
def flaggems_backends() -> tuple[Backend, ...]:
    """The one backend this plugin drives."""
    return (ASCEND,)


@hookimpl
def flaggems_operators(backend: Backend) -> tuple[OpImpl, ...]:
    """Ascend-specific implementations (none yet: operators come in later issues)."""
    return ()
