"""The transformers decoders (Llama, Qwen2, Mixtral) built from configs, and their prefill, varlen prefill,
training, greedy decode and ``generate()`` cases.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ._common import Case, Check, Metric, ModelApiError, ModelSlot, Phases, Skip
from .checks import Exact, decode_check, grads_check, prefill_check, tokens_equal

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
