"""``flaggems bench --models``: real model code, torch eager against flaggems (and fused rivals), side by side.

A faster kernel that makes a model slower is a loss, so this times whole
model steps, in one process, on the same weights and inputs, on up to four
*sides*:

* ``torch``: eager torch, flaggems disabled (the reference);
* ``flaggems``: the same code with ``flaggems.enable()``;
* ``patched``: ``flaggems.enable()`` plus ``flaggems.patch(model)`` (fused
  RMSNorm, residual add + RMSNorm, SiLU-mul and rotary operators; undone with
  ``flaggems.unpatch`` when the side is left);
* ``liger``: Liger-Kernel (when ``liger_kernel`` is importable, on CUDA):
  ``apply_liger_kernel_to_llama`` / ``_qwen2`` with rope, rms_norm and swiglu
  on a deep copy of the model, flaggems disabled. Liger also rebinds names in
  transformers' modeling module (``apply_rotary_pos_emb``, ``LlamaRMSNorm``...)
  and, in older releases, class attributes: those are snapshotted before it is
  applied and swapped in only while the liger side runs, so no other side sees
  them. An API this benchmark does not know skips the side with one line.

``patched`` and ``liger`` need a transformers decoder (``patched`` also takes
the diffusers UNet); they are omitted for the UNet stack. ``--side`` picks
sides (torch always runs).

Workloads (bf16 decoders built from configs: random weights, nothing downloaded,
SDPA attention, eval mode except training) and what each takes on an H200 with
four sides (estimated from the Llama decode step of ~6 ms and Qwen2's 24 layers;
``--list`` prints them):

* ``llama_prefill``: Llama-style decoder (4 layers, hidden 1024, GQA 16/4,
  vocab 32000), ``model(input_ids)`` on 4 x 256 tokens (~10 s);
* ``llama_decode``: greedy 24 tokens after a 128-token prompt, batch 4, into a
  ``StaticCache`` (``index_copy_``), explicit ``model(...)`` loop: ms per
  generate, per prefill into the cache and per decode step (~15 s);
* ``llama_generate`` / ``llama_generate_dynamic``: ``model.generate`` with a
  static cache (its automatic ``torch.compile`` off) / the default
  ``DynamicCache`` (~15 s each);
* ``{llama,qwen2}_decode_b{1,8}_{static,dynamic}``: greedy 32 tokens after a
  128-token prompt, batch 1 or 8, ``StaticCache`` or ``DynamicCache`` (K/V grow
  every token), explicit loop; Qwen2 is the Qwen2-0.5B shape (24 layers, hidden
  896, 14/2 heads, vocab 151936, tied embeddings): ~10 s each for Llama, ~45 s
  each for Qwen2 (8 rounds, 1 warm-up step per side by default);
* ``{llama,qwen2}_prefill_512``: ``model(input_ids)`` on 4 x 512 tokens (~15 s);
* ``{llama,qwen2}_train``: train mode, ``model(ids, labels=ids).loss.backward()``
  on 4 x 256 tokens, grads zeroed each step (~15 s);
* ``{llama,qwen2}_prefill_varlen``: ``model(input_ids)`` on 2 prompts whose
  length is new at every call (a seeded permutation of 97-496: every side sees
  the same sequence), timed after 64 such calls per side, a server's steady
  state (~18 s); ``*_prefill_varlen_seen``: the same walk cut to 32 lengths
  served round and round (each twice before timing): its steady-state twin;
  both keep attention off cuDNN's SDPA (a plan built per new shape);
* ``mixtral_prefill_512`` / ``mixtral_decode_b1_dynamic``: the same two
  workloads on a Mixtral-shaped MoE decoder (4 layers, hidden 1024, 8 experts
  of 1792, top 2), a family ``flaggems.patch`` knows by form (~20 s each);
* ``unet_fwd_fp16`` / ``unet_fwd_bwd_fp32``: a UNet-style stack of Conv2d ->
  GroupNorm -> SiLU blocks on channels_last input (pure torch; torch and
  flaggems sides only, ~7 s each);
* ``sd15_unet_fwd_fp16`` / ``sd15_unet_train_fp32`` (need diffusers): diffusers'
  ``UNet2DConditionModel`` in the SD-1.5 configuration, built from its
  constructor (random weights, nothing downloaded), channels_last: the fp16
  forward of 2x4x64x64 latents with 2x77x768 text states, no grad (output
  within 3e-2 of torch's largest magnitude), and an fp32 training step on
  1x4x32x32 latents, forward + backward of ``out.square().mean()`` (output,
  loss and every gradient within 1e-4 in relative norm, 1e-3 with TF32
  convolutions); torch, flaggems and patched sides (``flaggems.patch`` fuses
  the ResnetBlock2D norms and SiLUs), ~20 s and ~30 s.

Everything: about 9 minutes with four sides (8 without the two ``sd15_*``);
``--only 'qwen2*'`` about 4.

Per workload and side: one untimed step whose output is checked against torch's
(with the ``flaggems.dispatch`` log channel on: what served each call), the
side's warm-up steps, one untimed *census* step (calls per step, below), then
``rounds`` rounds, the sides interleaved round by round with the order rotated
each round (each side takes each position equally often, so a drifting host
hits every side alike); a round is ``steps`` back-to-back steps between two
device synchronisations (by default as many as take about 200 ms on torch; a
step longer than that is timed alone), after one untimed step that follows
each change of side. Times are medians over rounds; each ratio
torch/side is the median of the rounds' pairs, with the lowest and highest.

Calls per step: the census step runs under a ``TorchDispatchMode`` that counts
every operator call reaching the dispatcher's Python key (aten ops after
autograd and composite decomposition, and ``flaggems::`` fused ops; calls made
inside a kernel are not seen), per metric phase; on CUDA it also runs under
``torch.profiler`` (CPU and CUDA activity) and counts the kernels the device
ran (memcpy/memset counted apart), binned per phase by markers at each phase
boundary. Both are outside the timed rounds.

Checks (per side, against torch's output of the same step): logits within
:data:`LOGITS_TOLERANCE` (the largest difference over the vocabulary, divided
by the largest torch logit of that row); greedy tokens equal, a row allowed to
part only at a step whose logits agree within that tolerance (a near-tie that
rounding flipped; later steps of that row are not compared); gradients within
:data:`GRAD_TOLERANCE` (norm of the difference over the norm of torch's, per
tensor), the loss within :data:`LOGITS_TOLERANCE` (relative). When a side misses those, it
still passes when it is no less accurate than torch: its error against an fp32
run of the same model (teacher-forced on torch's tokens) at most twice torch's
own bf16 error against it.

Usage::

    flaggems bench --models                          # everything, on a GPU
    flaggems bench --models --only 'qwen2*' --side patched --json models.json --plot models.png
    flaggems bench --models --smoke                  # tiny models; also on the CPU interpreter
    python benchmarks/models.py --steps 20 --rounds 15

Exit status: 0; 1 when a workload or a side raised or a side's output differs
from torch's; 2 for a usage problem or when every workload was skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fnmatch
import functools
import gc
import importlib
import importlib.util
import inspect
import math
import statistics
import sys
import time
import traceback
import types
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import flaggems

from ..testing.steady import off_replay
from . import report, runner
from .report import plot_available
from .runner import FLAGGEMS, TOLERANCES, TORCH, Target

PATCHED, LIGER = "patched", "liger"
COMPILED, PATCHED_COMPILED = "compiled", "patched+compiled"
#: Every side, in the order they run (torch first: its output is the reference).
SIDE_NAMES = (TORCH, FLAGGEMS, PATCHED, LIGER, COMPILED, PATCHED_COMPILED)
#: The sides a run has unless ``--side`` chooses (the compiled ones cost a compile per workload and side).
DEFAULT_SIDES = (TORCH, FLAGGEMS, PATCHED, LIGER)
#: The sides of the UNet stack and of any workload without a transformers model.
SIDES = (TORCH, FLAGGEMS)
SMOKE_BANNER = ("SMOKE RUN: tiny models, one step per round; the timings below are meaningless "
                "(Triton interpreter or tiny sizes); only the output checks count")
#: Logits: max over the vocabulary of |side - torch|, over the row's max |torch|, per row (bf16's 8-bit
#: mantissa rounds each logit by up to 2^-9 of itself; layers of rounding differences add a few times that).
LOGITS_TOLERANCE = 2e-2
#: Gradients: ||side - torch|| / ||torch|| per tensor. bf16 rounds every stored activation and gradient by
#: up to 2^-9; a backward compounds a few such roundings per element. Measured on CPU (a 4-layer Qwen2-0.5B-
#: shaped model, 1 x 32 tokens): torch's bf16 gradients differ from fp32 ones by up to 2.4e-2 in norm
#: (median 1.5e-2), and flaggems' patched kernels' from torch's bf16 ones by up to 3.2e-2 (median 1.6e-2),
#: while being as accurate as torch (1.3x its error against fp32). 5e-2 leaves room for deeper models and
#: still catches a wrong kernel (a wrong scale or a dropped term moves a gradient by 1e-1 or more); beyond
#: it the fp32 criterion (module docstring) still accepts a side as accurate as torch.
GRAD_TOLERANCE = 5e-2
#: The fp32 criterion: a side's error against fp32 may be this many times torch's own.
ACCURACY_FACTOR = 2.0


class ModelApiError(RuntimeError):
    """The installed transformers does not offer an API this benchmark relies on (the message says which)."""


class Skip(Exception):  # noqa: N818 - control flow, like flaggems.Decline
    """A workload that cannot run here; the message says why, in one line."""


# -- declarations -------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """How many steps and rounds are timed, and whether this is a smoke run.

    ``steps=None``: automatic; ``rounds``/``warmup`` ``None``: each workload's own
    default (:class:`ModelWorkload`), fitted to the time budget of a full run.
    """

    smoke: bool
    steps: int | None = None
    rounds: int | None = None
    warmup: int | None = None
    round_ms: float = 200.0
    max_steps: int = 200
    sides: tuple[str, ...] = DEFAULT_SIDES

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Defaults (full run, or one step and one round for ``--smoke``) overridden by the options given."""
        smoke = bool(getattr(args, "smoke", False))
        base = cls(smoke=True, steps=1, rounds=1, warmup=0) if smoke else cls(smoke=False)
        steps, rounds, warmup = (getattr(args, name, None) for name in ("steps", "rounds", "warmup"))
        chosen = tuple(getattr(args, "side", None) or ())
        sides = tuple(s for s in SIDE_NAMES if s == TORCH or s in chosen) if chosen else DEFAULT_SIDES
        return cls(smoke=smoke, steps=base.steps if steps is None else steps,
                   rounds=base.rounds if rounds is None else rounds,
                   warmup=base.warmup if warmup is None else warmup, sides=sides)

    def steps_for(self, step_ms: float) -> int:
        """Steps per round: ``steps``, or as many as take about ``round_ms`` at ``step_ms`` each."""
        if self.steps is not None:
            return self.steps
        return max(1, min(self.max_steps, round(self.round_ms / max(step_ms, 1e-3))))

    def rounds_for(self, workload: ModelWorkload) -> int:
        """``rounds``, else the workload's default."""
        return workload.rounds if self.rounds is None else self.rounds

    def warmup_for(self, workload: ModelWorkload) -> int:
        """``warmup``, else the workload's default."""
        return workload.warmup if self.warmup is None else self.warmup

    def describe(self) -> str:
        """One line for reports."""
        prefix = "SMOKE (timings meaningless): " if self.smoke else ""
        steps = (f"{self.steps} back-to-back steps" if self.steps is not None else
                 f"back-to-back steps (as many as take ~{self.round_ms:g} ms on torch, at most {self.max_steps})")
        rounds = "each workload's rounds (see --list)" if self.rounds is None else f"{self.rounds} rounds"
        warmup = "the workload's warm-up steps" if self.warmup is None else f"{self.warmup} warm-up steps"
        return (f"{prefix}wall ms per step: median over {rounds} of {steps} between device "
                f"synchronisations, after {warmup} per side; sides interleaved round by round (order rotated "
                "each round), GC paused while timing; ratio torch/side: median of the rounds' pairs "
                "[lowest-highest]")


@dataclass(frozen=True)
class Metric:
    """A reported time: the whole step (``phase=None``) or one phase of it, divided by ``per_step``."""

    name: str
    phase: str | None = None
    per_step: int = 1


@dataclass
class Check:
    """The outcome of comparing a side's output with torch's."""

    match: bool
    detail: str
    max_diff: float | None = None


class Phases:
    """Wall time of named phases inside a step; synchronises at each lap, and does nothing when off."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.totals: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> None:
        """Start the clock of the first phase (after a synchronisation)."""
        if self.device is not None:
            runner.synchronize(self.device)
            self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        """Add the time since the last start or lap to phase ``name``."""
        if self.device is None:
            return
        runner.synchronize(self.device)
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + now - self._last
        self._last = now


#: The no-op phase clock of untimed steps.
OFF = Phases()


class ModelSlot:
    """The model a workload's step runs: a side may put another in (Liger's copy) while it is active."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.original = model

    @contextlib.contextmanager
    def holding(self, model: nn.Module) -> Iterator[None]:
        """``model`` in the slot inside the block, the original after."""
        self.model = model
        try:
            yield
        finally:
            self.model = self.original


