"""The plan records the planner hands the compiled entry: one definition of their fields.

Each record is a ``NamedTuple``: the tuple the compiled entry
(``flaggems/compiled/entry.cpp``, ``parse_plan`` and the parsers it calls)
receives is the record itself, and Python code builds and reads it by name.
The entry reads every field at the index :func:`field_layout` gives and tells
records apart by the tags of :data:`TAGS` (both handed over once, when
:mod:`flaggems.compiled` loads the module, ``set_layout``): a field moved or
added here needs no change in C++. A field the entry reads is looked up by
name (``entry_layout.inc``): renaming or removing one fails at load, naming
it; a new field the entry must read is added there. ``tests/test_plans.py`` pins the field
order anyway (plans built before a change must mean the same after), and
``tests/test_plan_contract.py`` checks the entry parses reordered records.

A plan (:func:`flaggems.planner.build_planner`'s answer, an :class:`Answer`)
is one of :data:`NATIVE_PLAN`, :data:`PYTHON_PLAN`, :class:`Replay`,
:class:`PinnedReplay` or :class:`AutogradPlan`, possibly with a
:class:`GenericPlan`; a replay's steps are :class:`CudaStep` or
:class:`PythonStep`, which name tensors by :class:`TensorRef` (views of an
input, an allocation or a pinned buffer) or :class:`Pointer`, and scalars by
:class:`Const`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: Where a tensor of a plan comes from: the call's inputs, the plan's allocations, or its pinned buffers.
INPUT, ALLOCATION, PINNED = 0, 1, 2

#: The tag (``kind`` field) of each kind of record, by what it marks: the entry tells records apart by these
#: (a Replay and a PinnedReplay share one; a PinnedReplay is the longer).
TAGS = {
    "native": "native", "python": "python", "replay": "replay", "autograd": "autograd", "generic": "generic",
    "cuda": "cuda", "python_step": "python", "pointer": "ptr", "const": "const", "float": "float", "null": "null",
    "sym": "sym", "grad": "grad", "saved": "saved", "arg_const": "const", "needs": "needs",
}


class Marker(NamedTuple):
    """A record that is its tag only: :data:`NATIVE_PLAN`, :data:`PYTHON_PLAN`, :data:`NULL_ARG`."""

    kind: str


#: Every implementation declined from metadata alone: the native kernel serves the key from now on.
NATIVE_PLAN = Marker(TAGS["native"])
#: The call needs the Python path every time (a host sync, a persistent workspace, untracked work).
PYTHON_PLAN = Marker(TAGS["python"])


class TensorRef(NamedTuple):
    """A tensor as a view of ``source`` (:data:`INPUT`, :data:`ALLOCATION` or :data:`PINNED`) number
    ``index``: the whole of it (``same``, sizes and strides then empty) or ``sizes``/``strides`` at
    ``offset`` elements."""

    source: int
    index: int
    same: bool
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


class Allocation(NamedTuple):
    """A fresh tensor the replay allocates (sizes, strides, dtype), on the call's device."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: Any


class Const(NamedTuple):
    """A scalar kernel argument: ``size`` bytes holding ``bits``; ``kind`` ``"const"`` for an integer,
    ``"float"`` for a float's bit pattern (never made symbolic by a generic plan)."""

    kind: str
    size: int
    bits: int


def const(size: int, bits: int) -> Const:
    """A :class:`Const` record of an integer."""
    return Const(TAGS["const"], size, bits)


def fconst(size: int, bits: int) -> Const:
    """A :class:`Const` record of a float's bits."""
    return Const(TAGS["float"], size, bits)


class Pointer(NamedTuple):
    """A kernel pointer argument: ``source`` number ``index`` plus ``offset`` bytes."""

    kind: str
    source: int
    index: int
    offset: int


def pointer(source: int, index: int, offset: int) -> Pointer:
    """A :class:`Pointer` record."""
    return Pointer(TAGS["pointer"], source, index, offset)


