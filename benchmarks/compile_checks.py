"""flaggems under torch.compile, transformers' static-cache ``generate`` and CUDA graphs: checks, then timings.

    python benchmarks/compile_checks.py checks  [--json out.json] [--smoke]   # every mode: no crash, equal results
    python benchmarks/compile_checks.py timings [--json out.json] [--rounds 5] # eager / compiled / CUDA-graph rows

``checks`` builds small decoders (transformers, random weights from configs, bf16 on CUDA, fp32 on the CPU)
and runs each with flaggems enabled (``enabled``) and enabled with the model patched (``patched``) against
the same model without flaggems, for every execution mode: ``torch.compile`` with ``eager``, ``aot_eager``,
``inductor`` (default, ``reduce-overhead``, ``max-autotune-no-cudagraphs``), ``dynamic=True`` and automatic
dynamic shapes after a recompile (a second prompt length); ``fullgraph=True`` on a patched decoder layer
(and ``torch._dynamo.explain``'s graph breaks); ``generate(cache_implementation="static")``, which compiles
its decode step by itself on CUDA, and ``generate`` with a ``compile_config``; a training step under compile;
a StaticCache decode step captured with ``torch.cuda.graph`` and replayed. Each check's line says ok, or
the exception (its traceback in the JSON). Exit 1 when any check failed.

``timings`` runs one model at a 1B-class size, all sides interleaved round by round on the same weights:
torch eager, patched eager, ``torch.compile``, ``torch.compile`` of the patched model with flaggems enabled,
torch's decode step in a CUDA graph and the patched one in a CUDA graph; a prefill and a StaticCache decode
step; wall ms per call (median of rounds) and GPU kernel ms per call (``torch.profiler``), compile seconds
with and without flaggems.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

import flaggems
from flaggems.bench import models

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
SMALL = {"layers": 2, "hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 4, "vocab": 32000}
SMOKE = {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 256}
#: Llama-3.2-1B's shape (16 layers, hidden 2048, GQA 32/8) with a 32k vocabulary.
BENCH = {"layers": 16, "hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8, "vocab": 32000}
FAMILIES = {
    "llama": models.LLAMA,
    "qwen2": models.QWEN2,
    "qwen3": models.Family("qwen3", "Qwen3", SMALL, SMOKE),
}
#: Relative logit error (max over rows of max |diff| / max |reference|) a bf16 side may show against torch's.
TOLERANCE = 3e-2 if CUDA else 1e-4


# -- models and sides ---------------------------------------------------------------------------------------------
def build(family: str, sizes: dict[str, int]) -> Any:
    """A ``<family>ForCausalLM`` with random weights (seed 0), SDPA, eval mode, in :data:`DTYPE`."""
    fam = FAMILIES[family]
    extra = {"head_dim": sizes["hidden"] // sizes["heads"]} if family == "qwen3" else {}
    model = models.build_decoder(models.Family(fam.name, fam.prefix, sizes, sizes, {**fam.extra, **extra}), DEVICE,
                                 sizes)
    return model.to(DTYPE)


def prompt(sizes: dict[str, int], batch: int, length: int, seed: int = 1) -> torch.Tensor:
    """Token ids drawn from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, sizes["vocab"], (batch, length), generator=gen).to(DEVICE)


@contextlib.contextmanager
def side(model: Any, name: str) -> Iterator[None]:
    """``torch``: flaggems off; ``enabled``: ``flaggems.enable()``; ``patched``: enabled and ``patch(model)``."""
    if name == "torch":
        flaggems.disable()
        yield
        return
    flaggems.enable()
    if name == "patched":
        flaggems.patch(model)
    try:
        yield
    finally:
        if name == "patched":
            flaggems.unpatch(model)
        flaggems.disable()


def logits_error(reference: torch.Tensor, output: torch.Tensor) -> float:
    """Max over rows of ``max |output - reference| / max |reference|`` (the last dimension is a row)."""
    ref, out = reference.float().flatten(0, -2), output.float().flatten(0, -2)
    return ((out - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-6)).max().item()