@dataclass
class Case:
    """A built workload: ``step(phases)`` returning outputs, how to check them, what to report.

    ``slot`` holds the transformers model (``None`` for plain torch modules: only
    the torch and flaggems sides run) and ``family`` its kind (``llama``,
    ``qwen2``). ``probe`` is the untimed step whose output is checked (default:
    ``step``). ``side`` names the side running now (set by the side). ``fresh_steps``,
    where steps walk a sequence of inputs: how many more steps every side can take
    before an input comes back (the timed rounds fit their steps within it).
    """

    step: Callable[[Phases], Any]
    check: Callable[[Any, Any], Check]
    params: dict[str, Any]
    metrics: tuple[Metric, ...] = (Metric("ms/step"),)
    slot: ModelSlot | None = None
    family: str | None = None
    probe: Callable[[Phases], Any] | None = None
    side: str = TORCH
    fresh_steps: Callable[[], int] | None = None

    def checked_step(self) -> Any:
        """One run of ``probe`` (or ``step``), untimed."""
        return (self.probe or self.step)(OFF)


@dataclass(frozen=True)
class ModelWorkload:
    """A named workload: ``build(device, smoke)`` makes its :class:`Case`; ``rounds``/``warmup``: defaults."""

    name: str
    description: str
    build: Callable[[torch.device, bool], Case]
    needs_transformers: bool = False
    rounds: int = 15
    warmup: int = 3
    estimate_s: int = 15


@dataclass
class MetricResult:
    """One reported time of one workload, every side (ms).

    ``ms``, ``rounds``: per side, the median and every round; ``ratios``: per
    non-torch side, ``{"median", "low", "high"}`` of the rounds' torch / side;
    ``calls``/``launches``: per side, operator calls and device kernels per
    unit of this metric (census step). ``torch_ms``, ``flaggems_ms``,
    ``ratio``, ``ratio_low``, ``ratio_high``: the torch and flaggems figures,
    as earlier versions of this report had them.
    """

    name: str
    torch_ms: float | None = None
    flaggems_ms: float | None = None
    ratio: float | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None
    ms: dict[str, float | None] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    rounds: dict[str, list[float]] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)
    launches: dict[str, float] = field(default_factory=dict)


@dataclass
class SideResult:
    """One side of one workload: ``status`` ok, omitted (does not apply), skipped (cannot run here) or error."""

    status: str = "ok"
    reason: str | None = None
    error: str | None = None
    match: bool | None = None
    check: str | None = None
    max_diff: float | None = None
    flaggems_ops: dict[str, int] = field(default_factory=dict)
    native_calls: dict[str, int] = field(default_factory=dict)
    declines: dict[str, int] = field(default_factory=dict)
    calls: int | None = None
    top_calls: dict[str, int] = field(default_factory=dict)
    kernel_launches: int | None = None
    device_copies: int | None = None
    off_replay: dict[str, dict[str, int]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ran(self) -> bool:
        """The side was checked without error (and is timed)."""
        return self.status == "ok"


@dataclass
class ModelResult:
    """Everything measured for one workload (``status``: ok, skipped or error).

    ``sides``: per side, its check, dispatch counts and calls per step. ``match``
    is every checked side's; ``check``, ``max_diff``, ``flaggems_ops``,
    ``native_calls`` and ``declines`` are the flaggems side's (as before).
    """

    workload: str
    description: str
    status: str = "ok"
    reason: str | None = None
    error: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    steps_per_round: int | None = None
    rounds: int | None = None
    match: bool | None = None
    check: str | None = None
    max_diff: float | None = None
    metrics: list[MetricResult] = field(default_factory=list)
    flaggems_ops: dict[str, int] = field(default_factory=dict)
    native_calls: dict[str, int] = field(default_factory=dict)
    declines: dict[str, int] = field(default_factory=dict)
    sides: dict[str, SideResult] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """The workload or a side raised, or a side's output differs from torch's."""
        return (self.status == "error" or self.match is False
                or any(s.status == "error" for s in self.sides.values()))

    def timed_sides(self) -> list[str]:
        """The sides that ran, in order."""
        return [name for name, side in self.sides.items() if side.ran]

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return asdict(self)


# -- checks ---------------------------------------------------------------------------
def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) tuple, list or dict, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_of(item)]
    return []


def detached_copy(value: Any) -> Any:
    """A copy of ``value`` with every tensor detached and cloned (the next step may overwrite them)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: detached_copy(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(detached_copy(v) for v in value)
    return value


def close(reference: Any, output: Any, tolerance: tuple[float, float] | None = None) -> Check:
    """Tensors equal within their dtype's tolerance, ``atol`` scaled by the reference's largest magnitude.

    ``|out - ref| <= atol * max|ref| + rtol * |ref|`` elementwise, with (rtol, atol)
    ``tolerance`` or from :data:`flaggems.bench.runner.TOLERANCES`; integers must be equal.
    """
    refs, outs = tensors_of(reference), tensors_of(output)
    if len(refs) != len(outs):
        return Check(False, f"{len(outs)} output tensors, torch gave {len(refs)}")
    worst, worst_rel, bad = 0.0, 0.0, []
    for i, (ref, out) in enumerate(zip(refs, outs)):
        if ref.shape != out.shape or ref.dtype != out.dtype:
            return Check(False, f"output {i}: {tuple(out.shape)} {out.dtype}, torch {tuple(ref.shape)} {ref.dtype}")
        diff, scale, ok = _tensor_close(ref, out, tolerance)
        worst, worst_rel = max(worst, diff), max(worst_rel, diff / scale if scale else diff)
        if not ok:
            bad.append(i)
    detail = f"{len(refs)} tensors, max abs diff {worst:.3g} ({worst_rel:.3g} of the largest magnitude)"
    return Check(not bad, detail if not bad else f"{detail}; outside tolerance: outputs {bad}", worst)


def _tensor_close(ref: torch.Tensor, out: torch.Tensor,
                  tolerance: tuple[float, float] | None) -> tuple[float, float, bool]:
    """(max abs difference, max |ref|, within tolerance) of one tensor pair."""
    if not ref.numel():
        return 0.0, 0.0, True
    if not ref.is_floating_point():
        return float((ref.long() - out.long()).abs().max().item()), 0.0, bool(torch.equal(ref, out))
    r, o = ref.double(), out.double()
    diff = float((r - o).abs().max().item())
    scale = float(r.abs().max().item())
    rtol, atol = tolerance or TOLERANCES.get(ref.dtype, (1e-4, 1e-4))
    return diff, scale, bool(torch.allclose(o, r, rtol=rtol, atol=atol * max(scale, 1e-30), equal_nan=True))


def tokens_equal(reference: torch.Tensor, output: torch.Tensor) -> Check:
    """Token ids identical; otherwise where the first difference is."""
    if reference.shape != output.shape:
        return Check(False, f"generated {tuple(output.shape)} tokens, torch {tuple(reference.shape)}")
    same = reference == output
    if bool(same.all()):
        return Check(True, f"{reference.shape[0]} sequences x {reference.shape[-1]} tokens identical", 0.0)
    row, col = (int(i) for i in (~same).nonzero()[0].tolist())
    return Check(False, f"tokens differ first at sequence {row}, position {col} "
                 f"(side {int(output[row, col])}, torch {int(reference[row, col])})")


def both(first: Check, second: Check) -> Check:
    """Two checks that must both pass, reported together."""
    return Check(first.match and second.match, f"{first.detail}; {second.detail}", second.max_diff)


def row_errors(reference: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Per row (every index but the last): max |output - reference| over the last dim / max |reference| there."""
    ref, out = reference.float(), output.float()
    return (out - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)


class Exact:
    """The fp32 reference of a workload, computed once and only when a check needs it.

    ``compute(reference_output)`` runs an fp32 copy of the model (made on first
    use, flaggems off) and returns what the outputs' floating tensors are compared with.
    """

    def __init__(self, slot: ModelSlot, compute: Callable[[nn.Module, Any], Any]) -> None:
        self.slot, self.compute = slot, compute
        self._value: Any = None

    def __call__(self, reference: Any) -> Any:
        """The fp32 values (cached), teacher-forced on ``reference`` where it holds generated tokens."""
        if self._value is None:
            with runner.flaggems_off():
                model = copy.deepcopy(self.slot.original).float()
                self._value = detached_copy(self.compute(model, reference))
                del model
        return self._value


def logits_check(reference: torch.Tensor, output: torch.Tensor, exact: Callable[[], torch.Tensor] | None = None,
                 rows: torch.Tensor | None = None) -> Check:
    """Logits within :data:`LOGITS_TOLERANCE` per row, or as accurate as torch's against ``exact()`` (fp32).

    ``rows``: a boolean mask of the rows compared (the others are not).
    """
    if reference.shape != output.shape:
        return Check(False, f"logits {tuple(output.shape)}, torch {tuple(reference.shape)}")
    errors = row_errors(reference, output)
    errors = errors if rows is None else errors[rows]
    worst = float(errors.max()) if errors.numel() else 0.0
    text = f"logits: max relative error over the vocabulary {worst:.3g}"
    if worst <= LOGITS_TOLERANCE:
        return Check(True, f"{text} <= {LOGITS_TOLERANCE:g}", worst)
    if exact is None:
        return Check(False, f"{text} > {LOGITS_TOLERANCE:g}", worst)
    return _as_accurate(text, *_against_exact(reference, output, exact(), rows), worst)


def _against_exact(reference: torch.Tensor, output: torch.Tensor, exact: torch.Tensor,
                   rows: torch.Tensor | None) -> tuple[float, float]:
    """(the side's, torch's) largest row error against the fp32 logits."""
    side, base = row_errors(exact, output), row_errors(exact, reference)
    if rows is not None:
        side, base = side[rows], base[rows]
    return float(side.max()), float(base.max())


def _as_accurate(text: str, side: float, base: float, worst: float) -> Check:
    """The fp32 criterion: the side's error against fp32 at most :data:`ACCURACY_FACTOR` x torch's."""
    ok = side <= ACCURACY_FACTOR * base
    verdict = "as accurate as torch" if ok else "less accurate than torch"
    return Check(ok, f"{text} > {LOGITS_TOLERANCE:g}; against fp32 {side:.3g}, torch's own {base:.3g} "
                     f"({verdict}: {'<=' if ok else '>'} {ACCURACY_FACTOR:g}x)", worst)


def decode_check(reference: Mapping[str, torch.Tensor], output: Mapping[str, torch.Tensor],
                 exact: Callable[[Any], torch.Tensor] | None = None) -> Check:
    """Greedy tokens equal, a row parting only at a near-tie; logits of every step compared up to there.

    ``reference``/``output``: ``tokens`` (batch x new) and ``logits`` (batch x new x vocab,
    the logits each token was chosen from). ``exact(reference)``: fp32 logits teacher-forced
    on torch's tokens (the same shape).
    """
    ref, out = reference["tokens"], output["tokens"]
    if ref.shape != out.shape:
        return Check(False, f"generated {tuple(out.shape)} tokens, torch {tuple(ref.shape)}")
    differ = ref != out
    parted = differ.any(1)
    last = torch.where(parted, differ.int().argmax(1), torch.full_like(parted, ref.shape[1] - 1, dtype=torch.long))
    rows = torch.arange(ref.shape[1], device=ref.device)[None, :] <= last[:, None]
    logits = logits_check(reference["logits"], output["logits"],
                          None if exact is None else functools.partial(exact, reference), rows.to(
                              reference["logits"].device))
    if not bool(parted.any()):
        return Check(logits.match, f"{ref.shape[0]} sequences x {ref.shape[1]} tokens identical; {logits.detail}",
                     logits.max_diff)
    where = ", ".join(f"sequence {int(r)} at token {int(last[r])}" for r in parted.nonzero().flatten()[:4])
    verdict = "near-ties that rounding flipped" if logits.match else "NOT near-ties"
    return Check(logits.match, f"tokens identical but for {int(parted.sum())} of {ref.shape[0]} sequences that part "
                               f"({where}; later tokens not compared): {verdict}; {logits.detail}", logits.max_diff)


def prefill_check(exact: Exact | None) -> Callable[[torch.Tensor, torch.Tensor], Check]:
    """The check of logits outputs, with the fp32 criterion when ``exact`` is given."""
    def check(reference: torch.Tensor, output: torch.Tensor) -> Check:
        return logits_check(reference, output, None if exact is None else functools.partial(exact, reference))

    return check


