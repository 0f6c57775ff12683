"""Two GPUs of one host: kernels launch on the tensors' device, whichever device is current.

Every routed op (fused ones included) runs the randomized kit's cases with its tensors on ``cuda:1``
while ``cuda:0`` is current, then the same cases on ``cuda:0`` while ``cuda:1`` is current: a kernel
launched on the current device, or a plan made on one device replayed on the other, fails the
comparison with torch. Also the kernel context's facts per device and a CUDA graph captured on
``cuda:1``. Skipped below two GPUs (the device tool's ``nvidia-h200-x2``; results in RESULTS.md).
"""

from __future__ import annotations

import pytest
import torch

import flaggems
from flaggems.binding import native_scope
from flaggems.testing import random_cases as kit

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

CASES = 40
SEED = 7


@pytest.mark.parametrize("data, current", [(1, 0), (0, 1)], ids=["on-cuda1", "on-cuda0"])
@pytest.mark.parametrize("target", [t for t in kit.targets() if t.label == "generic"], ids=str)
def test_every_routed_op_on_the_other_device(target, data, current):
    stream = kit.random_cases(target.op, CASES, SEED)
    with torch.cuda.device(current):
        tally = kit.run_target(target, stream, "compiled", SEED, torch.device("cuda", data))
        assert torch.cuda.current_device() == current
    assert not tally.failed, "\n\n".join(tally.failures)
    assert tally.passed > 0, tally.notes


def test_one_layout_on_both_devices_keeps_a_plan_per_device():
    """The same call on each device: each result is its own device's (a plan keyed without the device would
    replay the first device's pointers)."""
    flaggems.enable()
    try:
        for _ in range(3):
            for index in (0, 1):
                src = torch.randn(4096, device=f"cuda:{index}")
                dst = torch.empty(4096, device=f"cuda:{index}", dtype=torch.bfloat16)
                dst.copy_(src)
                torch.cuda.synchronize(index)
                with native_scope():  # torch's own cast to compare with (enabled, .bfloat16() is routed)
                    assert torch.equal(dst.float(), src.bfloat16().float())
    finally:
        flaggems.disable()


def test_the_kernel_context_reads_each_devices_facts():
    from flaggems.toolkit import context

    for index in (0, 1):
        facts = context.current().facts(index)
        assert facts.multiprocessors == torch.cuda.get_device_properties(index).multi_processor_count


def test_a_cuda_graph_captured_on_the_second_gpu_replays():
    """A routed copy and a fused op captured on ``cuda:1`` (``cuda:0`` current), replayed on new inputs."""
    flaggems.enable()
    try:
        device = torch.device("cuda:1")
        x = torch.randn(64, 512, device=device)
        gate, up = torch.randn(64, 512, device=device), torch.randn(64, 512, device=device)
        half = torch.empty(64, 512, device=device, dtype=torch.float16)
        for _ in range(2):  # plan outside the capture
            half.copy_(x)
            torch.ops.flaggems.silu_mul(gate, up)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(graph):
            half.copy_(x)
            product = torch.ops.flaggems.silu_mul(gate, up)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            gate.copy_(torch.randn_like(gate))
            graph.replay()
            torch.cuda.synchronize(device)
            with native_scope():
                assert torch.equal(half, x.half())
                torch.testing.assert_close(product, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    finally:
        flaggems.disable()
