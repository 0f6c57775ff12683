"""Index family end to end: checks contract, masking, no host sync, CUDA graphs, int64 offsets."""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import run_compiled, set_kernel_context

import flaggems
from flaggems.binding import native_scope
from flaggems.toolkit import tuning

DEV = torch.device(flaggems.backend().device_type)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_out_of_range_index_never_writes_out_of_bounds(unchecked):
    base = torch.zeros(4, 10, device=DEV)
    view = base[:, 2:6]  # writes outside columns 2..5 would corrupt base
    view.index_copy_(1, torch.tensor([0, 4, -1, 100], device=DEV), torch.ones(4, 4, device=DEV))
    expected = torch.zeros(4, 10, device=DEV)
    expected[:, 2] = 1
    assert torch.equal(base, expected)


def test_an_index_past_2_32_does_not_wrap_onto_a_valid_one(unchecked):
    """A plan with 32-bit offsets checks the 64-bit index: 2**32 + 1 is out of range, not position 1."""
    x = torch.arange(12.0, device=DEV).reshape(3, 4)
    index = torch.tensor([2**32 + 1, 2], device=DEV)
    assert torch.equal(x.index_select(1, index), torch.tensor([[0.0, 2], [0, 6], [0, 10]], device=DEV))
    source = -torch.ones(3, 2, device=DEV)
    expected = x.clone()
    expected[:, 2] = -1
    assert torch.equal(x.clone().index_copy_(1, index, source), expected)
    assert torch.equal(x.index_copy(1, index, source), expected)


def test_an_index_read_past_2_31_elements_takes_64_bit_offsets():
    """A column of a huge index matrix is read at ``j * stride``: that offset decides the plan too."""
    from flaggems.toolkit import indexing

    meta = torch.device("meta")  # shapes and strides only, no memory
    x = torch.empty(8, 16, device=meta)
    out = torch.empty(8, 3, device=meta)
    for stride, wide in ((2**20, False), (2**30, True)):
        index = torch.empty_strided((3,), (stride,), dtype=torch.int64, device=meta)
        for mode in (indexing.INDEX_TENSOR, indexing.INDEX_SEARCH):
            plan = indexing.plan_index(out, x, 1, index, scatter=False, mode=mode, divisor=3)
            assert plan.launcher.constexprs["INT64"] is wide, (stride, mode)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_index_select_of_an_expanded_view_past_2_31_elements(index_dtype, checked, monkeypatch):
    """An expanded (stride-0) view of 2**31 + 8 rows over one element of storage: its size along ``dim`` is
    past int32 though no offset is. The check compared an int32 index with the size wrapped to int32 (every
    index ``>=`` it: IndexError); the kernel narrowed the size likewise (every index invalid: zeros). Both
    now match torch; the plan takes 64-bit arithmetic once the indexed size passes 2**30."""
    from flaggems.toolkit import indexing

    set_kernel_context(monkeypatch, checks=checked)
    x = torch.randn(1, device=DEV).expand(2**31 + 8)
    index = torch.tensor([2**31 - 1, 5, 0], dtype=index_dtype, device=DEV)
    with native_scope():
        expected = torch.index_select(x, 0, index)
    with flaggems.enabled(include=["index_select"]):
        assert torch.equal(torch.index_select(x, 0, index), expected)
    meta = torch.device("meta")
    for rows, wide in ((2**30, False), (2**30 + 1, True)):
        view = torch.empty(1, 8, device=meta).expand(rows, 8)
        plan = indexing.plan_index(torch.empty(3, 8, device=meta), view, 0, index.to(meta), scatter=False)
        assert plan.launcher.constexprs["INT64"] is wide, rows


def test_out_of_range_gather_writes_zeros(unchecked):
    x = torch.arange(12.0, device=DEV).reshape(3, 4)
    out = x.index_select(1, torch.tensor([1, 7], device=DEV))
    assert torch.equal(out, torch.tensor([[1.0, 0], [5, 0], [9, 0]], device=DEV))


@pytest.mark.parametrize("overlap", ["source is a slice of self", "source is self", "index is self"])
def test_index_copy_into_overlapping_memory_raises_torchs_error(overlap):
    """In place, self sharing memory with source or index raises torch's RuntimeError; nothing changes."""
    def make():
        x = torch.arange(12, device=DEV).reshape(4, 3)
        if overlap == "source is a slice of self":
            return x, torch.tensor([2, 3], device=DEV), x[:2]
        if overlap == "source is self":
            return x, torch.tensor([1, 0, 3, 2], device=DEV), x
        flat = torch.tensor([1, 0, 2, 3], device=DEV)
        return flat, flat, torch.tensor([5, 6, 7, 8], device=DEV)

    with native_scope(), pytest.raises(RuntimeError) as native:
        x, index, source = make()
        x.index_copy_(0, index, source)
    x, index, source = make()
    before = x.clone()
    with flaggems.enabled(), pytest.raises(RuntimeError) as ours:
        x.index_copy_(0, index, source)
    assert str(ours.value) == str(native.value)
    assert torch.equal(x, before)