def _relative_norm(reference: torch.Tensor, output: torch.Tensor) -> float:
    ref = reference.double()
    return float((output.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def grads_check(reference: Sequence[torch.Tensor], output: Sequence[torch.Tensor],
                exact: Callable[[], Sequence[torch.Tensor]] | None = None) -> Check:
    """``[loss, *grads]``: each within :data:`GRAD_TOLERANCE` (loss: :data:`LOGITS_TOLERANCE`), relative norm.

    A tensor outside it still passes when its error against ``exact()`` (fp32) is at
    most :data:`ACCURACY_FACTOR` x torch's own.
    """
    refs, outs = tensors_of(reference), tensors_of(output)
    if len(refs) != len(outs) or any(r.shape != o.shape for r, o in zip(refs, outs)):
        return Check(False, f"{len(outs)} loss/gradient tensors, torch gave {len(refs)} (or shapes differ)")
    errors = [_relative_norm(r, o) for r, o in zip(refs, outs)]
    limits = [LOGITS_TOLERANCE, *[GRAD_TOLERANCE] * (len(refs) - 1)]
    outside = [i for i, (e, limit) in enumerate(zip(errors, limits)) if e > limit]
    worst = max(errors[1:], default=0.0)
    text = (f"loss relative error {errors[0]:.3g}; {len(refs) - 1} gradients, max relative norm error "
            f"{worst:.3g} (median {statistics.median(errors[1:]) if errors[1:] else 0:.3g}), tolerance "
            f"{GRAD_TOLERANCE:g}")
    if not outside:
        return Check(True, text, worst)
    if exact is None:
        return Check(False, f"{text}; outside: {len(outside)} tensors (first: {outside[0]})", worst)
    return _judged_against(text, worst, outside, refs, outs, tensors_of(exact()), "fp32")


def _judged_against(text: str, worst: float, outside: Sequence[int], refs: Sequence[torch.Tensor],
                    outs: Sequence[torch.Tensor], exact: Sequence[torch.Tensor], what: str) -> Check:
    """The tensors ``outside`` the tolerance pass when each is at most :data:`ACCURACY_FACTOR` x as far from
    ``exact`` (relative norm) as torch's own."""
    side = [_relative_norm(exact[i], outs[i]) for i in outside]
    base = [_relative_norm(exact[i], refs[i]) for i in outside]
    worse = [i for i, a, b in zip(outside, side, base) if a > ACCURACY_FACTOR * b]
    verdict = (f"the {len(outside)} outside it are as accurate as torch against {what} (worst {max(side):.3g}, "
               f"torch's {max(base):.3g}; <= {ACCURACY_FACTOR:g}x each)" if not worse else
               f"{len(worse)} less accurate than torch against {what} (first: tensor {worse[0]})")
    return Check(not worse, f"{text}; {verdict}", worst)


# -- the UNet-style stack ---------------------------------------------------------------
UNET_FULL = {"channels": 320, "groups": 32, "blocks": 4, "batch": 2, "size": 64}
UNET_SMOKE = {"channels": 8, "groups": 2, "blocks": 4, "batch": 1, "size": 8}
#: (rtol, atol) of fp32 results whose convolutions ran in TF32 (cuDNN's default on CUDA): its 10-bit
#: mantissa rounds a conv input that differs in its last fp32 bits either way, by up to 2^-11 of it.
TF32_TOLERANCE = (5e-3, 5e-3)


def unet_stack(channels: int, groups: int, blocks: int) -> nn.Sequential:
    """``blocks`` x (Conv2d(channels, channels, 3, padding=1) -> GroupNorm(groups, channels) -> SiLU)."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(groups, channels), nn.SiLU()]
    return nn.Sequential(*layers)


def _unet(device: torch.device, smoke: bool, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, dict[str, Any]]:
    """The stack and its input, both channels_last, with their parameters for the report."""
    p = UNET_SMOKE if smoke else UNET_FULL
    torch.manual_seed(0)
    model = unet_stack(p["channels"], p["groups"], p["blocks"])
    model = model.to(device=device, dtype=dtype, memory_format=torch.channels_last)
    x = torch.randn(p["batch"], p["channels"], p["size"], p["size"], device=device, dtype=dtype)
    x = x.to(memory_format=torch.channels_last)
    shape = "x".join(str(d) for d in x.shape)
    return model, x, {**p, "input": f"{shape} channels_last", "dtype": str(dtype).removeprefix("torch.")}


def build_unet_forward(device: torch.device, smoke: bool) -> Case:
    """UNet-style stack, fp16 forward without grad."""
    model, x, params = _unet(device, smoke, torch.float16)
    model.eval()

    def step(phases: Phases) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    return Case(step, close, params)


def build_unet_backward(device: torch.device, smoke: bool) -> Case:
    """UNet-style stack, fp32 forward + backward of ``out.float().square().mean()``, grads zeroed each step."""
    model, x, params = _unet(device, smoke, torch.float32)
    model.train()
    weights = list(model.parameters())
    tf32 = device.type == "cuda" and torch.backends.cudnn.allow_tf32

    def step(phases: Phases) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model(x)
        loss = out.float().square().mean()
        loss.backward()
        return [out.detach(), loss.detach(), *(w.grad for w in weights)]

    params = {**params, "loss": "out.float().square().mean()", "checked": "output, loss, every grad", "tf32_conv": tf32}
    return Case(step, functools.partial(close, tolerance=TF32_TOLERANCE if tf32 else None), params)


# -- the diffusers UNet (SD-1.5) -----------------------------------------------------------
#: ``UNet2DConditionModel`` arguments of the SD-1.5 UNet (its constructor's defaults otherwise: 4 latent
#: channels in and out, 32 groups, SiLU); the smoke UNet keeps its block kinds at a tiny size.
SD15_FULL = {"block_out_channels": (320, 640, 1280, 1280), "layers_per_block": 2, "cross_attention_dim": 768,
             "attention_head_dim": 8, "norm_num_groups": 32, "sample_size": 64,
             "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                  "DownBlock2D"),
             "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")}
SD15_SMOKE = {"block_out_channels": (32, 64), "layers_per_block": 1, "cross_attention_dim": 32,
              "attention_head_dim": 8, "norm_num_groups": 8, "sample_size": 8,
              "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
              "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D")}
#: Per workload: (batch, latent height = width, text tokens), full size and smoke.
SD15_RUNS = {"fwd": (2, 64, 77), "train": (1, 32, 77)}
SD15_RUNS_SMOKE = {"fwd": (2, 8, 5), "train": (1, 8, 5)}
#: The fp16 forward's check: max |side - torch| over the largest |torch| (issue 41's target).
SD15_FP16_TOLERANCE = (0.0, 3e-2)
#: The training step's check: ||side - torch|| / ||torch|| per tensor (output, loss, every gradient), fp32
#: (TF32 convolutions on CUDA: both sides round their inputs to 10 bits, differently where they differ; torch's
#: own TF32 step is up to 4e-3 from a step without TF32 on an H200, so a tensor beyond the tolerance is judged
#: against that step, see :func:`_relative_norms`).
SD15_GRAD_TOLERANCE = {False: 1e-4, True: 1e-3}
SD15_FAMILY = "sd15_unet"


def _diffusers() -> Any:
    """The diffusers module, or :class:`Skip` when it is not installed."""
    try:
        import diffusers
    except ImportError as exc:
        raise Skip(f"diffusers is not importable ({exc}); pip install diffusers") from exc
    return diffusers


def build_sd15_unet(device: torch.device, smoke: bool, dtype: torch.dtype, run: str,
                    ) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, Any]]:
    """The UNet (random weights, seed 0, channels_last) and one step's inputs, with the report's parameters."""
    diffusers = _diffusers()
    config = SD15_SMOKE if smoke else SD15_FULL
    batch, size, tokens = (SD15_RUNS_SMOKE if smoke else SD15_RUNS)[run]
    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(in_channels=4, out_channels=4, **config)
    model = model.to(device=device, dtype=dtype, memory_format=torch.channels_last)
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, 4, size, size, generator=generator).to(device=device, dtype=dtype)
    inputs = {"sample": latents.contiguous(memory_format=torch.channels_last),
              "timestep": torch.full((batch,), 500, dtype=torch.long, device=device),
              "encoder_hidden_states": torch.randn(batch, tokens, config["cross_attention_dim"],
                                                   generator=generator).to(device=device, dtype=dtype)}
    params = {"config": "SD-1.5" if not smoke else "tiny (smoke)", "block_out_channels": config["block_out_channels"],
              "layers_per_block": config["layers_per_block"], "cross_attention_dim": config["cross_attention_dim"],
              "latents": f"{batch}x4x{size}x{size} channels_last", "text": f"{batch}x{tokens}", "timestep": 500,
              "dtype": str(dtype).removeprefix("torch."), "diffusers": diffusers.__version__}
    return model, inputs, params


def build_sd15_forward(device: torch.device, smoke: bool) -> Case:
    """The SD-1.5 UNet's fp16 forward without grad (``model(sample, t, encoder_hidden_states).sample``)."""
    model, inputs, params = build_sd15_unet(device, smoke, torch.float16, "fwd")
    slot = ModelSlot(model.eval())

    def step(phases: Phases) -> torch.Tensor:
        with torch.no_grad():
            return slot.model(**inputs).sample

    check = functools.partial(close, tolerance=SD15_FP16_TOLERANCE)
    params = {**params, "checked": f"output, max |diff| <= {SD15_FP16_TOLERANCE[1]:g} x max |torch|"}
    return Case(step, check, params, slot=slot, family=SD15_FAMILY)


def _relative_norms(reference: Any, output: Any, limit: float,
                    exact: Callable[[], Any] | None = None) -> Check:
    """Each tensor's ``||side - torch|| / ||torch||`` within ``limit``; a tensor outside it still passes
    when its error against ``exact()`` (fp32 without TF32) is at most :data:`ACCURACY_FACTOR` x torch's own."""
    refs, outs = tensors_of(reference), tensors_of(output)
    if len(refs) != len(outs) or any(r.shape != o.shape for r, o in zip(refs, outs)):
        return Check(False, f"{len(outs)} tensors, torch gave {len(refs)} (or shapes differ)")
    errors = [_relative_norm(r, o) for r, o in zip(refs, outs)]
    outside = [i for i, e in enumerate(errors) if not e <= limit]
    text = f"{len(refs)} tensors (output, loss, gradients): max relative norm error {max(errors):.3g}, " \
           f"tolerance {limit:g}"
    if not outside:
        return Check(True, text, max(errors))
    if exact is None:
        return Check(False, f"{text}; outside: {len(outside)} (first: {outside[0]})", max(errors))
    return _judged_against(text, max(errors), outside, refs, outs, tensors_of(exact()), "fp32 without TF32")


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """cuDNN convolutions and matmuls in full fp32 inside the block."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def sd15_train_step(net: nn.Module, inputs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """One training step of ``net``: output, loss and every parameter's gradient."""
    net.zero_grad(set_to_none=True)
    out = net(**inputs).sample
    loss = out.float().square().mean()
    loss.backward()
    return [out.detach(), loss.detach(), *(w.grad for w in net.parameters())]


def build_sd15_train(device: torch.device, smoke: bool) -> Case:
    """The SD-1.5 UNet's fp32 training step: forward + backward of ``out.square().mean()``, grads zeroed."""
    model, inputs, params = build_sd15_unet(device, smoke, torch.float32, "train")
    slot = ModelSlot(model.train())
    tf32 = device.type == "cuda" and torch.backends.cudnn.allow_tf32
    cached: list[Any] = []

    def step(phases: Phases) -> list[torch.Tensor]:
        return sd15_train_step(slot.model, inputs)

    def exact() -> Any:
        """torch's step without TF32 on a copy of the unpatched model (cached)."""
        if not cached:
            with runner.flaggems_off(), no_tf32():
                twin = copy.deepcopy(slot.original)
                cached.append(detached_copy(sd15_train_step(twin, inputs)))
                del twin
        return cached[0]

    check = functools.partial(_relative_norms, limit=SD15_GRAD_TOLERANCE[tf32], exact=exact if tf32 else None)
    params = {**params, "mode": "train", "loss": "out.float().square().mean()", "tf32_conv": tf32,
              "checked": "output, loss, every gradient (relative norm; beyond it, against fp32 without TF32)"}
    return Case(step, check, params, slot=slot, family=SD15_FAMILY)


# -- transformers decoders --------------------------------------------------------------
LLAMA_FULL = {"layers": 4, "hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 4, "vocab": 32000,
              "batch": 4, "seq": 256, "decode_batch": 4, "prompt": 128, "new_tokens": 24}
LLAMA_SMOKE = {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 256,
               "batch": 2, "seq": 8, "decode_batch": 2, "prompt": 4, "new_tokens": 4}
#: The shape of Qwen2-0.5B (tied input and output embeddings).
QWEN2_FULL = {"layers": 24, "hidden": 896, "intermediate": 4864, "heads": 14, "kv_heads": 2, "vocab": 151936}
QWEN2_SMOKE = {"layers": 1, "hidden": 64, "intermediate": 160, "heads": 4, "kv_heads": 2, "vocab": 384}
#: A Mixtral-shaped MoE decoder (8 experts, top 2) the size of the Llama one: ``flaggems.patch`` knows its
#: modules by form (their code reads as Llama's RMSNorm and rotary, its layer as Mixtral's), not by name.
MIXTRAL_FULL = {"layers": 4, "hidden": 1024, "intermediate": 1792, "heads": 16, "kv_heads": 4, "vocab": 32000}
MIXTRAL_SMOKE = {"layers": 1, "hidden": 64, "intermediate": 96, "heads": 4, "kv_heads": 2, "vocab": 256}
LLAMA_DTYPE = torch.bfloat16
#: Sizes of the per-family workloads (``*_decode_b*``, ``*_prefill_512``, ``*_train``, ``*_prefill_varlen``).
RUNS_FULL = {"prefill": (4, 512), "prompt": 128, "new_tokens": 32, "decode_batch": {1: 1, 8: 8}, "train": (4, 256),
             "varlen_batch": 2, "varlen": (97, 496)}
RUNS_SMOKE = {"prefill": (2, 8), "prompt": 4, "new_tokens": 3, "decode_batch": {1: 1, 8: 2}, "train": (2, 8),
              "varlen_batch": 2, "varlen": (3, 12)}
#: Untimed new lengths a varlen prefill side serves first: a server's steady state. On the CPU (the fused ops
#: of a Qwen2 layer, hidden 64, 200 new lengths) the plans' misses were 63 in the first 50 lengths (each a
#: recording, and the first of a kernel variant a Triton compile), 8 in the next 50, 2 in the 100 after.
VARLEN_WARMUP = 64
#: The varlen prefill's steady-state twin (``*_prefill_varlen_seen``) cycles over this many lengths of the same
#: permutation, each served twice in its warm-up: the ratio a new length at every call is held against.
SEEN_LENGTHS = 32
#: Attention backends of the varlen prefills. cuDNN's SDPA builds an execution plan per new shape (46.6 ms
#: over 24 Qwen2 layers at one new length, H200): whichever side meets a length first pays it for all, so
#: it moved round ratios 0.2-5.7x; flash (then memory-efficient, then math on the CPU) has no such cost.
VARLEN_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


@dataclass(frozen=True)
class Family:
    """A transformers decoder family: its config and model classes (by prefix) and sizes."""

    name: str
    prefix: str
    full: Mapping[str, int]
    smoke: Mapping[str, int]
    extra: Mapping[str, Any] = field(default_factory=dict)

    def sizes(self, smoke: bool) -> Mapping[str, int]:
        """The model's sizes for a full or a smoke run."""
        return self.smoke if smoke else self.full


LLAMA = Family("llama", "Llama", LLAMA_FULL, LLAMA_SMOKE)
QWEN2 = Family("qwen2", "Qwen2", QWEN2_FULL, QWEN2_SMOKE, {"tie_word_embeddings": True})
MIXTRAL = Family("mixtral", "Mixtral", MIXTRAL_FULL, MIXTRAL_SMOKE, {"num_local_experts": 8, "num_experts_per_tok": 2})


def transformers_available() -> bool:
    """True when ``transformers`` can be imported."""
    return importlib.util.find_spec("transformers") is not None


def _transformers() -> Any:
    """The transformers module, or :class:`Skip` when it is not installed."""
    try:
        import transformers
    except ImportError as exc:
        raise Skip(f"transformers is not importable ({exc}); pip install transformers") from exc
    return transformers


def _attribute(module: Any, name: str) -> Any:
    """``module.name``, or a :class:`ModelApiError` naming the version."""
    try:
        return getattr(module, name)
    except AttributeError as exc:
        raise ModelApiError(f"transformers {module.__version__} has no {name}") from exc


def build_decoder(family: Family, device: torch.device, p: Mapping[str, int]) -> Any:
    """A ``<Family>ForCausalLM`` from its config with random weights (seed 0), bf16, SDPA, eval mode."""
    transformers = _transformers()
    config_class = _attribute(transformers, f"{family.prefix}Config")
    model_class = _attribute(transformers, f"{family.prefix}ForCausalLM")
    config = config_class(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                          num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                          num_key_value_heads=p["kv_heads"], max_position_embeddings=2048,
                          attn_implementation="sdpa", **family.extra)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)
    return model.to(device=device, dtype=LLAMA_DTYPE).eval()


def build_llama(device: torch.device, p: Mapping[str, int]) -> Any:
    """A ``LlamaForCausalLM`` from a ``LlamaConfig`` with random weights (seed 0), bf16, eval mode."""
    return build_decoder(LLAMA, device, p)


def _llama_params(model: Any, p: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The sizes of a decoder workload, with the transformers version and the attention implementation."""
    import transformers

    attention = getattr(model.config, "_attn_implementation", None)
    return {**{k: p[k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", *keys)},
            "dtype": "bf16", "transformers": transformers.__version__, "attention": attention,
            "tied_embeddings": bool(getattr(model.config, "tie_word_embeddings", False))}


def _token_ids(p: Mapping[str, int], batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Random prompt ids (seed 1), the same on every side."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, p["vocab"], (batch, length), generator=generator).to(device)


def _logits_of(ids: torch.Tensor) -> Callable[[nn.Module, Any], torch.Tensor]:
    """fp32 reference of a prefill: ``model(ids).logits``."""
    def compute(model: nn.Module, reference: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).logits

    return compute


def _teacher_forced(prompt: torch.Tensor) -> Callable[[nn.Module, Any], torch.Tensor]:
    """fp32 reference of a greedy decode: the logits of prompt + torch's tokens, each token's position."""
    def compute(model: nn.Module, reference: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ids = torch.cat([prompt, reference["tokens"][:, :-1].to(prompt.device)], dim=1)
        with torch.no_grad():
            return model(input_ids=ids).logits[:, prompt.shape[1] - 1:]

    return compute


def _prefill_case(family: Family, model: Any, ids: torch.Tensor, params: dict[str, Any]) -> Case:
    """``model(ids).logits`` on the model in the slot, checked as logits."""
    slot = ModelSlot(model)

    def step(phases: Phases) -> torch.Tensor:
        with torch.no_grad():
            return slot.model(input_ids=ids).logits

    return Case(step, prefill_check(Exact(slot, _logits_of(ids))), params, slot=slot, family=family.name)


def build_llama_prefill(device: torch.device, smoke: bool) -> Case:
    """``model(input_ids)`` on ``batch`` prompts of ``seq`` tokens; the logits are checked."""
    p = LLAMA.sizes(smoke)
    model = build_llama(device, p)
    ids = _token_ids(p, p["batch"], p["seq"], device)
    return _prefill_case(LLAMA, model, ids, _llama_params(model, p, ("batch", "seq")))


def build_prefill(family: Family, device: torch.device, smoke: bool) -> Case:
    """``model(input_ids)`` on the ``prefill`` batch x tokens of :data:`RUNS_FULL`; the logits are checked."""
    p, runs = family.sizes(smoke), RUNS_SMOKE if smoke else RUNS_FULL
    batch, seq = runs["prefill"]
    model = build_decoder(family, device, p)
    ids = _token_ids(p, batch, seq, device)
    return _prefill_case(family, model, ids, {**_llama_params(model, p, ()), "batch": batch, "seq": seq})


def build_prefill_varlen(family: Family, device: torch.device, smoke: bool, seen: int | None = None) -> Case:
    """``model(input_ids)`` on 2 prompts of a new length each call (a seeded permutation of the range, so no
    length comes back before all have been served; each side walks it alike).

    The checked step uses the first length; warm-up and timed steps walk the rest, a cursor per side.
    ``seen``: walk only the next ``seen`` lengths, round and round (the steady state of the same lengths).
    """
    p, runs = family.sizes(smoke), RUNS_SMOKE if smoke else RUNS_FULL
    low, high = runs["varlen"]
    lengths = (low + torch.randperm(high + 1 - low, generator=torch.Generator().manual_seed(2))).tolist()
    model = build_decoder(family, device, p)
    ids = _token_ids(p, runs["varlen_batch"], high, device)
    prompts = {length: ids[:, :length].contiguous() for length in set(lengths)}
    cursors: Counter[str] = Counter()
    walked = len(lengths) - 1 if seen is None else min(seen, len(lengths) - 1)
    slot = ModelSlot(model)
    backends = [getattr(SDPBackend, name) for name in VARLEN_SDPA]

    def forward(length: int) -> torch.Tensor:
        with torch.no_grad(), sdpa_kernel(backends):
            return slot.model(input_ids=prompts[length]).logits

    def step(phases: Phases) -> torch.Tensor:
        index = cursors[case.side]
        cursors[case.side] += 1
        return forward(lengths[1 + index % walked])

    params = {**_llama_params(model, p, ()), "batch": runs["varlen_batch"], "lengths": f"{low}-{high}",
              "seed": 2, "first_lengths": lengths[:8], "checked_length": lengths[0],
              "lengths_walked": walked, "sdpa": "/".join(VARLEN_SDPA).lower()}
    check = prefill_check(Exact(slot, _logits_of(prompts[lengths[0]])))

    def fresh_steps() -> int:
        return walked - max((n for name, n in cursors.items() if name != "fit"), default=0)

    case = Case(step, check, params, slot=slot, family=family.name, probe=lambda phases: forward(lengths[0]),
                fresh_steps=fresh_steps if seen is None else None)
    return case


def build_train(family: Family, device: torch.device, smoke: bool) -> Case:
    """Train mode, ``model(ids, labels=ids).loss.backward()``, grads zeroed (``None``) each step."""
    p, runs = family.sizes(smoke), RUNS_SMOKE if smoke else RUNS_FULL
    batch, seq = runs["train"]
    model = build_decoder(family, device, p).train()
    ids = _token_ids(p, batch, seq, device)
    slot = ModelSlot(model)

    def run(net: nn.Module) -> list[torch.Tensor]:
        net.zero_grad(set_to_none=True)
        loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        return [loss.detach(), *(w.grad for w in net.parameters())]

    def exact(net: nn.Module, reference: Any) -> list[torch.Tensor]:
        return run(net.train())

    def check(reference: Any, output: Any) -> Check:
        return grads_check(reference, output, lambda: fp32(reference))

    fp32 = Exact(slot, exact)
    params = {**_llama_params(model, p, ()), "batch": batch, "seq": seq, "mode": "train",
              "loss": "model(ids, labels=ids).loss", "checked": "loss, every gradient"}
    return Case(lambda phases: run(slot.model), check, params, slot=slot, family=family.name)


@dataclass(frozen=True)
class LlamaApi:
    """How this transformers version's forward takes the cache (found by inspecting the signature)."""

    cache_kwarg: str
    cache_position: bool
    logits_kwarg: str | None

    @classmethod
    def of(cls, forward: Callable[..., Any]) -> LlamaApi:
        """Read the keyword names off ``forward``'s signature; :class:`ModelApiError` if none takes a cache."""
        params = inspect.signature(forward).parameters
        cache = next((name for name in ("cache", "past_key_values") if name in params), None)
        if cache is None:
            raise ModelApiError(f"forward{inspect.signature(forward)} takes neither cache= (transformers 5.x) "
                                "nor past_key_values= (4.x)")
        logits = next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in params), None)
        return cls(cache, "cache_position" in params, logits)


