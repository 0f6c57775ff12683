"""The optional dependencies' probes: whether transformers and Liger-Kernel are importable, and Liger's
``apply_liger_kernel_to_<family>``.

The other modules call these through this module (``_deps.liger_apply(...)``), so a test that
monkeypatches one of them here changes what every caller sees.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ._common import Skip


def transformers_available() -> bool:
    """True when ``transformers`` can be imported."""
    return importlib.util.find_spec("transformers") is not None


LIGER_FUNCTIONS = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
                   "mixtral": "apply_liger_kernel_to_mixtral"}
#: What the liger side asks for: the same fusions as ``flaggems.patch``; the loss stays torch's.
LIGER_OPTIONS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}


def liger_unavailable() -> str | None:
    """Why no liger side is part of this run (``None``: ``liger_kernel`` is importable)."""
    try:
        found = importlib.util.find_spec("liger_kernel") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "liger_kernel is not installed"


def liger_apply(family: str, device: torch.device) -> Callable[..., Any]:
    """Liger's ``apply_liger_kernel_to_<family>`` with :data:`LIGER_OPTIONS`, or :class:`Skip` saying why not."""
    if device.type != "cuda":
        raise Skip(f"Liger-Kernel's kernels need a CUDA device (here: {device.type})")
    name = LIGER_FUNCTIONS[family]
    try:
        module = importlib.import_module("liger_kernel.transformers")
    except Exception as exc:  # noqa: BLE001 - any import failure skips the side
        raise Skip(f"liger_kernel.transformers is not importable ({type(exc).__name__}: {exc})") from exc
    apply = getattr(module, name, None)
    if apply is None:
        raise Skip(f"liger_kernel.transformers has no {name} (an API this benchmark does not know)")
    try:
        params = inspect.signature(apply).parameters
    except (TypeError, ValueError):
        params = {}
    missing = [k for k in (*LIGER_OPTIONS, "model") if k not in params]
    if missing:
        raise Skip(f"{name} takes no {', '.join(missing)} (an API this benchmark does not know)")
    return functools.partial(apply, **LIGER_OPTIONS)
