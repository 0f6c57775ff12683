"""``aten::copy_``: broadcast, cast and strided copy in one kernel launch.

Contract (everything else declines to the native kernel, with the reason on
the ``fallback`` log channel):

* ``self`` and ``src`` on the same device, dtypes among float16, bfloat16,
  float32, float64, int8, int16, int32, int64, uint8 and bool (any pair: the
  cast happens in the kernel), strided layout, no conj/neg view bits;
* ``src`` broadcastable to ``self`` (expanded, zero strides allowed);
* any strides on both sides (expand, transpose, slice with a step, permute,
  any rank): the toolkit collapses dimensions and passes real strides.

Errors are torch's: a destination whose elements overlap each other (an
expanded tensor) raises torch's RuntimeError; a shape that does not
broadcast raises torch's message. Partial overlap between ``src`` and
``self`` goes native, so the result (or error) is exactly torch's.

Those semantics live in the public front :mod:`flaggems.fronts.copy` (shared
with ``_to_copy`` and with any vendor's copy kernels); this module hands it
the toolkit's two copy kernels: :func:`~flaggems.toolkit.strided.copy_dense`
for the contiguous same-shape case and
:func:`~flaggems.toolkit.strided.strided_copy` for every other layout.
"""

from __future__ import annotations

from flaggems.fronts import copy as copy_front
from flaggems.toolkit.strided import copy_dense, strided_copy

#: torch's message for a destination overlapping itself (the front's; name kept for existing importers).
INTERNAL_OVERLAP = copy_front.INTERNAL_OVERLAP

copy_, to_copy = copy_front.entries(copy_dense=copy_dense, copy_strided=strided_copy)
