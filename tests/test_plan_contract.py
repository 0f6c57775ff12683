"""The plan contract: the compiled entry reads every plan record's fields where ``flaggems.toolkit.plans`` says.

``plans.field_layout()`` and ``plans.TAGS`` are handed to the entry when it loads (``set_layout``); its
parsers read no position of their own. Checked here: the layout the entry holds is Python's; records whose
fields are reordered in Python (with the layout that says so) parse, replay and generalise as before; a
layout without a field the entry reads is refused, naming it. ``describe_plan`` (the entry's parse without a
launch) checks the CUDA driver-launch form (``CudaStep``, ``Pointer``, ``Const``, ``NULL_ARG``), which only
replays on a CUDA device, on any machine, against the values each record says.
"""

from __future__ import annotations

import collections
import struct
from typing import Any

import pytest
import torch

import flaggems
from flaggems import binding, compiled, planner
from flaggems.runtime import RUNTIME
from flaggems.toolkit import plans
from flaggems.toolkit.plans import ALLOCATION, INPUT, NULL_ARG, PINNED, const, fconst, pointer, sym

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def entry(monkeypatch):
    """The compiled module, with Python's layout in force again after the test."""
    monkeypatch.setenv("FLAGGEMS_ENTRY", "compiled")
    compiled.reset()
    module = compiled.load()[0]
    if module is None:
        pytest.skip("the compiled entry cannot be built here")
    yield module
    module.set_layout(plans.field_layout(), plans.TAGS)
    compiled.reset()


# ---------------------------------------------------------------- reordered records
def _reordered(order: str) -> dict[type, type]:
    """Each record of plans.RECORDS and a stand-in with its fields reordered: ``reversed`` (the tags move
    too), or ``swapped`` (its last two fields exchanged)."""
    out = {}
    for name, record in plans.RECORDS.items():
        fields = list(record._fields)
        if order == "reversed":
            fields.reverse()
        elif len(fields) >= 2:
            fields[-2], fields[-1] = fields[-1], fields[-2]
        out[record] = collections.namedtuple(f"{order.title()}{name}", fields)
    return out


def _layout_of(into: dict[type, type]) -> dict[str, dict[str, int]]:
    return plans.layout_of({real.__name__: stand_in for real, stand_in in into.items()})


def _convert(value: Any, into: dict[type, type]) -> Any:
    """``value`` with every record rebuilt as its stand-in in ``into``, field by field (by name); a
    PythonStep's plain ``(position, ref)`` slot pairs (the recording's) become TensorSlot records first."""
    kind = type(value)
    if kind is plans.PythonStep:
        value = value._replace(slots=tuple(plans.TensorSlot(*slot) for slot in value.slots))
    if kind in into:
        return into[kind](**{field: _convert(getattr(value, field), into) for field in value._fields})
    if kind is tuple:
        return tuple(_convert(item, into) for item in value)
    return value


# ---------------------------------------------------------------- the layout
def test_the_entry_holds_the_layout_plans_defines(entry):
    """Every field of every record is read by the entry (its layout lists the fields it reads), where
    plans.py puts it, and the tags are plans.TAGS."""
    fields, tags = entry.layout()
    assert fields == plans.field_layout()
    assert tags == plans.TAGS
    assert set(fields) == set(plans.RECORDS)
    assert fields["CudaStep"] == {name: i for i, name in enumerate(plans.CudaStep._fields)}


def test_the_records_carry_the_tags_the_entry_reads():
    assert plans.pointer(INPUT, 0, 0).kind == plans.TAGS["pointer"]
    assert plans.const(4, 1).kind == plans.TAGS["const"] and plans.fconst(4, 1).kind == plans.TAGS["float"]
    assert plans.sym(0, 1, 0, 1, -1).kind == plans.TAGS["sym"]
    assert (plans.NATIVE_PLAN.kind, plans.PYTHON_PLAN.kind, NULL_ARG.kind) == (
        plans.TAGS["native"], plans.TAGS["python"], plans.TAGS["null"])


