"""A call whose result depends on values it reads back (``repeat_interleave`` without ``output_size``) is
never replayed from a plan: on the CPU its ``tolist()`` reaches no torch op, so the read is declared
(``flaggems.toolkit.recording.host_values``)."""

from __future__ import annotations

import pytest
import torch

from flaggems.binding import native_scope


@pytest.mark.parametrize("values", [[1, 2, 3], [3, 3, 3], [0, 0, 1], [5, 1, 1]])
def test_same_layout_other_repeats_other_total(values, compiled_for):
    compiled_for(["repeat_interleave.Tensor", "repeat_interleave.self_Tensor"])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for first in ([1, 2, 3], values):  # the first call plans; the second has the key and other repeats
        repeats = torch.tensor(first, dtype=torch.int32, device=dev)
        x = torch.arange(3.0, device=dev)
        got, got_rows = torch.repeat_interleave(repeats), torch.repeat_interleave(x, repeats)
        with native_scope():
            want, want_rows = torch.repeat_interleave(repeats), torch.repeat_interleave(x, repeats)
        assert torch.equal(got, want) and torch.equal(got_rows, want_rows)
