"""Typed records that plugins return from their hooks.

Plugins never touch ``torch.library``: they describe backends and operator
implementations with these records, and the core's policy decides which one
runs (see :mod:`flaggems.policy`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import torch

#: A callable, or a lazy reference ``"package.module:attribute"`` that is
#: imported only when the core needs it (at ``enable()`` time).
LazyCallable = Union[Callable[..., Any], str]


def resolve_callable(ref: LazyCallable) -> Callable[..., Any]:
    """Import a ``"module:attr"`` reference (or return a callable unchanged)."""
    if callable(ref):
        return ref
    if not isinstance(ref, str) or ":" not in ref:
        raise TypeError(f"expected a callable or 'module:attr' string, got {ref!r}")
    module_name, _, attr_path = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"{ref!r} resolved to a non-callable {type(obj).__name__}")
    return obj


@dataclass(frozen=True)
class ProbeResult:
    """Answer of a backend probe: is the hardware usable here, and why (not)."""

    available: bool
    reason: str


@dataclass(frozen=True)
class Backend:
    """A hardware backend a plugin can drive.

    Attributes:
        name: unique backend name, used by ``FLAGGEMS_VENDOR`` (e.g. ``"ascend"``).
        vendor: the vendor whose operator implementations apply on this backend.
            ``OpImpl.vendor`` is matched against it.
        device_type: torch device type of the hardware (``"npu"``, ``"cuda"``).
        dispatch_key: torch dispatch key the core registers kernels on
            (``"PrivateUse1"``, ``"CUDA"``, ``"CPU"``).
        probe: cheap check (no subprocess, no kernel compile) returning
            :class:`ProbeResult`; a lazy ``"module:attr"`` reference is allowed.
        priority: among several available backends the highest wins.
        description: one line shown by ``flaggems info``.
        facts: device index -> :class:`flaggems.toolkit.context.DeviceFacts` (multiprocessor or
            AI-core count, L2 size, warp/wavefront width, max grid, fp64/bf16 support), read once
            per device into the kernel context; ``None``: torch's CUDA properties on a ``cuda``
            device, nothing known elsewhere. A lazy ``"module:attr"`` reference is allowed.
        unsupported_dtypes: dtype names (``"float64"``) the device does not compute: every call
            with a tensor or a ``dtype`` argument of one of them declines, on every implementation,
            to the native kernel (also when simulated), with the reason in ``flaggems routes``.
        native_ops: op -> reason: ops left to the native kernel by default on this backend (the
            vendor's own torch serves them better); ``FLAGGEMS_OP_<op>``, a routes file,
            ``FLAGGEMS_FORCE`` or ``enable(include=...)`` still route them.
    """

    name: str
    vendor: str
    device_type: str
    dispatch_key: str
    probe: LazyCallable
    priority: int = 0
    description: str = ""
    facts: LazyCallable | None = None
    unsupported_dtypes: tuple[str, ...] = ()
    native_ops: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class OpImpl:
    """One implementation of one aten operator overload.

    Attributes:
        op: aten overload name without namespace: ``"index_copy_"``,
            ``"repeat_interleave.Tensor"`` (``".default"`` may be omitted).
        fn: the implementation, called with the op's arguments exactly as the
            dispatcher passes them; a lazy ``"module:attr"`` reference keeps
            kernel modules out of ``import flaggems``.
        supports: optional cheap per-call predicate taking the same arguments.
            It returns ``True`` to accept the call; ``False`` or a string
            (the reason) declines it to the next implementation in the chain.
        priority: order among implementations of the same tier (higher first).
        vendor: ``None`` for a generic implementation usable on any backend;
            otherwise the implementation applies only when the active backend's
            vendor equals this value.
        name: short label shown in routes (defaults to the plugin's name).
        dtypes: documentation of the dtypes the implementation accepts
            (shown by ``flaggems routes``; enforcement is ``supports``' job).
    """

    op: str
    fn: LazyCallable
    supports: LazyCallable | None = None
    priority: int = 0
    vendor: str | None = None
    name: str | None = None
    dtypes: tuple[str, ...] = ()
    dispatch_keys: tuple[str, ...] = ()
    replayable: bool = False


@dataclass(frozen=True)
class Tuning:
    """Configuration a plugin supplies for shared kernels (grid/tile policy...).

    ``key`` names what is configured (e.g. ``"elementwise"``); ``values`` is a
    mapping read by the kernel toolkit. Vendor tuning overrides generic tuning
    for the same key; later keys never remove earlier values.
    """

    key: str
    values: Mapping[str, Any] = field(default_factory=dict)
    vendor: str | None = None


#: The module kinds :func:`flaggems.patch` patches, which a :class:`PatchRule` names.
PATCH_KINDS = ("norm", "mlp", "decoder_layer", "rotary", "resnet_block", "geglu", "attention", "unet_output",
               "decoder_attention")
#: Kinds patched otherwise than by one module's forward (a modeling module's function; a norm and its
#: activation together): a rule may decline them, not make their forward.
DECLINE_ONLY_KINDS = ("rotary", "unet_output")


@dataclass(frozen=True)
class PatchRule:
    """A rule for one kind of module :func:`flaggems.patch` patches, for the backend it is returned for.

    ``kind`` is one the core recognises by its code (:data:`PATCH_KINDS`), or a new kind an op family
    (``flaggems/ops/<family>/patch.py``) or a plugin adds: then ``matches(module) -> bool`` says which modules
    are of it and ``forward`` is required. ``decline(module) -> str | None`` names why a module must stay as it
    is on this backend (a vendor library that takes the module's path there, a layout the device cannot
    serve), or ``None``. ``forward(module) -> callable``, where given, makes the patched forward in the core's
    stead (a vendor's fused kernel for the kind). All may be lazy ``"module:attr"`` references, resolved when
    :func:`flaggems.patch` runs; ``vendor`` set: used only when that vendor's backend is active. ``label``:
    what the patch report counts (default: the kind).
    """

    kind: str
    decline: LazyCallable | None = None
    forward: LazyCallable | None = None
    vendor: str | None = None
    matches: LazyCallable | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        if self.kind in PATCH_KINDS and self.matches is not None:
            raise ValueError(f"PatchRule({self.kind!r}): the core recognises {self.kind} modules by their code; "
                             "matches is for a new kind")
        if self.kind not in PATCH_KINDS and (self.matches is None or self.forward is None):
            raise ValueError(f"PatchRule kind {self.kind!r}: expected one of {', '.join(PATCH_KINDS)}, or a new "
                             "kind with matches and forward")
        if self.decline is None and self.forward is None:
            raise ValueError(f"PatchRule({self.kind!r}) has neither a decline nor a forward")
        if self.forward is not None and self.kind in DECLINE_ONLY_KINDS:
            raise ValueError(f"PatchRule({self.kind!r}) cannot make a forward: {self.kind} is not patched through "
                             "one module's forward (decline it instead)")


#: A case's inputs: ``(args, kwargs)``.
Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    """One contract case of an op.

    Attributes:
        name: short unique label (shown in test ids).
        make: ``make(device) -> (args, kwargs)``; called once per side with the
            same random seed, so both sides get equal, independent inputs.
        raises: exception type torch raises for these inputs (``None`` if valid).
        match: substring expected in the error message.
        ulps: allowed error in units in the last place of the output dtype
            (0 = bit-exact, the default for copies and index ops).
        check_strides: compare output strides with native (layout contract).
        tags: labels; ``"device-assert"`` marks an error case torch answers
            with a device-side assert on GPUs (which poisons the CUDA context):
            there the native side is not run, and the case needs flaggems'
            synchronous checks (``FLAGGEMS_CHECK_INDICES=1``).
            ``"native-contiguous-on-gpu"`` marks a layout torch's GPU kernel
            mishandles when called directly (its composite caller always makes
            the input contiguous): off the CPU the native side gets contiguous
            copies of the tensor inputs, which defines the expected values.
    """

    name: str
    make: Callable[[torch.device], Inputs]
    raises: type[BaseException] | tuple[type[BaseException], ...] | None = None
    match: str | None = None
    ulps: float = 0.0
    check_strides: bool = True
    tags: tuple[str, ...] = field(default=())
