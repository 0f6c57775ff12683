"""``flaggems bench --models``: real model code, torch eager against the same code with flaggems enabled.

A faster kernel that makes a model slower is a loss, so this times whole
model steps, in one process, on the same weights and inputs:

* ``llama_prefill``: a transformers Llama-style decoder built from a
  ``LlamaConfig`` (random weights, nothing downloaded; bf16, eval mode),
  ``model(input_ids)`` on a batch of prompts;
* ``llama_decode``: greedy decoding into a ``StaticCache`` (which writes K/V
  with ``index_copy_``), an explicit loop over ``model(...)``: ms per whole
  generate, per prefill into the cache and per decode step;
* ``llama_generate``: the same through ``model.generate(...,
  cache_implementation="static")``, with its automatic ``torch.compile`` off
  (compiled code would bypass flaggems);
* ``llama_generate_dynamic``: ``model.generate(...)`` with its default
  ``DynamicCache`` (what most users run): the K/V grow every token, so the
  calls' shapes change from one token to the next;
* ``unet_fwd_fp16`` and ``unet_fwd_bwd_fp32``: a UNet-style stack of
  Conv2d -> GroupNorm -> SiLU blocks on channels_last input (pure torch).

Per workload: one torch step (the reference), one flaggems step with the
``flaggems.dispatch`` log channel on (what served each call, and the output
check), warm-up, then ``rounds`` rounds per side, torch and flaggems
interleaved round by round (the order flips each round), each round ``steps``
back-to-back steps between two device synchronisations (by default as many as
take about 200 ms on torch); the times are medians over rounds, the ratio
torch/flaggems the median of each round's pair (adjacent in time, so a drifting
host hits both sides of a pair alike).

Usage::

    flaggems bench --models                          # everything, on a GPU
    flaggems bench --models --only 'llama*' --json models.json --plot models.png
    flaggems bench --models --smoke                  # tiny models; also on the CPU interpreter
    python benchmarks/models.py --steps 20 --rounds 15

Exit status: 0; 1 when a workload raised or flaggems' output differs from
torch's; 2 for a usage problem or when every workload was skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import gc
import importlib.util
import inspect
import math
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

import flaggems

from . import report, runner
from .report import plot_available
from .runner import FLAGGEMS, TOLERANCES, TORCH, Target

SIDES = (TORCH, FLAGGEMS)
SMOKE_BANNER = ("SMOKE RUN: tiny models, one step per round; the timings below are meaningless "
                "(Triton interpreter or tiny sizes); only the output checks count")
COLUMNS = ("workload", "metric", "torch ms", "flaggems ms", "torch/flaggems", "range", "steps", "match")


class ModelApiError(RuntimeError):
    """The installed transformers does not offer an API this benchmark relies on (the message says which)."""


class Skip(Exception):  # noqa: N818 - control flow, like flaggems.Decline
    """A workload that cannot run here; the message says why, in one line."""


# -- declarations -------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """How many steps and rounds are timed, and whether this is a smoke run (``steps=None``: automatic)."""

    smoke: bool
    steps: int | None = None
    rounds: int = 15
    warmup: int = 3
    round_ms: float = 200.0
    max_steps: int = 200

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Defaults (full run, or one step and one round for ``--smoke``) overridden by the options given."""
        smoke = bool(getattr(args, "smoke", False))
        base = cls(smoke=True, steps=1, rounds=1, warmup=0) if smoke else cls(smoke=False)
        steps, rounds, warmup = (getattr(args, name, None) for name in ("steps", "rounds", "warmup"))
        return cls(smoke=smoke, steps=base.steps if steps is None else steps,
                   rounds=base.rounds if rounds is None else rounds,
                   warmup=base.warmup if warmup is None else warmup)

    def steps_for(self, step_ms: float) -> int:
        """Steps per round: ``steps``, or as many as take about ``round_ms`` at ``step_ms`` each."""
        if self.steps is not None:
            return self.steps
        return max(1, min(self.max_steps, round(self.round_ms / max(step_ms, 1e-3))))

    def describe(self) -> str:
        """One line for reports."""
        prefix = "SMOKE (timings meaningless): " if self.smoke else ""
        steps = (f"{self.steps} back-to-back steps" if self.steps is not None else
                 f"back-to-back steps (as many as take ~{self.round_ms:g} ms on torch, at most {self.max_steps})")
        return (f"{prefix}wall ms per step: median over {self.rounds} rounds of {steps} between device "
                f"synchronisations, after {self.warmup} warm-up steps per side; torch and flaggems interleaved "
                "round by round (order flipped each round), GC paused while timing; ratio: median of the "
                "rounds' torch/flaggems pairs [lowest-highest]")