@pytest.mark.parametrize("record, field", [
    ("TensorRef", "sizes"), ("CudaStep", "ints"), ("Pointer", "offset"), ("Sym", "cls"), ("Answer", "generic"),
    ("TensorSlot", "ref"), ("BackwardArg", "value"), ("Agree", "second"), ("PinnedReplay", "stream"),
])
def test_a_layout_without_a_field_the_entry_reads_is_refused_naming_it(entry, record, field):
    layout = plans.field_layout()
    kept = [name for name in layout[record] if name != field]
    layout[record] = {name: i for i, name in enumerate(kept)}
    with pytest.raises(RuntimeError, match=f"plan layout's {record} has no field '{field}'"):
        entry.set_layout(layout, plans.TAGS)
    assert entry.layout() == (plans.field_layout(), plans.TAGS)  # the layout in force stays


def test_a_layout_without_a_record_or_a_tag_or_badly_numbered_is_refused(entry):
    layout = plans.field_layout()
    del layout["Steady"]
    with pytest.raises(RuntimeError, match="plan layout has no record Steady"):
        entry.set_layout(layout, plans.TAGS)
    tags = dict(plans.TAGS)
    del tags["null"]
    with pytest.raises(RuntimeError, match="plan layout has no tag 'null'"):
        entry.set_layout(plans.field_layout(), tags)
    layout = plans.field_layout()
    layout["Const"] = {"kind": 0, "size": 1, "bits": 1}
    with pytest.raises(RuntimeError, match="Const must number its 3 fields 0..2 once each"):
        entry.set_layout(layout, plans.TAGS)
    layout = plans.field_layout()
    layout["PinnedReplay"] = dict(layout["Replay"], pinned=4, stream=5)
    layout["Replay"] = dict(layout["Replay"], pinned=4, stream=5)
    with pytest.raises(RuntimeError, match="PinnedReplay must have more fields than its Replay"):
        entry.set_layout(layout, plans.TAGS)
    assert entry.layout() == (plans.field_layout(), plans.TAGS)


def test_a_layout_with_a_field_the_entry_does_not_read_is_taken(entry):
    """A field added in Python: the entry reads the others where they now are, and a record's length is
    the layout's."""
    layout = plans.field_layout()
    layout["TensorRef"] = {"note": 0, **{name: i + 1 for name, i in layout["TensorRef"].items()}}
    entry.set_layout(layout, plans.TAGS)
    ref = ("a new field", ALLOCATION, 0, False, (2,), (1,), 3)
    described = entry.describe_plan(plans.Replay("replay", (), (), (ref,)))
    assert described["returns"] == ((ALLOCATION, 0, False, (2,), (1,), 3),)
    assert entry.layout()[0]["TensorRef"] == {name: i + 1 for i, name in enumerate(plans.TensorRef._fields)}


# ---------------------------------------------------------------- the CUDA driver-launch form, described
FUNCTION = 0x7F00_DEAD_BEE0
F32 = int.from_bytes(struct.pack("<f", 1.5), "little")
F64 = int.from_bytes(struct.pack("<d", -2.25), "little", signed=True)


def _launcher(grid, *args):  # a PythonStep's launcher (never called: described only)
    raise AssertionError("described plans launch nothing")


def _cuda_params() -> tuple:
    return (pointer(INPUT, 0, 0), pointer(ALLOCATION, 1, 48), pointer(INPUT, 1, -8), const(4, 7), const(8, -5),
            const(1, 1), const(8, 2**62), fconst(4, F32), fconst(8, F64), NULL_ARG, NULL_ARG)


#: What the entry parses each of _cuda_params() into: (kind, source, index, size, value).
CUDA_PARAMS = (("pointer", INPUT, 0, 8, 0), ("pointer", ALLOCATION, 1, 8, 48), ("pointer", INPUT, 1, 8, -8),
               ("constant", 0, 0, 4, 7), ("constant", 0, 0, 8, -5), ("constant", 0, 0, 1, 1),
               ("constant", 0, 0, 8, 2**62), ("constant", 0, 0, 4, F32), ("constant", 0, 0, 8, F64),
               ("null", 0, 0, 8, 0), ("null", 0, 0, 8, 0))


