"""``aten::_to_copy`` (``x.to(dtype)``, ``x.to(memory_format=...)``): one on-device pass.

The output is allocated exactly as torch allocates it (``preserve_format``:
a dense, non-overlapping input keeps its strides; otherwise torch's suggested
memory format), then one strided kernel reads the input's real strides and
casts on store: no intermediate contiguous copy.

Declines to native: a device change, ``pin_memory``, non-strided layouts,
and dtypes outside the toolkit's set (complex, fp8, ...).

The semantics live in the public front :mod:`flaggems.fronts.copy`; the
entry point is built there with ``copy_``'s, around the same two toolkit
kernels (:mod:`flaggems.plugins.generic.copy_`).
"""

from __future__ import annotations

from flaggems.plugins.generic import copy_

#: Built by :mod:`flaggems.plugins.generic.copy_` with ``copy_``'s entry point, around the same kernels.
to_copy = copy_.to_copy
