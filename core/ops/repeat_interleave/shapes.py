"""``repeat_interleave``: the four-case benchmark of seed 002 (17096 rows -> 854524 items), values
and Tensor APIs, output length discovered on the device or given as ``output_size``; plus
``self_int`` (a scalar repeat along a dim).

The values API is composite (``repeat_interleave.Tensor`` then ``index_select``);
its index_select stays native here so that its cost is not credited to
repeat_interleave (seed 002 asks for the two to be reported apart).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flaggems.bench.workload import Inputs, Workload, dims, nbytes, randn

OP = "repeat_interleave"
ROWS, ITEMS = 17096, 854524
SMOKE_ROWS, SMOKE_ITEMS = 16, 50
VALUES_ROUTES = ("repeat_interleave.self_Tensor", "repeat_interleave.Tensor")
TENSOR_ROUTES = ("repeat_interleave.Tensor",)


def build(device: torch.device, rows: int, items: int) -> Inputs:
    """``repeats``: ``items // rows`` each, the first ``items % rows`` one more; ``x = arange(rows)``."""
    repeats = torch.full((rows,), items // rows, dtype=torch.int64)
    repeats[: items % rows] += 1
    return {"x": torch.arange(rows).to(device), "repeats": repeats.to(device), "items": items}


def values_dynamic(inputs: Inputs) -> torch.Tensor:
    """``repeat_interleave(x, repeats)``: the output length is read from the device."""
    return torch.repeat_interleave(inputs["x"], inputs["repeats"])


def values_known(inputs: Inputs) -> torch.Tensor:
    """``repeat_interleave(x, repeats, output_size=items)``."""
    return torch.repeat_interleave(inputs["x"], inputs["repeats"], output_size=inputs["items"])


def tensor_dynamic(inputs: Inputs) -> torch.Tensor:
    """``repeat_interleave(repeats)``."""
    return torch.repeat_interleave(inputs["repeats"])


def tensor_known(inputs: Inputs) -> torch.Tensor:
    """``repeat_interleave(repeats, output_size=items)``."""
    return torch.repeat_interleave(inputs["repeats"], output_size=inputs["items"])


def bytes_values(inputs: Inputs) -> int:
    """``x`` and ``repeats`` read, ``items`` int64 written."""
    return nbytes(inputs["x"], inputs["repeats"]) + inputs["items"] * 8


def bytes_tensor(inputs: Inputs) -> int:
    """``repeats`` read, ``items`` int64 written."""
    return nbytes(inputs["repeats"]) + inputs["items"] * 8


def build_self_int(device: torch.device, shape: tuple[int, ...], repeats: int, dim: int) -> Inputs:
    """A bf16 input of ``shape`` repeated ``repeats`` times along ``dim``."""
    return {"x": randn(shape, torch.bfloat16, device), "repeats": repeats, "dim": dim}


def run_self_int(inputs: Inputs) -> torch.Tensor:
    """``x.repeat_interleave(repeats, dim=dim)``."""
    return inputs["x"].repeat_interleave(inputs["repeats"], dim=inputs["dim"])


def bytes_self_int(inputs: Inputs) -> int:
    """Input read once, ``repeats`` copies written."""
    return nbytes(inputs["x"]) * (1 + inputs["repeats"])


def case(name: str, run: Callable[[Inputs], torch.Tensor], routes: tuple[str, ...],
         bytes_moved: Callable[[Inputs], int]) -> Workload:
    """One of the four seed-002 cases."""
    return Workload(
        op=OP, name=f"{name} {ROWS}->{ITEMS}", smoke_name=f"{name} {SMOKE_ROWS}->{SMOKE_ITEMS}", dtype="int64",
        build=build, run=run, bytes_moved=bytes_moved,
        routes=routes, source="seed 002", params={"rows": ROWS, "items": ITEMS},
        smoke={"rows": SMOKE_ROWS, "items": SMOKE_ITEMS},
    )


WORKLOADS: tuple[Workload, ...] = (
    case("values dynamic", values_dynamic, VALUES_ROUTES, bytes_values),
    case("values output_size", values_known, VALUES_ROUTES, bytes_values),
    case("Tensor dynamic", tensor_dynamic, TENSOR_ROUTES, bytes_tensor),
    case("Tensor output_size", tensor_known, TENSOR_ROUTES, bytes_tensor),
    Workload(
        op=OP, name=f"self_int {dims((4096, 64))} x4 dim0", smoke_name=f"self_int {dims((8, 4))} x4 dim0",
        dtype="bf16", build=build_self_int,
        run=run_self_int, bytes_moved=bytes_self_int, routes=("repeat_interleave.self_int",),
        source="peers.md (seed op defects)", params={"shape": (4096, 64), "repeats": 4, "dim": 0},
        smoke={"shape": (8, 4), "repeats": 4, "dim": 0},
    ),
)
