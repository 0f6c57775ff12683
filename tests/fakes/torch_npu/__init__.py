"""A stand-in for ``torch_npu`` in tests: a CPU-backed ``npu`` device on the PrivateUse1 key.

Importing it (as the Ascend probe does) builds and loads ``csrc/fake_npu.cpp``
with torch's extension tooling (cached under ``TORCH_EXTENSIONS_DIR``), renames
PrivateUse1 to ``npu`` and registers ``torch.npu`` with one device. Tensors on
it hold host memory but are real PrivateUse1 tensors: flaggems' PrivateUse1
registrations, its compiled entry and the kit run exactly as on an NPU, while
every op flaggems does not route runs torch's CPU kernel over the same memory.

Test-only: it lives under ``tests/fakes``, which only the test suite puts on
``sys.path`` (``FAKE_TORCH_NPU=1``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils import cpp_extension

__version__ = "0.0.0+fake"
SOURCE = Path(__file__).with_name("csrc") / "fake_npu.cpp"
DEVICE_NAME = "Fake Ascend 910B (host memory)"


def _build():
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    name = f"flaggems_fake_npu_{digest}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / name
    root.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name, sources=[str(SOURCE)], extra_cflags=["-O1"], build_directory=str(root))


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


def _device_module() -> SimpleNamespace:
    return SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        set_device=lambda device: None,
        get_device_name=lambda device=None: DEVICE_NAME,
        synchronize=lambda device=None: None,
        is_initialized=lambda: True,
        _is_in_bad_fork=lambda: False,
        manual_seed_all=lambda seed: None,
        get_amp_supported_dtype=lambda: [torch.float16, torch.bfloat16],
    )


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for torch_npu's fused RMSNorm: ``(x * rsqrt(mean(x**2) + eps) * gamma, rstd)``, computed in
    float32 and rounded once to ``x``'s dtype (as the CANN kernel does); rstd in float32."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def _install() -> None:
    if getattr(torch, "npu", None) is not None:
        return
    extension = _build()
    extension.register_allocator()
    torch.utils.rename_privateuse1_backend("npu")
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._register_device_module("npu", _device_module())
    torch._C._acc.register_python_privateuseone_hook(_Hooks())


_install()
