"""The declarative record of one benchmark case and helpers shared by the op families' shapes parts.

An op family's ``shapes`` part (``flaggems.ops.<family>.shapes``) declares ``WORKLOADS``: a tuple of
:class:`Workload`. Each names the aten ops the flaggems side routes, how to build
its inputs at full size (``params``) and at smoke size (``smoke``), the call to
time, and the bytes the call must move at least (for GB/s).

Inputs are built under a fixed seed (:data:`INPUT_SEED`), so a workload that
draws them from torch's default generator (``torch.randn(n)``) gives every
side of a run, and every run, the same values.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: Inputs of one workload: whatever ``build`` returns, handed to ``run``.
Inputs = dict[str, Any]

#: Seed of torch's default generators while a workload builds its inputs (see :meth:`Workload.make`).
INPUT_SEED = 0

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int64: "int64",
    torch.int32: "int32",
}

#: Spellings accepted by ``--dtype`` besides the short names above.
DTYPE_ALIASES: dict[str, str] = {
    "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
    "float64": "fp64", "double": "fp64", "long": "int64", "int": "int32",
}


@dataclass(frozen=True)
class Workload:
    """One benchmark case: an op at one shape and dtype.

    Attributes:
        op: its bench op (``copy_``, ``index_copy``...), the name ``--op`` selects and reports group by.
        name: what is measured, shapes included (shown in every report).
        dtype: ``"fp32"``, or ``"fp32->bf16"`` for a cast.
        build: ``build(device, **params)`` returns the inputs.
        run: ``run(inputs)`` is the timed call.
        params: full-size arguments of ``build``.
        smoke: tiny arguments of ``build`` for ``--smoke`` (CPU interpreter).
        routes: aten ops routed to flaggems on the flaggems side.
        bytes_moved: ``bytes_moved(inputs)``, the least traffic of one call,
            or ``None`` where it cannot be counted.
        source: where the case comes from (a seed document, a peer measurement).
        smoke_name: the name at smoke size; empty: derived from ``name`` (see :meth:`label`).
        torch_run: the timed call on the torch side where it is not ``run`` (torch's own fused op timed
            against ours); ``None``: ``run`` on every side (see :meth:`call`).
    """

    op: str
    name: str
    dtype: str
    build: Callable[..., Inputs]
    run: Callable[[Inputs], Any]
    params: Mapping[str, Any]
    smoke: Mapping[str, Any]
    routes: tuple[str, ...]
    bytes_moved: Callable[[Inputs], int] | None = None
    source: str = ""
    smoke_name: str = ""
    #: Judge a side that differs from torch beyond the dtype's tolerance against a float64 run of the torch call
    #: (floating inputs cast to float64): it matches when no farther from it than torch (for reductions whose
    #: torch reference rounds an intermediate to half precision, e.g. a fused op's gradients).
    float64_judge: bool = False
    torch_run: Callable[[Inputs], Any] | None = None

    @property
    def key(self) -> str:
        """``op/name/dtype``: unique across all workloads."""
        return f"{self.op}/{self.name}/{self.dtype}"

    def call(self, native: bool) -> Callable[[Inputs], Any]:
        """The call a side times: :attr:`torch_run` (where set) on the torch side (``native``), else :attr:`run`."""
        return self.torch_run if native and self.torch_run is not None else self.run

    def make(self, device: torch.device | str, smoke: bool = False) -> Inputs:
        """Build the inputs on ``device`` at full size, or tiny with ``smoke``.

        torch's default generators are seeded with :data:`INPUT_SEED` while ``build``
        runs (and restored after), so each call gives fresh tensors with the same values.
        """
        device = torch.device(device)
        with seeded_default_generators(device):
            return self.build(device, **(self.smoke if smoke else self.params))

    def label(self, smoke: bool = False) -> str:
        """The name with the sizes that run: ``name``, or at smoke size ``smoke_name`` (derived when empty)."""
        if not smoke:
            return self.name
        return self.smoke_name or smoke_label(self.name, self.params, self.smoke)

    def dtypes(self) -> set[str]:
        """Every dtype named by the label (``"fp32->bf16"`` names two)."""
        return set(self.dtype.split("->"))


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a dtype (``torch.float16`` -> ``"fp16"``)."""
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def cast_label(src: torch.dtype, dst: torch.dtype) -> str:
    """``"fp32"`` when both are the same, else ``"fp32->bf16"``."""
    return dtype_name(src) if src == dst else f"{dtype_name(src)}->{dtype_name(dst)}"


