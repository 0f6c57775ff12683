"""copy_ / _to_copy end to end through the dispatcher (seed 001 and friends)."""

from __future__ import annotations

import pytest
import torch
from conftest import ran

import flaggems

DEV = torch.device(flaggems.backend().device_type)


def close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # One bf16 ulp: the CPU interpreter truncates where torch rounds to nearest.
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-7)


def test_sdpa_with_expanded_fp32_mask_copied_to_bf16(dispatch_log):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.randn(1, 1, 16, 16, device=DEV).expand(2, 4, 16, 16)
    flaggems.disable()
    ref_mask = torch.empty(2, 4, 16, 16, device=DEV, dtype=torch.bfloat16).copy_(mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask)
    flaggems.enable()
    bf16_mask = torch.empty(2, 4, 16, 16, device=DEV, dtype=torch.bfloat16)
    bf16_mask.copy_(mask)
    actual = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bf16_mask)
    assert "copy_ -> generic" in ran(dispatch_log)
    close_bf16(bf16_mask, ref_mask)
    close_bf16(actual, expected)


def test_to_bf16_on_transposed_input(dispatch_log):
    x = torch.randn(64, 48, device=DEV)
    flaggems.disable()
    expected = x.t().to(torch.bfloat16)
    flaggems.enable()
    actual = x.t().to(torch.bfloat16)
    assert "_to_copy -> generic" in ran(dispatch_log)
    assert actual.stride() == expected.stride()
    close_bf16(actual, expected)


def test_contiguous_of_permuted_input(dispatch_log):
    x = torch.randn(3, 5, 7, 9, device=DEV, dtype=torch.float16).permute(2, 0, 3, 1)
    flaggems.disable()
    expected = x.contiguous()
    flaggems.enable()
    actual = x.contiguous()
    assert "copy_ -> generic" in ran(dispatch_log)
    assert actual.is_contiguous() and torch.equal(actual, expected)


def test_complex_source_declines_to_native_with_reason(dispatch_log):
    src = torch.tensor([1 + 2j, 3j], device=DEV)
    dst = torch.empty(2, device=DEV, dtype=torch.complex64)
    dst.copy_(src)
    assert torch.equal(dst, src)
    messages = ran(dispatch_log)
    assert any("copy_: generic declined: dtype pair" in m for m in messages)
    assert "copy_ -> native" in messages


def test_internal_overlap_error_and_nothing_written(dispatch_log):
    base = torch.zeros(3, device=DEV)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        base.expand(4, 3).copy_(torch.ones(4, 3, device=DEV))
    assert torch.equal(base, torch.zeros(3, device=DEV))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cross_device_copy_declines(dispatch_log):
    src = torch.randn(100)
    dst = torch.empty(100, device="cuda")
    dst.copy_(src)
    assert torch.equal(dst.cpu(), src)
    assert any("cross-device" in m for m in ran(dispatch_log))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_copy_on_second_gpu(dispatch_log):
    src = torch.randn(1024, device="cuda:1").expand(64, 1024)
    flaggems.disable()
    expected = src.to(torch.bfloat16)
    flaggems.enable()
    dst = torch.empty(64, 1024, device="cuda:1", dtype=torch.bfloat16)
    assert torch.cuda.current_device() == 0
    dst.copy_(src)
    torch.cuda.synchronize(1)
    assert "copy_ -> generic" in ran(dispatch_log)
    assert torch.equal(dst, expected)
