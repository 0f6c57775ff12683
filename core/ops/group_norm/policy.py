"""The launch policy of the group_norm kernels (tuning key ``group_norm``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...toolkit.tuning import IntegerPolicy


@dataclass(frozen=True)
class GroupNormPolicy(IntegerPolicy, key="group_norm",
                      powers_of_two=("tile", "num_warps", "finalize_tile", "param_tile", "param_min_channels",
                                     "channel_block_max"),
                      minimums={"max_chunks": 1, "programs_per_sm": 1, "fuse_limit": 0, "min_chunk_rows": 1}):
    """Tiles and grid of the group_norm reductions (``Tuning("group_norm", {...})``).

    Attributes:
        tile: elements per ``[BLOCK_C, BLOCK_S]`` tile of every kernel that walks the input.
        num_warps: warps per program.
        finalize_tile: partials per tile of the finalize kernels.
        param_tile: partials per tile of the dweight/dbias sums.
        param_min_channels: at least this many channels per dweight/dbias program.
        max_chunks: at most this many spatial chunks per channel (bounds the workspace).
        fuse_limit: the finalize step folds into the next launch when a tile merges at most this many
            partials (0: never).
        programs_per_sm: programs wanted per multiprocessor when groups are split over the device.
        channel_block_max: at most this many channels per tile of a channels_last input (its unit stride).
        min_chunk_rows: at least this many spatial positions per chunk of a channels_last input: each chunk
            writes 3 fp32 partials per channel, so short chunks write more than they read (2x1280x16x16 fp16
            in chunks of 2 rows wrote 3.9 MB of partials for a 655 KB input, 0.83x torch's GN + SiLU, H200).
    """

    # A sweep of tile 2048/4096/8192 x 4/8 warps x 2/4 programs per SM moved the kernels by at most
    # ~10% either way with no setting best on every shape (H200): the defaults stay.
    tile: int = 4096
    num_warps: int = 8
    finalize_tile: int = 1024
    param_tile: int = 4096
    param_min_channels: int = 4
    max_chunks: int = 128
    fuse_limit: int = 1024
    programs_per_sm: int = 4
    channel_block_max: int = 512
    min_chunk_rows: int = 32


POLICIES = {"group_norm": GroupNormPolicy}