def _replay() -> plans.Replay:
    """Two driver launches (every parameter form, both launch flags) and a Python launch."""
    steps = (
        plans.CudaStep("cuda", FUNCTION, (65535, 3, 2), 256, 49152, True, False, _cuda_params(), (7, 1)),
        plans.CudaStep("cuda", FUNCTION + 64, (1, 1, 1), 32, 0, False, True, ()),
        plans.PythonStep("python", _launcher, (4,), (None, 5, 2.0, None),
                         (plans.TensorSlot(0, plans.TensorRef(INPUT, 0, True, (), (), 0)),
                          plans.TensorSlot(3, plans.TensorRef(ALLOCATION, 0, False, (2, 3), (3, 1), 4)))),
    )
    allocations = (plans.Allocation((4, 8), (8, 1), torch.float16), plans.Allocation((16,), (1,), torch.int32))
    returns = (plans.TensorRef(ALLOCATION, 0, True, (), (), 0), None,
               plans.TensorRef(INPUT, 1, False, (2, 2), (1, 2), 3))
    return plans.Replay("replay", allocations, steps, returns)


REPLAY = {
    "kind": "replay",
    "allocs": (((4, 8), (8, 1), torch.float16), ((16,), (1,), torch.int32)),
    "steps": (
        {"kind": "cuda", "function": FUNCTION, "grid": (65535, 3, 2), "block": 256, "shared": 49152, "pdl": True,
         "cooperative": False, "params": CUDA_PARAMS},
        {"kind": "cuda", "function": FUNCTION + 64, "grid": (1, 1, 1), "block": 32, "shared": 0, "pdl": False,
         "cooperative": True, "params": ()},
        {"kind": "python", "launcher": _launcher, "grid": (4,), "args": (None, 5, 2.0, None),
         "slots": ((0, (INPUT, 0, True, (), (), 0)), (3, (ALLOCATION, 0, False, (2, 3), (3, 1), 4)))},
    ),
    "returns": ((ALLOCATION, 0, True, (), (), 0), (INPUT, -1, True, (), (), 0), (INPUT, 1, False, (2, 2), (1, 2), 3)),
    "pinned": (),
    "stream": 0,
    "python_steps": True,
}


def test_a_cuda_replay_parses_into_the_launches_its_records_say(entry):
    assert entry.describe_plan(_replay()) == REPLAY


def test_a_cuda_step_built_without_ints_and_plain_tuples_parse_alike(entry):
    """The records are tuples to the entry: a plain tuple of the same fields parses the same; a CudaStep
    of eight fields (no ``ints``) too."""
    replay = _replay()
    first = replay.steps[0]
    plain = ("replay", tuple(tuple(a) for a in replay.allocations),
             (tuple(first)[:8], tuple(replay.steps[1]), replay.steps[2]._replace(slots=tuple(
                 tuple(s) for s in replay.steps[2].slots))),
             tuple(None if r is None else tuple(r) for r in replay.returns))
    assert entry.describe_plan(plain) == REPLAY


def test_a_pinned_replay_keeps_its_state_and_stream(entry):
    state = torch.zeros(4, dtype=torch.int32)
    step = plans.CudaStep("cuda", FUNCTION, (8, 1, 1), 128, 0, False, False,
                          (pointer(PINNED, 0, 4), pointer(INPUT, 0, 0), const(4, 3)))
    plan = plans.PinnedReplay("replay", (), (step,), (plans.TensorRef(INPUT, 0, True, (), (), 0),), (state,), 77)
    described = entry.describe_plan(plan)
    assert described["steps"][0]["params"] == (("pointer", PINNED, 0, 8, 4), ("pointer", INPUT, 0, 8, 0),
                                               ("constant", 0, 0, 4, 3))
    assert described["stream"] == 77 and described["python_steps"] is False
    assert len(described["pinned"]) == 1 and described["pinned"][0].data_ptr() == state.data_ptr()


def test_native_and_python_plans(entry):
    assert entry.describe_plan(plans.NATIVE_PLAN) == {"kind": "native"}
    assert entry.describe_plan(plans.NATIVE_PLAN, routed=False) == {"kind": "python"}  # a backward op's
    assert entry.describe_plan(plans.PYTHON_PLAN) == {"kind": "python"}
    assert entry.describe_plan(("native",)) == {"kind": "native"}