@pytest.fixture
def small_index_tiles(monkeypatch):
    """The gather/scatter kernel with 16-element tiles at most 4 columns wide.

    Small tensors then span interior tiles (no size mask: vector accesses)
    and edge tiles, partial in rows, columns or both.
    """
    from flaggems.toolkit import indexing

    set_kernel_context(monkeypatch, tuning=lambda key: {"tile": 16, "max_cols": 4, "min_tile": 16}
                       if key == "gather_scatter" else {})  # the new context drops plans made with other tiles
    return indexing


SELECT_CASES = {  # (shape, dim, index): rows x columns of the work, in tiles of 4x4 (or 16x1)
    "rows and columns partial": ((10, 9), 0, [3, 0, 9, 3, 7, 1, 2]),
    "exact 4x4 tiles": ((6, 8), 0, [5, 0, 1, 2, 4, 3, 3, 0]),
    "one column": ((6, 10), 1, [9, 0, 4, 4, 2, 7, 1]),
    "inner of two dims": ((3, 5, 2, 6), 1, [4, 0, 2]),
    "transposed input": ((9, 10), 0, [8, 1, 1, 0, 6]),
    "whole rows, one tile wide": ((10, 4), 0, [9, 2, 2, 5, 0, 7]),
    "1-D": ((13,), 0, [12, 0, 5, 5, 3, 11, 7, 1, 8, 2, 6, 4, 9, 10, 0, 3, 12]),
}


def _select_case_input(case: str) -> tuple[torch.Tensor, int, torch.Tensor]:
    shape, dim, index = SELECT_CASES[case]
    x = torch.arange(torch.Size(shape).numel(), device=DEV).reshape(shape)
    if case == "transposed input":
        x = x.t()
        dim = 1
    return x, dim, torch.tensor(index, device=DEV)


def _gather_constexprs(indexing, x: torch.Tensor, dim: int, idx: torch.Tensor) -> dict:
    out = torch.empty(x.shape[:dim] + (len(idx),) + x.shape[dim + 1:], dtype=x.dtype, device=DEV)
    return indexing.plan_index(out, x, dim, idx, scatter=False).launcher.constexprs


@pytest.mark.parametrize("case", SELECT_CASES, ids=list(SELECT_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int64])
def test_interior_and_edge_tiles(case, dtype, small_index_tiles, unchecked):
    x, dim, idx = _select_case_input(case)
    x = x.to(dtype)
    index = idx.tolist()
    with native_scope():
        expected = torch.index_select(x, dim, idx)
        target = torch.full_like(x, -1)
        expected_copy = target.index_copy(dim, idx.unique(), torch.index_select(x, dim, idx.unique()))
    assert torch.equal(torch.index_select(x, dim, idx), expected)
    source = torch.index_select(x, dim, idx.unique())
    assert torch.equal(target.index_copy(dim, idx.unique(), source), expected_copy)
    # Invalid indices inside interior tiles: masked, whatever the tile.
    bad = idx.clone()
    bad[::2] = x.shape[dim] + 3
    gathered = torch.index_select(x, dim, bad)
    keep = torch.ones(len(index), dtype=torch.bool)
    keep[::2] = False
    assert torch.equal(gathered.movedim(dim, 0)[keep.to(DEV)], expected.movedim(dim, 0)[keep.to(DEV)])
    assert not gathered.movedim(dim, 0)[~keep.to(DEV)].any()
    scattered = target.clone().index_copy_(dim, bad, torch.index_select(x, dim, idx))
    with native_scope():
        reference = target.clone().index_copy_(dim, idx[keep.to(DEV)], expected.movedim(dim, 0)[keep.to(DEV)]
                                               .movedim(0, dim).contiguous())
    assert torch.equal(scattered, reference)


WRAP_CASES = {  # (make input, dim, indices, ROWS form): 16-row tiles over >= 16 rows of j
    "one column, 20 rows of j": (lambda: torch.arange(5 * 40).reshape(5, 40), 1, 20, "ROWS_WRAP_ONCE"),
    "two outer dims, carry into the first": (
        lambda: torch.arange(4 * 3 * 19).reshape(4, 3, 19).transpose(0, 1), 2, 17, "ROWS_WRAP_ONCE"),
    "two outer dims, j a whole tile": (
        lambda: torch.arange(4 * 3 * 40).reshape(4, 3, 40).transpose(0, 1), 2, 16, "ROWS_ONE_OUTER"),
    "two outer dims, j two tiles": (
        lambda: torch.arange(4 * 3 * 40).reshape(4, 3, 40).transpose(0, 1), 2, 32, "ROWS_ONE_OUTER"),
}


@pytest.mark.parametrize("case", WRAP_CASES, ids=list(WRAP_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.int64])
def test_tiles_spanning_one_or_two_outer_positions(case, dtype, small_index_tiles, unchecked):
    """A tile's rows split into (outer, j) by divisions of its first row only, then a compare or nothing."""
    make, dim, count, form = WRAP_CASES[case]
    x = make().to(DEV, dtype)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randperm(x.shape[dim], generator=gen)[:count].to(DEV)
    out = torch.empty(0, device=DEV, dtype=dtype)
    rows = _gather_constexprs(small_index_tiles, x, dim, idx)["ROWS"]
    assert rows == getattr(small_index_tiles, form), f"the case must exercise {form}"
    with native_scope():
        expected = torch.index_select(x, dim, idx)
        target = torch.full_like(x, -1)
        expected_copy = target.index_copy(dim, idx, expected)
    assert torch.equal(torch.index_select(x, dim, idx, out=out), expected)
    assert torch.equal(target.index_copy(dim, idx, expected), expected_copy)
    assert torch.equal(target.clone().index_copy_(dim, idx, expected), expected_copy)
    bad = idx.clone()
    bad[::3] = -1
    gathered = torch.index_select(x, dim, bad).movedim(dim, 0)
    assert not gathered[::3].any() and torch.equal(gathered[1::3], expected.movedim(dim, 0)[1::3])