#: A kernel argument the driver passes as a null pointer (Triton's scratch pointers when unused).
NULL_ARG = Marker(TAGS["null"])


class CudaStep(NamedTuple):
    """A compiled kernel launched through the CUDA driver: ``params`` are :class:`Pointer`, :class:`Const`
    or :data:`NULL_ARG`, in the kernel's parameter order; ``ints`` the launch's integer runtime arguments,
    those Triton specialised away (a 1) included (the entry does not read them; a generic plan guards
    their specialisation classes)."""

    kind: str
    function: int
    grid: tuple[int, int, int]
    threads: int
    shared: int
    pdl: bool
    cooperative: bool
    params: tuple[Any, ...]
    ints: tuple[int, ...] = ()


class TensorSlot(NamedTuple):
    """Where a :class:`PythonStep` puts a tensor: argument ``position`` gets the view ``ref``."""

    position: int
    ref: TensorRef


class PythonStep(NamedTuple):
    """A launch through its Python launcher: ``values`` with ``None`` where ``slots``
    (:class:`TensorSlot`) put a tensor."""

    kind: str
    launcher: Any
    grid: tuple[int, ...]
    values: tuple[Any, ...]
    slots: tuple[TensorSlot, ...]  # recording builds them as plain (position, ref) pairs: the same positions


class Replay(NamedTuple):
    """The call's launches over its inputs and fresh allocations; ``returns`` the results as
    :class:`TensorRef` (``None`` for an undefined one)."""

    kind: str
    allocations: tuple[Allocation, ...]
    steps: tuple[Any, ...]
    returns: tuple[TensorRef | None, ...]


class PinnedReplay(NamedTuple):
    """A :class:`Replay` that also uses state buffers the plan owns (``pinned``), bound to ``stream``."""

    kind: str
    allocations: tuple[Allocation, ...]
    steps: tuple[Any, ...]
    returns: tuple[TensorRef | None, ...]
    pinned: tuple[Any, ...]
    stream: int


class Backward(NamedTuple):
    """The backward op of an autograd plan: its name, schema, Python entry and planner."""

    name: str
    schema: str
    entry: Any
    planner: Any


class Saved(NamedTuple):
    """A tensor an autograd node saves for its backward: input ``index`` (``source`` :data:`INPUT`) or the
    forward's return ``index`` (:data:`ALLOCATION`)."""

    source: int
    index: int


class BackwardArg(NamedTuple):
    """One argument of a backward call (:func:`flaggems.autograd.apply`'s templates): ``kind`` ``"grad"``
    (incoming gradient ``value``), ``"saved"`` (saved tensor ``value``), ``"const"`` (``value`` itself) or
    ``"needs"`` (the per-input "needs a gradient" flags; no value)."""

    kind: str
    value: Any = None


class AutogradPlan(NamedTuple):
    """A forward :class:`Replay` under a C++ autograd node: ``slots`` the inputs that are differentiable
    (-1: none), ``saved`` what the backward reads (:class:`Saved`), ``backward`` its op, ``args`` and
    ``extra`` its arguments (:class:`BackwardArg`)."""

    kind: str
    forward: Replay
    outputs: int
    slots: tuple[int, ...]
    saved: tuple[Saved, ...]
    backward: Backward
    args: tuple[BackwardArg, ...]
    double_backward: Any
    extra: tuple[BackwardArg, ...]


class Sym(NamedTuple):
    """An integer of a generic plan computed from the call: ``cdiv(atoms[atom] * mul + add, div)``
    (``atom`` -1: the constant ``add``); ``cls`` the :func:`int_class` properties it must have (bits that
    held at every point the plan was fitted on: a kernel compiled or chosen for them; -1: none, for integers
    no kernel receives), checked before the plan serves a call."""

    kind: str
    atom: int
    mul: int
    add: int
    div: int
    cls: int


