"""Many sizes of one layout class through the compiled entry, each compared with torch's reference.

The layouts the randomized kit's GPU run failed on (an offset view with a
size-1 channel dimension for ``silu_mul``): a row count swept inside one
power-of-two bucket, so the first calls plan and the rest replay the generic
plan; prints mismatches, NaNs and the plan counters::

    python benchmarks/sweep_check.py [--sizes 24]
"""

from __future__ import annotations

import argparse
import os
import random

import torch

import flaggems
from flaggems.binding import native_scope
from flaggems.runtime import RUNTIME


def offset_view(shape: tuple[int, ...], strides: tuple[int, ...], offset: int, dtype: torch.dtype,
                dev: str) -> torch.Tensor:
    """Random values in a view at ``offset`` into a NaN-filled buffer."""
    extent = sum((s - 1) * st for s, st in zip(shape, strides)) + 1
    buf = torch.full((offset + extent + 3,), float("nan"), dtype=dtype, device=dev)
    view = buf.as_strided(shape, strides, offset)
    view.copy_(torch.randn(shape, device=dev).to(dtype))
    return view


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, default=24)
    args = parser.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ["FLAGGEMS_ENTRY"] = "compiled"
    flaggems.enable(include=["flaggems::silu_mul", "flaggems::gelu_tanh_mul", "flaggems::rms_norm"])
    rng = random.Random(0)
    for op in ("silu_mul", "gelu_tanh_mul"):
        bad = 0
        for _ in range(args.sizes):
            rows = rng.randint(257, 512)
            gate = offset_view((2, 1, rows, 128), (rows * 128, 1, 128, 1), 3, torch.bfloat16, dev)
            up = torch.randn(2, 1, rows, 128, device=dev).to(torch.bfloat16)
            out = getattr(torch.ops.flaggems, op)(gate, up)
            with native_scope():
                ref = getattr(torch.ops.flaggems, op)(gate, up)
            nans = int(out.isnan().sum())
            err = float((out.float() - ref.float()).abs().max())
            if nans or err > 0.07:
                bad += 1
                print(f"  {op} rows {rows}: {nans} NaN, max error {err:.3g}")
        stats = {k: (v["miss"], v["generic"]) for k, v in RUNTIME.plan_stats().items() if op in k}
        print(f"{op}: {bad} of {args.sizes} sizes wrong; (misses, generic) {stats}", flush=True)
    flaggems.disable()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