# -- the checks ---------------------------------------------------------------------------------------------------
class Checks:
    """Runs named checks, keeps each outcome (ok, error with its numbers, or the exception and traceback)."""

    def __init__(self, path: str | None = None) -> None:
        self.results: list[dict[str, Any]] = []
        self.path = path  # rewritten after every check: a run stopped by its time limit keeps what it did

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        """Run one check: ``fn`` returns its numbers and ``ok``; an exception fails it."""
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            row = {"name": name, **fn()}
        except Exception as exc:  # noqa: BLE001 - a check's failure is reported, the next check runs
            row = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}",
                   "traceback": traceback.format_exc()[-12000:]}
        finally:
            flaggems.disable()
        row["seconds"] = round(time.perf_counter() - start, 1)
        self.results.append(row)
        shown = {k: v for k, v in row.items() if k not in ("name", "traceback", "ok")}
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {name}: {shown}", flush=True)
        if self.path:
            with open(self.path, "w") as fh:
                json.dump({"results": self.results}, fh, indent=1)


def check_compile(model: Any, sizes: dict[str, int], name: str, lengths: tuple[int, ...], **compile_args: Any
                  ) -> dict[str, Any]:
    """``torch.compile(model, **compile_args)`` on side ``name`` against eager torch, one prompt per length."""
    refs = {}
    with side(model, "torch"), torch.no_grad():
        for n in lengths:
            refs[n] = model(prompt(sizes, 2, n)).logits
    errors, first = [], None
    with side(model, name), torch.no_grad():
        compiled = torch.compile(model, **compile_args)
        for n in lengths:
            start = time.perf_counter()
            out = compiled(prompt(sizes, 2, n)).logits
            if first is None:
                first = time.perf_counter() - start
            errors.append(logits_error(refs[n], out))
            out = compiled(prompt(sizes, 2, n, seed=2)).logits  # a second call: cudagraph trees replay now
    worst = max(errors)
    return {"ok": worst <= TOLERANCE, "error": round(worst, 5), "first_call_s": round(first, 1)}


def check_layer_fullgraph(model: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """A patched decoder layer under ``fullgraph=True`` (inductor) and ``torch._dynamo.explain``."""
    layer = model.model.layers[0]
    hidden = torch.randn(2, 16, sizes["hidden"], device=DEVICE, dtype=DTYPE)
    positions = torch.arange(16, device=DEVICE)[None].expand(2, -1)
    cos, sin = model.model.rotary_emb(hidden, positions)

    def run(h: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=(c, s))
        return out[0] if isinstance(out, tuple) else out

    with side(model, "torch"), torch.no_grad():
        want = run(hidden, cos, sin)
    with side(model, "patched"), torch.no_grad():
        breaks = torch._dynamo.explain(run)(hidden, cos, sin).graph_break_count
        torch._dynamo.reset()
        got = torch.compile(run, fullgraph=True)(hidden, cos, sin)
    error = logits_error(want, got)
    return {"ok": breaks == 0 and error <= TOLERANCE, "graph_breaks": breaks, "error": round(error, 5)}


def check_generate(model: Any, sizes: dict[str, int], name: str, compile_config: Any = None) -> dict[str, Any]:
    """``generate(cache_implementation="static")`` (transformers compiles its decode step on CUDA) on side
    ``name`` against the same call with flaggems off: tokens and first-step logits. Where the greedy tokens
    part, it passes only if every step's logits up to the parting and both sides teacher-forced along torch's
    sequence are within tolerance (:func:`_divergence` says how near the tie was)."""
    kwargs: dict[str, Any] = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False,
                              "cache_implementation": "static", "return_dict_in_generate": True,
                              "output_logits": True}
    if compile_config is not None:
        kwargs["compile_config"] = compile_config
    ids = prompt(sizes, 1, 12)
    outs = {}
    for who in ("torch", name):
        torch._dynamo.reset()
        with side(model, who), torch.no_grad():
            outs[who] = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    want, got = outs["torch"], outs[name]
    same = (want.sequences == got.sequences).all(0)
    diverge = int((~same).nonzero()[0]) - ids.shape[1] if not bool(same.all()) else None
    error = logits_error(want.logits[0], got.logits[0])
    row: dict[str, Any] = {"ok": error <= TOLERANCE and diverge is None, "first_logits_error": round(error, 5),
                           "tokens_equal": diverge is None, "first_divergence": diverge}
    if diverge is not None:
        row.update(_divergence(model, name, want, got, diverge))
        row["ok"] = error <= TOLERANCE and row["prefix_logits_error"] <= TOLERANCE \
            and row["teacher_forced_error"] <= TOLERANCE
    return row