def _step(params=(), grid=(1, 1, 1), **changes) -> plans.CudaStep:
    return plans.CudaStep("cuda", FUNCTION, grid, 32, 0, False, False, params)._replace(**changes)


@pytest.mark.parametrize("plan, message", [
    (plans.Replay("replay", (), (_step(tuple(const(4, i) for i in range(65))),), ()), "more than 64 kernel"),
    (plans.Replay("replay", (), (_step((pointer(INPUT, 0, 0), ("bogus", 4, 1))),), ()),
     "kernel parameter 1 is no Pointer, Const or NULL_ARG"),
    (plans.Replay("replay", (), (("bogus", 1),), ()), "step 0 is no CudaStep or PythonStep"),
    (("bogus",), "unknown plan kind"),
    (("replay", "not a plan"), "a replay has 4 fields"),
    (plans.Replay("replay", (plans.Allocation((4,), (1,), "float32"),), (), ()), "allocation dtype"),
    (plans.PinnedReplay("replay", (), (), (), ("not a tensor",), 0), "pinned state buffer must be a tensor"),
])
def test_malformed_cuda_plans_are_refused(entry, plan, message):
    with pytest.raises(RuntimeError, match=message):
        entry.describe_plan(plan)


def test_a_sym_outside_a_generic_plan_is_refused(entry):
    with pytest.raises(RuntimeError):
        entry.describe_plan(plans.Replay("replay", (), (_step(grid=(sym(0, 1, 0, 1, -1), 1, 1)),), ()))


# A generic plan over one 1-D input: atoms (n, stride, offset, numel).
def _generic() -> plans.GenericPlan:
    n = sym(0, 1, 0, 1, -1)
    params = (pointer(INPUT, 0, 0), pointer(ALLOCATION, 0, sym(0, 4, 0, 1, -1)), const(4, sym(0, 1, 0, 1, 4)),
              const(8, sym(0, 2, 1, 1, -1)), fconst(4, F32), const(4, 9), NULL_ARG)
    step = plans.CudaStep("cuda", FUNCTION, (sym(0, 1, 0, 1024, -1), 2, 1), 128, 256, True, True, params,
                          (sym(0, 1, 0, 1, 4), 1))
    replay = plans.Replay("replay", (plans.Allocation((n,), (1,), torch.float32),), (step,),
                          (plans.TensorRef(ALLOCATION, 0, False, (sym(0, 1, -1, 1, -1),), (1,), sym(-1, 0, 1, 1, -1)),))
    return plans.GenericPlan("generic", replay, (plans.Pin(1, 1), plans.Pin(2, 0)), (plans.Ratio(3, 1, 0, 1),),
                             (plans.Steady(sym(0, 1, 0, 2048, -1), 1),), (plans.Aligned(0, 4),),
                             (plans.Agree(n, sym(3, 1, 0, 1, -1)),))


def _generic_step(grid: tuple, params: tuple) -> dict:
    return {"kind": "cuda", "function": FUNCTION, "grid": grid, "block": 128, "shared": 256, "pdl": True,
            "cooperative": True, "params": params}


def _generic_params(n: int, doubled: int) -> tuple:
    return (("pointer", INPUT, 0, 8, 0), ("pointer", ALLOCATION, 0, 8, 4 * n), ("constant", 0, 0, 4, n),
            ("constant", 0, 0, 8, doubled), ("constant", 0, 0, 4, F32), ("constant", 0, 0, 4, 9), ("null", 0, 0, 8, 0))


def _generic_replay(n: int, grid0: int, returned: int, offset: int, doubled: int | None = None) -> dict:
    """The generic plan's replay for size ``n`` (the template: every patched integer 0)."""
    return {"kind": "replay", "allocs": (((n,), (1,), torch.float32),),
            "steps": (_generic_step((grid0, 2, 1), _generic_params(n, 2 * n + 1 if doubled is None else doubled)),),
            "returns": ((ALLOCATION, 0, False, (returned,), (1,), offset),), "pinned": (), "stream": 0,
            "python_steps": False}