def static_cache_kwargs(cache_class: type, config: Any, batch: int, max_len: int, device: torch.device,
                        dtype: torch.dtype) -> dict[str, Any]:
    """Keyword arguments for ``StaticCache``, fitted to its signature (transformers 4.4x-4.5x and 5.x).

    4.4x takes ``batch_size`` (``max_batch_size`` deprecated), 4.5x ``max_batch_size``;
    both want ``device`` and ``dtype``. 5.x takes ``config`` and ``max_cache_len`` only
    (batch, device and dtype come from the first update). A required parameter
    that is none of these is a :class:`ModelApiError` quoting the signature.
    """
    signature = inspect.signature(cache_class.__init__)
    params = signature.parameters
    known: dict[str, Any] = {"config": config, "max_cache_len": max_len, "device": device, "dtype": dtype}
    batch_name = next((name for name in ("batch_size", "max_batch_size") if name in params), None)
    if batch_name is not None:
        known[batch_name] = batch
    kwargs = {name: value for name, value in known.items() if name in params}
    required = [name for name, prm in params.items() if name != "self" and prm.default is prm.empty
                and prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY)]
    unknown = [name for name in required if name not in kwargs]
    if unknown or "max_cache_len" not in kwargs:
        raise ModelApiError(f"{cache_class.__name__}{signature}: cannot fill {unknown or ['max_cache_len']} "
                            "(this benchmark knows config, batch_size/max_batch_size, max_cache_len, device, dtype)")
    return kwargs


def static_cache(config: Any, batch: int, max_len: int, device: torch.device) -> Any:
    """A ``transformers.StaticCache`` for ``batch`` sequences of up to ``max_len`` tokens (bf16)."""
    cache_class = _attribute(_transformers(), "StaticCache")
    kwargs = static_cache_kwargs(cache_class, config, batch, max_len, device, LLAMA_DTYPE)
    try:
        return cache_class(**kwargs)
    except TypeError as exc:
        raise ModelApiError(f"StaticCache({', '.join(kwargs)}) failed: {exc}; "
                            f"signature {inspect.signature(cache_class.__init__)}") from exc


def rewind_static_cache(cache: Any, length: int) -> None:
    """Set a StaticCache's own write position back to ``length``: transformers 5.x keeps it per layer as a
    device counter that each ``update`` advances, whatever ``cache_position`` says. A decode step repeated
    (timed, warmed up, captured in a CUDA graph) otherwise writes each call one slot further, past the rows
    the mask and rotary positions describe; older caches (no counter) need nothing."""
    for layer in getattr(cache, "layers", ()):
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(length)
        elif isinstance(counter, int):
            layer.cumulative_length = length
        if isinstance(getattr(layer, "cumulative_length_int", None), int):
            layer.cumulative_length_int = length


def dynamic_cache() -> Any:
    """An empty ``transformers.DynamicCache`` (grows with every token)."""
    cache_class = _attribute(_transformers(), "DynamicCache")
    try:
        return cache_class()
    except TypeError as exc:
        signature = inspect.signature(cache_class.__init__)
        raise ModelApiError(f"DynamicCache() failed: {exc}; signature {signature}") from exc


