"""flaggems-kunlunxin: ``copy_`` of non-contiguous sources through the shared strided kernel, 12 CTAs.

Seed 001: on a KunlunXin XPU the native non-contiguous copy fails ("invalid
device function"), so every layout must reach the toolkit's strided kernel
with its real strides, under the plugin's launch policy (a fixed grid of 12
CTAs walking the tiles). These tests run wherever the ``kunlunxin`` backend is
active: simulated on the CPU interpreter (``tox -e kunlunxin``) or on a GPU
(``FLAGGEMS_VENDOR=kunlunxin``), and on an XPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own alias

import flaggems
from flaggems.binding import DECLINES, native_scope
from flaggems.toolkit.launch import FastLauncher

pytestmark = pytest.mark.skipif(flaggems.backend().name != "kunlunxin",
                                reason="the kunlunxin backend is not active (FLAGGEMS_VENDOR=kunlunxin)")
DEV = torch.device(flaggems.backend().device_type)
CTAS = 12


@pytest.fixture
def grids(monkeypatch) -> list[tuple[int, ...]]:
    """flaggems enabled; collects the grid of every toolkit launch planned in Python (first calls of a layout)."""
    seen: list[tuple[int, ...]] = []
    original = FastLauncher.__call__

    def spy(self, grid, *args):
        seen.append(tuple(grid))
        return original(self, grid, *args)

    monkeypatch.setattr(FastLauncher, "__call__", spy)
    with flaggems.enabled():
        DECLINES.clear()
        yield seen


def _native_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    with native_scope():
        return dst.clone().copy_(src)


def _served_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, asserting that flaggems served it (the checks' own host copies are not counted)."""
    DECLINES.clear()
    assert dst.copy_(src) is dst
    declined = [key for key in DECLINES if key[0] == "copy_"]
    assert not declined, f"copy_ declined to the native kernel: {declined}"


def _src(shape, dtype=torch.float32):
    with native_scope():
        return (torch.randn(shape) * 10).to(dtype).to(DEV)


