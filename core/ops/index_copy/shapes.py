"""``index_copy`` and ``index_copy_``: the 48-row benchmark of seed 000, plus a sorted index.

Each configuration is ``(self shape, dim, index length)`` as in the seed's
table (``[[64,64],1,[32],[64,32]]``); the index is a random permutation's
first half (no duplicates, so every implementation must agree exactly).
"""

from __future__ import annotations

import torch

from flaggems.bench.workload import Inputs, Workload, dims, dtype_name, nbytes, randn, seeded

OP = "index_copy"
DTYPES = (torch.float16, torch.float32, torch.bfloat16)

#: (self shape, dim, index length) at full size, then the same at smoke size.
CONFIGS: tuple[tuple[tuple[tuple[int, ...], int, int], tuple[tuple[int, ...], int, int]], ...] = (
    (((1 << 30,), 0, 1 << 29), ((64,), 0, 32)),
    (((64, 64), 1, 32), ((8, 8), 1, 4)),
    (((4096, 4096), 1, 2048), ((16, 16), 1, 8)),
    (((64, 512, 512), 1, 256), ((2, 8, 8), 1, 4)),
    (((1024, 1024, 1024), 1, 512), ((4, 8, 4), 1, 4)),
)
#: The sorted, contiguous index cases (a slice copy in disguise): whole rows, and along the last
#: dimension, where each row's block is a partial write the inverse form must not lose to a scatter.
SORTED = ((((4096, 4096), 0, 2048), ((16, 16), 0, 8)), (((4096, 4096), 1, 2048), ((16, 16), 1, 8)))


def build(device: torch.device, shape: tuple[int, ...], dim: int, length: int, dtype: torch.dtype,
          sorted_index: bool) -> Inputs:
    """``self``, a distinct ``index`` along ``dim`` and a matching ``source``."""
    size = shape[dim]
    if sorted_index:
        start = (size - length) // 2
        index = torch.arange(start, start + length, device=device)
    else:
        index = torch.randperm(size, generator=seeded(device, 1), device=device)[:length]
    source_shape = shape[:dim] + (length,) + shape[dim + 1:]
    return {"self": randn(shape, dtype, device), "dim": dim, "index": index,
            "source": randn(source_shape, dtype, device, seed=2)}


def run_inplace(inputs: Inputs) -> torch.Tensor:
    """``self.index_copy_(dim, index, source)``."""
    return inputs["self"].index_copy_(inputs["dim"], inputs["index"], inputs["source"])


def run_out_of_place(inputs: Inputs) -> torch.Tensor:
    """``torch.index_copy(self, dim, index, source)``."""
    return torch.index_copy(inputs["self"], inputs["dim"], inputs["index"], inputs["source"])


def bytes_inplace(inputs: Inputs) -> int:
    """Source read, the same amount written, index read."""
    return 2 * nbytes(inputs["source"]) + nbytes(inputs["index"])


def bytes_out_of_place(inputs: Inputs) -> int:
    """Result written; the rows not overwritten read from ``self``, the rest from ``source``; index read."""
    return 2 * nbytes(inputs["self"]) + nbytes(inputs["index"])


def case(config: tuple[tuple[int, ...], int, int], smoke: tuple[tuple[int, ...], int, int],
         dtype: torch.dtype, inplace: bool, sorted_index: bool = False) -> Workload:
    """One index_copy workload (``inplace`` picks ``index_copy_``)."""
    api = "index_copy_" if inplace else "index_copy"
    kind = "sorted" if sorted_index else "random"

    def label(sizes: tuple[tuple[int, ...], int, int]) -> str:
        shape, dim, length = sizes
        return f"{api} [{dims(shape)}] dim{dim} idx{length} {kind}"

    return Workload(
        op=OP, name=label(config), smoke_name=label(smoke), dtype=dtype_name(dtype),
        build=build, run=run_inplace if inplace else run_out_of_place,
        bytes_moved=bytes_inplace if inplace else bytes_out_of_place, routes=(api,),
        source="seed 000" if not sorted_index else "seed 000 (flat copy path)",
        params=_params(config, dtype, sorted_index), smoke=_params(smoke, dtype, sorted_index),
    )


def _params(config: tuple[tuple[int, ...], int, int], dtype: torch.dtype, sorted_index: bool) -> dict:
    shape, dim, length = config
    return {"shape": shape, "dim": dim, "length": length, "dtype": dtype, "sorted_index": sorted_index}


WORKLOADS: tuple[Workload, ...] = tuple(
    case(config, smoke, dtype, inplace)
    for inplace in (False, True)
    for dtype in DTYPES
    for config, smoke in CONFIGS
) + tuple(case(config, smoke, dtype, inplace, sorted_index=True)
        for config, smoke in SORTED for inplace in (False, True) for dtype in DTYPES)
