"""copy_ / _to_copy end to end through the dispatcher (seed 001 and friends)."""

from __future__ import annotations

import pytest
import torch
from conftest import ran

import flaggems

DEV = torch.device(flaggems.backend().device_type)


def close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit: our casts round to nearest even, as torch's, on the interpreter too."""
    assert torch.equal(actual, expected)


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


@pytest.mark.parametrize("src_dtype", [torch.int32, torch.int64, torch.int16, torch.uint8, torch.float64])
@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_casts_equal_torchs_bit_for_bit(src_dtype, dst_dtype):
    """Full-range integers, exactly representable values and float32 ties: torch rounds int -> float32 ->
    half/bfloat16 (twice); a direct conversion, which the compiler folds the two into, differs (H200: 18 of
    2.3M int32 -> bf16)."""
    torch.manual_seed(0)
    if src_dtype.is_floating_point:
        x = torch.randn(4096, dtype=src_dtype) * 1e4
    else:
        info = torch.iinfo(src_dtype)
        x = torch.randint(max(info.min, -2**62), min(info.max, 2**62), (4096,), dtype=torch.int64)
        special = [-2034237486, -1031798784, 643825637, 34471935, 2**24 + 1, 2**24 + 3, 2**31 - 1, -2**31,
                   2**40 + 2**32, -(2**40 + 2**32 + 1), 255, 65504, 65520, -32768]
        special = torch.tensor([v for v in special if info.min <= v <= info.max])
        x = torch.cat([x, special]).to(src_dtype)
    x = x.to(DEV)
    flaggems.disable()
    expected = x.to(dst_dtype)
    expected_t = x.reshape(-1, 2).t().to(dst_dtype) if x.numel() % 2 == 0 else None
    flaggems.enable()
    actual = x.to(dst_dtype)
    assert torch.equal(actual.float().nan_to_num(7), expected.float().nan_to_num(7))
    if expected_t is not None:
        assert torch.equal(x.reshape(-1, 2).t().to(dst_dtype).float().nan_to_num(7), expected_t.float().nan_to_num(7))


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
