"""Cheap check for a usable Ascend NPU: no subprocess, no kernel compile."""

from __future__ import annotations

import importlib.util

from flaggems import ProbeResult
from flaggems.toolkit.context import DeviceFacts


def probe() -> ProbeResult:
    """Available when ``torch_npu`` is installed and sees at least one NPU."""
    try:
        if importlib.util.find_spec("torch_npu") is None:
            return ProbeResult(False, "torch_npu is not installed")
        import torch
        import torch_npu  # noqa: F401 - importing it adds torch.npu

        if not torch.npu.is_available():
            return ProbeResult(False, "torch_npu is installed but sees no NPU")
        return ProbeResult(True, f"{torch.npu.device_count()} NPU(s): {torch.npu.get_device_name(0)}")
    except Exception as exc:  # noqa: BLE001 - a probe reports, it never raises
        return ProbeResult(False, f"torch_npu check failed: {type(exc).__name__}: {exc}")


def facts(index: int) -> DeviceFacts:
    """What Ascend kernels size grids by: AI cores and L2 from ``torch.npu``'s properties; never float64.

    Fields the installed ``torch_npu`` does not report stay unknown (kernels then use their defaults).
    """
    cores = l2 = None
    try:
        import torch

        props = torch.npu.get_device_properties(index)
        cores = getattr(props, "cube_core_num", None) or getattr(props, "multi_processor_count", None)
        l2 = getattr(props, "L2_cache_size", None)
    except Exception:  # noqa: BLE001 - properties are optional: the facts say "unknown"
        pass
    return DeviceFacts(multiprocessors=cores or None, l2_bytes=l2 or None, fp64=False)
