"""Plans generic over sizes (flaggems.generalize and the compiled entry's entry_generic.inc).

One recorded replay serves every call of its layout class whose atoms pass the
guards; a size outside them, another layout class, aliasing or broadcast plan
again. Each test compares every result with torch's and reads the plan counters.
"""

from __future__ import annotations

import pytest
import torch
from conftest import in_threads

import flaggems
from flaggems import generalize
from flaggems.runtime import RUNTIME
from flaggems.toolkit import plans

pytestmark = pytest.mark.usefixtures("compiled_entry")
#: The tests' device: the GPU where there is one (compiled kernels, driver launches), else the CPU interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def compiled_entry(compiled_for):
    compiled_for(["copy_", "_to_copy", "index_select"])


def _native_float(x: torch.Tensor) -> torch.Tensor:
    """torch's own ``x.float()`` (with flaggems enabled, ``x.float()`` is the routed ``_to_copy``)."""
    from flaggems.binding import native_scope

    with native_scope():
        return x.float()


def _stats(op: str) -> dict:
    rows = [s for k, s in RUNTIME.plan_stats().items() if k.startswith(f"aten::{op}@")]
    return {name: sum(r[name] for r in rows)
            for name in ("miss", "generic", "generic_plans", "replay", "plans", "typed_replay")}


def _copy(n: int, offset: int = 0) -> None:
    src = torch.randn(n + offset, device=DEV)[offset:]
    dst = torch.empty(n, device=DEV)
    dst.copy_(src)
    assert torch.equal(dst, src)


def test_one_generic_plan_serves_many_sizes():
    sizes = [100, 120, 97, 111, 126, 65, 125, 77]  # one power-of-two bucket: (64, 128], none a multiple of 16
    for n in sizes:
        _copy(n)
    stats = _stats("copy_")
    assert stats["miss"] == 3 and stats["generic"] == len(sizes) - 3 and stats["generic_plans"] == 1
    assert stats["typed_replay"] == len(sizes) - 3  # served unboxed: copy_'s typed entry binds the generic plan


def test_rows_of_a_padded_buffer_are_served_while_length_and_stride_agree():
    """``labels[..., 1:].contiguous()`` of ``[2, n + 1]`` rows (a training step's shifted labels): the length n
    and the source's row stride n + 1 vary independently in the class, and (the interpreter's tiles) a grid of
    ``cdiv(2n, 128)`` blocks is also ``cdiv(n + 1, 64)`` at the points. The plan takes one and guards that
    both agree (they used to refuse a plan: every step missed); n = 192 (where they differ) plans again.
    Every copy equals its source."""
    for n in (163, 227, 221, 201, 250, 192, 171, 237):  # n, n + 1 and 2n of one class but at 192
        src = torch.arange(2 * (n + 1), device=DEV).reshape(2, n + 1)[:, 1:]
        dst = torch.full((2, n), -1, device=DEV)
        dst.copy_(src)
        assert torch.equal(dst, src), n
    assert _stats("copy_")["generic"] >= (2 if DEV == "cpu" else 1)  # a GPU's tiles depend on its sizes too


def test_a_replayed_size_hits_its_exact_plan_after_the_generic_one_made_it():
    for n in [100, 120, 99, 101, 101, 101]:
        _copy(n)
    stats = _stats("copy_")
    assert stats["generic"] == 1 and stats["replay"] == 3


def test_another_bucket_is_another_layout_class():
    for n in [100, 120, 99, 200]:  # 200 is in (128, 256]
        _copy(n)
    assert _stats("copy_")["miss"] == 4


def test_a_pinned_atom_that_changes_plans_again():
    """Two calls varying only the length make a plan that pins the batch: another batch is a miss."""
    def convert(batch: int, n: int) -> None:
        x = torch.randn(batch, n, 8, dtype=torch.bfloat16, device=DEV)
        y = x.to(torch.float32)
        expected = _native_float(x)
        assert torch.equal(y, expected) and y.stride() == expected.stride()

    for n in (101, 121, 99, 113):  # odd lengths: every stride and numel keeps its class (not a multiple of 16)
        convert(3, n)
    assert _stats("_to_copy")["generic"] == 1
    convert(4, 101)  # batch 3 -> 4: the same bucket (2, 4], a pinned atom changed
    assert _stats("_to_copy")["miss"] == 4


