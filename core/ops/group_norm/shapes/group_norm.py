"""``F.group_norm`` forward and forward+backward with ``aten::group_norm`` routed (seed 004).

The same calls as :mod:`.native_group_norm`, with the composite op itself
sent to flaggems: a channels_last input reaches the kernels in place (torch's
composite copies it first) and the backward runs inside our autograd node.
The UNet case is Diffusers': ``GroupNorm(32, 320)`` on 2x320x64x64 channels_last fp16.
"""

from __future__ import annotations

import torch

from flaggems.bench.workload import Workload

from . import native_group_norm as seed

OP = "group_norm"
ROUTES = ("group_norm",)

#: (shape, groups, dtype, channels_last) at full size, then (shape, groups) at smoke size.
CONFIGS = (
    *seed.CONFIGS,
    ((2, 320, 64, 64), 32, torch.float16, True, (1, 20, 4, 4), 2),
)


def case(config: tuple, backward: bool) -> Workload:
    """One workload through ``aten::group_norm``, forward only or forward+backward."""
    return seed.case(config, backward, op=OP, routes=ROUTES, source="seed 004 (Diffusers UNet), peers.md")


WORKLOADS: tuple[Workload, ...] = tuple(case(config, backward) for backward in (False, True) for config in CONFIGS)
