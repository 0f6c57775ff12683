"""``aten::index_select``: gather rows along a dimension, in place of the input's layout.

``out[..., j, ...] = self[..., index[j], ...]`` through the toolkit's
gather/scatter kernel. The input is indexed through its real strides as an
``[outer, index, inner]`` view: no transpose or copy of the input when ``dim``
is not the last one (the known peer implementation copied the whole input,
twice). ``out`` is contiguous, as torch's.

int64 and int32 indices. torch's semantics (argument checks that decline to
the native kernel, which raises torch's error; dim wrapping; 0-dim operands;
the contiguous result) live in the public front
:mod:`flaggems.fronts.index_select`, which a vendor's kernel uses too.
Out-of-range indices follow :mod:`flaggems.toolkit.checks` (when checking,
torch's CPU error: RuntimeError on its dim-1 path of rank 2 or more, IndexError
"index out of range in self" on every other; masked, zeros written, otherwise).
"""

from __future__ import annotations

from flaggems import Decline
from flaggems.fronts import index_select as index_select_front
from flaggems.toolkit.indexing import index_along_dim


def gather_rows(call: index_select_front.Call) -> None:
    """The toolkit's gather for one validated call (:mod:`flaggems.fronts.index_select`)."""
    if not index_along_dim(call.out, call.source, call.dim, call.index, scatter=False):
        raise Decline("layout needs more than 2 outer or 2 inner dimensions")


index_select = index_select_front.entries(gather_rows)