def test_a_generic_cuda_plan_patches_grid_pointers_and_constants(entry):
    described = entry.describe_plan(_generic(), [1000, 1, 0, 1000])
    assert described["template"] == _generic_replay(0, 0, 0, 0, doubled=0)  # every patched integer holds 0
    assert described["patches"] == (
        ("alloc_size", 0, 0, 0, (0, 1, 0, 1, -1)),
        ("grid", 0, 0, 0, (0, 1, 0, 1024, -1)),
        ("param", 0, 1, 0, (0, 4, 0, 1, -1)),
        ("param", 0, 2, 0, (0, 1, 0, 1, 4)),
        ("param", 0, 3, 0, (0, 2, 1, 1, -1)),
        ("guard", 0, 0, 0, (0, 1, 0, 1, 4)),
        ("return_size", 0, 0, 0, (0, 1, -1, 1, -1)),
        ("return_offset", 0, 0, 0, (-1, 0, 1, 1, -1)),
    )
    assert described["pinned"] == ((1, 1), (2, 0)) and described["ratios"] == ((3, 1, 0, 1),)
    assert described["steady"] == (((0, 1, 0, 2048, -1), 1),) and described["aligned"] == ((0, 4),)
    assert described["agree"] == (((0, 1, 0, 1, -1), (3, 1, 0, 1, -1)),) and described["atoms"] == 4
    assert described["instance"] == _generic_replay(1000, 1, 999, 1)
    assert entry.describe_plan(_generic(), [2000, 1, 0, 2000])["instance"] == _generic_replay(2000, 2, 1999, 1)


@pytest.mark.parametrize("atoms", [
    [1000, 2, 0, 1000],   # a pinned atom changed
    [1000, 1, 0, 1004],   # the ratio (and the agreement) broken
    [4096, 1, 0, 4096],   # cdiv(n, 2048) left 1
    [1002, 1, 0, 1002],   # n no multiple of 4
])
def test_a_generic_cuda_plan_whose_guards_fail_gives_no_instance(entry, atoms):
    assert entry.describe_plan(_generic(), atoms)["instance"] is None


def test_a_generic_plan_naming_atoms_the_call_has_not_is_refused(entry):
    with pytest.raises(RuntimeError, match="bad agree atom"):  # the call's atoms: one tensor of rank 0, 3 atoms
        entry.describe_plan(_generic(), [1000, 1, 0])


def test_a_generic_cuda_plan_guards_its_kernel_integers_classes(entry):
    """A kernel integer every point had as a multiple of 16 (cls bit 2) must stay one; a 64-bit value of a
    32-bit one (bit 4) fails."""
    step = _step((const(4, sym(0, 1, 0, 1, 2)),), ints=(sym(0, 1, 0, 1, 4),))
    plan = plans.GenericPlan("generic", plans.Replay("replay", (), (step,), ()), (), ())
    assert entry.describe_plan(plan, [1008])["instance"]["steps"][0]["params"] == (("constant", 0, 0, 4, 1008),)
    assert entry.describe_plan(plan, [1000])["instance"] is None
    assert entry.describe_plan(plan, [2**36])["instance"] is None


@pytest.mark.parametrize("plan, message", [
    (plans.GenericPlan("generic", plans.Replay("replay", (), (_step(grid=(sym(9, 1, 0, 1, -1), 1, 1)),), ()), (), ()),
     "a sym names an unknown atom"),
    (plans.GenericPlan("generic", plans.Replay("replay", (), (_step(grid=(sym(0, 1, 0, 0, -1), 1, 1)),), ()), (), ()),
     "divisor must be positive"),
    (plans.GenericPlan("generic", plans.PinnedReplay("replay", (), (), (), (), 0), (), ()), "generalises a plain"),
    (plans.GenericPlan("generic", plans.Replay("replay", (), (), ()), (plans.Pin(4, 1),), ()), "bad pinned atom"),
    (plans.GenericPlan("generic", plans.Replay("replay", (), (), ()), (), (), (), ((0, 0),)), "bad aligned atom"),
    (plans.GenericPlan("generic", plans.Replay("replay", (), (), ()), (), (), ((3, 1),)), "a steady guard is a sym"),
])
def test_malformed_generic_cuda_plans_are_refused(entry, plan, message):
    with pytest.raises(RuntimeError, match=message):
        entry.describe_plan(plan, [10, 1, 0, 10])


