"""flaggems plugin for KunlunXin XPUs (P800, R200).

KunlunXin exposes its XPUs to torch through a CUDA-compatible layer
(``torch_xmlir``): tensors live on ``cuda`` devices and kernels are registered
on the ``CUDA`` dispatch key, as for NVIDIA. The probe in
:mod:`flaggems_kunlunxin.probe` tells the two apart.
"""

from __future__ import annotations

from flaggems import Backend, OpImpl, Tuning, hookimpl

#: The XPU runs the shared elementwise kernels best on a fixed grid of 12 CTAs
#: walking the tiles with a grid-stride loop (the policy of the seed's
#: KunlunXin copy_ fix, measured on a P800 there; not re-measured here).
ELEMENTWISE = {"max_ctas": 12}


@hookimpl
def flaggems_backends() -> list[Backend]:
    """Describe the KunlunXin backend; its probe is imported only at selection."""
    return [Backend(name="kunlunxin", vendor="kunlunxin", device_type="cuda", dispatch_key="CUDA",
                    probe="flaggems_kunlunxin.probe:probe",
                    description="KunlunXin XPUs through torch_xmlir (CUDA-compatible)")]


@hookimpl
def flaggems_operators(backend: Backend) -> list[OpImpl]:
    """No KunlunXin-specific operators yet; later issues add them."""
    return []


@hookimpl
def flaggems_tuning(backend: Backend) -> list[Tuning]:
    """Launch policy of the generic strided kernels on KunlunXin: configuration, not a copied kernel."""
    return [Tuning("elementwise", ELEMENTWISE, vendor="kunlunxin")]