def test_a_stride_order_change_is_another_class():
    def convert(x: torch.Tensor) -> None:
        y = x.to(torch.float32)
        expected = _native_float(x)
        assert torch.equal(y, expected) and y.stride() == expected.stride()

    for n in (100, 120, 99):
        convert(torch.randn(n, 6, dtype=torch.bfloat16, device=DEV))
    misses = _stats("_to_copy")["miss"]
    convert(torch.randn(6, 110, dtype=torch.bfloat16, device=DEV).t())
    assert _stats("_to_copy")["miss"] == misses + 1


def test_broadcast_and_aliasing_keep_distinct_plans():
    for n in (100, 120, 99):
        _copy(n)
    before = _stats("copy_")
    dst = torch.empty(110, device=DEV)
    src = torch.randn(1, device=DEV).expand(110)  # stride 0: another class
    dst.copy_(src)
    assert torch.equal(dst, src)
    base = torch.randn(230, device=DEV)
    expected = base[115:225].clone()
    base[:110].copy_(base[115:225])  # source and destination in one storage: another class
    assert torch.equal(base[:110], expected) and torch.equal(base[115:225], expected)
    after = _stats("copy_")
    assert after["generic"] == before["generic"] and after["miss"] >= before["miss"] + 2  # neither served generic


def test_offsets_and_index_tensors_across_sizes():
    from flaggems.binding import native_scope

    for n in (100, 120, 99, 111, 70):  # n + 3 <= 128: the memory spanned stays in one bucket
        _copy(n, offset=3)  # 12 bytes from a 16-byte boundary at every size: one class
        x = torch.randn(n, 5, device=DEV)
        index = torch.randint(0, n, (2 * n,), device=DEV)[1::2]  # strided index tensor, length n
        out = torch.index_select(x, 0, index)
        with native_scope():
            expected = torch.index_select(x, 0, index)
        assert torch.equal(out, expected) and out.stride() == expected.stride()
    assert _stats("copy_")["generic"] == 2


