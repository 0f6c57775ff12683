"""The plan records' field order and tags, pinned.

The compiled entry reads each field where ``plans.field_layout()`` puts it (``tests/test_plan_contract.py``),
so it needs no fixed order; Python still builds records by position in places (``TensorRef(PINNED, index,
...)``, ``Const(kind, size, bits)``), and plans kept across a change must mean the same: a reorder here
changes this test on purpose.
"""

from __future__ import annotations

from flaggems.toolkit import plans

#: Each record's fields, in order.
FIELDS = {
    "Marker": ("kind",),
    "TensorRef": ("source", "index", "same", "sizes", "strides", "offset"),
    "Allocation": ("sizes", "strides", "dtype"),
    "Const": ("kind", "size", "bits"),
    "Pointer": ("kind", "source", "index", "offset"),
    "CudaStep": ("kind", "function", "grid", "threads", "shared", "pdl", "cooperative", "params", "ints"),
    "TensorSlot": ("position", "ref"),
    "Sym": ("kind", "atom", "mul", "add", "div", "cls"),
    "Pin": ("atom", "value"),
    "Ratio": ("atom", "p", "of", "q"),
    "Steady": ("sym", "value"),
    "Aligned": ("atom", "multiple"),
    "Agree": ("first", "second"),
    "GenericPlan": ("kind", "plan", "pinned", "ratios", "steady", "aligned", "agree"),
    "PythonStep": ("kind", "launcher", "grid", "values", "slots"),
    "Replay": ("kind", "allocations", "steps", "returns"),
    "PinnedReplay": ("kind", "allocations", "steps", "returns", "pinned", "stream"),
    "Backward": ("name", "schema", "entry", "planner"),
    "Saved": ("source", "index"),
    "BackwardArg": ("kind", "value"),
    "AutogradPlan": ("kind", "forward", "outputs", "slots", "saved", "backward", "args", "double_backward",
                     "extra"),
    "Answer": ("result", "plan", "generic"),
}

#: The tags records carry, by what they mark.
TAGS = {
    "native": "native", "python": "python", "replay": "replay", "autograd": "autograd", "generic": "generic",
    "cuda": "cuda", "python_step": "python", "pointer": "ptr", "const": "const", "float": "float", "null": "null",
    "sym": "sym", "grad": "grad", "saved": "saved", "arg_const": "const", "needs": "needs",
}


def test_every_record_keeps_its_field_order():
    for name, fields in FIELDS.items():
        assert getattr(plans, name)._fields == fields, name
    assert set(plans.RECORDS) == set(FIELDS)  # every record the entry reads is pinned here


def test_the_layout_is_each_records_field_order():
    layout = plans.field_layout()
    assert layout == {name: {field: i for i, field in enumerate(fields)} for name, fields in FIELDS.items()}


def test_the_tags_are_pinned():
    assert plans.TAGS == TAGS


def test_records_are_plain_tuples_to_the_entry():
    ref = plans.TensorRef(plans.INPUT, 0, True, (), (), 0)
    assert isinstance(ref, tuple) and ref == (0, 0, True, (), (), 0)
    assert plans.const(4, 7) == ("const", 4, 7) and plans.pointer(plans.ALLOCATION, 1, 8) == ("ptr", 1, 1, 8)
    assert plans.NATIVE_PLAN == ("native",) and plans.PYTHON_PLAN == ("python",) and plans.NULL_ARG == ("null",)
    assert plans.Answer(1, plans.NATIVE_PLAN) == (1, ("native",), None)