def test_index_cases_cover_every_rows_form(small_index_tiles):
    """The cases above reach every ``ROWS_*`` form (each one-column form too), so each is tested end to end."""
    forms = set()
    for case in SELECT_CASES:
        constexprs = _gather_constexprs(small_index_tiles, *_select_case_input(case))
        forms.add((constexprs["ROWS"], constexprs["BLOCK_C"] == 1))
    for make, dim, count, _ in WRAP_CASES.values():
        x = make().to(DEV)
        constexprs = _gather_constexprs(small_index_tiles, x, dim, torch.arange(count, device=DEV))
        forms.add((constexprs["ROWS"], constexprs["BLOCK_C"] == 1))
    every = (small_index_tiles.ROWS_DIVIDE, small_index_tiles.ROWS_WRAP_ONCE,
             small_index_tiles.ROWS_ONE_OUTER, small_index_tiles.ROWS_NO_OUTER)
    assert {rows for rows, _ in forms} == set(every)
    assert {rows for rows, one_column in forms if one_column} == set(every)


def test_whole_tiles_only_when_the_tiles_cover_the_work_exactly(small_index_tiles):
    """``WHOLE_TILES`` (no edge branch compiled) exactly when rows and columns divide by the tile.

    The select cases reach both kernels, so ``test_interior_and_edge_tiles`` runs each end to end.
    """
    seen = set()
    for case in SELECT_CASES:
        x, dim, idx = _select_case_input(case)
        constexprs = _gather_constexprs(small_index_tiles, x, dim, idx)
        rows = x.shape[:dim].numel() * len(idx)
        cols = x.shape[dim + 1:].numel()
        exact = rows % constexprs["BLOCK_R"] == 0 and cols % constexprs["BLOCK_C"] == 0
        assert constexprs["WHOLE_TILES"] == exact, case
        seen.add(exact)
    assert seen == {False, True}


def test_tile_rows_shrink_to_the_indexed_dimension_only_when_it_pays():
    """Rows shrink to ``j_size`` (ROWS_WRAP_ONCE) only when the tile keeps ``MIN_TILE`` elements."""
    from flaggems.toolkit import indexing

    assert indexing._tile(4096 * 2048, 1, 2048, 0, 2) == (2048, 1)  # index_select [4096, 4096] dim 1
    assert indexing._tile(200 * 20499, 3, 20499, 0, 2) == (1024, 4)  # already within j_size
    assert indexing._tile(5000, 1, 1000, 0, 2) == (4096, 1)  # 512 rows would be under MIN_TILE: unchanged


def test_wide_rows_take_a_tile_of_fixed_bytes():
    """Rows of ``WIDE_ROW_BYTES`` or more get ``WIDE_TILE_BYTES`` tiles (64 bytes a thread), narrower ones ``TILE``."""
    from flaggems.toolkit import indexing

    assert indexing._tile(2048, 4096, 2048, 0, 2) == (2, 4096)  # index_select [4096, 4096] dim 0 fp16
    assert indexing._tile(2048, 4096, 2048, 0, 4) == (1, 4096)  # fp32: 16 KiB already
    assert indexing._tile(2048, 4096, 2048, 0, 8) == (1, 4096)  # fp64: one row, wider than the tile
    assert indexing._tile(2048, 4096, 2048, 0, 1) == (4, 4096)
    assert indexing._tile(512 * 1024, 1024, 512, 0, 2) == (8, 1024)  # [1024, 1024, 1024] dim 1 fp16: 2 KiB rows
    assert indexing._tile(64 * 256, 512, 256, 0, 2) == (8, 512)  # [64, 512, 512] dim 1 fp16: 1 KiB, TILE


def test_merged_one_column_gathers_get_more_warps():
    """A one-column gather with a fallback load (index_copy's inverse form) takes 16 warps; 1-2 wide rows, 4."""
    from flaggems.toolkit import indexing

    def warps(dim: int, fallback: int) -> int:
        out = torch.empty(4096, 4096, dtype=torch.float16)  # gathers from source by the inverse index
        source = torch.empty((4096, 2048) if dim else (2048, 4096), dtype=torch.float16)
        inverse = torch.empty(4096, dtype=torch.int32)
        plan = indexing.plan_index(out, source, dim, inverse, scatter=False, fallback=fallback)
        return plan.launcher.options["num_warps"]

    assert warps(1, indexing.FALLBACK_TENSOR) == tuning.GatherScatterPolicy().merged_gather_warps == 16
    defaults = tuning.GatherScatterPolicy()
    assert warps(1, indexing.FALLBACK_KEEP) == warps(1, indexing.FALLBACK_ZERO) == defaults.num_warps
    assert warps(0, indexing.FALLBACK_TENSOR) == defaults.few_rows_warps  # two 8 KiB rows a tile
    eight_rows = indexing.plan_index(torch.empty(64, 256, 512), torch.empty(64, 512, 512), 1,
                                     torch.empty(256, dtype=torch.int64), scatter=True)  # 2 KiB fp32 rows
    assert eight_rows.launcher.constexprs["BLOCK_R"] == 8 and eight_rows.launcher.options["num_warps"] == 8


