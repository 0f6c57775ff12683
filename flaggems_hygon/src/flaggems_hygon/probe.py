"""Detect a Hygon DCU from torch alone (no subprocess, no kernel compile)."""

from __future__ import annotations

from flaggems import ProbeResult
from flaggems.toolkit.context import DeviceFacts

#: Fragments of Hygon device names, and the GCN architectures of its DCUs.
NAME_MARKERS = ("DCU", "Hygon", "BW")
GCN_ARCHS = ("gfx936", "gfx928")


def probe() -> ProbeResult:
    """Available on a HIP build of torch that sees a Hygon DCU."""
    try:
        import torch

        if torch.version.hip is None:
            return ProbeResult(False, "torch is not a ROCm/HIP build")
        if not torch.cuda.is_available():
            return ProbeResult(False, f"HIP torch {torch.version.hip} sees no device")
        name = torch.cuda.get_device_name(0)
        arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "") or ""
    except Exception as exc:  # noqa: BLE001 - never raise out of a probe
        return ProbeResult(False, f"Hygon check failed: {type(exc).__name__}: {exc}")
    if any(marker in name for marker in NAME_MARKERS) or arch.startswith(GCN_ARCHS):
        return ProbeResult(True, f"Hygon DCU: {name} ({arch})")
    return ProbeResult(False, f"HIP device {name!r} ({arch}) is not a Hygon DCU")


#: Lanes of a wavefront on Hygon DCUs (GCN/CDNA-like compute units), when torch does not report it.
WAVEFRONT = 64


def facts(index: int) -> DeviceFacts:
    """The DCU's compute units, L2 and wavefront width, from torch's device properties (read once per device)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return DeviceFacts(multiprocessors=int(props.multi_processor_count) or None,
                       l2_bytes=int(getattr(props, "L2_cache_size", 0)) or None,
                       warp_size=int(getattr(props, "warp_size", 0) or WAVEFRONT))