@dataclass(frozen=True)
class Metric:
    """A reported time: the whole step (``phase=None``) or one phase of it, divided by ``per_step``."""

    name: str
    phase: str | None = None
    per_step: int = 1


@dataclass
class Check:
    """The outcome of comparing flaggems' output with torch's."""

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


@dataclass
class Case:
    """A built workload: one ``step(phases)`` returning outputs, how to check them, what to report."""

    step: Callable[[Phases], Any]
    check: Callable[[Any, Any], Check]
    params: dict[str, Any]
    metrics: tuple[Metric, ...] = (Metric("ms/step"),)


@dataclass(frozen=True)
class ModelWorkload:
    """A named workload: ``build(device, smoke)`` makes its :class:`Case`."""

    name: str
    description: str
    build: Callable[[torch.device, bool], Case]
    needs_transformers: bool = False


@dataclass
class MetricResult:
    """One reported time of one workload, both sides (ms).

    ``ratio`` is the median over rounds of that round's torch / flaggems, and
    ``ratio_low`` / ``ratio_high`` the lowest and highest of them.
    """

    name: str
    torch_ms: float | None = None
    flaggems_ms: float | None = None
    ratio: float | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None
    torch_rounds: list[float] = field(default_factory=list)
    flaggems_rounds: list[float] = field(default_factory=list)


@dataclass
class ModelResult:
    """Everything measured for one workload (``status``: ok, skipped or error)."""

    workload: str
    description: str
    status: str = "ok"
    reason: str | None = None
    error: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    steps_per_round: int | None = None
    match: bool | None = None
    check: str | None = None
    max_diff: float | None = None
    metrics: list[MetricResult] = field(default_factory=list)
    flaggems_ops: dict[str, int] = field(default_factory=dict)
    native_calls: dict[str, int] = field(default_factory=dict)
    declines: dict[str, int] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """The workload raised, or flaggems' output differs from torch's."""
        return self.status == "error" or self.match is False

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
                 f"(flaggems {int(output[row, col])}, torch {int(reference[row, col])})")


def both(first: Check, second: Check) -> Check:
    """Two checks that must both pass, reported together."""
    return Check(first.match and second.match, f"{first.detail}; {second.detail}", second.max_diff)


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


# -- the Llama-style decoder ------------------------------------------------------------
LLAMA_FULL = {"layers": 4, "hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 4, "vocab": 32000,
              "batch": 4, "seq": 256, "decode_batch": 4, "prompt": 128, "new_tokens": 24}
LLAMA_SMOKE = {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 256,
               "batch": 2, "seq": 8, "decode_batch": 2, "prompt": 4, "new_tokens": 4}
LLAMA_DTYPE = torch.bfloat16


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


def build_llama(device: torch.device, p: Mapping[str, int]) -> Any:
    """A ``LlamaForCausalLM`` from a ``LlamaConfig`` with random weights (seed 0), bf16, eval mode."""
    transformers = _transformers()
    config_class = _attribute(transformers, "LlamaConfig")
    model_class = _attribute(transformers, "LlamaForCausalLM")
    config = config_class(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                          num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                          num_key_value_heads=p["kv_heads"], max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)
    return model.to(device=device, dtype=LLAMA_DTYPE).eval()