@CUDA
def test_index_copy_beyond_2_31_elements():
    n = 2**31 + 64
    big = torch.zeros(n, dtype=torch.int8, device="cuda")
    index = torch.tensor([0, 2**31 + 5, n - 1], device="cuda")
    with flaggems.enabled():
        big.index_copy_(0, index, torch.tensor([1, 2, 3], dtype=torch.int8, device="cuda"))
        picked = big.index_select(0, index)
    assert picked.tolist() == [1, 2, 3]
    assert int(big.sum()) == 6


def test_kernels_vectorise_for_sm90():
    """Interior index tiles and full repeat_interleave blocks use 16-byte accesses (sm_90 PTX, no GPU needed).

    Also: a one-column tile divides once per program (``ROWS_WRAP_ONCE``, ``ROWS_ONE_OUTER``), not
    once per element; index_select along dim 0 of a matrix divides only to find its column tile.

    Sizes are runtime arguments Triton does not specialise, so only accesses
    without a size mask can vectorise: before the interior-tile branch every
    index access was a scalar 2- or 4-byte one.
    """
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = textwrap.dedent("""
        import re
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from flaggems.plugins.generic import index_copy as ic
        from flaggems.plugins.generic import repeat_interleave as ri
        from flaggems.toolkit import indexing
        from flaggems.toolkit.tuning import ScanPolicy

        scan = ScanPolicy()

        def ptx(fn, pointers, constexprs, num_warps):
            sig = {p.name: "constexpr" if p.name in constexprs else pointers.get(p.name, p.annotation_type or "i64")
                   for p in fn.params}
            attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if sig[p.name][0] == "*"}
            src = ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs)
            return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]

        common = dict(INDEX_MODE=0, INT64=False, A_UNIT=True, B_UNIT=True, A_LINEAR=True,
                      ROWS=indexing.ROWS_WRAP_ONCE, WHOLE_TILES=False, SEARCH=1)
        shapes = {  # (BLOCK_R, BLOCK_C, SCATTER, ALIGNED, FALLBACK): the contiguous side must vectorise
            "index_select dim 0": (1, 4096, False, True, indexing.FALLBACK_ZERO),
            "index_copy dim 0": (1, 4096, True, True, indexing.FALLBACK_ZERO),
            "index_copy [64, 512, 512] dim 1": (8, 512, True, True, indexing.FALLBACK_ZERO),
            "index_copy by inverse, dim 0": (1, 4096, False, True, indexing.FALLBACK_TENSOR)}
        for name, (rows, cols, scatter, aligned, fallback) in shapes.items():
            for dtype in ("fp16", "fp32"):
                pointers = {"a": "*" + dtype, "b": "*" + dtype, "idx": "*i64", "fallback": "*" + dtype}
                code = ptx(indexing.index_along_dim_kernel, pointers, dict(
                    BLOCK_R=rows, BLOCK_C=cols, SCATTER=scatter, ALIGNED=aligned, FALLBACK=fallback, **common), 8)
                assert re.search(r"(ld|st)\\.global\\.v4", code), f"{name} {dtype} did not vectorise"
        for table in (False, True):
            code = ptx(ri._expand_kernel, {"ends": "*i64", "out": "*i64", "values": "*i64", "status": "*i64"},
                       dict(BLOCK=2048, SUB=16, FANOUT=256, GATHER=False, TABLE=table), 4)
            assert "st.global.v2.b64" in code, "full repeat_interleave blocks did not vectorise"
        for repeats in ("*i64", "*i32"):  # the scan's look-back, tickets and reset compile for the GPU
            code = ptx(ri._scan_kernel, {"repeats": repeats, "ends": "*i64", "status": "*i64"},
                       dict(CHUNK=scan.chunk, BLOCK=scan.block, LOOKBACK=scan.lanes(32), TILE=scan.tile), 4)
            assert "atom.global" in code and "ld.volatile.global" in code  # publish, look back
        divisions = {}
        for rows in range(4):  # one-column tiles: one row per element (index_select dim 1)
            pointers = {"a": "*fp16", "b": "*fp16", "idx": "*i64", "fallback": "*fp16"}
            code = ptx(indexing.index_along_dim_kernel, pointers, dict(
                common, BLOCK_R=4096, BLOCK_C=1, SCATTER=False, ALIGNED=False, FALLBACK=indexing.FALLBACK_ZERO,
                ROWS=rows), 8)
            divisions[rows] = len(re.findall(r"\\b(div|rem)\\.[su](32|64)", code))
        # per element (16 a thread) with ROWS_DIVIDE; per program in the tile forms; none without outer dims
        assert divisions[indexing.ROWS_NO_OUTER] < 2, divisions  # the program's column tile
        assert divisions[indexing.ROWS_ONE_OUTER] <= divisions[indexing.ROWS_WRAP_ONCE] <= 8, divisions
        assert 16 <= divisions[indexing.ROWS_DIVIDE], divisions
        # index_select along dim 0 of a matrix: whole rows, no outer dimension
        code = ptx(indexing.index_along_dim_kernel, pointers, dict(
            common, BLOCK_R=1, BLOCK_C=4096, SCATTER=False, ALIGNED=True, FALLBACK=indexing.FALLBACK_ZERO,
            ROWS=indexing.ROWS_NO_OUTER), 8)
        assert len(re.findall(r"\\b(div|rem)\\.[su](32|64)", code)) < 2, "the flat dim 0 plan divides per row"
        assert re.search(r"(ld|st)\\.global\\.b16", code), "edge branch: no scalar access to remove"
        code = ptx(indexing.index_along_dim_kernel, pointers, dict(  # the same plan, tiles covering the work
            common, BLOCK_R=2, BLOCK_C=4096, SCATTER=False, ALIGNED=True, FALLBACK=indexing.FALLBACK_ZERO,
            ROWS=indexing.ROWS_NO_OUTER, WHOLE_TILES=True), 8)
        assert re.search(r"ld\\.global\\.v4", code) and not re.search(r"(ld|st)\\.global\\.b16", code), \
            "WHOLE_TILES still compiles the edge branch"
        for rows, cols, lanes in ((128, 1, 32), (2, 512, 2048)):  # index_copy's search form, both tile shapes
            code = ptx(indexing.index_along_dim_kernel, pointers, dict(
                common, INDEX_MODE=indexing.INDEX_SEARCH, BLOCK_R=rows, BLOCK_C=cols, SCATTER=False, ALIGNED=True,
                FALLBACK=indexing.FALLBACK_TENSOR, SEARCH=lanes), 8)
            assert "ld.local" not in code, "the search spills"
        for one_program in (False, True):  # the index_copy inverse: every form compiles
            for order in (False, True):
                ptx(ic._invert_kernel, {"index": "*i64", "inverse": "*i32"},
                    dict(BLOCK=1024, ONE_PROGRAM=one_program, ORDER=order), 4)
        side = dict(BLOCK_R=4096, BLOCK_C=1, INT64=False, A_LINEAR=True, A_UNIT=True, B_UNIT=True, ALIGNED=False,
                    ROWS=indexing.ROWS_ONE_OUTER, WHOLE_TILES=False)
        ptx(indexing.scatter_or_gather_kernel,  # in place index_copy_ along the last dimension
            {"a": "*fp16", "b": "*fp16", "idx": "*i64", "inverse": "*i32"},
            {**{"S_" + k: v for k, v in side.items()}, **{"G_" + k: v for k, v in side.items()}}, 8)
        print("ok")
    """)
    run_compiled(script)