def sym(atom: int, mul: int, add: int, div: int, cls: int) -> Sym:
    """A :class:`Sym` record."""
    return Sym(TAGS["sym"], atom, mul, add, div, cls)


def int_class(value: int) -> int:
    """What Triton specialises an integer argument on: equal to 1, a multiple of 16, fits 32 bits."""
    return int(value == 1) | int(value % 16 == 0) << 1 | int(-2**31 <= value < 2**31) << 2


class Pin(NamedTuple):
    """A generic plan's guard: ``atoms[atom] == value``."""

    atom: int
    value: int


class Ratio(NamedTuple):
    """A generic plan's guard: ``atoms[atom] * q == atoms[of] * p``."""

    atom: int
    p: int
    of: int
    q: int


class Steady(NamedTuple):
    """A generic plan's guard: the step function ``sym`` of the atoms keeps ``value``."""

    sym: Sym
    value: int


class Aligned(NamedTuple):
    """A generic plan's guard: ``atoms[atom]`` stays a multiple of ``multiple``."""

    atom: int
    multiple: int


class Agree(NamedTuple):
    """A generic plan's guard: two expressions of atoms that vary independently stay equal."""

    first: Sym
    second: Sym


class GenericPlan(NamedTuple):
    """A :class:`Replay` (or an :class:`AutogradPlan`'s forward) whose size-dependent integers are
    :class:`Sym`, serving every call of one layout
    class (the entry's class key) whose atoms pass the guards: ``pinned`` (:class:`Pin`) atoms that must be
    equal to their value, ``ratios`` (:class:`Ratio`): ``atoms[atom] * q == atoms[of] * p``, ``steady``
    (:class:`Steady`): a step function of the atoms (``cdiv`` or floor division by a power of two) that
    equalled a plan integer at every point and must keep that value (the integer may be that function: a
    grid of ``cdiv(numel, 1024)`` is 11 for every numel in (10240, 11264]), ``aligned`` (:class:`Aligned`):
    ``atoms[atom]`` must be a multiple of ``multiple`` (a division exact at every point stays exact: a
    launcher may have chosen a maskless kernel for it), ``agree`` (:class:`Agree`): expressions of atoms
    that vary independently which both gave a plan integer at every point (a row length ``n`` and its
    padded stride ``n + 1``): they must stay equal, so whichever the launcher computed from, the plan's
    value is its value."""

    kind: str
    plan: Replay | AutogradPlan  # an autograd plan: its forward's integers may be Syms, the node's may not
    pinned: tuple[Pin, ...]
    ratios: tuple[Ratio, ...]
    steady: tuple[Steady, ...] = ()
    aligned: tuple[Aligned, ...] = ()
    agree: tuple[Agree, ...] = ()


class Answer(NamedTuple):
    """What a planner returns to the entry: the call's ``result``, its ``plan`` (``None``: nothing cached) and
    a :class:`GenericPlan` for its layout class, or ``None``."""

    result: Any
    plan: Any
    generic: GenericPlan | None = None


#: Every record the entry reads, by the name its parser looks it up under.
RECORDS: dict[str, type] = {
    record.__name__: record for record in (
        Marker, TensorRef, Allocation, Const, Pointer, CudaStep, TensorSlot, PythonStep, Replay, PinnedReplay,
        Backward, Saved, BackwardArg, AutogradPlan, Sym, Pin, Ratio, Steady, Aligned, Agree, GenericPlan, Answer)
}


def layout_of(records: dict[str, type]) -> dict[str, dict[str, int]]:
    """``{record name: {field name: index}}`` of named tuple classes (tests pass reordered ones)."""
    return {name: {field: index for index, field in enumerate(record._fields)} for name, record in records.items()}


def field_layout() -> dict[str, dict[str, int]]:
    """Where each field of each record is, as the compiled entry reads them: ``{record: {field: index}}``."""
    return layout_of(RECORDS)
