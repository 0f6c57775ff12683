"""The plan records the planner hands the compiled entry: one definition of their fields, in order.

The compiled entry (``flaggems/compiled/entry.cpp``, ``parse_plan`` and the
parsers it calls) reads these records by position; each is a ``NamedTuple``,
so the tuple it receives is the record itself, and Python code builds and reads
them by name. A field added here must be added to the C++ parser at the same
position (``tests/test_plans.py`` pins every record's field order, so a change
here fails until the test, and the parser beside it, are changed too).

A plan (:func:`flaggems.planner.build_planner`'s answer) is one of
:data:`NATIVE_PLAN`, :data:`PYTHON_PLAN`, :class:`Replay`,
:class:`PinnedReplay` or :class:`AutogradPlan`; a replay's steps are
:class:`CudaStep` or :class:`PythonStep`, which name tensors by
:class:`TensorRef` (views of an input, an allocation or a pinned buffer) or
:class:`Pointer`, and scalars by :class:`Const`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: Where a tensor of a plan comes from: the call's inputs, the plan's allocations, or its pinned buffers.
INPUT, ALLOCATION, PINNED = 0, 1, 2

#: Every implementation declined from metadata alone: the native kernel serves the key from now on.
NATIVE_PLAN = ("native",)
#: The call needs the Python path every time (a host sync, a persistent workspace, untracked work).
PYTHON_PLAN = ("python",)


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
    return Const("const", size, bits)


def fconst(size: int, bits: int) -> Const:
    """A :class:`Const` record of a float's bits."""
    return Const("float", size, bits)


class Pointer(NamedTuple):
    """A kernel pointer argument: ``source`` number ``index`` plus ``offset`` bytes."""

    kind: str
    source: int
    index: int
    offset: int


def pointer(source: int, index: int, offset: int) -> Pointer:
    """A :class:`Pointer` record."""
    return Pointer("ptr", source, index, offset)


#: A kernel argument the driver passes as a null pointer (Triton's scratch pointers when unused).
NULL_ARG = ("null",)


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


class PythonStep(NamedTuple):
    """A launch through its Python launcher: ``values`` with ``None`` where ``slots`` (position,
    :class:`TensorRef`) put a tensor."""

    kind: str
    launcher: Any
    grid: tuple[int, ...]
    values: tuple[Any, ...]
    slots: tuple[tuple[int, TensorRef], ...]


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


class AutogradPlan(NamedTuple):
    """A forward :class:`Replay` under a C++ autograd node: ``slots`` the inputs that are differentiable
    (-1: none), ``saved`` what the backward reads (source, index), ``backward`` its op."""

    kind: str
    forward: Replay
    outputs: int
    slots: tuple[int, ...]
    saved: tuple[tuple[int, int], ...]
    backward: Backward
    args: tuple[Any, ...]
    double_backward: Any
    extra: Any


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
    return Sym("sym", atom, mul, add, div, cls)


def int_class(value: int) -> int:
    """What Triton specialises an integer argument on: equal to 1, a multiple of 16, fits 32 bits."""
    return int(value == 1) | int(value % 16 == 0) << 1 | int(-2**31 <= value < 2**31) << 2


class GenericPlan(NamedTuple):
    """A :class:`Replay` (or an :class:`AutogradPlan`'s forward) whose size-dependent integers are
    :class:`Sym`, serving every call of one layout
    class (the entry's class key) whose atoms pass the guards: ``pinned`` (atom, value) pairs that must be
    equal, ``ratios`` (atom, p, of, q): ``atoms[atom] * q == atoms[of] * p``, ``steady`` (sym, value):
    a step function of the atoms (``cdiv`` or floor division by a power of two) that equalled a plan
    integer at every point and must keep that value (the integer may be that function: a grid of
    ``cdiv(numel, 1024)`` is 11 for every numel in (10240, 11264]), ``aligned`` (atom, m): ``atoms[atom]``
    must be a multiple of ``m`` (a division exact at every point stays exact: a launcher may have chosen a
    maskless kernel for it), ``agree`` (sym, sym): expressions of atoms that vary independently which both
    gave a plan integer at every point (a row length ``n`` and its padded stride ``n + 1``): they must stay
    equal, so whichever the launcher computed from, the plan's value is its value."""

    kind: str
    plan: Replay | AutogradPlan  # an autograd plan: its forward's integers may be Syms, the node's may not
    pinned: tuple[tuple[int, int], ...]
    ratios: tuple[tuple[int, int, int, int], ...]
    steady: tuple[tuple[Sym, int], ...] = ()
    aligned: tuple[tuple[int, int], ...] = ()
    agree: tuple[tuple[Sym, Sym], ...] = ()