class GreedyDecoder:
    """Greedy decoding of ``new_tokens`` tokens, one ``model(...)`` call per token, into a static or dynamic cache.

    ``model`` is a model or a :class:`ModelSlot` (whose model may change between calls).
    """

    def __init__(self, model: Any, prompt: torch.Tensor, new_tokens: int, cache: str = "static") -> None:
        self.slot = model if isinstance(model, ModelSlot) else ModelSlot(model)
        self.prompt, self.new_tokens, self.kind = prompt, new_tokens, cache
        self.api = LlamaApi.of(self.model.forward)
        length = prompt.shape[1]
        self.cache = (static_cache(self.model.config, prompt.shape[0], length + new_tokens, prompt.device)
                      if cache == "static" else dynamic_cache())
        self.positions = torch.arange(length + new_tokens, device=prompt.device)

    @property
    def model(self) -> Any:
        """The model decoding now."""
        return self.slot.model

    def forward(self, ids: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        """Logits of ``ids`` written into the cache at positions ``start...``."""
        kwargs: dict[str, Any] = {self.api.cache_kwarg: self.cache, "use_cache": True}
        if self.api.cache_position:
            kwargs["cache_position"] = self.positions[start:start + ids.shape[1]]
        if last_only and self.api.logits_kwarg:
            kwargs[self.api.logits_kwarg] = 1
        return self.model(input_ids=ids, **kwargs).logits

    def _fresh_cache(self) -> None:
        if self.kind == "static":
            self.cache.reset()
        else:
            self.cache = dynamic_cache()

    def run(self, phases: Phases, keep_logits: bool = False) -> dict[str, torch.Tensor]:
        """Reset the cache, prefill the prompt, decode; laps ``prefill`` and ``decode``.

        Returns ``tokens`` and ``first_logits``, and with ``keep_logits`` ``logits``: every
        token's logits (batch x new_tokens x vocab).
        """
        with torch.no_grad():
            phases.start()
            self._fresh_cache()
            length = self.prompt.shape[1]
            first = self.forward(self.prompt, 0, last_only=True)[:, -1]
            token = first.argmax(-1, keepdim=True)
            tokens, logits = [token], [first]
            phases.lap("prefill")
            for i in range(self.new_tokens - 1):
                step = self.forward(token, length + i)[:, -1]
                token = step.argmax(-1, keepdim=True)
                tokens.append(token)
                if keep_logits:
                    logits.append(step)
            phases.lap("decode")
        out = {"tokens": torch.cat(tokens, dim=1), "first_logits": first}
        if keep_logits:
            out["logits"] = torch.stack(logits, dim=1)
        return out

    def __call__(self, phases: Phases) -> dict[str, torch.Tensor]:
        """One timed generate (no logits kept past their step)."""
        return self.run(phases)

    def probe(self, phases: Phases) -> dict[str, torch.Tensor]:
        """One generate keeping every step's logits (for the check)."""
        return self.run(phases, keep_logits=True)


DECODE_METRICS = ("ms/generate", "ms/prefill (cache)", "ms/decode step")


def _decode_case(family: Family, model: Any, prompt: torch.Tensor, new_tokens: int, cache: str,
                 params: dict[str, Any]) -> Case:
    """A :class:`GreedyDecoder` as a case: per generate, per prefill into the cache, per decode step."""
    slot = ModelSlot(model)
    decoder = GreedyDecoder(slot, prompt, new_tokens, cache)
    api = decoder.api
    params = {**params, "cache": "StaticCache" if cache == "static" else "DynamicCache",
              "forward_kwargs": [api.cache_kwarg, *(["cache_position"] if api.cache_position else []),
                                 *([api.logits_kwarg] if api.logits_kwarg else [])]}
    metrics = (Metric(DECODE_METRICS[0]), Metric(DECODE_METRICS[1], "prefill"),
               Metric(DECODE_METRICS[2], "decode", max(1, new_tokens - 1)))
    check = functools.partial(decode_check, exact=Exact(slot, _teacher_forced(prompt)))
    return Case(decoder, check, params, metrics, slot=slot, family=family.name, probe=decoder.probe)


def build_llama_decode(device: torch.device, smoke: bool) -> Case:
    """Greedy decode with a ``StaticCache``: whole generate, the prefill into the cache, each decode step."""
    p = LLAMA.sizes(smoke)
    model = build_llama(device, p)
    prompt = _token_ids(p, p["decode_batch"], p["prompt"], device)
    return _decode_case(LLAMA, model, prompt, p["new_tokens"], "static",
                        _llama_params(model, p, ("decode_batch", "prompt", "new_tokens")))


def build_decode(family: Family, batch: int, cache: str, device: torch.device, smoke: bool) -> Case:
    """Greedy decode of ``new_tokens`` after a ``prompt``-token prompt, ``batch`` (1 or 8) sequences, ``cache``."""
    p, runs = family.sizes(smoke), RUNS_SMOKE if smoke else RUNS_FULL
    size = runs["decode_batch"][batch]
    model = build_decoder(family, device, p)
    prompt = _token_ids(p, size, runs["prompt"], device)
    params = {**_llama_params(model, p, ()), "decode_batch": size, "prompt": runs["prompt"],
              "new_tokens": runs["new_tokens"]}
    return _decode_case(family, model, prompt, runs["new_tokens"], cache, params)
def generate_kwargs(generation_config_class: type, new_tokens: int, static: bool = True) -> dict[str, Any]:
    """``generate()`` keywords: greedy, exactly ``new_tokens`` tokens, no automatic compile; a static cache or
    (``static=False``) the default dynamic one.

    transformers 4.48+ ``torch.compile``s the forward of a static-cache generate on
    CUDA, which would bypass flaggems: ``disable_compile=True`` turns that off where
    it exists; a version with automatic compile (``compile_config``) but no
    ``disable_compile`` is a :class:`Skip`; older versions never compile.
    """
    defaults = generation_config_class()
    kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    if static:
        kwargs["cache_implementation"] = "static"
    if hasattr(defaults, "disable_compile"):
        kwargs["disable_compile"] = True
    elif static and hasattr(defaults, "compile_config"):
        raise Skip("this transformers compiles a static-cache generate() and has no GenerationConfig.disable_compile "
                   "to stop it (compiled code bypasses flaggems); llama_decode covers the static cache")
    return kwargs


def build_llama_generate(device: torch.device, smoke: bool, static: bool = True) -> Case:
    """``model.generate(..., do_sample=False[, cache_implementation="static"])``; tokens and logits checked.

    The checked step also asks for ``output_logits`` (where the version has it) so a
    row that parts from torch's at a near-tie is told from a wrong one.
    """
    p = LLAMA.sizes(smoke)
    transformers = _transformers()
    config_class = _attribute(transformers, "GenerationConfig")
    kwargs = generate_kwargs(config_class, p["new_tokens"], static)
    model = build_llama(device, p)
    model.generation_config.pad_token_id = model.config.eos_token_id
    slot = ModelSlot(model)
    prompt = _token_ids(p, p["decode_batch"], p["prompt"], device)
    mask = torch.ones_like(prompt)

    def step(phases: Phases) -> torch.Tensor:
        with torch.no_grad():
            return slot.model.generate(input_ids=prompt, attention_mask=mask, **kwargs)[:, prompt.shape[1]:]

    def probe(phases: Phases) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            out = slot.model.generate(input_ids=prompt, attention_mask=mask, output_logits=True,
                                      return_dict_in_generate=True, **kwargs)
        return {"tokens": out.sequences[:, prompt.shape[1]:], "logits": torch.stack(out.logits, dim=1)}

    params = {**_llama_params(model, p, ("decode_batch", "prompt", "new_tokens")),
              "generate": {k: v for k, v in kwargs.items() if k != "min_new_tokens"}}
    if not hasattr(config_class(), "output_logits"):  # transformers < 4.38: tokens only
        return Case(step, tokens_equal, params, (Metric("ms/generate"),), slot=slot, family=LLAMA.name)
    check = functools.partial(decode_check, exact=Exact(slot, _teacher_forced(prompt)))
    return Case(step, check, params, (Metric("ms/generate"),), slot=slot, family=LLAMA.name, probe=probe)


def _family_workloads(family: Family, first: str) -> tuple[ModelWorkload, ...]:
    """The prefill, varlen prefill, training and decode workloads of one family (``first`` describes the model)."""
    runs = RUNS_FULL
    title = f"the same {family.prefix} decoder"
    batch, seq = runs["prefill"]
    low, high = runs["varlen"]
    train_batch, train_seq = runs["train"]
    long_decode = family is QWEN2
    out = [
        ModelWorkload(f"{family.name}_prefill_512", f"{first}: model(input_ids), batch {batch} x {seq} tokens",
                      functools.partial(build_prefill, family), needs_transformers=True,
                      estimate_s=20 if long_decode else 17),
        ModelWorkload(f"{family.name}_prefill_varlen", f"{title}: model(input_ids), batch {runs['varlen_batch']}, "
                      f"a new prompt length ({low}-{high}, a seeded permutation) every call, after "
                      f"{VARLEN_WARMUP} such calls per side",
                      functools.partial(build_prefill_varlen, family), needs_transformers=True,
                      warmup=VARLEN_WARMUP, estimate_s=25 if long_decode else 18),
        ModelWorkload(f"{family.name}_prefill_varlen_seen", f"{title}: the varlen prefill's walk cut to "
                      f"{SEEN_LENGTHS} lengths served round and round, each twice in the warm-up (its steady state)",
                      functools.partial(build_prefill_varlen, family, seen=SEEN_LENGTHS), needs_transformers=True,
                      warmup=2 * SEEN_LENGTHS, estimate_s=25 if long_decode else 18),
        ModelWorkload(f"{family.name}_train", f"{title}: train mode, model(ids, labels=ids).loss.backward(), "
                      f"batch {train_batch} x {train_seq}, grads zeroed each step",
                      functools.partial(build_train, family), needs_transformers=True,
                      estimate_s=22 if long_decode else 17),
    ]
    for size in (1, 8):
        for cache in ("static", "dynamic"):
            out.append(ModelWorkload(
                f"{family.name}_decode_b{size}_{cache}",
                f"{title}: greedy {runs['new_tokens']} tokens after a {runs['prompt']}-token prompt, batch {size}, "
                f"{'StaticCache' if cache == 'static' else 'DynamicCache'}, explicit model(...) loop",
                functools.partial(build_decode, family, size, cache), needs_transformers=True, rounds=8, warmup=1,
                estimate_s=45 if long_decode else 10))
    return tuple(out)


LLAMA_TITLE = "Llama decoder (4 layers, hidden 1024, GQA 16/4 heads, vocab 32000, bf16)"
QWEN2_TITLE = ("Qwen2-0.5B-shaped decoder (24 layers, hidden 896, intermediate 4864, GQA 14/2 heads, "
               "vocab 151936, tied embeddings, bf16)")
MIXTRAL_TITLE = ("Mixtral-shaped MoE decoder (4 layers, hidden 1024, 8 experts of intermediate 1792, top 2, "
                 "GQA 16/4 heads, vocab 32000, bf16)")
#: The Mixtral workloads: a prefill and a batch-1 decode (the patch by form, beside the families named).
MIXTRAL_WORKLOADS = ("mixtral_prefill_512", "mixtral_decode_b1_dynamic")

WORKLOADS: tuple[ModelWorkload, ...] = (
    ModelWorkload("llama_prefill", f"{LLAMA_TITLE}: model(input_ids), batch 4 x 256 tokens", build_llama_prefill,
                  needs_transformers=True, estimate_s=17),
    ModelWorkload("llama_decode", "the same decoder: greedy 24 new tokens after a 128-token prompt, batch 4, "
                  "StaticCache, explicit model(...) loop", build_llama_decode, needs_transformers=True,
                  estimate_s=13),
    ModelWorkload("llama_generate", "the same decoder: model.generate(max_new_tokens=24, do_sample=False, "
                  "cache_implementation='static'), batch 4 x 128-token prompt", build_llama_generate,
                  needs_transformers=True, estimate_s=15),
    ModelWorkload("llama_generate_dynamic", "the same decoder: model.generate(max_new_tokens=24, do_sample=False) "
                  "with the default DynamicCache, batch 4 x 128-token prompt",
                  functools.partial(build_llama_generate, static=False), needs_transformers=True, estimate_s=15),
    *_family_workloads(LLAMA, "the same Llama decoder"),
    *_family_workloads(QWEN2, QWEN2_TITLE),
    *(w for w in _family_workloads(MIXTRAL, MIXTRAL_TITLE) if w.name in MIXTRAL_WORKLOADS),
    ModelWorkload("unet_fwd_fp16", "4 x (Conv2d(320,320,3) -> GroupNorm(32,320) -> SiLU), 2x320x64x64 "
                  "channels_last, fp16 forward, no grad", build_unet_forward, estimate_s=7),
    ModelWorkload("unet_fwd_bwd_fp32", "the same stack in fp32: forward + backward of out.square().mean(), "
                  "grads zeroed each step", build_unet_backward, estimate_s=7),
    ModelWorkload("sd15_unet_fwd_fp16", "diffusers UNet2DConditionModel, SD-1.5 configuration (random weights): "
                  "model(latents, t, text states), 2x4x64x64 channels_last, text 2x77x768, fp16, no grad "
                  "[needs diffusers]", build_sd15_forward, estimate_s=20),
    ModelWorkload("sd15_unet_train_fp32", "the same UNet in fp32, train mode: forward + backward of "
                  "out.square().mean(), 1x4x32x32 channels_last, text 1x77x768, grads zeroed each step "
                  "[needs diffusers]", build_sd15_train, estimate_s=30),
)


def select(patterns: Sequence[str]) -> list[ModelWorkload]:
    """The workloads whose name equals, or matches as a glob, one of ``patterns`` (all when empty)."""
    if not patterns:
        return list(WORKLOADS)
    return [w for w in WORKLOADS if any(w.name == p or fnmatch.fnmatchcase(w.name, p) for p in patterns)]


# -- sides ----------------------------------------------------------------------------------
@contextlib.contextmanager
def as_side(side: str, log: bool = False) -> Iterator[None]:
    """Run the block natively (``torch``) or with every routed op on flaggems."""
    with runner.side_scope(side, None, log=log):
        yield


class Side:
    """One way of running a workload's step: torch eager (this class), or a subclass's change on top."""

    name = TORCH
    uses_flaggems = False

    def omitted(self, case: Case) -> str | None:
        """Why this side does not apply to ``case`` (``None``: it does)."""
        return None

    def prepare(self, case: Case) -> None:
        """Once per workload, before the side first runs; :class:`Skip` when it cannot run here."""

    @contextlib.contextmanager
    def active(self, case: Case, log: bool = False) -> Iterator[None]:
        """The block runs as this side (``log``: flaggems' per-call log channels on); all is put back after."""
        case.side = self.name
        try:
            with as_side(FLAGGEMS if self.uses_flaggems else TORCH, log=log), self.scope(case):
                yield
        finally:
            case.side = TORCH

    @contextlib.contextmanager
    def scope(self, case: Case) -> Iterator[None]:
        """What this side changes around the block, besides flaggems' state (nothing here)."""
        yield

    def info(self) -> dict[str, Any]:
        """What the side did, for the report (a patch report, the names Liger rebound)."""
        return {}

    def release(self) -> None:
        """Drop what :meth:`prepare` made."""


class FlaggemsSide(Side):
    """``flaggems.enable()`` alone."""

    name = FLAGGEMS
    uses_flaggems = True


class PatchedSide(Side):
    """``flaggems.enable()`` and ``flaggems.patch(model)``; ``flaggems.unpatch(model)`` on leaving."""

    name = PATCHED
    uses_flaggems = True

    def __init__(self) -> None:
        self.report: dict[str, Any] = {}

    def omitted(self, case: Case) -> str | None:
        """Only a transformers model can be patched."""
        return None if case.slot is not None else "no transformers model to patch"

    def prepare(self, case: Case) -> None:
        """Patch once to read the report; :class:`Skip` when nothing was patched."""
        report_ = flaggems.patch(case.slot.model)
        flaggems.unpatch(case.slot.model)
        self.report = report_.as_dict()
        if not report_.patched:
            raise Skip(f"flaggems.patch patched nothing: {report_}".replace("\n", "; "))

    @contextlib.contextmanager
    def scope(self, case: Case) -> Iterator[None]:
        """The model patched inside the block."""
        flaggems.patch(case.slot.model)
        try:
            yield
        finally:
            flaggems.unpatch(case.slot.model)

    def info(self) -> dict[str, Any]:
        """The patch report."""
        return {"patch": self.report} if self.report else {}


_MISSING: Any = object()


@dataclass
class Swap:
    """A name Liger rebound: ``owner.name`` is ``original`` off the liger side and ``value`` on it."""

    owner: Any
    name: str
    original: Any
    value: Any

    def put(self, liger: bool) -> None:
        """Set the liger value (``liger``) or the original; a missing one is deleted."""
        value = self.value if liger else self.original
        if value is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, value)

    def describe(self) -> str:
        """``module.name`` or ``module.Class.name``."""
        owner = self.owner
        prefix = owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
        return f"{prefix}.{self.name}"


