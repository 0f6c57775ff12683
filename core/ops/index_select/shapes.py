"""``index_select`` along the first, the last and a middle dim (peers.md: FlagGems transposes the
whole input when dim is not last). The index is a random half of the dim (no duplicates).
"""

from __future__ import annotations

import torch

from flaggems.bench.workload import Inputs, Workload, dims, dtype_name, nbytes, randn, seeded

OP = "index_select"
ROUTES = ("index_select",)
DTYPES = (torch.float16, torch.float32)

#: (shape, dim) at full size, then at smoke size.
CONFIGS: tuple[tuple[tuple[tuple[int, ...], int], tuple[tuple[int, ...], int]], ...] = (
    (((4096, 4096), 0), ((16, 16), 0)),
    (((4096, 4096), 1), ((16, 16), 1)),
    (((200, 40999, 3), 1), ((2, 37, 3), 1)),
)


def build(device: torch.device, shape: tuple[int, ...], dim: int, dtype: torch.dtype) -> Inputs:
    """An input of ``shape`` and a random half of ``dim``'s indices."""
    index = torch.randperm(shape[dim], generator=seeded(device, 1), device=device)[: shape[dim] // 2]
    return {"x": randn(shape, dtype, device), "dim": dim, "index": index}


def run(inputs: Inputs) -> torch.Tensor:
    """``torch.index_select(x, dim, index)``."""
    return torch.index_select(inputs["x"], inputs["dim"], inputs["index"])


def bytes_moved(inputs: Inputs) -> int:
    """Selected elements read and written once, index read."""
    x, dim, index = inputs["x"], inputs["dim"], inputs["index"]
    selected = x.numel() // x.shape[dim] * index.numel() * x.element_size()
    return 2 * selected + nbytes(index)


WORKLOADS: tuple[Workload, ...] = tuple(
    Workload(
        op=OP, name=f"[{dims(shape)}] dim{dim} idx{shape[dim] // 2}",
        smoke_name=f"[{dims(smoke_shape)}] dim{smoke_dim} idx{smoke_shape[smoke_dim] // 2}", dtype=dtype_name(dtype),
        build=build,
        run=run, bytes_moved=bytes_moved, routes=ROUTES, source="peers.md (seed op defects)",
        params={"shape": shape, "dim": dim, "dtype": dtype},
        smoke={"shape": smoke_shape, "dim": smoke_dim, "dtype": dtype},
    )
    for dtype in DTYPES
    for (shape, dim), (smoke_shape, smoke_dim) in CONFIGS
)
