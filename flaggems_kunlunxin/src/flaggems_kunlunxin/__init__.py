"""flaggems plugin for KunlunXin XPUs (P800, R200).

KunlunXin exposes its XPUs to torch through a CUDA-compatible layer
(``torch_xmlir``): tensors live on ``cuda`` devices and kernels are registered
on the ``CUDA`` dispatch key, as for NVIDIA. The probe in
:mod:`flaggems_kunlunxin.probe` tells the two apart.

What the plugin changes is configuration, not code: the generic ``copy_``
(and every other user of the toolkit's strided copy kernel: ``_to_copy``,
``index_copy``'s out-of-place fill) runs on the XPU with a fixed grid of 12
CTAs walking the tiles, and float64 goes to torch_xmlir's own kernels.
Non-contiguous sources (an expanded SDPA mask, transposes, slices, permutes,
rank 1 to 6, a strided destination) go through that kernel with their real
strides: the XPU layer's native non-contiguous copy fails there with "invalid
device function" (seed 001).
"""

from __future__ import annotations

from flaggems import Backend, Tuning, hookimpl

#: The XPU runs the shared elementwise kernels best on a fixed grid of 12 CTAs
#: walking the tiles with a grid-stride loop (the policy of the seed's
#: KunlunXin copy_ fix, measured on a P800 there; not re-measured here).
ELEMENTWISE = {"max_ctas": 12}


@hookimpl
def flaggems_backends() -> list[Backend]:
    """Describe the KunlunXin backend; its probe is imported only at selection."""
    return [Backend(name="kunlunxin", vendor="kunlunxin", device_type="cuda", dispatch_key="CUDA",
                    probe="flaggems_kunlunxin.probe:probe", unsupported_dtypes=("float64",),
                    description="KunlunXin XPUs through torch_xmlir (CUDA-compatible)")]


@hookimpl
def flaggems_tuning(backend: Backend) -> list[Tuning]:
    """Launch policy of the generic strided kernels on KunlunXin: configuration, not a copied kernel."""
    return [Tuning("elementwise", ELEMENTWISE, vendor="kunlunxin")]