@pytest.fixture(params=[0, 1 << 17], ids=["inverse-by-blocks", "inverse-one-program"])
def inverse_always(monkeypatch, request):
    """index_copy takes the inverse-index form (a gather over the destination) at every size.

    The inverse is built by one program (fill, barrier, scatter) or by a fill
    and one program per block of indices.
    """
    from flaggems.plugins.generic import index_copy as ic

    monkeypatch.setattr(ic, "INVERSE_MIN_ELEMENTS", 0)
    monkeypatch.setattr(ic, "INVERSE_DIM_SHARE", 1)
    monkeypatch.setattr(ic, "SECTOR_BYTES", 1 << 30)  # in place too, whatever the row width
    monkeypatch.setattr(ic, "INVERT_BLOCK", 4)  # several blocks of indices and of positions
    monkeypatch.setattr(ic, "ONE_PROGRAM_LIMIT", request.param)
    monkeypatch.setattr(ic, "_INVERT", {})
    monkeypatch.setattr(ic, "SEARCH_MAX_PAIRS", 0)  # out of place too (small calls otherwise search)
    return ic


INVERSE_CASES = {  # (shape, dim, index length)
    "columns": ((12, 10), 1, 6),
    "rows": ((10, 7), 0, 4),
    "middle of 3-D": ((3, 9, 5), 1, 5),
    "last of 3-D": ((3, 4, 9), -1, 9),
    "1-D": ((17,), 0, 11),
}


@pytest.mark.parametrize("case", INVERSE_CASES, ids=list(INVERSE_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int32, torch.bool])
@pytest.mark.parametrize("order", ["random", "increasing"])
def test_index_copy_by_inverse(case, dtype, order, inverse_always, small_index_tiles, unchecked):
    """In place, an increasing index takes the scatter inside the one launch, any other the gather."""
    shape, dim, count = INVERSE_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    self_ = (torch.randn(shape, generator=gen) * 9).to(dtype).to(DEV)
    index = torch.randperm(self_.shape[dim], generator=gen)[:count]
    index = (index.sort().values if order == "increasing" else index).to(DEV)
    source_shape = list(shape)
    source_shape[dim] = count
    source = (torch.randn(source_shape, generator=gen) * 9).to(dtype).to(DEV)
    with native_scope():
        expected = self_.index_copy(dim, index, source)
    assert torch.equal(self_.index_copy(dim, index, source), expected)
    inplace = self_.clone()
    assert inplace.index_copy_(dim, index, source) is inplace
    assert torch.equal(inplace, expected)
    # A transposed destination, written in place through its strides.
    if self_.dim() == 2:
        base = self_.t().contiguous()
        view = base.t()
        view.index_copy_(dim, index, source)
        assert torch.equal(base.t(), expected)