def test_threads_served_by_generic_plans_get_their_own_sizes():
    for n in (100, 120, 99):
        _copy(n)
    errors = []

    def work(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        try:
            for _ in range(30):
                _copy(int(torch.randint(65, 129, (1,), generator=generator)))
        except Exception as exc:  # noqa: BLE001 - any error in a thread fails the test below
            errors.append(exc)

    in_threads(work, 4)
    assert not errors and _stats("copy_")["generic"] > 0


def test_a_generic_plan_gives_what_the_planner_records_at_a_held_out_size(monkeypatch):
    """The generic plan of three ``_to_copy`` calls, instantiated for a fourth size, equals the replay the
    planner records for that size (every plan dropped first, so it is recorded again)."""
    made, recorded = {}, {}
    real = generalize.Points.add

    def add(self, layout, inputs, plan):
        generic = real(self, layout, inputs, plan)
        recorded[tuple(inputs[0].shape)] = (generalize.atoms(inputs), plan)
        if generic is not None:
            made.setdefault("plan", generic)  # the first: fitted on the three sizes before the held-out one
        return generic

    monkeypatch.setattr(generalize.Points, "add", add)
    for n in (101, 121, 99):
        torch.randn(3, n, 8, dtype=torch.bfloat16, device=DEV).to(torch.float32)
    assert "plan" in made
    RUNTIME._binding.clear_plans()  # the exact and generic plans: the next call is recorded
    torch.randn(3, 113, 8, dtype=torch.bfloat16, device=DEV).to(torch.float32)
    atoms, plan = recorded[(3, 113, 8)]
    assert generalize.instantiate(made["plan"].plan, atoms) == plan


def test_the_entry_computes_the_same_atoms_as_python():
    from flaggems import compiled

    module = compiled.loaded()
    tensors = [torch.randn(2, 3, 4, 5, device=DEV), torch.randn(7, device=DEV)[2:], torch.randn(3, 4, device=DEV).t(),
               torch.tensor(1.0), torch.randn(4, 1, 6, device=DEV).expand(4, 5, 6), torch.empty(0, 3, device=DEV)]
    assert tuple(module.call_atoms(tensors)) == generalize.atoms(tensors)


# -- the generaliser alone -----------------------------------------------------------------------------------

def _replay(*ints: int, function: int = 1) -> plans.Replay:
    step = plans.CudaStep("cuda", function, (ints[0], 1, 1), 128, 0, False, False,
                          (plans.pointer(plans.INPUT, 0, 0), plans.const(4, ints[1])), (ints[1],))
    return plans.Replay("replay", (plans.Allocation((ints[1],), (1,), torch.float32),), (step,),
                        (plans.TensorRef(plans.ALLOCATION, 0, True, (), (), 0),))


def _point(n: int, *ints: int, function: int = 1):
    return generalize.atoms([torch.empty(n)]), _replay(*ints, function=function)


def test_grid_and_sizes_become_expressions_of_the_atoms():
    made = generalize.generalize([_point(1000, 4, 1000), _point(1100, 5, 1100), _point(1800, 8, 1800)])
    assert made is not None
    step = made.plan.steps[0]
    assert step.grid[0] == plans.sym(0, 1, 0, 256, -1)  # cdiv(n, 256); a grid is not specialised on
    assert step.params[1].bits.atom == 0 and step.params[1].bits.cls == plans.int_class(1000)
    assert made.plan.allocations[0].sizes[0].cls == -1  # no kernel receives it: no class guard


def test_different_kernels_do_not_generalise():
    assert generalize.generalize([_point(1000, 4, 1000), _point(1500, 6, 1500),
                                  _point(1800, 8, 1800, function=2)]) is None


def test_a_value_no_atom_explains_does_not_generalise():
    assert generalize.generalize([_point(1000, 4, 1000), _point(1500, 6, 1500), _point(1800, 8, 1801)]) is None


def _admits_n(made: plans.GenericPlan, n: int) -> bool:
    """``admits`` and the entry's check of the kernel argument's class properties, for ``torch.empty(n)``."""
    bits = made.plan.steps[0].params[1].bits
    required = bits.cls
    return generalize.admits(made, generalize.atoms([torch.empty(n)])) and (
        plans.int_class(n) & required) == required


def test_a_kernel_argument_keeps_the_class_properties_every_point_had():
    """Points that were all multiples of 16 (a kernel compiled or chosen for that) serve multiples of 16 only;
    points of which some were not make a plan that does not rely on it, and serves both."""
    aligned = generalize.generalize([_point(1008, 4, 1008), _point(1120, 5, 1120), _point(1296, 6, 1296)])
    assert aligned is not None and aligned.plan.steps[0].params[1].bits.cls == plans.int_class(1024)
    assert _admits_n(aligned, 1040) and not _admits_n(aligned, 1041)
    mixed = generalize.generalize([_point(1000, 4, 1000), _point(1100, 5, 1100), _point(1024, 4, 1024)])
    assert mixed is not None and mixed.plan.steps[0].params[1].bits.cls == plans.int_class(1001)
    assert _admits_n(mixed, 1040) and _admits_n(mixed, 1041)


def test_two_groups_that_both_explain_a_value_must_stay_equal():
    """A value that is the first input's size and the second's minus 10 at every point (sizes that vary
    independently, like a row length and its padded stride): the plan takes the first and guards that both
    stay equal; a call where they differ plans again."""
    def point(a: int, b: int):
        return generalize.atoms([torch.empty(a), torch.empty(b)]), _replay(1, a)

    made = generalize.generalize([point(10, 20), point(12, 22), point(15, 25)])
    assert made is not None and made.plan.steps[0].ints[0].atom == 0
    assert made.agree == ((plans.sym(0, 1, 0, 1, -1), plans.sym(4, 1, -10, 1, -1)),)
    assert generalize.admits(made, generalize.atoms([torch.empty(14), torch.empty(24)]))
    assert not generalize.admits(made, generalize.atoms([torch.empty(14), torch.empty(25)]))


def test_a_grid_of_rows_times_blocks_is_not_taken_for_one_division():
    """A launcher's ``2 * cdiv(n, 1024)`` (two rows of column blocks) equals ``cdiv(n, 512)`` wherever n mod 1024
    is above 512 or 0, so three such points fit both; they differ for the rest (the H200 kit's
    repeat_interleave of a [1, 203137] row, fitted on such points, left the last 385 elements unwritten).
    No generic plan until a point tells them apart."""
    def point(n):
        return generalize.atoms([torch.empty(n)]), _replay(2 * generalize._cdiv(n, 1024), n)

    assert generalize.generalize([point(n) for n in (246402, 237157, 239000)]) is None
    assert generalize.generalize([point(n) for n in (246402, 237157, 255008)]) is None  # fits no one division


def test_a_division_exact_at_every_point_stays_exact():
    """``silu_mul`` launched ``n / 512`` programs of a maskless 512-element block for n = 2 x L x 128 at three
    even L; an odd L gets a masked 256-element block from the planner. A plan fitted on the even points
    (grid ``cdiv(L, 2)``) once served L = 427 with the maskless kernel and wrote 256 elements past the
    output: the plan serves even L only."""
    def point(rows):
        return generalize.atoms([torch.empty(2, rows, 128)]), _replay(rows // 2, 256 * rows)

    made = generalize.generalize([point(rows) for rows in (330, 450, 394)])
    assert made is not None and made.aligned == ((1, 2),)  # atom 1: L
    assert made.plan.steps[0].grid[0] == plans.sym(1, 1, 0, 2, -1)
    assert all(generalize.admits(made, generalize.atoms([torch.empty(2, rows, 128)])) for rows in (258, 300, 510))
    assert not any(generalize.admits(made, generalize.atoms([torch.empty(2, rows, 128)])) for rows in (427, 301))


def test_a_grid_equal_at_every_point_keeps_the_step_of_a_size_the_plan_computes():
    """``repeat_interleave(x, 3)`` of n elements: 3n outputs in tiles of 4096, so 7 programs at n = 9012, 9228
    and 9536 (3n up to 28672), 8 at n = 10885. No atom steps there, the output's 3n does: the plan keeps
    ``cdiv(3n, 4096) == 7``. Before that guard it served 10885 with 7 programs and left the last 3983 outputs
    unwritten (the CPU kit, seed 500, hygon and generic alike)."""
    def point(n):
        return generalize.atoms([torch.empty(n)]), _replay(7, 3 * n)

    made = generalize.generalize([point(n) for n in (9012, 9228, 9536)])
    assert made is not None and made.plan.steps[0].grid[0] == 7
    assert (plans.sym(0, 3, 0, 4096, -1), 7) in made.steady
    assert generalize.admits(made, generalize.atoms([torch.empty(9300)]))
    assert not generalize.admits(made, generalize.atoms([torch.empty(10885)]))


def test_repeat_interleave_of_a_size_past_the_points_tiles_plans_again(compiled_for):
    """The entry end to end, the kit's sweep: four sizes whose outputs fill 7 tiles, then one that needs 8."""
    from flaggems.binding import native_scope

    compiled_for(["repeat_interleave.self_int"])
    for n in (9909, 9012, 9228, 9536, 10885):
        x = torch.randint(-100, 100, (n,), dtype=torch.int32, device=DEV)
        got = torch.repeat_interleave(x, 3)
        with native_scope():
            assert torch.equal(got, torch.repeat_interleave(x, 3))


def test_an_exact_division_keeps_the_points_alignment_up_to_16():
    """Points that are all multiples of 16 also fit ``8 * cdiv(L, 16)``, equal to ``cdiv(L, 2)`` on multiples
    of 16 only: the plan serves those."""
    def point(rows):
        return generalize.atoms([torch.empty(rows)]), _replay(rows // 2, rows)

    made = generalize.generalize([point(rows) for rows in (272, 400, 496)])
    assert made is not None and made.aligned == ((0, 16),)
    assert generalize.admits(made, generalize.atoms([torch.empty(288)]))
    assert not generalize.admits(made, generalize.atoms([torch.empty(290)]))


def test_rows_times_blocks_equal_at_every_point_keep_their_blocks():
    """A grid of 18 rows times ``cdiv(n, 512)`` blocks that is 180 at every point stays 180 only while
    ``cdiv(n, 512)`` stays 10."""
    made = generalize.generalize([_point(n, 180, n) for n in (4700, 4777, 4860)])
    assert made is not None and made.plan.steps[0].grid[0] == 180
    assert not generalize.admits(made, generalize.atoms([torch.empty(5121)]))
    assert generalize.admits(made, generalize.atoms([torch.empty(5000)]))


def test_two_points_are_not_enough():
    """``cdiv(n, 4)`` at 100 and 101 is 25 and 26, which ``n - 75`` also gives: a third point decides."""
    def point(n):
        return generalize.atoms([torch.empty(n)]), _replay(1, generalize._cdiv(n, 4))

    assert generalize.generalize([point(100), point(101)]) is None
    made = generalize.generalize([point(100), point(101), point(117)])
    assert made.plan.allocations[0].sizes[0] == plans.sym(0, 1, 0, 4, -1)


def test_an_integer_equal_at_every_point_keeps_its_value_under_a_guard():
    """Three sizes in (10240, 11264] all launch ``cdiv(n, 1024) == 11`` programs: the grid looks constant. The
    generic plan keeps 11 only while ``cdiv(n, 1024)`` is 11 (n = 11265 needs 12: it plans again)."""
    made = generalize.generalize([_point(n, 11, n) for n in (10600, 10607, 10614)])
    assert made is not None and made.plan.steps[0].grid[0] == 11
    assert (plans.sym(0, 1, 0, 1024, -1), 11) in made.steady
    assert generalize.admits(made, generalize.atoms([torch.empty(11264)]))
    assert not generalize.admits(made, generalize.atoms([torch.empty(11265)]))
    assert not generalize.admits(made, generalize.atoms([torch.empty(10240)]))


def test_copies_across_a_grid_step_inside_one_bucket():
    """Sizes in (2048, 4096] step over 3072, where a 1024-element block's grid goes from 3 to 4 programs
    (a plan that kept the grid of its first points dropped the last elements)."""
    for n in range(3000, 3160, 7):
        _copy(n)
    stats = _stats("copy_")
    assert stats["generic"] > 0


def test_points_of_another_kernel_gather_on_their_own():
    """A multiple of 16 compiles another Triton specialisation of the kernel (another function): those points
    are kept apart from the others', so both kernels get a generic plan, the specialised one for multiples of
    16 only."""
    points = generalize.Points()
    layout = (1, 2, 3)
    made = {}
    for n in (1001, 1003, 1008, 1005, 1007, 1024, 1009, 1011, 1040):
        g = points.add(layout, [torch.empty(n)], _replay(generalize._cdiv(n, 256), n, function=1 + (n % 16 == 0)))
        if g is not None:
            made[g.plan.steps[0].function] = g.plan.steps[0].params[1].bits.cls
    assert made == {1: plans.int_class(1001), 2: plans.int_class(1024)}


def test_plans_survive_disable_and_enable_with_the_same_routes():
    """``disable()`` then ``enable()`` with the same routes and settings serves with the plans made before
    (no miss); a kernel-context reset (new tuning or flags) drops them."""
    from flaggems.toolkit import context

    for n in (100, 120, 97):
        _copy(n)
    misses = _stats("copy_")["miss"]
    flaggems.disable()
    flaggems.enable(include=["copy_", "_to_copy", "index_select"])
    for n in (100, 120, 97, 111):  # three exact plans and one size of their generic plan
        _copy(n)
    assert _stats("copy_")["miss"] == misses
    flaggems.disable()
    context.reset()
    flaggems.enable(include=["copy_", "_to_copy", "index_select"])
    _copy(100)
    assert _stats("copy_")["miss"] == 1


def _silu_mul_at(shape: tuple[int, ...]) -> None:
    """One ``flaggems::silu_mul`` call of bf16 ``shape``, compared with torch's two ops."""
    from flaggems.binding import native_scope

    gate = torch.randn(*shape, device=DEV, dtype=torch.bfloat16)
    up = torch.randn(*shape, device=DEV, dtype=torch.bfloat16)
    out = torch.ops.flaggems.silu_mul(gate, up)
    with native_scope():
        expected = (torch.nn.functional.silu(gate.float()) * up.float()).bfloat16()
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=2**-7)


def _silu_mul_stats() -> dict:
    stats = [s for k, s in RUNTIME.plan_stats().items() if k.startswith("flaggems::silu_mul@")]
    return {name: sum(s[name] for s in stats) for name in ("miss", "generic")}


def test_a_fused_op_planned_at_even_sizes_serves_odd_ones_in_bounds(compiled_for):
    """``silu_mul`` of ``[2, 1, L, 640]`` (640 takes no maskless column tile: the operands stay one flat
    dimension): L of 2 mod 4 launch a maskless 512-element block, odd L a masked 256-element one. Three even sizes
    first, then odd ones: a plan fitted on the even ones wrote 256 elements past an odd size's output (heap
    corruption on the CPU). Every result equals torch's."""
    compiled_for(["flaggems::silu_mul"])
    for rows in (330, 398, 394, 327, 333, 362, 401, 378):  # 2 * L * 640 elements: one numel bucket
        _silu_mul_at((2, 1, rows, 640))
    assert _silu_mul_stats()["generic"] == 2  # 362 and 378 (even) from the even sizes' plan; odd ones miss


def test_a_host_choice_on_a_sizes_alignment_keeps_its_plans_apart(compiled_for):
    """``silu_mul`` of ``[n]``: the launcher hints ``n % 16 == 0`` to the kernel (``ALIGNED``) where it holds.
    A plan fitted on multiples of 16 must not serve n = 4170 (the CPU kit stress found the last elements wrong
    when integers the kernel does not specialise on lost their class guard)."""
    compiled_for(["flaggems::silu_mul"])
    for n in (4112, 4144, 4176, 4208, 4170, 4240, 4186):
        _silu_mul_at((n,))
    assert _silu_mul_stats()["generic"] >= 1


def test_a_fused_op_of_a_new_prompt_length_is_served_by_a_generic_plan(compiled_for):
    """``silu_mul`` of ``[2, L, 256]`` (an MLP's activations at prompt length L): the operands are rows of the
    256 columns, whose tile does not depend on L, so after three lengths every new one replays a generic plan.
    Seen flat, ``2 * L * 256`` elements took a tile set by L's factors of two: 5 of these 7 lengths missed."""
    compiled_for(["flaggems::silu_mul"])
    for length in (237, 178, 226, 242, 182, 134, 199):
        _silu_mul_at((2, length, 256))
    assert _silu_mul_stats() == {"miss": 3, "generic": 4}


def test_rotary_of_a_new_length_is_served_by_a_generic_plan(compiled_for):
    """GQA rotary (q with 4 heads, k with 2) at lengths of one bucket: once three lengths planned, the next
    ones come from a generic plan, and every result equals the reference. The grid used to be the sum of
    both sides' block counts, which no plan expression computes: every new length missed."""
    from flaggems import ops
    from flaggems.binding import native_scope

    compiled_for(["flaggems::rotary_embedding"])
    for length in (237, 179, 227, 243, 183, 135, 199):  # odd: 8 * L rows keep one class
        q = torch.randn(2, 4, length, 16, device=DEV)
        k = torch.randn(2, 2, length, 16, device=DEV)
        cos, sin = torch.randn(2, length, 16, device=DEV), torch.randn(2, length, 16, device=DEV)
        got = torch.ops.flaggems.rotary_embedding(q, k, cos, sin)
        with native_scope():
            want = ops.rotary_embedding(q, k, cos, sin)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    stats = [s for key, s in RUNTIME.plan_stats().items() if key.startswith("flaggems::rotary_embedding@")]
    assert sum(s["generic"] for s in stats) >= 3, stats


def _generic_counts(op: str) -> dict[str, int]:
    """Calls served by generic plans per entry of ``op``: its forward (an Autograd key) and its backward op."""
    counts: dict[str, int] = {}
    for key, s in RUNTIME.plan_stats().items():
        if key.startswith(f"flaggems::{op}"):
            counts[key.split("@")[0]] = counts.get(key.split("@")[0], 0) + s["generic"]
    return counts


#: Ten prompt lengths of one bucket, odd (so the kernels' integers keep one class: ``8 * L`` rows of
#: rotary's q is a multiple of 16 for every even L): three plan the forward (through Python's autograd
#: node), the next three plan the backward op (now reached through the replayed node), the rest are
#: generic for both.
LENGTHS = (237, 179, 227, 243, 183, 135, 199, 211, 157, 229)


def test_a_training_call_of_a_new_length_is_served_by_generic_autograd_plans(compiled_for):
    """``silu_mul`` of ``[2, L, 256]`` inputs that require grad: after three lengths, the forward's autograd plan
    (the node and its forward's launches) and the backward op both come from generic plans, and the gradients
    equal torch's. The backward used to take the output's strides as an ``int[]``: every length missed both."""
    from flaggems.binding import native_scope

    compiled_for(["flaggems::silu_mul"])
    for length in LENGTHS:
        gate, up = (torch.randn(2, length, 256, device=DEV, requires_grad=True) for _ in range(2))
        dy = torch.randn(2, length, 256, device=DEV)
        got = torch.autograd.grad(torch.ops.flaggems.silu_mul(gate, up), (gate, up), dy)
        with native_scope():
            want = torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), dy)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert _generic_counts("silu_mul") == {"flaggems::silu_mul": 7, "flaggems::silu_mul_backward": 4}


