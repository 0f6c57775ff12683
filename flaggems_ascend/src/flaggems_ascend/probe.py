"""Cheap check for a usable Ascend NPU: no subprocess, no kernel compile."""

from __future__ import annotations

import importlib.util

from flaggems import ProbeResult


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