def test_index_copy_by_inverse_edge_cases(inverse_always, small_index_tiles, unchecked):
    """Out-of-range indices never write; duplicates pick one candidate per position; empty does nothing."""
    self_ = torch.arange(40.0, device=DEV).reshape(5, 8)
    index = torch.tensor([7, -1, 8, 2, 2], device=DEV)
    source = -torch.arange(1.0, 26.0, device=DEV).reshape(5, 5)
    for result in (self_.index_copy(1, index, source), self_.clone().index_copy_(1, index, source)):
        untouched = [c for c in range(8) if c not in (7, 2)]
        assert torch.equal(result[:, untouched], self_[:, untouched])
        assert torch.equal(result[:, 7], source[:, 0])
        column = result[:, 2]
        assert torch.equal(column, source[:, 3]) or torch.equal(column, source[:, 4])
    # Never decreasing, with out-of-range ends and a duplicate: the scatter branch, same contract.
    ordered = self_.clone().index_copy_(1, torch.tensor([-1, 2, 2, 7, 8], device=DEV), source)
    untouched = [c for c in range(8) if c not in (7, 2)]
    assert torch.equal(ordered[:, untouched], self_[:, untouched]) and torch.equal(ordered[:, 7], source[:, 3])
    assert torch.equal(ordered[:, 2], source[:, 1]) or torch.equal(ordered[:, 2], source[:, 2])
    empty = torch.empty(0, dtype=torch.int64, device=DEV)
    assert torch.equal(self_.index_copy(1, empty, source[:, :0]), self_)


@pytest.mark.parametrize("flag", [-1, 0, 1])
def test_scatter_or_gather_follows_the_device_flag(flag, small_index_tiles):
    """The flag alone picks the branch: given an inverse that indexes nothing, only the scatter writes."""
    dest = torch.zeros(6, 10, device=DEV)
    source = torch.arange(1.0, 25.0, device=DEV).reshape(6, 4)
    index = torch.tensor([1, 4, 5, 8], device=DEV)
    nothing = torch.tensor([-1] * 10 + [flag], dtype=torch.int32, device=DEV)  # the flag after the inverse
    with native_scope():
        assert small_index_tiles.scatter_or_gather(dest, source, 1, index, nothing)
        expected = torch.zeros(6, 10, device=DEV).index_copy_(1, index, source)
    assert torch.equal(dest, expected if flag <= 0 else torch.zeros(6, 10, device=DEV))
    launcher, grid, _ = small_index_tiles._EITHER_PLANS[next(iter(small_index_tiles._EITHER_PLANS))]
    assert launcher.constexprs["S_BLOCK_R"] == launcher.constexprs["G_BLOCK_R"] == 16 and grid == (4,)


@pytest.mark.parametrize("order", ["increasing", "decreasing"])
def test_index_copy_in_place_with_a_strided_index(order, inverse_always, small_index_tiles, unchecked):
    """Every other element of an index tensor: the order flag and both branches read it through its stride."""
    base = torch.arange(0, 24, device=DEV) if order == "increasing" else torch.arange(23, -1, -1, device=DEV)
    index = base[::2]  # 12 positions along a dimension of 24, stride 2
    self_ = torch.arange(5 * 24, dtype=torch.float32, device=DEV).reshape(5, 24)
    source = -torch.arange(1.0, 61.0, device=DEV).reshape(5, 12)
    with native_scope():
        expected = self_.clone().index_copy_(1, index.contiguous(), source)
    assert torch.equal(self_.clone().index_copy_(1, index, source), expected)


ORDER_CASES = {  # index, whether it ever decreases (blocks of 4 indices in the fixture)
    "increasing": ([0, 1, 3, 4, 6, 9, 10, 11, 13], False),
    "repeats, never decreasing": ([1, 1, 2, 2, 2, 5, 5, 8], False),
    "decreases inside a block": ([0, 2, 1, 3, 4, 5, 6, 7], True),
    "decreases across blocks": ([0, 1, 2, 9, 3, 4, 5, 6], True),
    "decreases at the end": ([0, 1, 2, 3, 4, 5, 6, 7, 8, 0], True),
    "one index": ([5], False),
}


@pytest.mark.parametrize("case", ORDER_CASES, ids=list(ORDER_CASES))
def test_inverse_flags_a_decreasing_index(case, inverse_always):
    """The inverse kernel's order flag, by one program and by blocks: positive iff the index decreases."""
    values, decreases = ORDER_CASES[case]
    index = torch.tensor(values, device=DEV)
    with native_scope():
        buffer = inverse_always._inverse(index, 16, order=True)
        inverse, order = buffer[:16], int(buffer[16])
        assert (order > 0) == decreases
        expected = torch.full((16,), -1, dtype=torch.int32)
        for j, d in enumerate(values):
            expected[d] = j
        if len(set(values)) == len(values):  # duplicates: one j wins, unspecified
            assert torch.equal(inverse.cpu(), expected)
        assert torch.equal(inverse.cpu() >= 0, expected >= 0)


