"""flaggems plugin for Huawei Ascend NPUs.

Ascend devices reach torch through ``torch_npu``, which registers the ``npu``
device type on the ``PrivateUse1`` dispatch key. This module describes
the backend (its probe and device facts live in :mod:`flaggems_ascend.probe`,
imported when the core selects a backend) and offers Ascend's index_copy
kernels (:mod:`flaggems_ascend.index_copy`, imported at ``enable()``).
"""

from __future__ import annotations

from flaggems import Backend, OpImpl, PatchRule, hookimpl

ASCEND = Backend(
    name="ascend",
    vendor="ascend",
    device_type="npu",
    dispatch_key="PrivateUse1",
    probe="flaggems_ascend.probe:probe",
    description="Huawei Ascend NPUs through torch_npu",
    facts="flaggems_ascend.probe:facts",
    # Ascend AI cores compute no float64: such calls go to torch_npu on every implementation.
    unsupported_dtypes=("float64",),
    native_ops={
        "copy_": "torch_npu's own copy (CANN's view-copy and DMA paths) serves it better than a Triton kernel",
        "_to_copy": "torch_npu's own cast-and-copy serves it better than a Triton kernel",
    },
)


@hookimpl
def flaggems_backends() -> tuple[Backend, ...]:
    """The one backend this plugin drives."""
    return (ASCEND,)


@hookimpl
def flaggems_operators(backend: Backend) -> tuple[OpImpl, ...]:
    """Ascend's index_copy kernels (:mod:`flaggems_ascend.index_copy`) and torch_npu's fused RMSNorm
    (:mod:`flaggems_ascend.rms_norm`), tried before the generic ones."""
    common = {"vendor": "ascend", "replayable": True, "dtypes": ("float16", "bfloat16", "float32", "ints", "bool")}
    module = "flaggems_ascend.index_copy"
    norm = "flaggems_ascend.rms_norm"
    return (OpImpl("index_copy_", f"{module}:index_copy_", supports=f"{module}:supports_in_place", **common),
            OpImpl("index_copy", f"{module}:index_copy", supports=f"{module}:supports_out_of_place", **common),
            # torch_npu's fused RMSNorm kernel (a torch operator: served on the entry's Python path)
            OpImpl("flaggems::rms_norm", f"{norm}:rms_norm", supports=f"{norm}:supports", vendor="ascend",
                   dtypes=("float16", "bfloat16", "float32")))


@hookimpl
def flaggems_patch_rules(backend: Backend) -> tuple[PatchRule, ...]:
    """diffusers' GEGLU stays diffusers' on an NPU, where it calls torch_npu's own kernel
    (:func:`flaggems_ascend.patch_rules.npu_geglu`)."""
    return (PatchRule("geglu", decline="flaggems_ascend.patch_rules:npu_geglu", vendor="ascend"),)
