"""torch.compile with flaggems enabled: eager-executing backends run our kernels."""

from __future__ import annotations

import torch

import flaggems
from flaggems.binding import native_scope
from flaggems.runtime import RUNTIME

DEV = torch.device(flaggems.backend().device_type)


def _select_then_cast(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.index_select(x, 0, index).to(torch.float16)


def test_aot_eager_graph_runs_flaggems_kernels(dispatch_log):
    x, index = torch.randn(8, 5, device=DEV), torch.tensor([3, 1, 3], device=DEV)
    with native_scope():
        expected = _select_then_cast(x, index)
    compiled = torch.compile(_select_then_cast, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        assert torch.equal(compiled(x, index), expected)
    served = {r.getMessage() for r in dispatch_log.records}
    assert "index_select -> generic" in served and "_to_copy -> generic" in served
    assert RUNTIME.registered_ops()