def test_rotary_training_of_a_new_length_keeps_the_gradients_layouts(compiled_for):
    """Rotary of transposed ``[2, L, H, 16]`` projections that require grad, as transformers calls it: the
    backward lays ``dq``/``dk`` out as the forward's outputs from a size-free layout code, so one autograd plan
    and one backward plan serve every length; values equal the reference's, and the projections' gradients
    are laid out like them (the documented layout: a transposed ``q`` gets a transposed ``dq``)."""
    from flaggems import ops
    from flaggems.binding import native_scope

    compiled_for(["flaggems::rotary_embedding"])
    for length in LENGTHS:
        q = torch.randn(2, length, 4, 16, device=DEV, requires_grad=True)
        k = torch.randn(2, length, 2, 16, device=DEV, requires_grad=True)
        cos, sin = torch.randn(2, length, 16, device=DEV), torch.randn(2, length, 16, device=DEV)
        dq, dk = torch.randn(2, 4, length, 16, device=DEV), torch.randn(2, 2, length, 16, device=DEV)
        outs = torch.ops.flaggems.rotary_embedding(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        got = torch.autograd.grad(outs, (q, k), (dq, dk))
        with native_scope():
            want = torch.autograd.grad(ops.rotary_embedding(q.transpose(1, 2), k.transpose(1, 2), cos, sin),
                                       (q, k), (dq, dk))
        for g, w, x in zip(got, want, (q, k), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            assert g.stride() == x.stride()
    assert _generic_counts("rotary_embedding") == {"flaggems::rotary_embedding": 7,
                                                   "flaggems::rotary_embedding_backward": 4}
