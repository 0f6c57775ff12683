"""``Tensor.copy_`` from expanded, transposed and permuted sources (seed 001, peers.md).

The expanded attention mask is the KunlunXin failure of seed 001 (an SDPA
mask expanded over heads, copied with a cast to bf16); the 4096-float copy is
the host-overhead case measured in peers.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flaggems.bench.workload import Inputs, Workload, cast_label, dims, nbytes, randn

OP = "copy_"
ROUTES = ("copy_",)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

View = Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]
VIEWS: dict[str, View] = {
    "contiguous": lambda t, shape: t,
    "expand": lambda t, shape: t.expand(shape),
    "transpose": lambda t, shape: t.t(),
    "permute(2,0,1)": lambda t, shape: t.permute(2, 0, 1),
}


def build(device: torch.device, src: tuple[int, ...], dst: tuple[int, ...], view: str,
          src_dtype: torch.dtype, dst_dtype: torch.dtype) -> Inputs:
    """A source viewed as ``view`` and an empty destination of shape ``dst``."""
    source = VIEWS[view](randn(src, src_dtype, device), dst)
    return {"dst": torch.empty(dst, dtype=dst_dtype, device=device), "src": source}


def run(inputs: Inputs) -> torch.Tensor:
    """``dst.copy_(src)``."""
    return inputs["dst"].copy_(inputs["src"])


def bytes_moved(inputs: Inputs) -> int:
    """Destination written once, each distinct source element read once."""
    return nbytes(inputs["dst"], inputs["src"])


def case(view: str, src: tuple[int, ...], dst: tuple[int, ...], smoke_src: tuple[int, ...],
         smoke_dst: tuple[int, ...], src_dtype: torch.dtype = F32, dst_dtype: torch.dtype = F32,
         source: str = "seed 001") -> Workload:
    """One copy workload; ``src``/``dst`` full size, ``smoke_*`` tiny."""
    common: dict[str, Any] = {"view": view, "src_dtype": src_dtype, "dst_dtype": dst_dtype}
    return Workload(
        op=OP, name=f"{view} {dims(src)} -> {dims(dst)}", smoke_name=f"{view} {dims(smoke_src)} -> {dims(smoke_dst)}",
        dtype=cast_label(src_dtype, dst_dtype),
        build=build, run=run, bytes_moved=bytes_moved, routes=ROUTES, source=source,
        params={"src": src, "dst": dst, **common}, smoke={"src": smoke_src, "dst": smoke_dst, **common},
    )


WORKLOADS: tuple[Workload, ...] = (
    case("contiguous", (1024, 1024), (1024, 1024), (8, 16), (8, 16), source="seed 001 (P800 table)"),
    case("expand", (1024,), (1024, 1024), (16,), (8, 16), source="seed 001, peers.md"),
    case("expand", (1024,), (1024, 1024), (16,), (8, 16), dst_dtype=BF16),
    case("transpose", (4096, 4096), (4096, 4096), (16, 16), (16, 16)),
    case("permute(2,0,1)", (64, 128, 256), (256, 64, 128), (2, 4, 8), (8, 2, 4), F16, F16),
    case("expand", (8, 1, 2048, 2048), (8, 16, 2048, 2048), (2, 1, 8, 8), (2, 2, 8, 8), F32, BF16,
         source="seed 001 (SDPA mask per batch)"),
    case("expand", (1, 1, 2048, 2048), (8, 16, 2048, 2048), (1, 1, 8, 8), (2, 2, 8, 8), F32, BF16,
         source="seed 001 (SDPA mask shared)"),
    case("contiguous", (4096,), (4096,), (256,), (256,), source="peers.md (host overhead)"),
)
