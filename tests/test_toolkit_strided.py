"""strided_copy and collapse_dims: layouts, dtype pairs, plans, no recompiles.

Runs on the active backend's device: the Triton interpreter on CPU here
(``flaggems.backend()`` sets ``TRITON_INTERPRET`` before kernels are
decorated), compiled kernels on a GPU. Tensors stay small: the interpreter
runs every program in Python.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import flaggems

ACTIVE = flaggems.backend()  # before importing kernels: may switch Triton to its interpreter

from flaggems.toolkit import ElementwisePolicy, collapse_dims, set_policy, strided, strided_copy  # noqa: E402
from flaggems.toolkit.strided import KernelPlan, SplitPlan, kernel_plan, plan_copy  # noqa: E402

DEVICE = ACTIVE.device_type
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
ALL_DTYPES = (*FLOATS, *INTS, torch.bool)


@pytest.fixture(autouse=True)
def _default_policy():
    set_policy(ElementwisePolicy())
    yield
    set_policy(None)


def make(shape, dtype, gen=None, low=-100):
    """Random small integers, exact in every dtype (uint8 and bool: in range)."""
    gen = gen or torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool().to(DEVICE)
    low = max(low, 0) if dtype == torch.uint8 else low
    return torch.randint(low, 100, shape, generator=gen).to(dtype).to(DEVICE)


def reference(dst, src):
    expected = dst.clone()
    expected.copy_(src)
    return expected


def assert_same(actual, expected):
    """Bit for bit on every device (bf16 too: our casts round to nearest even on the interpreter as well)."""
    assert torch.equal(actual, expected) or (actual.isnan() == expected.isnan()).all() and torch.equal(
        actual.nan_to_num(0), expected.nan_to_num(0)), (actual, expected)


def check_copy(dst, src):
    expected = reference(dst, src)
    strided_copy(dst, src)
    assert_same(dst, expected)


# -- collapse_dims ----------------------------------------------------------


def test_collapse_contiguous_is_rank_one():
    assert collapse_dims((2, 3, 4), (12, 4, 1), (12, 4, 1)) == ((24,), ((1,), (1,)))


def test_collapse_drops_size_one_dims():
    assert collapse_dims((4, 1, 3), (3, 3, 1), (0, 0, 1)) == ((4, 3), ((3, 1), (0, 1)))


def test_collapse_broadcast_keeps_two_dims():
    assert collapse_dims((5, 6), (6, 1), (0, 1)) == ((5, 6), ((6, 1), (0, 1)))


def test_collapse_orders_by_destination():
    sizes, (dst, src) = collapse_dims((3, 4), (1, 3), (4, 1))
    assert sizes == (4, 3) and dst == (3, 1) and src == (1, 4)


def test_collapse_same_permutation_merges():
    x = torch.empty(2, 3, 4, 5).permute(0, 2, 3, 1)
    assert collapse_dims(x.shape, x.stride(), x.stride()) == ((120,), ((1,), (1,)))


def test_collapse_step_slice():
    assert collapse_dims((4, 5), (5, 1), (20, 2)) == ((4, 5), ((5, 1), (20, 2)))


def test_collapse_partial_merge():
    # Inner two dims merge in both operands; the source's rows have a gap.
    assert collapse_dims((2, 3, 4), (12, 4, 1), (32, 8, 2)) == ((2, 12), ((12, 1), (32, 2)))
    assert collapse_dims((2, 3, 4), (12, 4, 1), (24, 8, 2)) == ((24,), ((1,), (2,)))


def test_collapse_rank_zero():
    assert collapse_dims((), (), ()) == ((), ((), ()))
    assert collapse_dims((1, 1), (1, 1), (5, 7)) == ((), ((), ()))


def test_collapse_rejects_mismatched_strides():
    with pytest.raises(ValueError):
        collapse_dims((2, 3), (3, 1), (1,))


# -- planning (host only) ---------------------------------------------------


def test_plan_contiguous_is_flat():
    plan = plan_copy((64, 64), (64, 1), (64, 1), ElementwisePolicy())
    assert isinstance(plan, KernelPlan) and plan.kernel == "flat"


def test_plan_transpose_loads_along_rows():
    plan = plan_copy((64, 64), (64, 1), (1, 64), ElementwisePolicy())
    flags = dict(plan.constexprs)
    assert plan.kernel == "tiled" and flags["TRANSPOSED"] and not flags["SRC_UNIT0"] and flags["ALIGNED"]


def test_plan_moves_source_unit_dim_next_to_innermost():
    # dst contiguous (a, b, c); src has its unit stride on dst's outermost dim, padded rows.
    plan = plan_copy((32, 16, 48), (768, 48, 1), (1, 32 * 50, 32), ElementwisePolicy())
    flags = dict(plan.constexprs)
    assert plan.kernel == "tiled" and flags["TRANSPOSED"] and flags["RANK"] == 3


def test_plan_small_inner_dim_is_linear():
    plan = plan_copy((50, 3), (3, 1), (1, 50), ElementwisePolicy())
    assert plan.kernel == "linear"


def test_plan_high_rank_splits():
    shape = (2,) * 8
    src = torch.empty(shape).permute(7, 6, 5, 4, 3, 2, 1, 0)
    plan = plan_copy(shape, torch.empty(shape).stride(), src.stride(), ElementwisePolicy())
    assert isinstance(plan, SplitPlan) and len(plan.inner_sizes) == strided.MAX_RANK


def test_plan_int64_only_when_needed():
    assert dict(kernel_plan((2**31 + 5,), (1,), (1,), ElementwisePolicy()).constexprs)["INT64"]
    assert not dict(kernel_plan((2**20,), (1,), (1,), ElementwisePolicy()).constexprs)["INT64"]
    wide = kernel_plan((4, 64), (64, 1), (2**30, 1), ElementwisePolicy())
    assert dict(wide.constexprs)["INT64"]


def test_plan_shapes_share_specialisations():
    policy = ElementwisePolicy()
    seen = set()
    for rows, cols in ((300, 700), (1000, 999), (257, 513), (4096, 300)):
        plan = kernel_plan((rows, cols), (cols, 1), (1, rows), policy)
        seen.add((plan.kernel, plan.constexprs))
    assert len(seen) == 1


def test_policy_rejects_bad_values():
    with pytest.raises(ValueError):
        ElementwisePolicy.from_values({"block_size": 1000})
    with pytest.raises(ValueError):
        ElementwisePolicy.from_values({"max_ctas": 0})
    with pytest.raises(ValueError, match="unknown field 'extra'"):  # never silently ignored
        ElementwisePolicy.from_values({"max_ctas": 12, "extra": 1})


# -- copies on the device ---------------------------------------------------


def _layouts():
    """(name, dst factory, src factory): each factory takes a dtype."""
    def contiguous(shape):
        return lambda dtype: make(shape, dtype)

    yield "flat", contiguous((37, 5)), contiguous((37, 5))
    yield "expand", contiguous((6, 33)), lambda d: make((33,), d).expand(6, 33)
    yield "expand_middle", contiguous((4, 5, 6)), lambda d: make((4, 1, 6), d).expand(4, 5, 6)
    yield "scalar_broadcast", contiguous((3, 7)), lambda d: make((), d).expand(3, 7)
    yield "transpose", contiguous((19, 23)), lambda d: make((23, 19), d).t()
    yield "step_slice", contiguous((9, 10)), lambda d: make((18, 30), d)[::2, ::3]
    yield "permute", contiguous((3, 4, 5, 2)), lambda d: make((2, 5, 3, 4), d).permute(2, 3, 1, 0)
    yield "dst_transposed", lambda d: make((11, 13), d).t(), contiguous((13, 11))
    yield "dst_sliced", lambda d: make((8, 40), d)[:, 5:30:2], lambda d: make((13, 8), d).t()
    yield "channels_last_to_contiguous", contiguous((2, 3, 5, 4)), \
        lambda d: make((2, 3, 5, 4), d).contiguous(memory_format=torch.channels_last)
    yield "contiguous_to_channels_last", \
        lambda d: make((2, 16, 5, 4), d).contiguous(memory_format=torch.channels_last), contiguous((2, 16, 5, 4))
    yield "both_channels_last", \
        lambda d: make((2, 3, 5, 4), d).contiguous(memory_format=torch.channels_last), \
        lambda d: make((2, 3, 5, 4), d).contiguous(memory_format=torch.channels_last)
    yield "aligned_transpose", contiguous((32, 48)), lambda d: make((48, 32), d).t()
    yield "aligned_expand", contiguous((16, 64)), lambda d: make((64,), d).expand(16, 64)
    yield "storage_offset", lambda d: make((50,), d)[3:40], lambda d: make((60,), d)[7:44]


LAYOUTS = list(_layouts())


@pytest.mark.parametrize("name,dst_of,src_of", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_layouts(name, dst_of, src_of):
    check_copy(dst_of(torch.float32), src_of(torch.float32))


def _dtype_pairs():
    """Every dtype from and to float32, plus a cycle through all pairs of distinct kinds."""
    pairs = {(torch.float32, d) for d in ALL_DTYPES} | {(d, torch.float32) for d in ALL_DTYPES}
    pairs |= {(a, b) for a, b in zip(ALL_DTYPES, ALL_DTYPES[3:] + ALL_DTYPES[:3], strict=True)}
    pairs |= {(torch.bool, torch.int8), (torch.uint8, torch.int8), (torch.int64, torch.int16),
              (torch.float64, torch.float16), (torch.float16, torch.bfloat16)}
    return sorted(pairs, key=str)


@pytest.mark.parametrize("src_dtype,dst_dtype", _dtype_pairs(), ids=str)
def test_dtype_pairs(src_dtype, dst_dtype):
    # Float -> uint8 of a negative value is undefined (torch wraps, GPUs saturate): keep values >= 0.
    low = 0 if torch.uint8 in (src_dtype, dst_dtype) else -100
    src = make((13, 6), src_dtype, low=low)
    dst = make((6, 13), dst_dtype).t()  # non-contiguous destination: the tiled kernel
    check_copy(dst, src)
    check_copy(make((29,), dst_dtype), make((29,), src_dtype, low=low))


def test_float_to_int_truncates_and_bool_is_nonzero():
    src = torch.tensor([-2.75, -0.5, 0.0, 0.25, 3.9, 100.5], device=DEVICE)
    for dtype in (torch.int8, torch.int32, torch.int64, torch.bool):
        check_copy(torch.empty(6, dtype=dtype, device=DEVICE), src)


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5, 6, 8])
def test_ranks(rank):
    gen = torch.Generator().manual_seed(rank)
    shape = (3, 2, 4, 2, 3, 2, 2, 3)[:rank]
    perm = torch.randperm(rank, generator=gen).tolist()
    base = make(tuple(shape[p] for p in perm), torch.float32, gen)
    src = base.permute(*[perm.index(d) for d in range(rank)])
    dst = make(tuple(s + 1 for s in shape), torch.float16)[tuple(slice(0, s) for s in shape)]
    check_copy(dst, src)


def test_rank_eight_with_large_inner_dims():
    shape = (2, 2, 2, 2, 2, 2, 9, 17)
    src = make(shape[::-1], torch.float32).permute(*range(7, -1, -1))
    check_copy(make(shape, torch.float32), src)


def test_non_power_of_two_and_multi_tile():
    set_policy(ElementwisePolicy(block_size=64, tile=256, transpose_tile=(16, 16)))
    check_copy(make((1000,), torch.float32), make((1000,), torch.int32))
    check_copy(make((37, 41), torch.float32), make((41, 37), torch.float32).t())
    check_copy(make((21, 70), torch.float32), make((70,), torch.float32).expand(21, 70))
    check_copy(make((301,), torch.float32), make((903,), torch.float32)[::3])


def test_grid_stride_loop_with_max_ctas():
    set_policy(ElementwisePolicy(block_size=64, tile=256, transpose_tile=(16, 16), max_ctas=2))
    check_copy(make((700,), torch.float32), make((700,), torch.float16))
    check_copy(make((33, 47), torch.float32), make((47, 33), torch.float32).t())
    check_copy(make((130,), torch.float32), make((390,), torch.float32)[::3])


def test_int64_variant(monkeypatch):
    monkeypatch.setattr(strided, "INT32_LIMIT", 256)
    set_policy(ElementwisePolicy(block_size=64, tile=256, transpose_tile=(16, 16)))
    for dst, src in ((make((300,), torch.float32), make((300,), torch.int64)),
                     (make((20, 24), torch.float32), make((24, 20), torch.float32).t()),
                     (make((40,), torch.float32), make((120,), torch.float32)[::3]),
                     (make((4, 5, 24), torch.float32), make((4, 1, 24), torch.float32).expand(4, 5, 24)),
                     (make((5, 3), torch.int64), make((3, 5), torch.int32).t())):
        plan = plan_copy(dst.shape, dst.stride(), src.stride(), ElementwisePolicy())
        assert dict(plan.constexprs)["INT64"]
        check_copy(dst, src)


def test_empty_and_zero_dim():
    strided_copy(torch.empty(0, 5, device=DEVICE), torch.empty(0, 5, device=DEVICE))
    strided_copy(torch.empty(3, 0, device=DEVICE).t(), torch.empty(3, 0, device=DEVICE).t())
    check_copy(torch.zeros((), device=DEVICE), torch.tensor(2.5, device=DEVICE))
    check_copy(torch.zeros((), dtype=torch.int32, device=DEVICE), torch.tensor(7.9, device=DEVICE))


def test_rejects_mismatched_shapes_and_dtypes():
    with pytest.raises(ValueError):
        strided_copy(torch.empty(3, 4, device=DEVICE), torch.empty(4, device=DEVICE))
    with pytest.raises(TypeError):
        strided_copy(torch.empty(3, device=DEVICE), torch.empty(3, dtype=torch.complex64, device=DEVICE))


# -- no recompiles ----------------------------------------------------------


def compiled_variants() -> int:
    """Compiled kernels of the copy kernels on a GPU; bound launchers under the interpreter."""
    total = 0
    for fn in set(strided._KERNELS.values()):
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return len(strided._LAUNCHERS)
        total += sum(len(cache[0]) for cache in caches.values())
    return total


@pytest.mark.parametrize("case", ["flat", "transpose", "expand", "linear", "permute3"])
def test_new_shapes_and_strides_do_not_recompile(case):
    def layout(n, m):
        if case == "flat":
            return make((n * m,), torch.float32), make((n * m,), torch.float16)
        if case == "transpose":
            return make((n, m), torch.float32), make((m, n), torch.float32).t()
        if case == "expand":
            return make((n, m), torch.float32), make((m,), torch.float32).expand(n, m)
        if case == "linear":
            return make((n,), torch.float32), make((3 * n,), torch.float32)[::3]
        return make((n, 3, m), torch.float32), make((m, n, 3), torch.float32).permute(1, 2, 0)

    check_copy(*layout(40, 50))
    before = compiled_variants()
    for n, m in itertools.product((41, 70), (50, 83)):
        check_copy(*layout(n, m))
    assert compiled_variants() == before


def test_plan_caches_start_over_when_full(monkeypatch):
    """A per-layout plan cache is bounded: the entry that finds it full empties it first."""
    from flaggems.toolkit import layout

    monkeypatch.setattr(layout, "PLAN_CACHE_SIZE", 2)
    cache: dict = {}
    assert layout.remember(cache, "a", 1) == 1
    layout.remember(cache, "b", 2)
    assert cache == {"a": 1, "b": 2}
    assert layout.remember(cache, "c", 3) == 3
    assert cache == {"c": 3}
