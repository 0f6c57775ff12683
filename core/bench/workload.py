"""The declarative record of one benchmark case and helpers shared by the shape files.

A shape file (``flaggems.bench.shapes.<op>``) declares ``WORKLOADS``: a tuple of
:class:`Workload`. Each names the aten ops the flaggems side routes, how to build
its inputs at full size (``params``) and at smoke size (``smoke``), the call to
time, and the bytes the call must move at least (for GB/s).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: Inputs of one workload: whatever ``build`` returns, handed to ``run``.
Inputs = dict[str, Any]

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int64: "int64",
    torch.int32: "int32",
}

#: Spellings accepted by ``--dtype`` besides the short names above.
DTYPE_ALIASES: dict[str, str] = {
    "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
    "float64": "fp64", "double": "fp64", "long": "int64", "int": "int32",
}


@dataclass(frozen=True)
class Workload:
    """One benchmark case: an op at one shape and dtype.

    Attributes:
        op: the shape file (``copy_``, ``index_copy``...) it belongs to.
        name: what is measured, shapes included (shown in every report).
        dtype: ``"fp32"``, or ``"fp32->bf16"`` for a cast.
        build: ``build(device, **params)`` returns the inputs.
        run: ``run(inputs)`` is the timed call.
        params: full-size arguments of ``build``.
        smoke: tiny arguments of ``build`` for ``--smoke`` (CPU interpreter).
        routes: aten ops routed to flaggems on the flaggems side.
        bytes_moved: ``bytes_moved(inputs)``, the least traffic of one call,
            or ``None`` where it cannot be counted.
        source: where the case comes from (a seed document, a peer measurement).
    """

    op: str
    name: str
    dtype: str
    build: Callable[..., Inputs]
    run: Callable[[Inputs], Any]
    params: Mapping[str, Any]
    smoke: Mapping[str, Any]
    routes: tuple[str, ...]
    bytes_moved: Callable[[Inputs], int] | None = None
    source: str = ""

    @property
    def key(self) -> str:
        """``op/name/dtype``: unique across all shape files."""
        return f"{self.op}/{self.name}/{self.dtype}"

    def make(self, device: torch.device | str, smoke: bool = False) -> Inputs:
        """Build the inputs on ``device`` at full size, or tiny with ``smoke``."""
        return self.build(torch.device(device), **(self.smoke if smoke else self.params))

    def dtypes(self) -> set[str]:
        """Every dtype named by the label (``"fp32->bf16"`` names two)."""
        return set(self.dtype.split("->"))


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a dtype (``torch.float16`` -> ``"fp16"``)."""
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def cast_label(src: torch.dtype, dst: torch.dtype) -> str:
    """``"fp32"`` when both are the same, else ``"fp32->bf16"``."""
    return dtype_name(src) if src == dst else f"{dtype_name(src)}->{dtype_name(dst)}"


def normalize_dtype(text: str) -> str:
    """Map a ``--dtype`` spelling to the short name used in labels."""
    word = text.strip().lower().replace("torch.", "")
    return DTYPE_ALIASES.get(word, word)


def nbytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct elements of each tensor (an expanded dim counts once)."""
    total = 0
    for tensor in tensors:
        distinct = math.prod(size for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if stride != 0)
        total += distinct * tensor.element_size() if tensor.numel() else 0
    return total


def dims(shape: tuple[int, ...]) -> str:
    """``(64, 512, 512)`` -> ``"64x512x512"``."""
    return "x".join(str(s) for s in shape)


def seeded(device: torch.device, seed: int = 0) -> torch.Generator:
    """A generator on ``device`` so inputs are the same on every side and run."""
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Seeded normal values of ``shape`` and ``dtype`` on ``device``."""
    return torch.randn(shape, generator=seeded(device, seed), device=device, dtype=dtype)