def normalize_dtype(text: str) -> str:
    """Map a ``--dtype`` spelling to the short name used in labels."""
    word = text.strip().lower().replace("torch.", "")
    return DTYPE_ALIASES.get(word, word)


def nbytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct elements of each tensor (an expanded dim counts once)."""
    total = 0
    for tensor in tensors:
        distinct = math.prod(size for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if stride != 0)
        total += distinct * tensor.element_size() if tensor.numel() else 0
    return total


def dims(shape: tuple[int, ...]) -> str:
    """``(64, 512, 512)`` -> ``"64x512x512"``."""
    return "x".join(str(s) for s in shape)


def seeded(device: torch.device, seed: int = 0) -> torch.Generator:
    """A generator on ``device`` so inputs are the same on every side and run."""
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Seeded normal values of ``shape`` and ``dtype`` on ``device``."""
    return torch.randn(shape, generator=seeded(device, seed), device=device, dtype=dtype)


@contextlib.contextmanager
def seeded_default_generators(device: torch.device, seed: int = INPUT_SEED) -> Iterator[None]:
    """torch's default generators seeded with ``seed`` inside the block, their states restored after."""
    devices: list[int] = []
    if device.type != "cpu":
        try:
            devices = list(range(getattr(torch, device.type).device_count()))
        except Exception:  # noqa: BLE001 - a device module without RNG state: the CPU's is still restored
            devices = []
    try:
        fork = torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda")
        fork.__enter__()
    except Exception:  # noqa: BLE001 - as above
        fork = torch.random.fork_rng(devices=[])
        fork.__enter__()
    try:
        torch.manual_seed(seed)
        yield
    finally:
        fork.__exit__(None, None, None)


def _size_spellings(value: Any) -> list[str]:
    """How a size may be written in a workload's name: ``16777216`` and ``16M``; ``(8, 16)`` as ``8x16``."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return list(dict.fromkeys((str(value), _binary(value))))
    if isinstance(value, tuple) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [dims(value)]
    return []


def _binary(n: int) -> str:
    """``16777216`` -> ``"16M"``, ``1024`` -> ``"1K"`` (multiples of 2^10, 2^20, 2^30), else the digits."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


#: A size in a name: not inside a longer number or word (``x`` may join it: ``8x16``, ``idx64``).
_EDGE_BEFORE, _EDGE_AFTER = r"(?<![0-9A-Za-wyz_.])", r"(?![0-9A-Za-wyz_.])"


def smoke_label(name: str, params: Mapping[str, Any], smoke: Mapping[str, Any]) -> str:
    """``name`` with each full size replaced by its smoke size (``"neg [16M]"`` -> ``"neg [1K]"``).

    Where that cannot be done safely (a size the name does not spell, or one
    number standing for two sizes), the smoke sizes follow the name instead:
    ``"name (smoke: n=256)"``, so a smoke row never passes for a full-size one.
    """
    changed = [key for key in smoke if params.get(key) != smoke[key]]
    if not changed:
        return name
    swaps: dict[str, str] = {}
    derivable = True
    for key in changed:
        full, tiny = _size_spellings(params.get(key)), _size_spellings(smoke[key])
        found = [(f, t) for f, t in zip(full, tiny) if re.search(_EDGE_BEFORE + re.escape(f) + _EDGE_AFTER, name)]
        if not found or len(full) != len(tiny):
            derivable = False
        for f, t in found:
            derivable = derivable and swaps.setdefault(f, t) == t
    unchanged = {f for key, value in params.items() if key not in changed for f in _size_spellings(value)}
    if derivable and not unchanged & swaps.keys():
        pattern = "|".join(re.escape(f) for f in sorted(swaps, key=len, reverse=True))
        return re.sub(f"{_EDGE_BEFORE}({pattern}){_EDGE_AFTER}", lambda m: swaps[m.group(1)], name)
    return f"{name} (smoke: " + ", ".join(f"{key}={_brief(smoke[key])}" for key in changed) + ")"


def _brief(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return dims(value) if isinstance(value, tuple) else str(value)