def _divergence(model: Any, name: str, want: Any, got: Any, step: int) -> dict[str, Any]:
    """Where greedy tokens part at generated ``step``: the logits of every step up to it (the same prefix on
    both sides) against torch's, torch's margin there between its token and ours (relative, and in bf16 ulps
    of the largest logit: a flip needs a margin within twice the logits' error), and both sides teacher-forced
    along torch's sequence (one forward each, flaggems off and on side ``name``). Tokens that part at a
    near-tie while every logit stays within tolerance are the dtype's rounding, not a wrong kernel."""
    prefix = max(logits_error(want.logits[i], got.logits[i]) for i in range(step + 1))
    ref = want.logits[step][0].float()
    mine, theirs = int(got.sequences[0, -len(got.logits) + step]), int(want.sequences[0, -len(want.logits) + step])
    top = ref.abs().max().item()
    margin = (ref[theirs] - ref[mine]).item()
    ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(max(top, 1e-30)))
    sequence = want.sequences
    forced = {}
    for who in ("torch", name):
        with side(model, who), torch.no_grad():
            forced[who] = model(sequence).logits[0, -len(want.logits) - 1:-1].float()
    return {"prefix_logits_error": round(prefix, 5), "margin_at_divergence": round(margin / max(top, 1e-30), 6),
            "margin_bf16_ulps": round(margin / ulp, 2),
            "teacher_forced_error": round(logits_error(forced["torch"], forced[name]), 5)}


def check_training(model: Any, sizes: dict[str, int], name: str, backend: str) -> dict[str, Any]:
    """A forward and ``loss.backward()`` of ``torch.compile(model)`` on side ``name`` against eager torch."""
    ids = prompt(sizes, 2, 32)
    grads = {}
    for who in ("torch", name):
        model.zero_grad(set_to_none=True)
        model.train()
        with side(model, who):
            fn = model if who == "torch" else torch.compile(model, backend=backend)
            loss = fn(ids, labels=ids).loss
            loss.backward()
        grads[who] = (loss.detach().float(), [p.grad.float().clone() for p in model.parameters()
                                              if p.grad is not None])
        model.eval()
    model.zero_grad(set_to_none=True)
    loss_err = abs(grads[name][0] - grads["torch"][0]).item() / abs(grads["torch"][0]).item()
    worst = max(((g - r).norm() / r.norm().clamp_min(1e-12)).item() for g, r in zip(grads[name][1], grads["torch"][1]))
    limit = 5e-2 if CUDA else 1e-4
    return {"ok": loss_err <= limit and worst <= limit, "loss_error": round(loss_err, 6),
            "worst_grad_norm_error": round(worst, 5)}


def decode_inputs(model: Any, sizes: dict[str, int], batch: int, length: int) -> tuple[Any, torch.Tensor]:
    """A StaticCache prefilled with a prompt (flaggems off) and the next token."""
    cache = models.static_cache(model.config, batch, length + 64, DEVICE)
    ids = prompt(sizes, batch, length)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(length, device=DEVICE)).logits
    return cache, logits[:, -1:].argmax(-1)


def _logits_step(model: Any, ids: torch.Tensor, cache: Any, position: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=position).logits[:, -1].float()


