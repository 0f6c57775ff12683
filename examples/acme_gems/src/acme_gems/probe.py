"""Cheap check for an Acme device: no subprocess, no kernel compile."""

from __future__ import annotations

import importlib.util

from flaggems import ProbeResult


def probe() -> ProbeResult:
    """Available when ``torch_acme`` is installed and sees a device."""
    if importlib.util.find_spec("torch_acme") is None:
        return ProbeResult(False, "torch_acme is not installed")
    import torch

    count = torch.acme.device_count()
    return ProbeResult(count > 0, f"{count} Acme device(s)")