def watched_namespaces(model: nn.Module) -> list[Any]:
    """Where Liger rebinds names: ``model``'s modeling module, every class defined there, ``torch.nn.functional``."""
    module = sys.modules[type(model).__module__]
    classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
    return [module, *classes, torch.nn.functional]


def swapped_by(apply: Callable[[], Any], owners: Sequence[Any]) -> list[Swap]:
    """Run ``apply``; every name it rebound in ``owners`` is put back and returned as a :class:`Swap`."""
    before = [dict(vars(owner)) for owner in owners]
    swaps: list[Swap] = []
    try:
        apply()
    finally:
        for owner, old in zip(owners, before):
            now = dict(vars(owner))
            for name in dict.fromkeys([*old, *now]):
                if old.get(name, _MISSING) is not now.get(name, _MISSING):
                    swaps.append(Swap(owner, name, old.get(name, _MISSING), now.get(name, _MISSING)))
        for swap in swaps:
            swap.put(liger=False)
    return swaps


LIGER_FUNCTIONS = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
                   "mixtral": "apply_liger_kernel_to_mixtral"}
#: What the liger side asks for: the same fusions as ``flaggems.patch``; the loss stays torch's.
LIGER_OPTIONS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}


def liger_unavailable() -> str | None:
    """Why no liger side is part of this run (``None``: ``liger_kernel`` is importable)."""
    try:
        found = importlib.util.find_spec("liger_kernel") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "liger_kernel is not installed"


def liger_apply(family: str, device: torch.device) -> Callable[..., Any]:
    """Liger's ``apply_liger_kernel_to_<family>`` with :data:`LIGER_OPTIONS`, or :class:`Skip` saying why not."""
    if device.type != "cuda":
        raise Skip(f"Liger-Kernel's kernels need a CUDA device (here: {device.type})")
    name = LIGER_FUNCTIONS[family]
    try:
        module = importlib.import_module("liger_kernel.transformers")
    except Exception as exc:  # noqa: BLE001 - any import failure skips the side
        raise Skip(f"liger_kernel.transformers is not importable ({type(exc).__name__}: {exc})") from exc
    apply = getattr(module, name, None)
    if apply is None:
        raise Skip(f"liger_kernel.transformers has no {name} (an API this benchmark does not know)")
    try:
        params = inspect.signature(apply).parameters
    except (TypeError, ValueError):
        params = {}
    missing = [k for k in (*LIGER_OPTIONS, "model") if k not in params]
    if missing:
        raise Skip(f"{name} takes no {', '.join(missing)} (an API this benchmark does not know)")
    return functools.partial(apply, **LIGER_OPTIONS)


class LigerSide(Side):
    """Liger-Kernel on a deep copy of the model, flaggems off; the names it rebinds swapped in only here."""

    name = LIGER

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.model: nn.Module | None = None
        self.swaps: list[Swap] = []

    def omitted(self, case: Case) -> str | None:
        """Liger patches the families of :data:`LIGER_FUNCTIONS` only."""
        if case.slot is None:
            return "no transformers model"
        return None if case.family in LIGER_FUNCTIONS else f"Liger-Kernel is not applied to {case.family}"

    def prepare(self, case: Case) -> None:
        """Copy the model, apply Liger to the copy, and take back every name it rebound (until :meth:`scope`)."""
        apply = liger_apply(case.family, self.device)
        model = copy.deepcopy(case.slot.original)
        self.swaps = swapped_by(lambda: apply(model=model), watched_namespaces(model))
        self.model = model

    @contextlib.contextmanager
    def scope(self, case: Case) -> Iterator[None]:
        """Liger's names and its model copy inside the block; the originals after."""
        for swap in self.swaps:
            swap.put(liger=True)
        try:
            with case.slot.holding(self.model):
                yield
        finally:
            for swap in self.swaps:
                swap.put(liger=False)

    def info(self) -> dict[str, Any]:
        """The names Liger rebound (swapped in on this side only)."""
        return {"options": LIGER_OPTIONS, "swapped": [s.describe() for s in self.swaps]} if self.model else {}

    def release(self) -> None:
        """Drop the copy."""
        self.model, self.swaps = None, []


class CompiledSide(Side):
    """``torch.compile`` (inductor, default mode) of the model, flaggems off: the compiler's own speed.

    The compile happens in :meth:`prepare` (its seconds go to the report); ``generate()`` workloads omit
    the side (``generate`` calls the module's own forward; transformers compiles it through ``compile_config``).
    """

    name = COMPILED
    uses_flaggems = False
    patched = False

    def __init__(self) -> None:
        self.model: Any = None
        self.compile_s: float | None = None

    def omitted(self, case: Case) -> str | None:
        """A transformers model whose step calls the module (not ``generate``)."""
        if case.slot is None:
            return "no transformers model"
        return "generate() runs the module's own forward" if "generate" in case.params else None

    def prepare(self, case: Case) -> None:
        """Compile (a patched deep copy on the patched side) and run one step: the compile's seconds."""
        model = case.slot.original
        if self.patched:
            model = copy.deepcopy(model)
            flaggems.patch(model)
        torch._dynamo.reset()
        self.model = torch.compile(model)
        start = time.perf_counter()
        with self.active(case):
            case.step(OFF)
            runner.synchronize(next(model.parameters()).device)
        self.compile_s = round(time.perf_counter() - start, 2)

    @contextlib.contextmanager
    def scope(self, case: Case) -> Iterator[None]:
        """The compiled model in the slot inside the block."""
        with case.slot.holding(self.model):
            yield

    def info(self) -> dict[str, Any]:
        """The first step's seconds (the compile)."""
        return {"compile_s": self.compile_s} if self.compile_s is not None else {}

    def release(self) -> None:
        """Drop the compiled model."""
        self.model = None


class PatchedCompiledSide(CompiledSide):
    """``torch.compile`` of a patched deep copy, flaggems enabled: flaggems with the compiler."""

    name = PATCHED_COMPILED
    uses_flaggems = True
    patched = True


def run_sides(settings: Settings) -> tuple[list[str], dict[str, str]]:
    """The sides of this run (``--side``; liger only where importable) and why any is absent."""
    absent: dict[str, str] = {}
    reason = liger_unavailable() if LIGER in settings.sides else None
    if reason is not None:
        absent[LIGER] = reason
    return [s for s in settings.sides if s not in absent], absent


def make_side(name: str, device: torch.device) -> Side:
    """A fresh side (its state lives for one workload)."""
    sides = {TORCH: Side, FLAGGEMS: FlaggemsSide, PATCHED: PatchedSide, COMPILED: CompiledSide,
             PATCHED_COMPILED: PatchedCompiledSide}
    return sides.get(name, functools.partial(LigerSide, device))()


# -- calls per step -------------------------------------------------------------------------
class CallCounter(TorchDispatchMode):
    """Counts every operator call reaching the dispatcher's Python key, per op (the census' fallback).

    That sees aten ops after autograd and composite decompositions, but not ops
    with a Python kernel above that key (flaggems' fused operators), and it sees
    the calls such kernels make.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Count the call, then make it."""
        self.total += 1
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


#: Name prefix of the profiler ranges marking phase boundaries in a census step.
MARKER = "flaggems_bench_phase:"


class CountingPhases(Phases):
    """The phase clock of a census step: a profiler marker at each boundary, or a :class:`CallCounter`'s deltas."""

    def __init__(self, device: torch.device, counter: CallCounter | None = None) -> None:
        super().__init__(None)
        self.marker_device, self.counter = device, counter
        self._mark = 0

    def start(self) -> None:
        """Begin the first phase."""
        self._boundary("start")

    def lap(self, name: str) -> None:
        """End phase ``name``."""
        self._boundary(name)

    def _boundary(self, name: str) -> None:
        if self.counter is not None:
            if name != "start":
                self.totals[name] = self.totals.get(name, 0) + self.counter.total - self._mark
            self._mark = self.counter.total
            return
        runner.synchronize(self.marker_device)  # every kernel of the phase has run before the marker
        with torch.profiler.record_function(f"{MARKER}{name}"):
            pass


@dataclass
class Census:
    """Calls one step made: operator calls (whole step, per phase, the most frequent ops) and device kernels."""

    calls: int
    phase_calls: dict[str, int]
    top: dict[str, int]
    kernels: int | None = None
    copies: int | None = None
    phase_kernels: dict[str, int] = field(default_factory=dict)
    method: str = "torch.profiler"

    def per(self, metric: Metric, kernels: bool = False) -> float | None:
        """Calls (or kernels) per unit of ``metric``: the whole step's, or its phase's / ``per_step``."""
        whole, phases = (self.kernels, self.phase_kernels) if kernels else (self.calls, self.phase_calls)
        value = whole if metric.phase is None else phases.get(metric.phase)
        return None if value is None else value / metric.per_step


def is_op(name: str) -> bool:
    """A dispatcher operator's profiler event (``aten::mm``, ``flaggems::rms_norm``), not autograd's ranges."""
    namespace, sep, rest = name.partition("::")
    return bool(sep and rest) and namespace.isidentifier() and namespace != "autograd"


def _outermost(event: Any) -> bool:
    """No operator encloses ``event`` (calls made inside an op's implementation are not the step's)."""
    parent = event.cpu_parent
    while parent is not None:
        if is_op(parent.name):
            return False
        parent = parent.cpu_parent
    return True


def _phase(start: float, marks: Sequence[tuple[float, str]]) -> str | None:
    """The phase ending at the first boundary at or after ``start`` (``None`` before ``start`` or after the last)."""
    name = next((name for at, name in marks if at >= start), None)
    return None if name == "start" else name