def _spy_forms(monkeypatch) -> list[str]:
    """The forms index_copy's kernel calls take from now on: ``search``, ``scatter`` or ``gather``, in order."""
    from flaggems.plugins.generic import index_copy as ic

    forms, real = [], ic.index_along_dim

    def spy(*args, **kwargs):
        searched = kwargs.get("mode") == ic.INDEX_SEARCH
        forms.append("search" if searched else "scatter" if kwargs["scatter"] else "gather")
        return real(*args, **kwargs)

    monkeypatch.setattr(ic, "index_along_dim", spy)
    return forms


@pytest.fixture(params=["search", "scatter"], ids=["search", "copy-then-scatter"])
def out_of_place_form(monkeypatch, request, small_index_tiles):
    """index_copy out of place by one of its two small-workload forms, whatever the size.

    The search form compares 4 index entries a step (rows then take several
    steps, the last one partial); the inverse form is never taken. Yields the
    form and the list of forms the calls took.
    """
    from flaggems.plugins.generic import index_copy as ic

    monkeypatch.setattr(ic, "SEARCH_MAX_PAIRS", 1 << 62 if request.param == "search" else 0)
    monkeypatch.setattr(ic, "INVERSE_MIN_ELEMENTS", 1 << 62)
    set_kernel_context(monkeypatch, tuning=lambda key: {"tile": 16, "max_cols": 4, "min_tile": 16, "search_lanes": 4}
                       if key == "gather_scatter" else {})
    return request.param, _spy_forms(monkeypatch)


SEARCH_CASES = {  # (shape, dim, index length): rows x columns of the work in 16-element tiles
    **INVERSE_CASES,
    "one index": ((6, 5), 0, 1),
    "wide rows": ((4, 7, 9), 1, 7),
    "4-D, middle": ((2, 3, 5, 4), 2, 3),
}


@pytest.mark.parametrize("case", SEARCH_CASES, ids=list(SEARCH_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.bool])
def test_index_copy_out_of_place_forms(case, dtype, out_of_place_form, unchecked):
    """Each form matches torch, with a random index read through a stride and a transposed source."""
    shape, dim, count = SEARCH_CASES[case]
    gen = torch.Generator().manual_seed(len(case) + 7)
    self_ = (torch.randn(shape, generator=gen) * 9).to(dtype).to(DEV)
    index = torch.randperm(self_.shape[dim], generator=gen)[:count].to(DEV)
    source_shape = list(shape)
    source_shape[dim] = count
    source = (torch.randn(source_shape, generator=gen) * 9).to(dtype).to(DEV)
    strided_index = torch.stack((index, -index), 1)[:, 0]
    transposed = source.t().contiguous().t() if source.dim() == 2 else source
    with native_scope():
        expected = self_.index_copy(dim, index, source)
    assert torch.equal(self_.index_copy(dim, index, source), expected)
    assert torch.equal(self_.index_copy(dim, strided_index, transposed), expected)
    form, taken = out_of_place_form
    assert taken == [form, form]  # the form under test ran, not the other one


def test_index_copy_out_of_place_forms_edge_cases(out_of_place_form, unchecked):
    """Out-of-range indices write nothing, a duplicate writes one of its candidates, 0-dim and empty work."""
    self_ = torch.arange(40.0, device=DEV).reshape(5, 8)
    source = -torch.arange(1.0, 31.0, device=DEV).reshape(5, 6)
    result = self_.index_copy(1, torch.tensor([7, -1, 8, 2, 2, 1 << 40], device=DEV), source)
    untouched = [c for c in range(8) if c not in (7, 2)]
    assert torch.equal(result[:, untouched], self_[:, untouched])
    assert torch.equal(result[:, 7], source[:, 0])
    # duplicates: each element is one of its candidates (the scatter races per element, as torch's does)
    assert bool(((result[:, 2] == source[:, 3]) | (result[:, 2] == source[:, 4])).all())
    scalar = torch.tensor(3.0, device=DEV).index_copy(0, torch.tensor(0, device=DEV), torch.tensor(-2.0, device=DEV))
    assert scalar.shape == () and float(scalar) == -2.0
    empty = torch.empty(0, dtype=torch.int64, device=DEV)
    assert torch.equal(self_.index_copy(1, empty, source[:, :0]), self_)


def test_index_copy_out_of_place_forms_with_zero_strides(out_of_place_form, unchecked):
    """A broadcast source (zero stride along the outer dimension) and an index of one repeated position."""
    self_ = torch.arange(60.0, device=DEV).reshape(6, 10)
    source = -torch.arange(1.0, 5.0, device=DEV).reshape(1, 4).expand(6, 4)
    index = torch.tensor([7, 0, 3, 9], device=DEV)
    with native_scope():
        expected = self_.index_copy(1, index, source.contiguous())
    assert torch.equal(self_.index_copy(1, index, source), expected)
    repeated = torch.tensor([5], device=DEV).expand(4)  # stride 0: four entries, all 5
    result = self_.index_copy(1, repeated, source)
    untouched = [c for c in range(10) if c != 5]
    assert torch.equal(result[:, untouched], self_[:, untouched])
    assert bool(torch.isin(result[:, 5], source[0]).all())