# (name, source factory, destination shape): expand, transpose, slice, permute, composite views, rank 1 to 6
LAYOUTS = {
    "rank1 slice step 3": (lambda: _src(300)[::3], (100,)),
    "rank2 expand (seed repro)": (lambda: _src(128).expand(4, 128), (4, 128)),
    "rank2 transpose": (lambda: _src((70, 33)).t(), (33, 70)),
    "rank3 permute": (lambda: _src((5, 6, 7)).permute(2, 0, 1), (7, 5, 6)),
    "rank4 SDPA mask expand": (lambda: _src((2, 1, 9, 9)).expand(2, 3, 9, 9), (2, 3, 9, 9)),
    "rank5 slice of permute": (lambda: _src((3, 4, 5, 6, 8)).permute(4, 3, 2, 1, 0)[1::2, :, 1:], (4, 6, 4, 4, 3)),
    "rank6 expand of transpose": (lambda: _src((2, 1, 3, 1, 4, 5)).transpose(2, 4).expand(2, 3, 4, 2, 3, 5),
                                  (2, 3, 4, 2, 3, 5)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_layout_goes_through_the_strided_kernel_on_12_ctas(grids, name, dst_dtype):
    make, shape = LAYOUTS[name]
    src = make()
    assert not src.is_contiguous() and tuple(src.shape) == shape
    dst = torch.empty(shape, dtype=dst_dtype, device=DEV)
    expected = _native_copy(dst, src)
    _served_copy(dst, src)
    assert torch.equal(dst.cpu(), expected.cpu())
    assert grids and all(len(g) == 1 and g[0] <= CTAS for g in grids), grids


@pytest.mark.parametrize("rank", range(1, 7))
def test_a_strided_destination_of_each_rank(grids, rank):
    shape = (3, 5, 2, 4, 3, 2)[:rank]
    base = torch.zeros(tuple(2 * s for s in shape), device=DEV)
    dst = base[tuple(slice(None, None, 2) for _ in shape)]  # every other element of each dim
    src = _src(tuple(reversed(shape))).permute(*reversed(range(rank)))
    expected = _native_copy(base, torch.zeros_like(base))
    with native_scope():
        expected[tuple(slice(None, None, 2) for _ in shape)] = src
    _served_copy(dst, src)
    assert torch.equal(base.cpu(), expected.cpu())  # written where the view points, nowhere else


def test_more_tiles_than_ctas_take_the_grid_stride_loop(grids):
    big = torch.empty(600, 700, device=DEV)
    big.copy_(torch.arange(700.0, device=DEV))  # 420000 elements: far more tiles than 12 programs
    dense = torch.empty(600, 700, dtype=torch.bfloat16, device=DEV)
    dense.copy_(big)
    assert grids == [(CTAS,), (CTAS,)]
    with native_scope():
        assert torch.equal(big.cpu(), torch.arange(700.0).expand(600, 700))
        assert torch.equal(dense.cpu(), big.cpu().to(torch.bfloat16))
    assert flaggems.tuning("elementwise")["max_ctas"] == CTAS


def test_empty_copies_launch_nothing(grids):
    _served_copy(torch.empty(0, 5, device=DEV), torch.randn(5, device=DEV).expand(0, 5))
    _served_copy(torch.empty(3, 0, dtype=torch.bfloat16, device=DEV), torch.empty(0, 3, device=DEV).t())
    assert grids == []


def test_an_overlapping_destination_and_a_bad_broadcast_raise_torchs_errors(grids):
    expanded = torch.zeros(4, device=DEV)[None].expand(3, 4)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor refers to a single"):
        expanded.copy_(torch.ones(3, 4, device=DEV))
    with native_scope(), pytest.raises(RuntimeError) as native_error:
        torch.zeros(3, 4, device=DEV).copy_(torch.ones(5, device=DEV))
    with pytest.raises(RuntimeError) as ours:
        torch.zeros(3, 4, device=DEV).copy_(torch.ones(5, device=DEV))
    assert str(ours.value) == str(native_error.value)
    assert torch.equal(expanded.cpu(), torch.zeros(3, 4))  # nothing written


def test_complex_to_real_keeps_the_native_path_and_its_warning(grids):
    src = torch.randn(4, 3, dtype=torch.complex64, device=DEV).t()
    dst = torch.empty(3, 4, device=DEV)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dst.copy_(src)
    assert any("discards the imaginary part" in str(w.message) for w in caught)
    assert torch.equal(dst.cpu(), src.real.cpu()) and grids == []


def test_float64_goes_to_the_xpus_own_kernels(grids):
    src = torch.randn(6, 5, dtype=torch.float64, device=DEV).t()
    dst = torch.empty(5, 6, dtype=torch.float64, device=DEV)
    DECLINES.clear()
    dst.copy_(src)
    reasons = {reason for (op, _, reason) in DECLINES if op == "copy_"}
    assert reasons == {"torch.float64: the kunlunxin backend computes no float64"} and grids == []
    with native_scope():
        assert torch.equal(dst.cpu(), src.cpu())


def test_sdpa_with_an_expanded_mask_end_to_end(grids):
    """The seed's failure: an fp32 mask expanded over heads, copied into bf16, then attention."""
    batch, heads, length, width = 2, 4, 16, 8
    q, k, v = (torch.randn(batch, heads, length, width).to(torch.bfloat16).to(DEV) for _ in range(3))
    mask = torch.randn(batch, 1, length, length, device=DEV).expand(batch, heads, length, length)
    bf16_mask = torch.empty(batch, heads, length, length, dtype=torch.bfloat16, device=DEV)
    _served_copy(bf16_mask, mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bf16_mask)
    with native_scope():
        expected_mask = torch.empty_like(bf16_mask).copy_(mask)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=expected_mask)
    assert torch.equal(bf16_mask.cpu(), expected_mask.cpu())
    assert torch.equal(out.cpu(), expected.cpu())
    assert grids and all(g[0] <= CTAS for g in grids)