def _decode_steps(model: Any, sizes: dict[str, int], who: str, graphed: bool, tokens: torch.Tensor | None,
                  steps: int) -> torch.Tensor:
    """``steps`` StaticCache decode steps' logits on side ``who``, eager or replaying one captured step.

    ``tokens`` (``[steps, batch, 1]``) teacher-forces the input of every step after the first; ``None`` feeds
    back each step's own argmax (greedy). A free-running comparison of random-weight models measures argmax
    near-ties, not the capture: one bf16 ulp that flips a token changes every later step."""
    length = 12
    cache, token = decode_inputs(model, sizes, 2, length)
    with side(model, who), torch.no_grad():
        ids, position = token.clone(), torch.tensor([length], device=DEVICE)
        step = functools.partial(_logits_step, model, ids, cache, position)
        if graphed:
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):  # warm-up on a side stream, as torch.cuda.graph's notes ask
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side_stream)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                captured = step()
            ids.copy_(token)
            models.rewind_static_cache(cache, length)  # the warm-ups advanced the cache's own write position
            step = lambda: (graph.replay(), captured.clone())[1]  # noqa: E731
        logits = []
        for i in range(steps):
            logits.append(step())
            ids.copy_(logits[-1].argmax(-1, keepdim=True) if tokens is None else tokens[i])
            position.add_(1)
    return torch.stack(logits)


def check_cuda_graph(model: Any, sizes: dict[str, int], name: str, steps: int = 8) -> dict[str, Any]:
    """A StaticCache decode step captured with ``torch.cuda.graph`` on side ``name``, replayed ``steps`` times
    with advancing positions, against the same steps eager with flaggems off. Every side reads the tokens
    torch's eager greedy run chose (teacher forcing), so each step's logits compare like for like; torch's
    own capture is the control, and the greedy tokens of each graph are reported beside."""
    free = _decode_steps(model, sizes, "torch", False, None, steps)
    tokens = free.argmax(-1, keepdim=True)  # [steps, batch, 1]: step i's choice is step i + 1's input
    eager = _decode_steps(model, sizes, "torch", False, tokens, steps)
    torch_graph = _decode_steps(model, sizes, "torch", True, tokens, steps)
    ours = _decode_steps(model, sizes, name, True, tokens, steps)
    ours_free = _decode_steps(model, sizes, name, True, None, steps)
    error, control = logits_error(eager, ours), logits_error(eager, torch_graph)
    per_step = [round(logits_error(eager[i], ours[i]), 5) for i in range(steps)]
    greedy_same = bool((ours_free.argmax(-1) == free.argmax(-1)).all())
    return {"ok": error <= TOLERANCE, "error": round(error, 5), "step_errors": per_step,
            "torch_graph_error": round(control, 5), "teacher_forced_equals_free": logits_error(free, eager) == 0.0,
            "greedy_tokens_equal": greedy_same}


def all_checks(smoke: bool, path: str | None = None) -> list[dict[str, Any]]:
    """Every check (:func:`main`'s ``checks``)."""
    sizes = SMOKE if smoke else SMALL
    checks = Checks(path)
    llama = build("llama", sizes)
    lengths = (24, 40)
    for who in ("enabled", "patched"):
        compiled = functools.partial(check_compile, llama, sizes, who, lengths)
        checks.run(f"llama {who} eager backend", functools.partial(compiled, backend="eager"))
        checks.run(f"llama {who} aot_eager dynamic=True", functools.partial(compiled, backend="aot_eager",
                                                                             dynamic=True))
        checks.run(f"llama {who} inductor (automatic dynamic after a recompile)", compiled)
        checks.run(f"llama {who} inductor dynamic=True", functools.partial(compiled, dynamic=True))
        if CUDA:
            checks.run(f"llama {who} inductor reduce-overhead", functools.partial(compiled, mode="reduce-overhead"))
    if CUDA:
        checks.run("llama patched inductor max-autotune-no-cudagraphs",
                   functools.partial(check_compile, llama, sizes, "patched", lengths[:1],
                                     mode="max-autotune-no-cudagraphs"))
    checks.run("llama patched decoder layer fullgraph=True", functools.partial(check_layer_fullgraph, llama, sizes))
    for who in ("enabled", "patched"):
        checks.run(f"llama {who} generate(cache_implementation='static')",
                   functools.partial(check_generate, llama, sizes, who))
    try:
        from transformers import CompileConfig
    except ImportError:
        CompileConfig = None  # noqa: N806 - transformers' class
    if CompileConfig is not None:
        checks.run("llama patched generate with compile_config(dynamic=True)",
                   functools.partial(check_generate, llama, sizes, "patched", CompileConfig(dynamic=True)))
    for backend in ("aot_eager", "inductor"):
        checks.run(f"llama patched training step, {backend}",
                   functools.partial(check_training, llama, sizes, "patched", backend))
    if CUDA:
        for who in ("enabled", "patched"):
            checks.run(f"llama {who} StaticCache decode step in torch.cuda.graph",
                       functools.partial(check_cuda_graph, llama, sizes, who))
    del llama
    for family in ("qwen2", "qwen3"):
        model = build(family, sizes)
        checks.run(f"{family} patched inductor dynamic=True",
                   functools.partial(check_compile, model, sizes, "patched", lengths, dynamic=True))
        checks.run(f"{family} patched generate(cache_implementation='static')",
                   functools.partial(check_generate, model, sizes, "patched"))
        del model
    return checks.results