def test_index_copy_out_of_place_form_is_chosen_by_comparisons(monkeypatch):
    """The search form while rows x index entries stay within SEARCH_MAX_PAIRS and ``self`` is dense."""
    from flaggems.plugins.generic import index_copy as ic

    modes = _spy_forms(monkeypatch)
    limit = ic.SEARCH_MAX_PAIRS
    calls = {  # (self, dim, index length) -> the form
        "a matrix, dim 1, at the limit": (torch.zeros(limit // 64 // 64, 64, device=DEV), 1, 64),
        "a matrix, dim 0: rows of the first dim only": (torch.zeros(64, 2**16, device=DEV), 0, 32),
        "1-D, over the limit": (torch.zeros(limit // 16, device=DEV), 0, 32),
        "a transposed self (out is dense)": (torch.zeros(16, 64, device=DEV).t(), 1, 8),
    }
    with flaggems.enabled():
        for x, dim, count in calls.values():
            source_shape = list(x.shape)
            source_shape[dim] = count
            out = x.index_copy(dim, torch.arange(count, device=DEV), torch.ones(source_shape, device=DEV))
            assert float(out.sum()) == out.numel() // x.shape[dim] * count
    assert modes == ["search", "search", "scatter", "scatter"]


def test_index_copy_by_inverse_is_chosen_by_size():
    """The default thresholds: large 2-D workloads take the inverse form, small and 1-D ones scatter."""
    from flaggems.plugins.generic import index_copy as ic

    calls = []

    def spy(index, size, **kwargs):
        calls.append(size)
        return real(index, size, **kwargs)

    real, ic._inverse = ic._inverse, spy
    try:
        big = torch.zeros(1024, 1024, device=DEV)
        idx = torch.arange(0, 1024, 2, device=DEV)
        with flaggems.enabled():
            out = big.index_copy(1, idx, torch.ones(1024, 512, device=DEV))
            big.index_copy_(1, idx, torch.ones(1024, 512, device=DEV))  # 4-byte rows: in place too
            big.index_copy_(0, idx, torch.ones(512, 1024, device=DEV))  # 4 KB rows: plain scatter
            torch.zeros(2**20, device=DEV).index_copy_(0, idx, torch.ones(512, device=DEV))  # 1-D: plain
            torch.zeros(64, 64, device=DEV).index_copy(1, idx[:8], torch.ones(64, 8, device=DEV))  # small
    finally:
        ic._inverse = real
    assert calls == [1024, 1024]
    assert float(out.sum()) == 1024 * 512 and float(big.sum()) == 512 * 512 + 512 * 1024  # odd rows: even columns


def test_gather_scatter_tiles_come_from_the_typed_policy(monkeypatch):
    """A backend's ``gather_scatter`` tuning sets the tiles and warps; the plans made before are dropped."""
    from flaggems.toolkit import indexing

    def plan():
        out = torch.empty(64, 4096, dtype=torch.float16)
        return indexing.plan_index(out, torch.empty(64, 4096, dtype=torch.float16), 0,
                                   torch.empty(64, dtype=torch.int64), scatter=False)

    default = plan()
    assert (default.launcher.constexprs["BLOCK_R"], default.launcher.options["num_warps"]) == (2, 4)
    set_kernel_context(monkeypatch, tuning=lambda key: {"wide_tile_bytes": 32768, "few_rows": 0, "num_warps": 4}
                       if key == "gather_scatter" else {})
    tuned = plan()
    assert (tuned.launcher.constexprs["BLOCK_R"], tuned.launcher.options["num_warps"]) == (4, 4)
    with pytest.raises(ValueError, match="max_col.*did you mean 'max_cols'"):
        tuning.check_tuning("gather_scatter", {"max_col": 1024})
    with pytest.raises(ValueError, match="gather_scatter.tile=1000: expected a power of two"):
        tuning.check_tuning("gather_scatter", {"tile": 1000})


def test_high_rank_layouts_decline_with_a_counted_reason():
    """A layout the index kernels cannot collapse to 2 outer + 2 inner dimensions goes native, and
    ``flaggems.routes()`` says so with a count (the reason is also in the fallback log)."""
    x = torch.randn(3, 4, 5, 6, 7, 2, device=DEV)[:, ::2, :, ::2, :, :].permute(0, 3, 1, 4, 2, 5)  # none merge
    index = torch.tensor([0, 2, 1], device=DEV)
    with native_scope():
        expected = x.index_select(4, index)
    with flaggems.enabled():
        for _ in range(3):
            assert torch.equal(x.index_select(4, index), expected)
        row = flaggems.routes("index_select")[0]
    seen = [d for d in row["declined"] if "more than 2 outer or 2 inner" in d["reason"]]
    assert seen and seen[0]["impl"] == row["chosen"] and seen[0]["count"] >= 1, row["declined"]
