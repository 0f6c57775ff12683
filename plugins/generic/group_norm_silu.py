"""``flaggems::group_norm_silu``: ``silu(group_norm(x))`` in the group norm's own launches, forward and backward.

The semantics (checks, the output's layout, autograd) are
:mod:`flaggems.fronts.group_norm_silu`'s; the kernels are
:mod:`.group_norm`'s, launched with their ``SILU`` flag (one kernel file for
both ops, so every layout, group size, tiling and accuracy property of the
group norm holds here too: channels_last and strided inputs read in place,
any ``C % groups == 0``, fp32 statistics about a scaled pivot, deterministic):

* forward: the statistics launch(es) unchanged; the normalize launch applies
  ``silu`` to each fp32 value before its one rounding. torch's ``F.group_norm``
  then ``F.silu`` write the normalised tensor and read it again: this saves a
  read and a write of the activation, and a launch.
* backward: ``dz = dy * silu'(z)`` wherever the group norm's backward reads
  ``dy``, with ``z = (x - mean) * rstd * weight + bias`` recomputed from the
  input (no ``z`` is kept: the forward writes only ``y``, and a training
  step holds one activation less per fused norm); the rest is the group
  norm's backward on ``dz``: 4 reads and 1 write of the activation, where
  torch's autograd makes 6 and 2 (``silu``'s backward reads ``dy`` and ``z``
  and writes ``dz``, which the group norm's backward reads twice with
  ``x``). The statistics are kept in fp32 whatever the input's dtype
  (:func:`.group_norm.group_norm_silu_forward`).

Numerics: fp32 throughout, one rounding per output; the reference rounds
``z`` to the input's dtype before the SiLU (and ``dz`` before the group norm's
backward), so half-precision results differ from it by about one ulp more
than from a float64 computation.
"""

from __future__ import annotations

import torch

from flaggems.fronts import group_norm_silu as front

from . import group_norm as kernels  # through the module: a patched (spied) function is seen


def forward(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, N: int, C: int, HxW: int,
            group: int, eps: float, y: torch.Tensor, save: bool) -> torch.Tensor:
    """Fill ``y``; returns the packed fp32 statistics (with ``save``: what :func:`backward` reads)."""
    return kernels.group_norm_silu_forward(input, weight, bias, N, C, HxW, group, eps, y, save)


def backward(grad: torch.Tensor, input: torch.Tensor, saved: torch.Tensor, weight: torch.Tensor | None,
             bias: torch.Tensor | None, N: int, C: int, HxW: int, group: int, dx: torch.Tensor | None,
             dweight: torch.Tensor | None, dbias: torch.Tensor | None) -> None:
    """Fill the gradients asked (the weight and bias are read from ``saved``, as the forward used them)."""
    kernels.group_norm_silu_backward(grad, input, saved, N, C, HxW, group, dx, dweight, dbias)


#: The implementation of the ``OpImpl`` line (checks, layouts and autograd are the front's).
group_norm_silu = front.entry(forward, backward)