# -- the timings --------------------------------------------------------------------------------------------------
def _wall_ms(fn: Callable[[], Any], calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def _kernel_ms(fn: Callable[[], Any], calls: int = 5) -> float:
    """GPU kernel time per call: the summed durations of the device kernels ``calls`` calls launch."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages() if str(e.device_type).endswith("CUDA"))
    return total / 1e3 / calls


def _graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    for _ in range(2):
        fn()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def timing_sides(family: str, sizes: dict[str, int], batch: int, length: int, decode: bool
                 ) -> tuple[dict[str, Callable[[], Any]], dict[str, float], dict[str, Callable[[], None]]]:
    """The sides of one workload: their step functions, compile seconds, and how to enter each side."""
    torch_model = build(family, sizes)
    patched_model = copy.deepcopy(torch_model)
    flaggems.enable()
    flaggems.patch(patched_model)
    flaggems.disable()
    state: dict[str, Any] = {}

    def inputs(model: Any) -> dict[str, Any]:
        if not decode:
            return {"input_ids": prompt(sizes, batch, length)}
        cache, token = decode_inputs(model, sizes, batch, length)
        return {"input_ids": token, "past_key_values": cache, "use_cache": True,
                "cache_position": torch.tensor([length], device=DEVICE)}

    def step_of(model: Any, fn: Any) -> Callable[[], Any]:
        if id(model) not in state:  # one cache per model, shared by its eager, compiled and graphed sides
            state[id(model)] = inputs(model)
        kwargs = state[id(model)]
        return lambda: fn(**kwargs).logits

    def entering(model: Any, flag: Callable[[], None]) -> Callable[[], None]:
        """Enter a side: flaggems on or off, and (decode) the cache's write position back to the prompt's end,
        so every timed batch decodes the same positions (20 calls stay within the cache's 64 spare rows)."""
        def enter() -> None:
            flag()
            if decode and id(model) in state:
                models.rewind_static_cache(state[id(model)]["past_key_values"], length)
        return enter

    on, off = flaggems.enable, flaggems.disable
    steps = {"torch eager": step_of(torch_model, torch_model), "patched eager": step_of(patched_model, patched_model)}
    enter = {"torch eager": entering(torch_model, off), "patched eager": entering(patched_model, on)}
    compile_s = {}
    torch._dynamo.reset()
    for label, model, flag in (("torch.compile", torch_model, off), ("patched + torch.compile", patched_model, on)):
        flag()
        compiled = torch.compile(model)
        fn = step_of(model, compiled)
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        torch.cuda.synchronize()
        compile_s[label] = round(time.perf_counter() - start, 1)
        steps[label], enter[label] = fn, entering(model, flag)
    if decode:
        for label, model, flag in (("torch CUDA graph", torch_model, off), ("patched CUDA graph", patched_model, on)):
            flag()
            with torch.no_grad():
                steps[label] = _graphed(step_of(model, model))
            enter[label] = entering(model, flag)
    off()
    return steps, compile_s, enter


def time_workload(name: str, family: str, sizes: dict[str, int], batch: int, length: int, decode: bool,
                  rounds: int) -> dict[str, Any]:
    """Interleaved rounds over every side; the median wall ms per call, kernel ms per call, ratios to torch."""
    steps, compile_s, enter = timing_sides(family, sizes, batch, length, decode)
    calls = 20 if decode else 5
    walls: dict[str, list[float]] = {label: [] for label in steps}
    with torch.no_grad():
        for label, fn in steps.items():  # warm-up
            enter[label]()
            fn()
        for _ in range(rounds):
            for label, fn in steps.items():
                enter[label]()
                walls[label].append(_wall_ms(fn, calls))
        kernels = {}
        for label, fn in steps.items():
            enter[label]()
            kernels[label] = round(_kernel_ms(fn), 3)
    flaggems.disable()
    wall = {label: round(statistics.median(v), 3) for label, v in walls.items()}
    row = {"workload": name, "family": family, "sizes": sizes, "batch": batch, "length": length, "wall_ms": wall,
           "kernel_ms": kernels, "compile_s": compile_s,
           "vs": {"patched eager / torch eager": round(wall["torch eager"] / wall["patched eager"], 3),
                  "patched compile / torch.compile": round(wall["torch.compile"] / wall["patched + torch.compile"], 3)}}
    if decode:
        row["vs"]["patched graph / torch graph"] = round(wall["torch CUDA graph"] / wall["patched CUDA graph"], 3)
        row["vs"]["patched graph / torch graph (kernel)"] = round(
            kernels["torch CUDA graph"] / max(kernels["patched CUDA graph"], 1e-9), 3)
    row["vs"]["compile time with / without flaggems"] = round(
        compile_s["patched + torch.compile"] / compile_s["torch.compile"], 3)
    print(json.dumps(row), flush=True)
    return row


def all_timings(rounds: int, only: list[str] | None) -> list[dict[str, Any]]:
    """Prefill 2x1024 and decode steps (batch 1 and 8) of a 1B-class Llama; a Qwen3 decode step."""
    qwen3 = {**BENCH, "layers": 28, "hidden": 1024, "intermediate": 3072, "heads": 16, "kv_heads": 8}
    plan = [("llama prefill 2x1024", "llama", BENCH, 2, 1024, False),
            ("llama decode step b1 (StaticCache, 128 cached)", "llama", BENCH, 1, 128, True),
            ("llama decode step b8 (StaticCache, 128 cached)", "llama", BENCH, 8, 128, True),
            ("qwen3 decode step b1 (StaticCache, 128 cached)", "qwen3", qwen3, 1, 128, True)]
    rows = []
    for name, family, sizes, batch, length, decode in plan:
        key = "_".join(name.split()[:2] + [w for w in name.split() if w in ("b1", "b8")])  # llama_decode_b1
        if only and not any(part in name or part == key for part in only):
            continue
        try:
            rows.append(time_workload(name, family, sizes, batch, length, decode, rounds))
        except Exception as exc:  # noqa: BLE001 - reported, the next workload runs
            print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
            rows.append({"workload": name, "error": traceback.format_exc()[-6000:]})
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    """``checks`` or ``timings`` (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("checks", "timings"))
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true", help="checks at tiny sizes (the CPU)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", action="append", help="timings: workloads whose name contains this, or "
                        "a key: llama_prefill, llama_decode_b1, llama_decode_b8, qwen3_decode_b1 (repeatable)")
    opts = parser.parse_args(argv)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if CUDA else "cpu",
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "transformers": __import__("transformers").__version__, "entry": None}
    flaggems.enable()
    meta["entry"] = flaggems.info()["entry"]["active"]
    flaggems.disable()
    print(json.dumps(meta), flush=True)
    if opts.what == "checks":
        results = all_checks(opts.smoke, opts.json and opts.json + '.partial')
        failed = [r["name"] for r in results if not r["ok"]]
        print(f"{len(results) - len(failed)} of {len(results)} checks passed"
              + (f"; failed: {failed}" if failed else ""))
    else:
        if not CUDA:
            print("timings need a CUDA GPU", file=sys.stderr)
            return 2
        results = all_timings(opts.rounds, opts.only)
        failed = [r["workload"] for r in results if "error" in r]
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