def test_a_float_constant_is_never_symbolic(entry):
    plan = plans.GenericPlan("generic", plans.Replay("replay", (), (_step((fconst(4, sym(0, 1, 0, 1, -1)),)),), ()),
                             (), ())
    with pytest.raises(RuntimeError):
        entry.describe_plan(plan, [10])


SCHEMA = "flaggems::contract_backward(Tensor grad, Tensor x, bool[] needs, float scale) -> (Tensor, Tensor)"


def _double_backward(*args):
    raise AssertionError("described plans run nothing")


def _autograd(forward: plans.Replay, needs: tuple = plans.BackwardArg("needs")) -> plans.AutogradPlan:
    backward = plans.Backward("flaggems::contract_backward", SCHEMA, _launcher, _double_backward)
    args = (plans.BackwardArg("grad", 0), plans.BackwardArg("saved", 0), needs, plans.BackwardArg("const", 0.5))
    extra = (plans.BackwardArg("saved", 1), plans.BackwardArg("const", None), plans.BackwardArg("const", 3),
             plans.BackwardArg("const", True), plans.BackwardArg("needs"))
    return plans.AutogradPlan("autograd", forward, 1, (0, -1), (plans.Saved(INPUT, 0), plans.Saved(ALLOCATION, 1)),
                              backward, args, _double_backward, extra)


def _autograd_description(forward: dict) -> dict:
    return {"kind": "autograd", "forward": forward, "outputs": 1, "slots": (0, -1),
            "saved": ((INPUT, 0), (ALLOCATION, 1)), "backward": "flaggems::contract_backward",
            "backward_schema": SCHEMA, "backward_entry": _launcher, "backward_planner": _double_backward,
            "args": (("grad", 0, None), ("saved", 0, None), ("needs", 0, None), ("const", 0, 0.5)),
            "double_backward": _double_backward,
            "extra": (("saved", 1, None), ("const", 0, None), ("const", 0, 3), ("const", 0, True), ("needs", 0, None))}


def test_an_autograd_plan_of_cuda_launches_parses_its_node(entry):
    assert entry.describe_plan(_autograd(_replay())) == _autograd_description(REPLAY)
    # flaggems.autograd's own templates are plain tuples: ("needs",) has no value field, and needs none
    assert entry.describe_plan(_autograd(_replay(), needs=("needs",))) == _autograd_description(REPLAY)


def test_a_generic_autograd_plan_patches_its_forward_only(entry):
    generic = _generic()
    plan = generic._replace(plan=_autograd(generic.plan._replace(returns=generic.plan.returns * 2)))
    described = entry.describe_plan(plan, [1000, 1, 0, 1000])
    forward = _generic_replay(1000, 1, 999, 1)
    forward["returns"] *= 2
    assert described["instance"] == _autograd_description(forward)
    assert [p[0] for p in described["patches"]].count("return_size") == 2


def test_an_autograd_plan_must_give_its_backward_every_argument(entry):
    plan = _autograd(_replay())
    with pytest.raises(RuntimeError, match="takes 4 arguments, the plan gives 3"):
        entry.describe_plan(plan._replace(args=plan.args[:3]))
    with pytest.raises(RuntimeError, match="unknown backward argument"):
        entry.describe_plan(plan._replace(extra=(plans.BackwardArg("bogus", 1),)))


# ---------------------------------------------------------------- reordered records parse as before
def _records() -> list[tuple[Any, list[int] | None]]:
    generic = _generic()
    pinned = plans.PinnedReplay("replay", (), (_step((pointer(PINNED, 0, 4),)),), (), (torch.zeros(2),), 5)
    return [(_replay(), None), (pinned, None), (_autograd(_replay()), None), (plans.NATIVE_PLAN, None),
            (plans.PYTHON_PLAN, None), (generic, [1000, 1, 0, 1000]), (generic, [1000, 2, 0, 1000]),
            (generic._replace(plan=_autograd(generic.plan)), [2000, 1, 0, 2000])]


