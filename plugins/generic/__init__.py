"""The default plugin: generic Triton kernels, one operator per module.

Registered through the same ``flaggems.plugins`` entry-point group as every
vendor plugin (no special path). Kernel modules are referenced lazily
(``"module:attr"``) so that ``import flaggems`` never compiles or imports them.
"""

from __future__ import annotations

import dataclasses

from flaggems import Backend, OpImpl, hookimpl

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_COPY_DTYPES = (*_FLOATS, "int8", "int16", "int32", "int64", "uint8", "bool")

#: Operators of this plugin, one module each; the callables are imported at enable().
OPERATORS: tuple[OpImpl, ...] = (
    OpImpl("copy_", f"{__name__}.copy_:copy_", dtypes=_COPY_DTYPES),
    OpImpl("_to_copy", f"{__name__}.to_copy:to_copy", dtypes=_COPY_DTYPES),
    OpImpl("index_copy_", f"{__name__}.index_copy:index_copy_", dtypes=_COPY_DTYPES),
    OpImpl("index_copy", f"{__name__}.index_copy:index_copy", dtypes=_COPY_DTYPES),
    OpImpl("index_select", f"{__name__}.index_select:index_select", dtypes=_COPY_DTYPES),
    OpImpl("repeat_interleave.Tensor", f"{__name__}.repeat_interleave:repeat_interleave_tensor",
           dtypes=("int32", "int64")),
    OpImpl("repeat_interleave.self_Tensor", f"{__name__}.repeat_interleave:repeat_interleave_self_tensor",
           dtypes=_COPY_DTYPES),
    OpImpl("repeat_interleave.self_int", f"{__name__}.repeat_interleave:repeat_interleave_self_int",
           dtypes=_COPY_DTYPES),
    OpImpl("native_group_norm", f"{__name__}.group_norm:native_group_norm", dtypes=_FLOATS),
    OpImpl("native_group_norm_backward", f"{__name__}.group_norm:native_group_norm_backward", dtypes=_FLOATS),
    OpImpl("group_norm", f"{__name__}.group_norm_op:group_norm", dtypes=_FLOATS),
    # unfold exists natively on CUDA and CPU as a view op, and a Python route that declines there still costs
    # ~12 µs per call (measured on the CI host): it is offered only where the backend's torch lacks it.
    OpImpl("unfold", f"{__name__}.unfold:unfold", dtypes=_COPY_DTYPES, dispatch_keys=("PrivateUse1",)),
    OpImpl("unfold_backward", f"{__name__}.unfold:unfold_backward", dtypes=_FLOATS),
    # flaggems' own fused ops (flaggems.ops): a decline runs their torch reference.
    OpImpl("flaggems::silu_mul", f"{__name__}.glu:silu_mul", dtypes=_FLOATS[:3]),
    OpImpl("flaggems::gelu_tanh_mul", f"{__name__}.glu:gelu_tanh_mul", dtypes=_FLOATS[:3]),
    OpImpl("flaggems::gelu_mul", f"{__name__}.glu:gelu_mul", dtypes=_FLOATS[:3]),
    OpImpl("flaggems::rms_norm", f"{__name__}.rms_norm:rms_norm", dtypes=_FLOATS[:3]),
    OpImpl("flaggems::add_rms_norm", f"{__name__}.rms_norm:add_rms_norm", dtypes=_FLOATS[:3]),
    OpImpl("flaggems::rotary_embedding", f"{__name__}.rotary:rotary_embedding", dtypes=_FLOATS[:3]),
    OpImpl("flaggems::rotary_cache_append", f"{__name__}.rotary_cache:rotary_cache_append", dtypes=_FLOATS[:3]),
    OpImpl("flaggems::group_norm_silu", f"{__name__}.group_norm_silu:group_norm_silu", dtypes=_FLOATS[:3]),
)


@hookimpl
def flaggems_operators(backend: Backend) -> tuple[OpImpl, ...]:
    """Generic implementations apply on every backend (``unfold`` declares PrivateUse1 only).

    Every one is replayable: it launches through the toolkit's launcher and
    decides from metadata; the planner still keeps calls that sync, use a
    persistent workspace or need autograd on the Python path.
    """
    return tuple(dataclasses.replace(impl, replayable=True) for impl in OPERATORS)
