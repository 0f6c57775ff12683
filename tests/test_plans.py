"""The plan records' field order is what ``compiled/entry.cpp`` parses by position: pinned here."""

from __future__ import annotations

from flaggems.toolkit import plans

#: Each record's fields, in the order the C++ parser reads them (change both together).
FIELDS = {
    "TensorRef": ("source", "index", "same", "sizes", "strides", "offset"),
    "Allocation": ("sizes", "strides", "dtype"),
    "Const": ("kind", "size", "bits"),
    "Pointer": ("kind", "source", "index", "offset"),
    "CudaStep": ("kind", "function", "grid", "threads", "shared", "pdl", "cooperative", "params", "ints"),
    "Sym": ("kind", "atom", "mul", "add", "div", "cls"),
    "GenericPlan": ("kind", "plan", "pinned", "ratios", "steady", "aligned", "agree"),
    "PythonStep": ("kind", "launcher", "grid", "values", "slots"),
    "Replay": ("kind", "allocations", "steps", "returns"),
    "PinnedReplay": ("kind", "allocations", "steps", "returns", "pinned", "stream"),
    "Backward": ("name", "schema", "entry", "planner"),
    "AutogradPlan": ("kind", "forward", "outputs", "slots", "saved", "backward", "args", "double_backward",
                     "extra"),
}


def test_every_record_keeps_the_field_order_the_entry_parses():
    for name, fields in FIELDS.items():
        assert getattr(plans, name)._fields == fields, name


def test_records_are_plain_tuples_to_the_entry():
    ref = plans.TensorRef(plans.INPUT, 0, True, (), (), 0)
    assert isinstance(ref, tuple) and ref == (0, 0, True, (), (), 0)
    assert plans.const(4, 7) == ("const", 4, 7) and plans.pointer(plans.ALLOCATION, 1, 8) == ("ptr", 1, 1, 8)
    assert plans.NATIVE_PLAN == ("native",) and plans.PYTHON_PLAN == ("python",)