@pytest.mark.parametrize("order", ["reversed", "swapped"])
def test_reordered_records_parse_as_the_records_they_stand_for(entry, order):
    """Every record's fields reordered in Python (and the layout saying so): each plan describes as before;
    the records of plans.py, read through the reordered layout, do not."""
    into = _reordered(order)
    records = _records()
    expected = [_described(entry, record, atoms) for record, atoms in records]
    converted = [(_convert(record, into), atoms) for record, atoms in records]
    assert all(type(c) is not type(r) for (c, _), (r, _) in zip(converted, records))
    entry.set_layout(_layout_of(into), plans.TAGS)
    assert entry.layout()[0] == _layout_of(into)
    for (record, atoms), want in zip(converted, expected):
        assert _described(entry, record, atoms) == want, type(record).__name__
    with pytest.raises((RuntimeError, IndexError, TypeError)):
        entry.describe_plan(_replay())  # a record in plans.py's order is misread now: the layout is what is read


def _described(entry, record, atoms):
    described = entry.describe_plan(record, atoms)
    return _comparable(described)


def _comparable(value):
    """Tensors (pinned state) by identity of their memory."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_comparable(v) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr())
    return value


# ---------------------------------------------------------------- reordered records replay as before
@pytest.fixture
def reversed_plans(entry, monkeypatch):
    """Every planner answers reversed records (its Answer too) and the entry reads the reversed layout."""
    flaggems.disable()
    into = _reordered("reversed")
    real = planner.build_planner

    def build(*args, **kwargs):
        plan = real(*args, **kwargs)

        def reversed_planner(call_args, call_kwargs, inputs, layout=None):
            return _convert(plan(call_args, call_kwargs, inputs, layout), into)

        return reversed_planner

    monkeypatch.setattr(planner, "build_planner", build)
    monkeypatch.setattr(planner, "_BACKWARDS", {})  # backward ops' planners made now answer reversed records
    entry.set_layout(_layout_of(into), plans.TAGS)
    yield entry
    flaggems.disable()
    binding.forget_plans()  # registries whose planners answer reversed records


def _stats(prefix: str) -> dict[str, int]:
    rows = [s for key, s in RUNTIME.plan_stats().items() if key.startswith(prefix)]
    return {name: sum(r[name] for r in rows) for name in ("miss", "replay", "generic", "rejected", "python")}


def test_reversed_records_replay(runtime, reversed_plans):
    from flaggems_fakes.plugins import ReplayNeg

    runtime.manager.register(ReplayNeg(), "replay-neg")
    flaggems.enable()
    x = torch.randn(100, device=flaggems.backend().device_type)
    with binding.native_scope():
        want = -x
    for _ in range(3):
        assert torch.equal(torch.neg(x), want)
    stats = _stats("aten::neg@")
    assert stats["miss"] == 1 and stats["replay"] == 2 and stats["rejected"] == 0 and stats["python"] == 0, stats


def test_reversed_generic_plans_serve_new_sizes(reversed_plans):
    flaggems.enable(include=["copy_"])
    sizes = [100, 120, 97, 111, 126, 65, 125, 77]
    for n in sizes:
        src, dst = torch.randn(n, device=DEV), torch.empty(n, device=DEV)
        dst.copy_(src)
        assert torch.equal(dst, src)
    stats = _stats("aten::copy_@")
    assert stats["miss"] == 3 and stats["generic"] == len(sizes) - 3 and stats["rejected"] == 0, stats


def test_reversed_generic_autograd_plans_serve_training_calls(reversed_plans):
    """silu_mul's autograd plans (node, backward op, saved tensors, backward arguments) and its backward
    op's plans, all generic, from reversed records: gradients equal torch's (as in test_generic_plans)."""
    flaggems.enable(include=["flaggems::silu_mul"])
    for length in (237, 179, 227, 243, 183, 135, 199, 211, 157, 229):
        gate, up = (torch.randn(2, length, 256, device=DEV, requires_grad=True) for _ in range(2))
        dy = torch.randn(2, length, 256, device=DEV)
        got = torch.autograd.grad(torch.ops.flaggems.silu_mul(gate, up), (gate, up), dy)
        with binding.native_scope():
            want = torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), dy)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    forward, backward = _stats("flaggems::silu_mul@"), _stats("flaggems::silu_mul_backward@")
    assert (forward["generic"], backward["generic"]) == (7, 4), (forward, backward)
    assert forward["rejected"] == backward["rejected"] == 0