def call_activity(events: Sequence[Any]) -> tuple[int, dict[str, int], dict[str, int]]:
    """(outermost operator calls, per phase, the 12 most frequent) among profiler events."""
    from torch.autograd import DeviceType

    marks = sorted((e.time_range.start, e.name[len(MARKER):]) for e in events if e.name.startswith(MARKER))
    calls = [e for e in events if e.device_type == DeviceType.CPU and is_op(e.name) and _outermost(e)]
    phases = Counter(p for p in (_phase(e.time_range.start, marks) for e in calls) if p is not None)
    return len(calls), dict(phases), dict(Counter(e.name for e in calls).most_common(12))


def device_activity(events: Sequence[Any]) -> tuple[int, int, dict[str, int]]:
    """(kernels, memcpy/memset, kernels per phase) among profiler events; phases from :data:`MARKER` ranges.

    A kernel belongs to the first phase boundary at or after its start (the census
    synchronises before each marker, so a phase's kernels all start before it).
    """
    from torch.autograd import DeviceType

    marks = sorted((e.time_range.start, e.name[len(MARKER):]) for e in events if e.name.startswith(MARKER))
    kernels = copies = 0
    phases: Counter[str] = Counter()
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue
        if event.name.lower().startswith(("memcpy", "memset")):
            copies += 1
            continue
        kernels += 1
        phase = _phase(event.time_range.start, marks)
        if phase is not None:
            phases[phase] += 1
    return kernels, copies, dict(phases)


def census(case: Case, device: torch.device) -> Census:
    """One untimed step under ``torch.profiler`` (call it inside a side): calls and, on CUDA, kernels.

    Calls: the outermost operator calls (``aten::``, ``flaggems::``... events that
    no other operator encloses, on every thread: autograd's too). Should the
    profiler fail, the step is counted again by a :class:`CallCounter` (no kernels).
    """
    try:
        return _profiled_census(case, device)
    except Exception as exc:  # noqa: BLE001 - the fallback counts calls without the profiler
        print(f"flaggems bench --models: torch.profiler failed ({describe_exception(exc)}); "
              "counting calls with a TorchDispatchMode", file=sys.stderr)
    counter = CallCounter()
    phases = CountingPhases(device, counter)
    with counter:
        case.step(phases)
    runner.synchronize(device)
    return Census(counter.total, dict(phases.totals), dict(counter.ops.most_common(12)),
                  method="TorchDispatchMode")


def _profiled_census(case: Case, device: torch.device) -> Census:
    from torch.profiler import ProfilerActivity

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch.profiler.profile(activities=activities) as prof:
        case.step(CountingPhases(device))
        runner.synchronize(device)
    events = prof.events()
    result = Census(*call_activity(events))
    if cuda:
        result.kernels, result.copies, result.phase_kernels = device_activity(events)
    return result


# -- running ------------------------------------------------------------------------------
def skip_reason(workload: ModelWorkload, target: Target, smoke: bool) -> str | None:
    """Why ``workload`` cannot run here (no GPU without ``--smoke``, no transformers), or ``None``."""
    if not smoke and not target.gpu:
        return (f"no GPU (active backend {target.backend!r}: {target.reason}); "
                "timings on the Triton interpreter mean nothing (--smoke runs a tiny functional version)")
    if workload.needs_transformers and not transformers_available():
        return "transformers is not installed (pip install transformers)"
    return None