def _llama_params(model: Any, p: Mapping[str, int], keys: Sequence[str]) -> dict[str, Any]:
    """The sizes of a Llama workload, with the transformers version and the attention implementation."""
    import transformers

    attention = getattr(model.config, "_attn_implementation", None)
    return {**{k: p[k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", *keys)},
            "dtype": "bf16", "transformers": transformers.__version__, "attention": attention}


def _token_ids(p: Mapping[str, int], batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Random prompt ids (seed 1), the same on both sides."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, p["vocab"], (batch, length), generator=generator).to(device)


def build_llama_prefill(device: torch.device, smoke: bool) -> Case:
    """``model(input_ids)`` on ``batch`` prompts of ``seq`` tokens; the logits are checked."""
    p = LLAMA_SMOKE if smoke else LLAMA_FULL
    model = build_llama(device, p)
    ids = _token_ids(p, p["batch"], p["seq"], device)

    def step(phases: Phases) -> torch.Tensor:
        with torch.no_grad():
            return model(ids).logits

    return Case(step, close, _llama_params(model, p, ("batch", "seq")))


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


class GreedyDecoder:
    """Greedy decoding of ``new_tokens`` tokens into a static cache, one ``model(...)`` call per token."""

    def __init__(self, model: Any, prompt: torch.Tensor, new_tokens: int) -> None:
        self.model, self.prompt, self.new_tokens = model, prompt, new_tokens
        self.api = LlamaApi.of(model.forward)
        length = prompt.shape[1]
        self.cache = static_cache(model.config, prompt.shape[0], length + new_tokens, prompt.device)
        self.positions = torch.arange(length + new_tokens, device=prompt.device)

    def forward(self, ids: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        """Logits of ``ids`` written into the cache at positions ``start...``."""
        kwargs: dict[str, Any] = {self.api.cache_kwarg: self.cache, "use_cache": True}
        if self.api.cache_position:
            kwargs["cache_position"] = self.positions[start:start + ids.shape[1]]
        if last_only and self.api.logits_kwarg:
            kwargs[self.api.logits_kwarg] = 1
        return self.model(input_ids=ids, **kwargs).logits

    def __call__(self, phases: Phases) -> dict[str, torch.Tensor]:
        """Reset the cache, prefill the prompt, decode; laps ``prefill`` and ``decode``."""
        with torch.no_grad():
            phases.start()
            self.cache.reset()
            length = self.prompt.shape[1]
            first = self.forward(self.prompt, 0, last_only=True)[:, -1]
            token = first.argmax(-1, keepdim=True)
            tokens = [token]
            phases.lap("prefill")
            for i in range(self.new_tokens - 1):
                token = self.forward(token, length + i)[:, -1].argmax(-1, keepdim=True)
                tokens.append(token)
            phases.lap("decode")
        return {"tokens": torch.cat(tokens, dim=1), "first_logits": first}


def _check_decode(reference: dict[str, torch.Tensor], output: dict[str, torch.Tensor]) -> Check:
    """Identical tokens, and the prefill's last logits within bf16 tolerance."""
    return both(tokens_equal(reference["tokens"], output["tokens"]),
                close(reference["first_logits"], output["first_logits"]))


def build_llama_decode(device: torch.device, smoke: bool) -> Case:
    """Greedy decode with a ``StaticCache``: whole generate, the prefill into the cache, each decode step."""
    p = LLAMA_SMOKE if smoke else LLAMA_FULL
    model = build_llama(device, p)
    decoder = GreedyDecoder(model, _token_ids(p, p["decode_batch"], p["prompt"], device), p["new_tokens"])
    api = decoder.api
    params = {**_llama_params(model, p, ("decode_batch", "prompt", "new_tokens")), "cache": "StaticCache",
              "forward_kwargs": [api.cache_kwarg, *(["cache_position"] if api.cache_position else []),
                                 *([api.logits_kwarg] if api.logits_kwarg else [])]}
    metrics = (Metric("ms/generate"), Metric("ms/prefill (cache)", "prefill"),
               Metric("ms/decode step", "decode", max(1, p["new_tokens"] - 1)))
    return Case(decoder, _check_decode, params, metrics)


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
    """``model.generate(..., do_sample=False[, cache_implementation="static"])``; the sequences must be identical."""
    p = LLAMA_SMOKE if smoke else LLAMA_FULL
    transformers = _transformers()
    kwargs = generate_kwargs(_attribute(transformers, "GenerationConfig"), p["new_tokens"], static)
    model = build_llama(device, p)
    model.generation_config.pad_token_id = model.config.eos_token_id
    prompt = _token_ids(p, p["decode_batch"], p["prompt"], device)
    mask = torch.ones_like(prompt)

    def step(phases: Phases) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(input_ids=prompt, attention_mask=mask, **kwargs)[:, prompt.shape[1]:]

    params = {**_llama_params(model, p, ("decode_batch", "prompt", "new_tokens")),
              "generate": {k: v for k, v in kwargs.items() if k != "min_new_tokens"}}
    return Case(step, tokens_equal, params, (Metric("ms/generate"),))


WORKLOADS: tuple[ModelWorkload, ...] = (
    ModelWorkload("llama_prefill", "Llama decoder (4 layers, hidden 1024, GQA 16/4 heads, bf16): model(input_ids), "
                  "batch 4 x 256 tokens", build_llama_prefill, needs_transformers=True),
    ModelWorkload("llama_decode", "the same decoder: greedy 24 new tokens after a 128-token prompt, batch 4, "
                  "StaticCache, explicit model(...) loop", build_llama_decode, needs_transformers=True),
    ModelWorkload("llama_generate", "the same decoder: model.generate(max_new_tokens=24, do_sample=False, "
                  "cache_implementation='static'), batch 4 x 128-token prompt", build_llama_generate,
                  needs_transformers=True),
    ModelWorkload("llama_generate_dynamic", "the same decoder: model.generate(max_new_tokens=24, do_sample=False) "
                  "with the default DynamicCache, batch 4 x 128-token prompt",
                  functools.partial(build_llama_generate, static=False), needs_transformers=True),
    ModelWorkload("unet_fwd_fp16", "4 x (Conv2d(320,320,3) -> GroupNorm(32,320) -> SiLU), 2x320x64x64 "
                  "channels_last, fp16 forward, no grad", build_unet_forward),
    ModelWorkload("unet_fwd_bwd_fp32", "the same stack in fp32: forward + backward of out.square().mean(), "
                  "grads zeroed each step", build_unet_backward),
)


def select(patterns: Sequence[str]) -> list[ModelWorkload]:
    """The workloads whose name equals, or matches as a glob, one of ``patterns`` (all when empty)."""
    if not patterns:
        return list(WORKLOADS)
    return [w for w in WORKLOADS if any(w.name == p or fnmatch.fnmatchcase(w.name, p) for p in patterns)]


# -- running ------------------------------------------------------------------------------
def skip_reason(workload: ModelWorkload, target: Target, smoke: bool) -> str | None:
    """Why ``workload`` cannot run here (no GPU without ``--smoke``, no transformers), or ``None``."""
    if not smoke and not target.gpu:
        return (f"no GPU (active backend {target.backend!r}: {target.reason}); "
                "timings on the Triton interpreter mean nothing (--smoke runs a tiny functional version)")
    if workload.needs_transformers and not transformers_available():
        return "transformers is not installed (pip install transformers)"
    return None


@contextlib.contextmanager
def as_side(side: str, log: bool = False) -> Iterator[None]:
    """Run the block natively (``torch``) or with every routed op on flaggems."""
    with runner.side_scope(side, None, log=log):
        yield


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


def counted_step(case: Case, device: torch.device) -> tuple[Any, list[tuple[str, str]]]:
    """One untimed flaggems step with the dispatch and fallback channels on: its output and the log records."""
    with runner.capture_dispatch() as captured, as_side(FLAGGEMS, log=True):
        output = case.step(OFF)
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


def time_sides(case: Case, device: torch.device, settings: Settings) -> tuple[dict[str, dict[str, list[float]]], int]:
    """Per side and metric, the ms per step of every round (sides interleaved, order flipped each round).

    Also returns the steps per round: ``settings.steps``, or fitted to a warm torch step.
    """
    samples: dict[str, dict[str, list[float]]] = {s: {m.name: [] for m in case.metrics} for s in SIDES}
    for side in SIDES:
        with as_side(side):
            for _ in range(settings.warmup):
                case.step(OFF)
    steps = settings.steps
    if steps is None:
        with as_side(TORCH):
            steps = settings.steps_for(timed_round(case, device, 1)[case.metrics[0].name])
    for index in range(settings.rounds):
        for side in SIDES if index % 2 == 0 else SIDES[::-1]:
            with as_side(side), runner.gc_paused():
                if not settings.smoke:
                    case.step(OFF)  # the first step after re-routing is not the steady state
                for name, value in timed_round(case, device, steps).items():
                    samples[side][name].append(value)
    return samples, steps


def metric_results(case: Case, samples: dict[str, dict[str, list[float]]]) -> list[MetricResult]:
    """Medians per side, and the median, lowest and highest of the rounds' torch/flaggems pairs."""
    out = []
    for metric in case.metrics:
        base, ours = samples[TORCH][metric.name], samples[FLAGGEMS][metric.name]
        pairs = [t / f for t, f in zip(base, ours) if t and f]
        result = MetricResult(metric.name, statistics.median(base) if base else None,
                              statistics.median(ours) if ours else None, torch_rounds=base, flaggems_rounds=ours)
        if pairs:
            result.ratio, result.ratio_low, result.ratio_high = statistics.median(pairs), min(pairs), max(pairs)
        out.append(result)
    return out


def describe_exception(exc: BaseException) -> str:
    """``Type: message (at file:line in function)``, the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def measure(case: Case, result: ModelResult, device: torch.device, settings: Settings) -> None:
    """Reference step, counted flaggems step and check, then the timed rounds, into ``result``."""
    with as_side(TORCH):
        reference = detached_copy(case.step(OFF))
        runner.synchronize(device)
    output, records = counted_step(case, device)
    check = case.check(reference, output)
    result.match, result.check, result.max_diff = check.match, check.detail, check.max_diff
    result.flaggems_ops, result.native_calls, result.declines = dispatch_counts(records)
    del reference, output
    samples, result.steps_per_round = time_sides(case, device, settings)
    result.metrics = metric_results(case, samples)


def run_model(workload: ModelWorkload, target: Target, settings: Settings) -> ModelResult:
    """Build, check and time one workload; a skip or an exception is recorded, not raised."""
    result = ModelResult(workload.name, workload.description)
    reason = skip_reason(workload, target, settings.smoke)
    try:
        if reason is not None:
            raise Skip(reason)
        case = workload.build(target.device, settings.smoke)
        result.params = case.params
        measure(case, result, target.device, settings)
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
            progress: Callable[[str], None] | None = None) -> list[ModelResult]:
    """Every workload, flaggems disabled between sides (the previous state restored after)."""
    results = []
    with runner.flaggems_off():
        for workload in workloads:
            if progress is not None:
                progress(workload.name)
            results.append(run_model(workload, target, settings))
    return results


# -- reporting ------------------------------------------------------------------------------
def environment(target: Target, settings: Settings) -> dict[str, Any]:
    """Where and how the numbers were taken, as ``flaggems bench`` records it, plus the model settings."""
    meta = runner.environment(target, settings, SIDES)  # type: ignore[arg-type] # Settings has smoke and describe()
    meta.update(steps=settings.steps if settings.steps is not None else f"auto (~{settings.round_ms:g} ms a round)",
                rounds=settings.rounds, warmup=settings.warmup, transformers=_version())
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


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _match(result: ModelResult) -> str:
    return {True: "yes", False: "NO", None: "-"}[result.match]


def rows(results: Sequence[ModelResult]) -> list[tuple[str, ...]]:
    """One row per metric of each workload that ran."""
    out = []
    for r in results:
        for i, m in enumerate(r.metrics):
            ratio = "-" if m.ratio is None else f"{m.ratio:.3f}x"
            spread = "-" if m.ratio_low is None else f"{m.ratio_low:.2f}-{m.ratio_high:.2f}"
            first = i == 0
            out.append((r.workload if first else "", m.name, _ms(m.torch_ms), _ms(m.flaggems_ms), ratio, spread,
                        str(r.steps_per_round) if first else "", _match(r) if first else ""))
    return out


def _align(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    numeric = {2, 3, 4, 5, 6}
    return ["  ".join(c.rjust(widths[i]) if i in numeric else c.ljust(widths[i]) for i, c in enumerate(row)).rstrip()
            for row in (header, *body)]


def _counts(counts: Mapping[str, int], limit: int = 8) -> str:
    items = [f"{name} x{n}" for name, n in counts.items()]
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def ops_lines(results: Sequence[ModelResult]) -> list[str]:
    """Per workload that ran: what served its calls in the counted step, what went native, declines."""
    lines = ["flaggems dispatch in one untimed step (op -> implementation x calls):"]
    for r in results:
        if r.status != "ok":
            continue
        lines.append(f"  {r.workload}: {_counts(r.flaggems_ops) or 'NO call served by flaggems (all native)'}")
        if r.native_calls:
            lines.append(f"    native: {_counts(r.native_calls)}")
        if r.declines:
            lines.append(f"    declined: {_counts(r.declines, 4)}")
    return lines


def summary(results: Sequence[ModelResult]) -> dict[str, Any]:
    """Geomean of the first metric's ratio over the workloads timed, and how many ran, skipped, failed."""
    ratios = [r.metrics[0].ratio for r in results if r.metrics and r.metrics[0].ratio]
    geomean = math.exp(sum(math.log(v) for v in ratios) / len(ratios)) if ratios else None
    return {"geomean_ratio": geomean, "workloads_timed": len(ratios),
            "skipped": sum(r.status == "skipped" for r in results),
            "failed": sum(r.failed for r in results)}


def table(results: Sequence[ModelResult], meta: Mapping[str, Any]) -> str:
    """The human-readable report: banner, context, the rows, dispatch counts, skips and problems."""
    lines = [SMOKE_BANNER] if meta["smoke"] else []
    lines.append(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  flaggems {meta['flaggems']}"
                 f"  transformers {meta['transformers'] or '-'}  backend {meta['backend']}")
    lines.append(meta["timing"])
    if any(r.metrics for r in results):
        lines.extend(_align(COLUMNS, rows(results)))
        stats = summary(results)
        if stats["geomean_ratio"]:
            lines.append(f"geomean torch/flaggems (first metric of each workload; >1: flaggems faster): "
                         f"{stats['geomean_ratio']:.3f}x over {stats['workloads_timed']} workloads")
        lines.extend(ops_lines(results))
    lines.extend(problems(results))
    return "\n".join(lines)


def problems(results: Sequence[ModelResult]) -> list[str]:
    """A line per skipped workload, per error and per output that differs from torch's."""
    found = []
    for r in results:
        if r.status == "skipped":
            found.append(f"skipped {r.workload}: {r.reason}")
        elif r.error:
            found.append(f"error: {r.workload}: {r.error}")
        elif r.match is False:
            found.append(f"MISMATCH: {r.workload}: flaggems' output differs from torch's: {r.check}")
    return found


def listing(workloads: Sequence[ModelWorkload]) -> str:
    """``--list``: each workload's name and what it runs."""
    lines = [f"  {w.name:<18} {w.description}{' [needs transformers]' if w.needs_transformers else ''}"
             for w in workloads]
    return "\n".join([f"{len(workloads)} model workloads (smoke: tiny sizes, see flaggems.bench.models):", *lines])


def document(results: Sequence[ModelResult], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--json`` document."""
    return {"meta": dict(meta), "summary": summary(results), "results": [r.as_dict() for r in results]}


def write_json(path: str, results: Sequence[ModelResult], meta: Mapping[str, Any]) -> None:
    """Write :func:`document` to ``path``."""
    report.dump_json(path, document(results, meta))


def write_plot(path: str, results: Sequence[ModelResult], meta: Mapping[str, Any]) -> None:
    """Bars of torch / flaggems per workload and metric from 1x, log scale, whiskers over the rounds' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    bars = [(f"{r.workload}: {m.name}", m, r.match is not False) for r in results for m in r.metrics if m.ratio]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.35 * max(1, len(bars))))
    for y, (_, m, ok) in enumerate(bars):
        ax.barh(y, m.ratio - 1.0, left=1.0, color="C0" if ok else "red")
        ax.errorbar(m.ratio, y, xerr=[[m.ratio - m.ratio_low], [m.ratio_high - m.ratio]], fmt="none",
                    ecolor="black", capsize=3, linewidth=0.8)
        ax.text(m.ratio_high, y, f" {m.ratio:.2f}x", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [label for label, _, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("torch / flaggems wall time per step: median of the rounds' pairs, whiskers lowest-highest\n"
                  "(right of 1x: flaggems faster; red: output differs)")
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

    results = run_all(chosen, target, settings, progress)
    meta = environment(target, settings)
    print(table(results, meta))
    if args.json:
        write_json(args.json, results, meta)
    if args.plot and plot_available():
        write_plot(args.plot, results, meta)
    if all(r.status == "skipped" for r in results):
        return 2
    return 1 if any(r.failed for r in results) else 0


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
    return cmd_models(build_parser().parse_args(argv))
