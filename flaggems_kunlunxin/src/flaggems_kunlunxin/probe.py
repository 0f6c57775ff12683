"""Is a KunlunXin XPU usable here? Answered without subprocesses or compiles."""

from __future__ import annotations

import importlib.util

from flaggems import ProbeResult

#: Lower-case fragments of the device names KunlunXin XPUs report through torch.cuda.
DEVICE_MARKERS = ("p800", "r200", "kunlun")


def probe() -> ProbeResult:
    """Available with ``torch_xmlir`` installed, or a CUDA device named like a Kunlun XPU."""
    try:
        if importlib.util.find_spec("torch_xmlir") is not None:
            return ProbeResult(True, "torch_xmlir is installed")
        import torch

        if not torch.cuda.is_available():
            return ProbeResult(False, "torch_xmlir is not installed and torch sees no CUDA device")
        name = torch.cuda.get_device_name(0)
    except Exception as exc:  # noqa: BLE001 - report the failure instead of raising it
        return ProbeResult(False, f"KunlunXin check failed: {type(exc).__name__}: {exc}")
    if any(marker in name.lower() for marker in DEVICE_MARKERS):
        return ProbeResult(True, f"KunlunXin device: {name}")
    return ProbeResult(False, f"torch_xmlir is not installed and device {name!r} is not a Kunlun XPU")
