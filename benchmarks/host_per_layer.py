"""Host time of a decode step per decoder layer and per module kind: torch eager, ``enable()``, patched.

    python benchmarks/host_per_layer.py [--family llama] [--batch 1] [--steps 200] [--json out.json]

A 1B-class decoder (:data:`compile_checks.BENCH` sizes, random weights, bf16) decodes one token into a
StaticCache 128 tokens long, the same step again and again (the cache's write position rewound each time).
Per side it reports the step's wall ms (synchronised), its host ms (the time until the Python call returns,
the GPU left to run behind: on a host-bound step the GPU never makes the host wait), and the host µs per
layer of each module kind, from timers around every module's ``forward`` (their own cost, about 1 µs a
module, is measured by an empty module and subtracted). What the patch removes per layer, and what is
left, is read off these rows: issue 62's "host µs per layer before and after".
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_checks as cc  # noqa: E402 - the sibling script: its models and sides

import flaggems  # noqa: E402
from flaggems.bench import models  # noqa: E402


def _step(model: Any, cache: Any, token: torch.Tensor, length: int) -> Any:
    position = torch.tensor([length], device=cc.DEVICE)

    def step() -> Any:
        models.rewind_static_cache(cache, length)
        return model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position).logits
    return step


def _sync() -> None:
    if cc.CUDA:
        torch.cuda.synchronize()


def _host_and_wall_ms(step: Any, steps: int) -> tuple[float, float]:
    hosts, walls = [], []
    for _ in range(steps):
        _sync()
        start = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - start)
        _sync()
        walls.append(time.perf_counter() - start)
    return statistics.median(hosts) * 1e3, statistics.median(walls) * 1e3


class _Timers:
    """Host seconds per module kind, from a pre- and a post-forward hook on every module."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.spent: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._open: dict[int, float] = {}
        self._handles = []
        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post))

    def _pre(self, module: torch.nn.Module, *_: Any) -> None:
        self._open[id(module)] = time.perf_counter()

    def _post(self, module: torch.nn.Module, *_: Any) -> None:
        kind = type(module).__name__
        self.spent[kind] += time.perf_counter() - self._open.pop(id(module))
        self.calls[kind] += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _hook_cost_us() -> float:
    """What a timed empty module's call costs beyond an untimed one (subtracted per call)."""
    empty = torch.nn.Identity()
    x = torch.zeros(1)
    start = time.perf_counter()
    for _ in range(2000):
        empty(x)
    plain = time.perf_counter() - start
    timers = _Timers(empty)
    start = time.perf_counter()
    for _ in range(2000):
        empty(x)
    timed = time.perf_counter() - start
    timers.remove()
    return max(0.0, (timed - plain) / 2000 * 1e6)


def measure(family: str, batch: int, steps: int, smoke: bool = False) -> dict[str, Any]:
    """Every side's step host and wall ms and host µs per layer by module kind (``smoke``: tiny sizes)."""
    sizes = cc.BENCH if family == "llama" else {**cc.BENCH, "layers": 28, "hidden": 1024, "intermediate": 3072,
                                                  "heads": 16, "kv_heads": 8}
    sizes = cc.SMOKE if smoke else sizes
    model = cc.build(family, sizes)
    length, layers = 128, sizes["layers"]
    cache, token = cc.decode_inputs(model, sizes, batch, length)
    hook_us = _hook_cost_us()
    rows: dict[str, Any] = {}
    order = ("torch", "enabled", "patched")
    with torch.no_grad():
        for who in order:  # warm-up: plans made, kernels compiled
            with cc.side(model, who):
                for _ in range(5):
                    _step(model, cache, token, length)()
        times: dict[str, list[tuple[float, float]]] = {who: [] for who in order}
        for _ in range(5):  # interleaved rounds
            for who in order:
                with cc.side(model, who):
                    times[who].append(_host_and_wall_ms(_step(model, cache, token, length), steps // 5))
        for who in order:
            with cc.side(model, who):
                timers = _Timers(model)
                step = _step(model, cache, token, length)
                for _ in range(steps // 5):
                    step()
                _sync()
                timers.remove()
            per_layer = {kind: round((s / (steps // 5) * 1e6 - hook_us * timers.calls[kind] / (steps // 5)) / layers,
                                     1)
                         for kind, s in timers.spent.most_common(12)}
            rows[who] = {"host_ms": round(statistics.median(h for h, _ in times[who]), 3),
                         "wall_ms": round(statistics.median(w for _, w in times[who]), 3),
                         "host_us_per_layer_by_module": per_layer,
                         "module_calls_per_layer": {k: round(v / (steps // 5) / layers, 2)
                                                    for k, v in timers.calls.most_common(12)}}
            print(who, json.dumps(rows[who]), flush=True)
    return {"family": family, "batch": batch, "sizes": sizes, "cached": length, "hook_us": round(hook_us, 2),
            "sides": rows}


def main(argv: list[str] | None = None) -> int:
    """Measure and print (``--json``: write) one family's rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama", choices=("llama", "qwen3"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU)")
    opts = parser.parse_args(argv)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if cc.CUDA else "cpu",
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "transformers": __import__("transformers").__version__}
    print(json.dumps(meta), flush=True)
    result = {"meta": meta, **measure(opts.family, opts.batch, opts.steps, opts.smoke)}
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    flaggems.disable()
    sys.exit(main())
