"""Calls of torch's CPU kernels the kit makes safely: arguments for which a kernel would write outside its
output get torch's error another way (the kit's oracle on CPU copies must not corrupt the heap)."""

from __future__ import annotations

import torch

#: ``repeat_interleave`` overloads taking a tensor of repeats, and its position (``output_size`` is keyword-only).
_REPEATS_AT = {"repeat_interleave.Tensor": 0, "repeat_interleave.self_Tensor": 1}


def torch_cpu_overruns(op: str, args: tuple, kwargs: dict) -> bool:
    """Whether torch's CPU kernel may write outside its output for these arguments (heap corruption).

    ``aten::repeat_interleave`` with ``output_size`` (ATen ``Repeat.cpp``, ``compute_cpu``): torch compares
    ``output_size`` with the running sum's last element, allocates that many elements, then checks each
    ``repeats[i] >= 0`` only inside its ``at::parallel_for``, row by row, each row writing
    ``[cumsum[i] - repeats[i], cumsum[i])``. With a negative repeat and an ``output_size`` equal to the sum,
    the rows before it, and on other threads the rows after it, write before the output's start or past its
    end before the negative row raises: ``[-1, 2]`` with ``output_size=1`` writes element -1, which glibc
    reports as ``free(): invalid pointer`` / ``invalid next size (fast)`` (the kit's generated
    ``negative/right`` cases; on a GPU host through the kit's CPU copies). Values are read
    resolved (a negative-bit view is resolved before torch's kernel).
    """
    at = _REPEATS_AT.get(op)
    if at is None or kwargs.get("output_size") is None:
        return False
    repeats = args[at] if len(args) > at else kwargs.get("repeats")
    if not isinstance(repeats, torch.Tensor) or repeats.dtype not in (torch.int32, torch.int64) or not repeats.numel():
        return False
    from ..binding import native_scope

    with native_scope():
        return bool((repeats < 0).any())


def cpu_safe_kwargs(op: str, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` for a call of torch's CPU kernel that raises torch's error instead of overrunning its output.

    For :func:`torch_cpu_overruns` arguments, without ``output_size``: torch then checks the repeats for a
    negative one before it allocates or writes anything, and raises its RuntimeError ("repeats can not be
    negative"); every check before (dimensions, sizes, dtypes) is torch's own, as before. With a wrong
    ``output_size`` torch would have said "allocated size does not match required size": also a
    RuntimeError, the one thing the kit compares.
    """
    if not torch_cpu_overruns(op, args, kwargs):
        return kwargs
    return {k: v for k, v in kwargs.items() if k != "output_size"}
