"""Launch policy of the toolkit's elementwise kernels, read from plugin tuning.

A vendor changes grid and tile choices by returning
``Tuning("elementwise", {...}, vendor=...)`` from ``flaggems_tuning``; the
kernels themselves are never copied. Recognised keys:

``block_size``
    elements per program of the flat and linear kernels (power of two).
``tile``
    elements per program of the tiled kernel (power of two, >= 256).
``transpose_tile``
    ``(rows, cols)`` of the tiled kernel when the source is transposed.
``num_warps``
    warps per program (power of two).
``max_ctas``
    ``None`` launches one program per tile; an integer caps the grid, each
    program then walking the tiles with a grid-stride loop.

Each tuning key names a typed launch policy (:data:`POLICIES`): a dataclass
whose fields are the values a plugin may set. A key no policy has, a field the
policy lacks or a value it cannot use is an error naming the plugin (raised
when the core merges the tuning, at ``enable()``), never silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from . import context

KEY = "elementwise"


@dataclass(frozen=True)
class ElementwisePolicy:
    """Validated grid/tile policy (see the module docstring for each field)."""

    # 1024 elements and 4 warps: contiguous 256M fp32 copies ran at 4231 GB/s against 4104 with
    # 4096 (H200, triton 3.6, twice each; tiled and strided shapes unchanged within 1%).
    block_size: int = 1024
    tile: int = 4096
    transpose_tile: tuple[int, int] = (64, 64)
    num_warps: int = 4
    max_ctas: int | None = None

    def grid(self, tiles: int) -> tuple[int]:
        """Programs to launch for ``tiles`` units of work (never zero)."""
        if self.max_ctas is not None and tiles > self.max_ctas:
            return (self.max_ctas,)
        return (max(tiles, 1),)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> ElementwisePolicy:
        """Build a policy from a tuning mapping; raises ``ValueError`` on unknown fields or bad values."""
        unknown_fields(KEY, cls, values)
        policy = cls(
            block_size=int(values.get("block_size", cls.block_size)),
            tile=int(values.get("tile", cls.tile)),
            transpose_tile=tuple(int(v) for v in values.get("transpose_tile", cls.transpose_tile)),
            num_warps=int(values.get("num_warps", cls.num_warps)),
            max_ctas=None if values.get("max_ctas") is None else int(values["max_ctas"]),
        )
        policy.validate()
        return policy

    def validate(self) -> None:
        """Raise ``ValueError`` when a value cannot drive the kernels."""
        for name, value in (("block_size", self.block_size), ("tile", self.tile), ("num_warps", self.num_warps),
                            *(("transpose_tile", v) for v in self.transpose_tile)):
            if value < 1 or value & (value - 1):
                raise ValueError(f"tuning {KEY}.{name}={value}: expected a power of two")
        if len(self.transpose_tile) != 2:
            raise ValueError(f"tuning {KEY}.transpose_tile={self.transpose_tile}: expected (rows, cols)")
        if self.tile < 256:
            raise ValueError(f"tuning {KEY}.tile={self.tile}: expected at least 256")
        if self.max_ctas is not None and self.max_ctas < 1:
            raise ValueError(f"tuning {KEY}.max_ctas={self.max_ctas}: expected a positive integer or None")


def unknown_fields(key: str, policy: type, values: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming each value ``policy`` has no field for (with the closest field)."""
    import difflib

    names = [f.name for f in dataclasses.fields(policy)]
    for name in values:
        if name not in names:
            close = difflib.get_close_matches(str(name), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; fields: {', '.join(names)}"
            raise ValueError(f"tuning {key}: unknown field {name!r}{hint}")


def _power_of_two(key: str, name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"tuning {key}.{name}={value}: expected a power of two")


class IntegerPolicy:
    """Base of a launch policy of integer fields, a frozen dataclass built by :meth:`from_values`.

    A subclass names its tuning key, the fields that must be powers of two and the least value of others in
    its class statement (``class P(IntegerPolicy, key="...", powers_of_two=(...), minimums={...})``), and
    overrides :meth:`check` where its values must satisfy more.
    """

    key: ClassVar[str]
    powers_of_two: ClassVar[tuple[str, ...]]
    minimums: ClassVar[Mapping[str, int]]

    def __init_subclass__(cls, key: str, powers_of_two: tuple[str, ...] = (), minimums: Mapping[str, int] | None = None,
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.key, cls.powers_of_two, cls.minimums = key, powers_of_two, dict(minimums or {})

    @classmethod
    def from_values(cls: type[_P], values: Mapping[str, Any]) -> _P:
        """Build a policy from a tuning mapping; raises ``ValueError`` on unknown fields or bad values (unknown
        fields, non-powers of two, values below a minimum, then what :meth:`check` rejects)."""
        unknown_fields(cls.key, cls, values)
        policy = cls(**{name: int(value) for name, value in values.items()})
        for name in cls.powers_of_two:
            _power_of_two(cls.key, name, getattr(policy, name))
        for name, least in cls.minimums.items():
            if getattr(policy, name) < least:
                raise ValueError(f"tuning {cls.key}.{name}={getattr(policy, name)}: expected an integer >= {least}")
        policy.check()
        return policy

    def check(self) -> None:
        """Raise ``ValueError`` for values the kernels cannot use beyond the integer checks (none here)."""


_P = TypeVar("_P", bound=IntegerPolicy)


@dataclass(frozen=True)
class GatherScatterPolicy(IntegerPolicy, key="gather_scatter",
                          powers_of_two=("tile", "max_cols", "num_warps", "min_tile", "elements_per_warp",
                                         "wide_tile_bytes", "few_rows_warps", "merged_gather_warps", "search_lanes"),
                          minimums={"min_programs": 0, "few_rows": 0, "wide_row_bytes": 1}):
    """Tiles and warps of the gather/scatter kernels along one dimension (``Tuning("gather_scatter", {...})``).

    Used by ``index_select``, ``index_copy``, ``repeat_interleave``'s expand
    (:mod:`flaggems.toolkit.indexing`).

    Attributes:
        tile: elements per ``[BLOCK_R, BLOCK_C]`` tile.
        max_cols: widest column block.
        num_warps: warps per program (at most; small tiles get fewer).
        min_programs: a grid of fewer tiles gets smaller tiles (down to ``min_tile`` elements).
        min_tile: smallest tile the shrinking goes to.
        elements_per_warp: one warp per this many elements of a small tile.
        wide_row_bytes: rows this wide (bytes) or wider hold ``wide_tile_bytes`` a tile, whatever the dtype.
        wide_tile_bytes: bytes per tile of wide rows.
        few_rows: a wide tile of at most this many rows runs ``few_rows_warps`` warps.
        few_rows_warps: warps of such a tile.
        merged_gather_warps: warps of a one-column gather that merges a fallback load.
        search_lanes: row-and-entry pairs a search tile compares per step.
    """

    # H200 sweeps behind these values (benchmarks/RESULTS.md): tile 4096/8192/16384 x max_cols
    # 1024/4096 x 4/8 warps, best or within 3% of best on every seed shape but one; two rows of 2 KiB a
    # tile 3% faster (index_select [4096, 4096] fp16 dim 0 14.56 -> 14.14 µs); 4 warps for two rows of
    # 8 KiB 6% faster (14.02 -> 13.12 µs); 16 warps for the merged one-column gather 21% faster sorted
    # (64.2 -> 50.5 µs), 12% slower random; search lanes 1024 vs 4096 no clear winner (11 shapes).
    tile: int = 4096
    max_cols: int = 4096
    num_warps: int = 8
    min_programs: int = 1024
    min_tile: int = 1024
    elements_per_warp: int = 256
    wide_row_bytes: int = 2048
    wide_tile_bytes: int = 16384
    few_rows: int = 2
    few_rows_warps: int = 4
    merged_gather_warps: int = 16
    search_lanes: int = 4096


@dataclass(frozen=True)
class GroupedScatterPolicy(IntegerPolicy, key="grouped_scatter",
                           powers_of_two=("block", "partition_warps", "scatter_block", "scatter_warps", "count_warps",
                                          "window"),
                           minimums={"partition_stages": 1, "programs": 1, "windows": 2, "spread_share": 1,
                                     "min_sector_stores": 1, "min_dest_bytes": 0}):
    """Blocks, warps and thresholds of the grouped scatter (``Tuning("grouped_scatter", {...})``).

    Used by :mod:`flaggems.toolkit.partition` (large random 1-D scatters, index_copy_).

    Attributes:
        block: pairs a count/partition program handles at once (below 1024: the rank fields hold its counts).
        partition_warps, count_warps, scatter_warps: warps of those launches.
        partition_stages: pipeline stages of the partition's block loop.
        scatter_block: slots a scatter program writes.
        programs: programs of the count and partition launches (they loop over blocks).
        windows, window: the probe's sampled windows and elements per window.
        spread_share: the index is grouped when its windows touch more than 1/spread_share of the regions.
        min_sector_stores: grouped only where each 32-byte sector of ``dest`` takes this many stores.
        min_dest_bytes: grouped only for a destination this large or larger.
    """

    # H200 ([2^30], fp16 / fp32, ms): block 512 at 4 warps 9.8 / 13.5 (1024: 9.9 / 16.1); count
    # at 4 warps 1.75 / 1.95 (16: 2.80 / 3.00); programs 16384 9.6 / 13.3 (2048: 10.6 / 15.5); two
    # stages 11.6 ms against one stage's 15.9 with masked loads; grouping pays from 4 stores a sector
    # (1.01-1.22x) and not on a destination the L2 cache holds (32 MiB: 0.54-0.56x).
    block: int = 512
    partition_warps: int = 4
    partition_stages: int = 2
    scatter_block: int = 1024
    scatter_warps: int = 4
    count_warps: int = 4
    programs: int = 16384
    windows: int = 16
    window: int = 256
    spread_share: int = 4
    min_sector_stores: int = 4
    min_dest_bytes: int = 64 << 20

    def check(self) -> None:
        """The block below 1024 (its counts fill 10-bit rank fields)."""
        if self.block >= 1024:
            raise ValueError(f"tuning grouped_scatter.block={self.block}: expected below 1024 (10-bit rank fields)")


@dataclass(frozen=True)
class ScanPolicy(IntegerPolicy, key="scan", powers_of_two=("block", "sub", "fanout", "chunk", "tile", "threads"),
                 minimums={"lookback": 0}):
    """Blocks, chunks and searches of ``repeat_interleave``'s scan and expand (``Tuning("scan", {...})``).

    Attributes:
        block: output elements an expand program writes.
        sub: output elements per sub-block (each sub-block's rows are found first, so an element's own
            search spans only the few rows its sub-block touches).
        fanout: row ends compared per step of a program's first/last-row search (output size unknown).
        chunk: rows of ``repeats`` a scan program sums.
        lookback: predecessor chunks read per step of the scan's look-back; 0: one warp or wavefront,
            the device facts' ``warp_size`` (32 on NVIDIA, 64 on a DCU).
        tile: blocks searched at a time by a chunk whose rows hold several block starts each.
        threads: threads per program of both kernels; warps = threads / the device's warp width.
    """

    # H200 (seed case 17096 rows -> 854524 items, output_size given):
    # block 2048/1024/512: expand 5.23/4.8/5.58 µs of GPU time (17096 -> 50M items: 110/106/118 µs);
    # sub 8 against 16: seed 13.5/13.5 µs, 854524 one-item rows 32.2/41.2; chunk 256/512/1024: scan
    # 3.04/2.88/3.42 µs (cub's: 0.75 + 2.21).
    block: int = 1024
    sub: int = 8
    fanout: int = 256
    chunk: int = 512
    lookback: int = 0
    tile: int = 1024
    threads: int = 128

    def check(self) -> None:
        """A look-back of 0 or a power of two; sub-blocks no larger than the block."""
        if self.lookback:
            _power_of_two("scan", "lookback", self.lookback)
        if self.sub > self.block:
            raise ValueError(f"tuning scan.sub={self.sub}: expected at most block ({self.block})")

    def lanes(self, warp_size: int) -> int:
        """Look-back lanes on a device whose warps are ``warp_size`` wide."""
        return self.lookback or warp_size

    def warps(self, warp_size: int) -> int:
        """Warps (wavefronts) per program on a device whose warps are ``warp_size`` wide."""
        return max(self.threads // warp_size, 1)


#: Tuning key -> the launch policy its values configure: the toolkit's kernels here; each op family's
#: ``policy.py`` registers its own (:func:`register_policy`, when ``import flaggems`` loads the op specs).
POLICIES: dict[str, type] = {KEY: ElementwisePolicy, "gather_scatter": GatherScatterPolicy,
                             "grouped_scatter": GroupedScatterPolicy, "scan": ScanPolicy}
_FAMILY_POLICIES: dict[str, Any] = context.cache()  # new context, new tuning


def policy(key: str) -> Any:
    """The active policy of kernel family ``key`` (from the context's tuning; cached until a reset)."""
    found = _FAMILY_POLICIES.get(key)
    if found is None:
        found = _FAMILY_POLICIES[key] = POLICIES[key].from_values(context.current().tuning(key))
    return found


def register_policy(key: str, policy: type) -> None:
    """Declare the launch policy of a kernel family: a dataclass with ``from_values(values)``."""
    POLICIES[key] = policy


def check_tuning(key: str, values: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` when ``values`` cannot configure ``key`` (no such policy, field or value)."""
    import difflib

    policy = POLICIES.get(key)
    if policy is None:
        close = difflib.get_close_matches(key, list(POLICIES), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(sorted(POLICIES))}"
        raise ValueError(f"unknown tuning key {key!r}; {hint}")
    policy.from_values(values)


_LISTENERS: list[Callable[[], None]] = []


def on_policy_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` whenever the elementwise policy is forced (:func:`set_policy`); a reset of the context
    empties the caches derived from it without this."""
    _LISTENERS.append(listener)


def elementwise_policy() -> ElementwisePolicy:
    """The active policy, read once per context from ``flaggems.tuning("elementwise")`` and cached.

    The plugins' values come through the kernel context (the runtime merges
    them: every plugin's hook, far too slow per call); :func:`reset_policy`,
    or a reset of the context, forgets the cached answer.
    """
    return policy(KEY)


def set_policy(forced: ElementwisePolicy | None) -> None:
    """Force a policy (tests, benchmarks) until the next reset; ``None`` re-reads tuning on next use."""
    if forced is not None:
        forced.validate()
        _FAMILY_POLICIES[KEY] = forced
    else:
        _FAMILY_POLICIES.pop(KEY, None)
    for listener in _LISTENERS:
        listener()


def reset_policy() -> None:
    """Forget the cached policy: the next use reads plugin tuning again."""
    set_policy(None)