def dispatch_counts(records: Sequence[tuple[str, str]]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(calls served by a flaggems implementation, calls that went native, declines), counted per message."""
    served: Counter[str] = Counter()
    native: Counter[str] = Counter()
    declines: Counter[str] = Counter()
    for channel, message in records:
        if channel == "fallback":
            declines[message] += 1
        elif message.partition(" -> ")[2].startswith("native"):
            native[message] += 1
        else:
            served[message] += 1
    return dict(served.most_common()), dict(native.most_common()), dict(declines.most_common())


def counted_step(case: Case, device: torch.device, side: Side | None = None) -> tuple[Any, list[tuple[str, str]]]:
    """One untimed checked step as ``side`` (default: flaggems) with the dispatch and fallback channels on.

    Returns its output and the log records.
    """
    side = side or FlaggemsSide()
    with runner.capture_dispatch() as captured, side.active(case, log=True):
        output = case.checked_step()
        runner.synchronize(device)
    return output, captured.records


def timed_round(case: Case, device: torch.device, steps: int) -> dict[str, float]:
    """ms per step of each metric over ``steps`` back-to-back steps between two synchronisations."""
    phases = Phases(device)
    runner.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        case.step(phases)
    runner.synchronize(device)
    elapsed = time.perf_counter() - start
    return {m.name: 1e3 * (phases.totals.get(m.phase, 0.0) if m.phase else elapsed) / (steps * m.per_step)
            for m in case.metrics}


def rotation(sides: Sequence[Any], index: int) -> list[Any]:
    """The order of round ``index``: ``sides`` rotated by ``index`` (two sides: the order flips each round)."""
    shift = index % len(sides)
    return [*sides[shift:], *sides[:shift]]


def time_sides(case: Case, sides: Sequence[Side], device: torch.device, settings: Settings,
               rounds: int) -> tuple[dict[str, dict[str, list[float]]], int]:
    """Per side and metric, the ms per step of every round (sides interleaved, order rotated each round).

    Also returns the steps per round: ``settings.steps``, or fitted to a warm torch
    step (``sides[0]``). An untimed step follows each change of side (not in smoke runs).
    """
    samples: dict[str, dict[str, list[float]]] = {s.name: {m.name: [] for m in case.metrics} for s in sides}
    steps = settings.steps
    if steps is None:
        with sides[0].active(case):
            case.side = "fit"  # its own cursor where steps walk a sequence: torch's stays in step with the others
            steps = settings.steps_for(timed_round(case, device, 1)[case.metrics[0].name])
        if case.fresh_steps is not None:  # each round also takes one settling step per side
            steps = max(1, min(steps, case.fresh_steps() // rounds - 1))
    # one step a round too: after a change of side, the SD-1.5 training step ran 50-86 ms over its steady
    # 80 ms (allocator segments and plans of the other side), on torch's side as on flaggems'
    settle = not settings.smoke
    for index in range(rounds):
        for side in rotation(sides, index):
            with side.active(case), runner.gc_paused():
                if settle:
                    case.step(OFF)  # the first step after re-routing is not the steady state
                for name, value in timed_round(case, device, steps).items():
                    samples[side.name][name].append(value)
    return samples, steps


def metric_results(case: Case, samples: Mapping[str, Mapping[str, list[float]]],
                   censuses: Mapping[str, Census] | None = None) -> list[MetricResult]:
    """Per metric: medians per side, the median/lowest/highest torch/side ratio of the rounds, calls per unit."""
    out = []
    for metric in case.metrics:
        base = samples[TORCH][metric.name]
        result = MetricResult(metric.name)
        for side, per_metric in samples.items():
            values = per_metric[metric.name]
            result.ms[side], result.rounds[side] = (statistics.median(values) if values else None), values
            pairs = [t / s for t, s in zip(base, values) if t and s]
            if side != TORCH and pairs:
                result.ratios[side] = {"median": statistics.median(pairs), "low": min(pairs), "high": max(pairs)}
        for side, counted in (censuses or {}).items():
            for target, kernels in ((result.calls, False), (result.launches, True)):
                value = counted.per(metric, kernels)
                if value is not None:
                    target[side] = value
        result.torch_ms, result.flaggems_ms = result.ms.get(TORCH), result.ms.get(FLAGGEMS)
        legacy = result.ratios.get(FLAGGEMS)
        if legacy:
            result.ratio, result.ratio_low, result.ratio_high = legacy["median"], legacy["low"], legacy["high"]
        out.append(result)
    return out


def describe_exception(exc: BaseException) -> str:
    """``Type: message (at file:line in function)``, the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _check_side(case: Case, side: Side, entry: SideResult, reference: Any, device: torch.device) -> Any:
    """torch: run the checked step and return its output (the reference). Others: run it logged, check it."""
    if side.name == TORCH:
        with side.active(case):
            output = detached_copy(case.checked_step())
            runner.synchronize(device)
        return output
    output, records = counted_step(case, device, side)
    check = case.check(reference, output)  # outside the side: an fp32 reference is made from the original
    entry.match, entry.check, entry.max_diff = check.match, check.detail, check.max_diff
    entry.flaggems_ops, entry.native_calls, entry.declines = dispatch_counts(records)
    return reference


def prepare_side(case: Case, side: Side, entry: SideResult, reference: Any, device: torch.device,
                 warmup: int) -> tuple[Any, Census | None]:
    """Prepare, check, warm up and count one side; a skip or (but for torch) an exception goes to ``entry``."""
    try:
        side.prepare(case)
        reference = _check_side(case, side, entry, reference, device)
        with side.active(case):
            for _ in range(warmup):
                case.step(OFF)
            counts: list[Census] = []
            # the census step is a steady one: routed calls it sends to Python or the planner cost host time
            entry.off_replay = off_replay(lambda: counts.append(census(case, device)))
            counted = counts[0]
        entry.calls, entry.top_calls = counted.calls, counted.top
        entry.kernel_launches, entry.device_copies = counted.kernels, counted.copies
        entry.info["calls_counted_by"] = counted.method
        return reference, counted
    except Skip as exc:
        entry.status, entry.reason = "skipped", str(exc)
    except Exception as exc:
        if side.name == TORCH:
            raise
        entry.status, entry.error = "error", describe_exception(exc)
        traceback.print_exception(type(exc), exc, exc.__traceback__, limit=-8, file=sys.stderr)
    finally:
        entry.info = side.info()
    return reference, None


def measure(case: Case, result: ModelResult, sides: Sequence[Side], device: torch.device, settings: Settings,
            workload: ModelWorkload | None = None) -> None:
    """Per side: checked step, warm-up and census; then the timed rounds over the sides that ran, into ``result``."""
    rounds = settings.rounds_for(workload) if workload else (settings.rounds or 1)
    warmup = settings.warmup_for(workload) if workload else (settings.warmup or 0)
    reference, censuses = None, {}
    try:
        for side in sides:
            reference, counted = prepare_side(case, side, result.sides[side.name], reference, device, warmup)
            if counted is not None:
                censuses[side.name] = counted
        del reference
        timed = [s for s in sides if result.sides[s.name].ran]
        samples, result.steps_per_round = time_sides(case, timed, device, settings, rounds)
        result.rounds = rounds
        result.metrics = metric_results(case, samples, censuses)
    finally:
        for side in sides:
            side.release()
    _legacy_fields(result)


def _legacy_fields(result: ModelResult) -> None:
    """``match`` over every checked side; ``check``, ``max_diff`` and the dispatch counts of the flaggems side."""
    checked = [s.match for name, s in result.sides.items() if name != TORCH and s.ran and s.match is not None]
    result.match = all(checked) if checked else None
    ours = result.sides.get(FLAGGEMS)
    if ours is not None and ours.ran:
        result.check, result.max_diff = ours.check, ours.max_diff
        result.flaggems_ops, result.native_calls, result.declines = ours.flaggems_ops, ours.native_calls, ours.declines


def choose_sides(case: Case, names: Sequence[str], device: torch.device, result: ModelResult) -> list[Side]:
    """The sides that apply to ``case``; each of ``names`` gets an entry in ``result.sides`` (omitted: why)."""
    chosen = []
    for name in names:
        side = make_side(name, device)
        reason = side.omitted(case)
        result.sides[name] = SideResult(status="omitted", reason=reason) if reason else SideResult()
        if reason is None:
            chosen.append(side)
    return chosen


def run_model(workload: ModelWorkload, target: Target, settings: Settings,
              side_names: Sequence[str] | None = None) -> ModelResult:
    """Build, check and time one workload; a skip or an exception is recorded, not raised."""
    result = ModelResult(workload.name, workload.description)
    reason = skip_reason(workload, target, settings.smoke)
    names = list(side_names if side_names is not None else run_sides(settings)[0])
    case = None
    try:
        if reason is not None:
            raise Skip(reason)
        case = workload.build(target.device, settings.smoke)
        result.params = case.params
        sides = choose_sides(case, names, target.device, result)
        measure(case, result, sides, target.device, settings, workload)
    except Skip as exc:
        result.status, result.reason = "skipped", str(exc)
    except ModelApiError as exc:
        result.status, result.error = "error", f"transformers API mismatch: {exc}"
    except Exception as exc:  # noqa: BLE001 - report it and go on with the other workloads
        result.status, result.error = "error", describe_exception(exc)
        traceback.print_exception(type(exc), exc, exc.__traceback__, limit=-8, file=sys.stderr)
    finally:
        case = None
        _release(target.device)
    return result


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_all(workloads: Sequence[ModelWorkload], target: Target, settings: Settings,
            progress: Callable[[str], None] | None = None,
            finished: Callable[[Sequence[ModelResult]], None] | None = None) -> list[ModelResult]:
    """Every workload, flaggems disabled between sides (the previous state restored after).

    ``finished`` is called with the results so far after each workload, so a run stopped by a time limit
    keeps what it measured.
    """
    results: list[ModelResult] = []
    names, _ = run_sides(settings)
    with runner.flaggems_off():
        for workload in workloads:
            if progress is not None:
                progress(workload.name)
            results.append(run_model(workload, target, settings, names))
            if finished is not None:
                finished(results)
    return results


# -- reporting ------------------------------------------------------------------------------
def environment(target: Target, settings: Settings) -> dict[str, Any]:
    """Where and how the numbers were taken, as ``flaggems bench`` records it, plus the model settings."""
    names, absent = run_sides(settings)
    meta = runner.environment(target, settings, names)  # type: ignore[arg-type] # Settings has smoke and describe()
    meta.update(steps=settings.steps if settings.steps is not None else f"auto (~{settings.round_ms:g} ms a round)",
                rounds=settings.rounds if settings.rounds is not None else "per workload",
                warmup=settings.warmup if settings.warmup is not None else "per workload",
                transformers=_version(), liger_kernel=_liger_version(), sides_absent=absent,
                logits_tolerance=LOGITS_TOLERANCE, grad_tolerance=GRAD_TOLERANCE,
                accuracy_factor=ACCURACY_FACTOR)
    meta["routes"] = {row["op"]: row["chosen"] for row in flaggems.routes()}
    return meta


def _version() -> str | None:
    if not transformers_available():
        return None
    try:
        import transformers
    except Exception as exc:  # noqa: BLE001 - a broken install is reported per workload
        return f"unimportable ({type(exc).__name__})"
    return transformers.__version__


def _liger_version() -> str | None:
    if liger_unavailable() is not None:
        return None
    from importlib import metadata

    try:
        return metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        return "unknown"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _match(result: ModelResult) -> str:
    return {True: "yes", False: "NO", None: "-"}[result.match]


def table_sides(results: Sequence[ModelResult]) -> list[str]:
    """The sides any result timed, in :data:`SIDE_NAMES` order."""
    timed = {name for r in results for name in r.timed_sides()}
    return [s for s in SIDE_NAMES if s in timed]


def _ratio(metric: MetricResult, side: str) -> str:
    r = metric.ratios.get(side)
    return "-" if r is None else f"{r['median']:.3f}x ({r['low']:.2f}-{r['high']:.2f})"


def columns(sides: Sequence[str]) -> tuple[str, ...]:
    """The table's header: a column per side's ms and per non-torch side's ratio."""
    others = [s for s in sides if s != TORCH]
    return ("workload", "metric", *[f"{s} ms" for s in sides], *[f"torch/{s}" for s in others], "steps", "match")


def rows(results: Sequence[ModelResult], sides: Sequence[str] | None = None) -> list[tuple[str, ...]]:
    """One row per metric of each workload that ran: each side's ms, each torch/side ratio [range]."""
    sides = table_sides(results) if sides is None else sides
    out = []
    for r in results:
        for i, m in enumerate(r.metrics):
            first = i == 0
            out.append((r.workload if first else "", m.name, *[_ms(m.ms.get(s)) for s in sides],
                        *[_ratio(m, s) for s in sides if s != TORCH],
                        str(r.steps_per_round) if first else "", _match(r) if first else ""))
    return out


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def call_rows(results: Sequence[ModelResult], sides: Sequence[str]) -> list[tuple[str, ...]]:
    """One row per metric: per side, operator calls per unit, with device kernels after a slash where counted."""
    out = []
    for r in results:
        for i, m in enumerate(r.metrics):
            cells = [_count(m.calls.get(s)) + (f" / {_count(m.launches[s])}" if s in m.launches else "")
                     for s in sides]
            out.append((r.workload if i == 0 else "", m.name, *cells))
    return out


def _align(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    return ["  ".join(c.rjust(widths[i]) if i >= 2 else c.ljust(widths[i]) for i, c in enumerate(row)).rstrip()
            for row in (header, *body)]


def _counts(counts: Mapping[str, int], limit: int = 8) -> str:
    items = [f"{name} x{n}" for name, n in counts.items()]
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def ops_lines(results: Sequence[ModelResult]) -> list[str]:
    """Per workload and flaggems side: what served its calls in the checked step, what went native, declines."""
    lines = ["flaggems dispatch in one untimed step (op -> implementation x calls):"]
    for r in results:
        if r.status != "ok":
            continue
        for name, side in r.sides.items():
            if name not in (FLAGGEMS, PATCHED) or not side.ran:
                continue
            served = _counts(side.flaggems_ops) or "NO call served by flaggems (all native)"
            lines.append(f"  {r.workload} [{name}]: {served}")
            if side.native_calls:
                lines.append(f"    native: {_counts(side.native_calls)}")
            if side.declines:
                lines.append(f"    declined: {_counts(side.declines, 4)}")
            patched = side.info.get("patch", {}).get("patched")
            if patched:
                lines.append(f"    flaggems.patch: {_counts(patched)}")
            if side.off_replay:  # steady-state calls that took Python or the planner (flaggems.testing.steady)
                lines.append("    off the replay path: " + "; ".join(
                    f"{op} " + ", ".join(f"{k} {v}" for k, v in counts.items() if v)
                    for op, counts in side.off_replay.items()))
    return lines


def summary(results: Sequence[ModelResult]) -> dict[str, Any]:
    """Per non-torch side, the geomean of the first metric's ratio; the flaggems one also as ``geomean_ratio``."""
    sides: dict[str, dict[str, Any]] = {}
    for side in SIDE_NAMES[1:]:
        ratios = [r.metrics[0].ratios[side]["median"] for r in results if r.metrics and side in r.metrics[0].ratios]
        if ratios:
            sides[side] = {"geomean_ratio": math.exp(sum(math.log(v) for v in ratios) / len(ratios)),
                           "workloads_timed": len(ratios)}
    ours = sides.get(FLAGGEMS, {})
    return {"geomean_ratio": ours.get("geomean_ratio"), "workloads_timed": ours.get("workloads_timed", 0),
            "sides": sides, "skipped": sum(r.status == "skipped" for r in results),
            "failed": sum(r.failed for r in results)}


def table(results: Sequence[ModelResult], meta: Mapping[str, Any]) -> str:
    """The human-readable report: banner, context, the times, calls per step, dispatch counts, problems."""
    lines = [SMOKE_BANNER] if meta["smoke"] else []
    liger = f"  liger_kernel {meta['liger_kernel']}" if meta.get("liger_kernel") else ""
    lines.append(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  flaggems {meta['flaggems']}"
                 f"  transformers {meta['transformers'] or '-'}{liger}  backend {meta['backend']}")
    lines.append(meta["timing"])
    lines.extend(f"side {name} absent: {why}" for name, why in meta.get("sides_absent", {}).items())
    sides = table_sides(results)
    if any(r.metrics for r in results):
        lines.extend(_align(columns(sides), rows(results, sides)))
        for side, stats in (() if meta["smoke"] else summary(results)["sides"].items()):
            lines.append(f"geomean torch/{side} (first metric of each workload; >1: {side} faster): "
                         f"{stats['geomean_ratio']:.3f}x over {stats['workloads_timed']} workloads")
        lines.append("calls per unit of each metric in one untimed step: operator calls at the dispatcher"
                     + (" / CUDA kernels" if any(m.launches for r in results for m in r.metrics) else ""))
        lines.extend(_align(("workload", "metric", *[f"{s} calls" for s in sides]), call_rows(results, sides)))
        lines.extend(ops_lines(results))
    lines.extend(problems(results))
    return "\n".join(lines)


def problems(results: Sequence[ModelResult]) -> list[str]:
    """A line per skipped workload or side, per error and per side whose output differs from torch's."""
    found = []
    for r in results:
        if r.status == "skipped":
            found.append(f"skipped {r.workload}: {r.reason}")
        elif r.error:
            found.append(f"error: {r.workload}: {r.error}")
        for name, side in r.sides.items():
            if side.status == "skipped":
                found.append(f"skipped side {name} of {r.workload}: {side.reason}")
            elif side.status == "error":
                found.append(f"error: {r.workload} [{name}]: {side.error}")
            elif side.match is False:
                found.append(f"MISMATCH: {r.workload} [{name}]: differs from torch's output: {side.check}")
    return found


def listing(workloads: Sequence[ModelWorkload]) -> str:
    """``--list``: each workload's name, what it runs, its default rounds and estimated time on an H200."""
    lines = [f"  {w.name:<24} {w.description}{' [needs transformers]' if w.needs_transformers else ''} "
             f"[{w.rounds} rounds, {w.warmup} warm-up; ~{w.estimate_s} s]" for w in workloads]
    total = sum(w.estimate_s for w in workloads)
    return "\n".join([f"{len(workloads)} model workloads (smoke: tiny sizes, see flaggems.bench.models); "
                      f"about {total // 60} min {total % 60} s on an H200 with four sides:", *lines])


def document(results: Sequence[ModelResult], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--json`` document."""
    return {"meta": dict(meta), "summary": summary(results), "results": [r.as_dict() for r in results]}


def write_json(path: str, results: Sequence[ModelResult], meta: Mapping[str, Any]) -> None:
    """Write :func:`document` to ``path``."""
    report.dump_json(path, document(results, meta))


def write_plot(path: str, results: Sequence[ModelResult], meta: Mapping[str, Any]) -> None:
    """Bars of torch / side per workload, metric and side from 1x, log scale, whiskers over the rounds' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    others = [s for s in table_sides(results) if s != TORCH]
    labels = [(r, m) for r in results for m in r.metrics if m.ratios]
    height = 0.8 / max(1, len(others))
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.3 * max(1, len(labels)) * max(1, len(others)) ** 0.5))
    for k, side in enumerate(others):
        for y, (r, m) in enumerate(labels):
            ratio = m.ratios.get(side)
            if ratio is None:
                continue
            bad = r.sides[side].match is False
            at = y + k * height
            ax.barh(at, ratio["median"] - 1.0, left=1.0, height=height, color="red" if bad else f"C{k}",
                    label=side if y == next(i for i, (_, q) in enumerate(labels) if side in q.ratios) else None)
            ax.errorbar(ratio["median"], at, xerr=[[ratio["median"] - ratio["low"]], [ratio["high"] - ratio["median"]]],
                        fmt="none", ecolor="black", capsize=2, linewidth=0.7)
            ax.text(ratio["high"], at, f" {ratio['median']:.2f}x", va="center", fontsize=6)
    ax.set_yticks([y + height * (len(others) - 1) / 2 for y in range(len(labels))],
                  [f"{r.workload}: {m.name}" for r, m in labels], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("torch / side wall time per step: median of the rounds' pairs, whiskers lowest-highest\n"
                  "(right of 1x: the side is faster; red: its output differs)")
    if others:
        ax.legend(loc="lower right", fontsize=8)
    title = f"flaggems bench --models on {meta['device']} (torch {meta['torch']}, {meta['date']})"
    ax.set_title(f"{title}\n{SMOKE_BANNER}" if meta["smoke"] else title, fontsize=9,
                 color="red" if meta["smoke"] else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------------
def _usage(message: str) -> int:
    print(f"flaggems bench --models: {message}", file=sys.stderr)
    return 2


def _misplaced_options(args: argparse.Namespace) -> list[str]:
    """Options of the seed-workload bench given with ``--models``, where they mean nothing."""
    return [flag for flag, name in (("--op", "op"), ("--route", "route"), ("--dtype", "dtype"))
            if getattr(args, name, None)]


def cmd_models(args: argparse.Namespace) -> int:
    """Handler of ``flaggems bench --models`` and ``benchmarks/models.py`` (see the module docstring)."""
    misplaced = _misplaced_options(args)
    if misplaced:
        return _usage(f"{', '.join(misplaced)} apply to the seed workloads, not to --models (use --only)")
    chosen = select(args.only)
    if not chosen:
        return _usage(f"no workload matches --only {' '.join(args.only)}; known: "
                      f"{', '.join(w.name for w in WORKLOADS)}")
    if args.list:
        print(listing(chosen))
        return 0
    if args.plot and not plot_available():
        print("flaggems bench --models: --plot: matplotlib is not importable, so no plot is written "
              "(pip install 'flaggems-core[bench]')", file=sys.stderr)
    return _run(args, chosen, Settings.from_args(args))


def _run(args: argparse.Namespace, chosen: Sequence[ModelWorkload], settings: Settings) -> int:
    target = runner.detect()
    total = len(chosen)
    counter = iter(range(1, total + 1))

    def progress(name: str) -> None:
        print(f"[{next(counter)}/{total}] {name}", file=sys.stderr, flush=True)

    def finished(results: Sequence[ModelResult]) -> None:
        if not settings.smoke:  # a long GPU run keeps each workload's rows; a smoke run prints its table once
            _print_partial(results[-1])
        if args.json:
            write_json(args.json, results, environment(target, settings))

    results = run_all(chosen, target, settings, progress, finished)
    meta = environment(target, settings)
    print(table(results, meta))
    if args.json:
        write_json(args.json, results, meta)
    if args.plot and plot_available():
        write_plot(args.plot, results, meta)
    if all(r.status == "skipped" for r in results):
        return 2
    return 1 if any(r.failed for r in results) else 0


def _print_partial(result: ModelResult) -> None:
    """The finished workload's rows on stderr at once (the table on stdout comes after the last one)."""
    sides = table_sides([result])
    body = rows([result], sides)
    lines = _align(columns(sides), body) if body else []
    lines.extend(problems([result]))
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``benchmarks/models.py`` (the options of ``flaggems bench --models``)."""
    from . import add_common_arguments, add_model_arguments

    parser = argparse.ArgumentParser(prog="benchmarks/models.py", description=__doc__.split("\n\n")[0],
                                     epilog="See benchmarks/README.md.")
    add_common_arguments(parser)
    add_model_arguments(parser, prefix="")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``benchmarks/models.py``."""
    from . import invalid_configuration

    args = build_parser().parse_args(argv)
    return invalid_configuration() or cmd_models(args)
